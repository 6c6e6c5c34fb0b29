"""Worker of test_cser.py: the CSER combiners stepped by hand on a small float64 model.

Every rank builds the same model (seed 0), draws its own batches (seeded by rank and step)
and steps ``SGD(nesterov)`` through the combiner; it saves its parameters after every step,
the module's parameters at two evaluations and at the end of training, and the bytes sent.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from trainers import DistEnv, create_combiner
from trainers.data import derive_seed

STEPS = 10
EVAL_AFTER = (4, 7)  # evaluations after these steps (1-based)
LR, MOMENTUM, WD = 0.05, 0.9, 1e-3
SEED = 3

# (name, mode, options); test_cser.py transcribes the first three.
CASES = (
    ("cser", "cser", dict(period=3, rows=0.3, cols=0.5, layers=0.7, reset_rows=0.6)),
    ("cser_default", "cser", {}),
    ("cser_pl", "cser-pl", dict(period=3, rows=0.5, cols=0.5, layers=0.8)),
    ("cser_update", "cser-update", dict(compressor="randblock", ratio=0.3, period=3)),
)


class Net(nn.Module):
    """A conv (4-D weight), two biases, a matrix and a 0-d scale."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 2)
        self.fc = nn.Linear(36, 5)
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))  # (B, 4, 3, 3)
        return self.fc(h.flatten(1)) * self.scale  # (B, 5)


def make_net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(derive_seed(rank, step))
    x = torch.randn(8, 3, 4, 4, generator=g, dtype=torch.float64)
    return x, torch.randn(8, 5, generator=g, dtype=torch.float64)


def loss_fn(net: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return F.mse_loss(net(x), y)


def snapshot(net: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def run(env: DistEnv, mode: str, options: dict) -> dict:
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM, nesterov=True,
                          weight_decay=WD)  # fmt: skip
    combiner = create_combiner(mode, seed=SEED, **options)
    combiner.prepare(net, opt, env)
    out: dict = {"steps": [], "evals": []}
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        loss_fn(net, env.rank, step).backward()
        combiner.reduce_gradients(None)
        combiner.step(opt, None)
        out["steps"].append(snapshot(net))
        if step in EVAL_AFTER:
            combiner.synchronize()
            out["evals"].append(snapshot(net))
            combiner.end_evaluation()
    combiner.close()
    out["final"] = snapshot(net)
    out["bytes"] = combiner.counter.total_bytes
    return out


def main(out: Path) -> None:
    torch.set_num_threads(1)
    with DistEnv.from_env(device="cpu") as env:
        res = {name: run(env, mode, options) for name, mode, options in CASES}
        torch.save(res, out / f"rank{env.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
