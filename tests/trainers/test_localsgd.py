"""The local-SGD family and CSER/error feedback in one process: update rules and resuming.

Oracles: SlowMo's outer step transcribed here from the paper's formula, Local AdaAlter's from
the authors' code (and this library's earlier variants); for resuming, the same run without
interruption. The multi-worker transcriptions of the authors' code are in
test_faithful_comm.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.trainers._trainer_toys import ToyDataset, lr_fn, make_mlp, params, train_step
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig
from trainers.comm import (
    QSGD,
    CSERUpdateCombiner,
    ErrorFeedbackCombiner,
    LocalAdaAlterCombiner,
    LocalSGDCombiner,
    SlowMoCombiner,
    TopK,
)
from trainers.data import derive_seed


def run(combiner, *, momentum=0.9, epochs=2, save_dir=None, resume=None, seed=3):
    model = make_mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr_fn(0), momentum=momentum, weight_decay=1e-3)
    trainer = Trainer(
        model,
        opt,
        TrainerConfig(epochs=epochs, batch_size=8, seed=seed, log_interval=2, save_dir=save_dir),
        env=DistEnv(),
        logger=RunLogger(None, enabled=False),
        lr_schedule=lr_fn,
        train_step=train_step,
        combiner=combiner,
    )
    if resume is not None:
        trainer.resume(resume)
    trainer.fit(ToyDataset(40))
    return trainer


def batches(seed: int, epochs: int):
    data = ToyDataset(40)
    for epoch in range(epochs):
        perm = torch.randperm(40, generator=torch.Generator().manual_seed(derive_seed(seed, epoch)))
        for k in range(5):
            idx = perm[k * 8 : (k + 1) * 8]
            yield data.x[idx], data.y[idx]


def test_slowmo_on_one_worker_is_the_outer_momentum_rule():
    """With one worker the average is the model itself: x0 -= lr a (b buf + (x0 - x) / lr)."""
    b, alpha, slow = 0.6, 0.7, 3
    got = params(
        run(SlowMoCombiner(period=2, slow_period=slow, slow_momentum=b, slow_lr=alpha)).model
    )
    model = make_mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr_fn(0), momentum=0.9, weight_decay=1e-3)
    x0 = params(model)
    buf = [torch.zeros_like(p) for p in x0]
    for t, (x, y) in enumerate(batches(3, 2), start=1):
        lr = lr_fn(t - 1)
        for g in opt.param_groups:
            g["lr"] = lr
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if t % slow == 0:
            with torch.no_grad():
                for p, a, m in zip(model.parameters(), x0, buf, strict=True):
                    m.mul_(b).add_((a - p) / lr)
                    a.sub_(lr * alpha * m)
                    p.copy_(a)
    for a, w in zip(got, model.parameters(), strict=True):
        torch.testing.assert_close(a, w.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        {"period": 2, "eps": 0.3},  # the authors' rule: one synchronous step, sqrt(D + eps)
        {"period": 2, "eps": 0.3, "warmup_steps": 3},
        {"period": 2, "eps": 0.3, "warmup_steps": 0, "eps_mode": "per_step"},
        {"period": 3, "eps": 0.3, "weight_decay_mode": "in_gradient"},
    ],
    ids=["authors", "warmup3", "per-step-eps", "wd-in-gradient"],
)
def test_local_adaalter_on_one_worker_is_adaalter(options):
    """Synchronous steps update D every step; then D <- A every H local steps. The
    denominator is sqrt(D + eps) (per_step: sqrt(D + s eps^2)); weight decay is
    ``- lr wd x`` apart from the accumulator (in_gradient: added to g)."""
    combiner = LocalAdaAlterCombiner(**options)
    eps, period, warmup = combiner.eps, combiner.period, combiner.warmup_steps
    got = params(run(combiner, momentum=0.0).model)
    model = make_mlp(seed=0)
    ps = list(model.parameters())
    acc = [torch.zeros_like(p) for p in ps]
    den = [torch.zeros_like(p) for p in ps]
    s = 0
    for t, (x, y) in enumerate(batches(3, 2), start=1):
        grads = torch.autograd.grad(F.cross_entropy(model(x), y), ps)
        s = 1 if t <= warmup else s + 1
        with torch.no_grad():
            for p, g, a, d in zip(ps, grads, acc, den, strict=True):
                in_gradient = options.get("weight_decay_mode") == "in_gradient"
                if in_gradient:
                    g = g + 1e-3 * p
                shift = s * eps**2 if options.get("eps_mode") == "per_step" else eps
                step = g / torch.sqrt(d + shift)
                if not in_gradient:
                    step = step + 1e-3 * p
                p -= lr_fn(t - 1) * step
                a += g * g
        if t <= warmup or (t - warmup) % period == 0:
            for a, d in zip(acc, den, strict=True):
                d.copy_(a)
            s = 0
    for a, w in zip(got, ps, strict=True):
        torch.testing.assert_close(a, w.detach(), rtol=0, atol=1e-6)


def test_local_adaalter_options_say_how_to_fix_them():
    with pytest.raises(ValueError, match="'constant'.*'per_step'"):
        LocalAdaAlterCombiner(eps_mode="squared")
    with pytest.raises(ValueError, match="'decoupled'.*'in_gradient'"):
        LocalAdaAlterCombiner(weight_decay_mode="adamw")
    with pytest.raises(ValueError, match="warmup_steps must be >= 0"):
        LocalAdaAlterCombiner(warmup_steps=-1)
    with pytest.raises(ValueError, match="initial_accumulator > 0"):
        LocalAdaAlterCombiner(eps=0.0)
    LocalAdaAlterCombiner(eps=0.0, initial_accumulator=0.1)  # no division by zero


def test_local_adaalter_needs_plain_sgd():
    with pytest.raises(ValueError, match="--optimizer sgd --momentum 0"):
        run(LocalAdaAlterCombiner(period=2), momentum=0.9)


@pytest.mark.parametrize(
    "make",
    [
        lambda: CSERUpdateCombiner(compressor=TopK(ratio=0.3), period=4),
        lambda: ErrorFeedbackCombiner(compressor=QSGD(levels=4, bucket_size=16)),
        lambda: SlowMoCombiner(period=2, slow_period=3),
        lambda: LocalAdaAlterCombiner(period=3),
        lambda: LocalSGDCombiner(period=2),
    ],
    ids=["cser", "ef-qsgd", "slowmo", "local-adaalter", "localsgd"],
)
def test_resumes_bit_for_bit(make, tmp_path):
    momentum = 0.0 if isinstance(make(), LocalAdaAlterCombiner) else 0.9
    straight = params(run(make(), momentum=momentum, epochs=3).model)
    run(make(), momentum=momentum, epochs=1, save_dir=str(tmp_path))
    resumed = run(make(), momentum=momentum, epochs=3, resume=tmp_path / "epoch0.pt")
    for a, b in zip(params(resumed.model), straight, strict=True):
        assert torch.equal(a, b)


def test_cser_on_one_worker_keeps_the_update_split():
    """x = xbar + e, and the reset folds e back in: after a reset x is xbar."""
    combiner = CSERUpdateCombiner(compressor=TopK(ratio=0.3), period=4)
    trainer = run(combiner, epochs=1)  # 5 steps: a reset after step 4, then one more step
    flat = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])
    torch.testing.assert_close(flat, combiner.synced + combiner.residual, rtol=0, atol=1e-6)
    assert combiner.residual.any()
