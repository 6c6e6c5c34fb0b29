"""One rank of test_ef_residual_dist.py (torchrun's variables set).

For every registered compressor, builds ``--grad-combine ef --compressor NAME`` from the
command line (no ``--ef-bucket-mb``: the whole gradient as one vector), gives it this rank's
own gradient each step (:func:`gradient`, different on every rank), and records what the
test's reference needs and judges: the weights and the gradient going in, the averaged
gradient the optimizer steps on and this rank's residual coming out. Saves
``OUTDIR/rank{r}.pt``.

Usage: python -m tests.trainers._ef_residual_worker OUTDIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from tests.trainers._trainer_toys import make_mlp
from trainers import DistEnv
from trainers.cli import add_distributed_args, build_combiner
from trainers.comm import COMPRESSORS

# The scenario; test_ef_residual_dist.py imports these.
SEED, STEPS, LR, RATIO, QSGD_BUCKET = 11, 5, 0.05, 0.25, 40
# --ef-momentum (momentum before compression, per tensor): its momentum, the optimizer's weight
# decay (applied by the combiner) and a learning rate that changes every step.
MU, WD = 0.9, 0.01
MOMENTUM_FIRST = ("randblock", "topk")


def lr_at(step: int) -> float:
    return LR * (step + 1) / STEPS


def flags(name: str) -> list[str]:
    """The command line of compressor ``name`` (its ratio or bucket where it takes one)."""
    argv = ["--grad-combine", "ef", "--compressor", name]
    if name in ("topk", "randblock", "importance"):
        argv += ["--compress-ratio", str(RATIO)]
    if name == "qsgd":
        argv += ["--qsgd-bucket", str(QSGD_BUCKET)]
    return argv


def gradient(rank: int, step: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s gradient at ``step``: its own draw, its own scale."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(numel, generator=g) * (1 + rank)


def give_gradient(params, g: torch.Tensor, out: dict) -> None:
    """Set ``g`` as the parameters' gradients; record the weights and ``g``."""
    offset = 0
    for p in params:
        p.grad = g[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    out["weights"].append(flat(params))
    out["grads"].append(g)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


def run(env: DistEnv, name: str) -> dict[str, list[torch.Tensor]]:
    parser = argparse.ArgumentParser()
    add_distributed_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args([*flags(name), "--seed", str(SEED)])
    combiner = build_combiner(args, env)
    assert combiner.name == "ef" and combiner.options.bucket_mb == 0, combiner
    model = make_mlp(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model = combiner.prepare(model, optimizer, env)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    out: dict[str, list[torch.Tensor]] = {"weights": [], "grads": [], "means": [], "residuals": []}
    for step in range(STEPS):
        give_gradient(params, gradient(env.rank, step, numel), out)
        combiner.reduce_gradients(None)
        out["means"].append(flat(p.grad for p in params))
        out["residuals"].append(combiner.residual.clone())
        combiner.step(optimizer, None)
        optimizer.zero_grad(set_to_none=True)
    combiner.close()
    return out


def run_momentum_first(env: DistEnv, name: str) -> dict[str, list[torch.Tensor]]:
    """``--ef-momentum MU`` with SGD (momentum 0, weight decay WD, lr_at(step)): the weights
    before and after each step, the gradient going in, this rank's residual coming out."""
    parser = argparse.ArgumentParser()
    add_distributed_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args([*flags(name), "--ef-momentum", str(MU), "--seed", str(SEED)])
    combiner = build_combiner(args, env)
    model = make_mlp(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0, weight_decay=WD)
    model = combiner.prepare(model, optimizer, env)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    out: dict[str, list[torch.Tensor]] = {"weights": [], "grads": [], "residuals": []}
    for step in range(STEPS):
        give_gradient(params, gradient(env.rank, step, numel), out)
        combiner.reduce_gradients(None)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        combiner.step(optimizer, None)
        assert optimizer.param_groups[0]["weight_decay"] == WD  # put back after the step
        out["residuals"].append(combiner.residual.clone())
        optimizer.zero_grad(set_to_none=True)
    out["weights"].append(flat(params))
    out["sizes"] = [torch.tensor(p.numel()) for p in params]
    return out


def main(out: Path) -> None:
    torch.set_num_threads(1)
    with DistEnv.from_env(device="cpu") as env:
        res = {name: run(env, name) for name in COMPRESSORS}
        res["momentum_first"] = {name: run_momentum_first(env, name) for name in MOMENTUM_FIRST}
        res["world_size"] = env.world_size
        torch.save(res, out / f"rank{env.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
