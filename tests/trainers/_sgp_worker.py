"""One rank of tests/trainers/test_sgp.py (2 or 3 gloo ranks): SGP driven by hand.

Every rank trains the same starting model on its own data (:func:`rank_batches`) through
the combiner protocol (backward, ``reduce_gradients``, ``step``) and records what the test
compares with its oracles: the models after every step (``reference``), the push-sum totals
with the messages in flight and what each step applied (``mass``), and the BatchNorm running
statistics around every step (``batchnorm``, 2 ranks). Each rank saves ``OUTDIR/rank{r}.pt``.

Usage: python -m tests.trainers._sgp_worker OUTDIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainers import DistEnv, create_combiner
from trainers.comm.flat import flat_grads, flatten

DIM, CLASSES, BATCH, STEPS = 4, 3, 5, 8
LR, MOMENTUM, WD = 0.1, 0.9, 0.1  # a large decay, so decaying x instead of z shows
OVERLAPS = (0, 1, 2)


def rank_batches(rank: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batches: its own inputs (shifted by the rank) and labels."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [
        (
            torch.randn(BATCH, DIM, generator=g) + rank,
            torch.randint(0, CLASSES, (BATCH,), generator=g),
        )
        for _ in range(steps)
    ]


def linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(DIM, CLASSES)


def mass_lr(step: int) -> float:
    return LR / (1 + step)


def _train_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], combiner) -> None:
    F.cross_entropy(model(batch[0]), batch[1]).backward()
    combiner.reduce_gradients(None)


def reference_run(env: DistEnv, overlap: int) -> dict:
    """Nesterov SGD with weight decay: the model z after every step and after synchronize()."""
    model = linear()
    opt = torch.optim.SGD(
        model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD, nesterov=True
    )
    combiner = create_combiner("sgp", overlap=overlap)
    combiner.prepare(model, opt, env)
    start = flatten(list(model.parameters()))
    zs, weights = [], []
    for batch in rank_batches(env.rank):
        _train_step(model, batch, combiner)
        combiner.step(opt, None)
        opt.zero_grad()
        zs.append(flatten(list(model.parameters())))
        weights.append(combiner.weight)
    combiner.synchronize()
    return {
        "start": start,
        "z": zs,
        "w": weights,
        "synchronized": flatten(list(model.parameters())),
    }


def _totals(model: nn.Module, combiner) -> tuple[torch.Tensor, float]:
    """``(sum_i x_i, sum_i w_i)`` over the ranks, counting the messages each has in flight."""
    x = flatten(list(model.parameters())).double() * combiner.weight
    w = torch.tensor([combiner.weight], dtype=torch.float64)
    for msg in combiner.in_flight:
        received = msg.wait().double()
        x += received[:-1]
        w += received[-1]
    total = torch.cat([x, w])
    dist.all_reduce(total)
    return total[:-1].clone(), float(total[-1])


def mass_run(env: DistEnv, overlap: int) -> dict:
    """Plain SGD with weight decay and a decaying lr: per step, what the update was computed
    from (z before the step, the gradient, the lr) and the totals after it."""
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=LR, weight_decay=WD)
    combiner = create_combiner("sgp", overlap=overlap)
    combiner.prepare(model, opt, env)
    rec: dict[str, list] = {"z": [], "grad": [], "lr": [], "sum_x": [], "sum_w": []}
    sum_x, sum_w = _totals(model, combiner)
    rec["sum_x"].append(sum_x)
    rec["sum_w"].append(sum_w)
    for step, batch in enumerate(rank_batches(env.rank)):
        _train_step(model, batch, combiner)
        for group in opt.param_groups:
            group["lr"] = mass_lr(step)
        rec["z"].append(flatten(list(model.parameters())))
        rec["grad"].append(flat_grads(list(model.parameters())))
        rec["lr"].append(mass_lr(step))
        combiner.step(opt, None)
        opt.zero_grad()
        sum_x, sum_w = _totals(model, combiner)
        rec["sum_x"].append(sum_x)
        rec["sum_w"].append(sum_w)
    return rec


def batchnorm_run(env: DistEnv, overlap: int, steps: int = 4) -> dict:
    """A model with BatchNorm on this rank's data: its running statistics after the forward
    (before the step) and after the step, then after synchronize()."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, CLASSES))
    bn = model[1]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    combiner = create_combiner("sgp", overlap=overlap)
    combiner.prepare(model, opt, env)

    def stats() -> torch.Tensor:
        return torch.cat([bn.running_mean, bn.running_var]).clone()

    rec: dict[str, list] = {"before": [], "after": [], "tracked": []}
    for batch in rank_batches(env.rank, steps):
        _train_step(model, batch, combiner)
        rec["before"].append(stats())
        combiner.step(opt, None)
        opt.zero_grad()
        rec["after"].append(stats())
        rec["tracked"].append(int(bn.num_batches_tracked))
    combiner.synchronize()
    rec["synchronized"] = stats()
    return rec


def main(out: Path) -> None:
    torch.set_num_threads(1)
    with DistEnv.from_env(device="cpu") as env:
        res: dict = {
            "reference": {tau: reference_run(env, tau) for tau in OVERLAPS},
            "mass": {tau: mass_run(env, tau) for tau in OVERLAPS[1:]},
        }
        if env.world_size == 2:
            res["batchnorm"] = {tau: batchnorm_run(env, tau) for tau in (0, 1)}
        torch.save(res, out / f"rank{env.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
