"""Small models, datasets, steps and a hand-written plain PyTorch loop for the trainer tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from trainers.data import derive_seed

DIM, CLASSES = 6, 3


class ToyDataset(Dataset):
    """Fixed random features with labels from a fixed linear rule; optional torch-RNG noise."""

    def __init__(self, n: int, *, noise: float = 0.0, seed: int = 123) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, DIM, generator=g)
        w = torch.randn(DIM, CLASSES, generator=g)
        self.y = (self.x @ w).argmax(1)
        self.noise = noise

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i]
        if self.noise:
            x = x + self.noise * torch.randn(DIM)  # augmentation drawn from torch's RNG
        return x, self.y[i]


def make_mlp(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(DIM, 16), nn.Tanh()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(16, CLASSES))
    return nn.Sequential(*layers)


def train_step(model, batch):
    x, y = batch
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    return loss, {"accuracy": (logits.argmax(1) == y).sum(), "count": y.numel()}


def eval_step(model, batch):
    x, y = batch
    logits = model(x)
    return {
        "top1": (logits.argmax(1) == y).sum(),
        "loss": F.cross_entropy(logits.float(), y, reduction="sum"),
        "count": y.numel(),
    }


def lr_fn(step: int) -> float:
    return 0.2 / (1 + 0.1 * step)


def plain_loop(
    model: nn.Module,
    data: ToyDataset,
    *,
    batch: int,
    steps: int,
    seed: int,
    lr=lr_fn,
    momentum: float = 0.9,
    weight_decay: float = 1e-3,
    clip: float | None = None,
) -> nn.Module:
    """The oracle: SGD over global batches of the documented permutation, fp32, no accumulation.

    The epoch order is ``torch.randperm(n)`` from a generator seeded with
    ``derive_seed(seed, epoch)`` (the sampler's documented definition); incomplete batches
    are dropped. Clipping uses the textbook formula, not ``clip_grad_norm_``.
    """
    opt = torch.optim.SGD(
        model.parameters(), lr=lr(0), momentum=momentum, weight_decay=weight_decay
    )
    n, done, epoch = len(data), 0, 0
    while done < steps:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(seed, epoch)))
        for k in range(n // batch):
            if done == steps:
                break
            idx = perm[k * batch : (k + 1) * batch]
            loss = F.cross_entropy(model(data.x[idx]), data.y[idx])
            loss.backward()
            if clip is not None:
                grads = [p.grad for p in model.parameters()]
                total = torch.sqrt(sum((g.double() ** 2).sum() for g in grads))
                coef = min(1.0, clip / (float(total) + 1e-6))
                for g in grads:
                    g.mul_(coef)
            for group in opt.param_groups:
                group["lr"] = lr(done)
            opt.step()
            opt.zero_grad()
            done += 1
        epoch += 1
    return model


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]
