"""modelzoo.vision.tasks against the formulas they implement (GluonCV's recipe)."""

from __future__ import annotations

import numpy as np
import torch

from modelzoo.vision.tasks import ImageClassificationTask, distillation_loss, smooth_one_hot


def test_label_smoothing_is_gluoncvs_rule():
    labels = torch.tensor([0, 2, 1])
    got = smooth_one_hot(labels, 4, 0.1).numpy()
    want = np.full((3, 4), 0.1 / 4)
    want[np.arange(3), labels.numpy()] = 1 - 0.1 + 0.1 / 4
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got.sum(1), 1.0, rtol=1e-6)


def test_distillation_loss_is_t_squared_kl():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    t = 3.0
    p = torch.softmax(teacher.double() / t, 1).numpy()
    log_q = torch.log_softmax(student.double() / t, 1).numpy()
    want = (p * (np.log(p) - log_q)).sum(1).mean() * t * t
    assert abs(float(distillation_loss(student, teacher, t)) - want) < 1e-5


def test_mixup_mixes_the_batch_with_itself_reversed_and_stops_after_its_epochs():
    class Identity(torch.nn.Module):
        def forward(self, x):
            return x

    task = ImageClassificationTask(3, mixup_alpha=0.4, mixup_epochs=2)
    images = torch.eye(3)  # logits = images: the model is the identity
    labels = torch.tensor([0, 1, 2])
    torch.manual_seed(5)
    loss, _ = task.train_step(Identity(), (images, labels))
    torch.manual_seed(5)
    lam = float(torch.distributions.Beta(0.4, 0.4).sample())
    mixed = lam * images + (1 - lam) * images.flip(0)
    targets = lam * torch.eye(3) + (1 - lam) * torch.eye(3).flip(0)
    want = torch.sum(-targets * torch.log_softmax(mixed, 1), 1).mean()
    assert torch.allclose(loss, want)
    task.on_epoch_start(None, 2)  # mixup_epochs=2: epochs 0 and 1 only
    assert not task.mixup_active()
    loss, _ = task.train_step(Identity(), (images, labels))
    assert torch.allclose(loss, torch.sum(-torch.eye(3) * torch.log_softmax(images, 1), 1).mean())
