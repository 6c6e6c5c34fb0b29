"""Worker of tests/trainers/test_wrap.py: the digits trained by a plain PyTorch loop with
``combiner.wrap`` (three modes), and by the same loop on torch's own DDP (the reference for
``average``). Writes ``rank<r>.pt``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from tests.trainers._adasum_worker import digits_sets
from trainers import DistEnv
from trainers.comm import create_combiner

EPOCHS, BATCH, LR = 6, 32, 0.05


def loop(env, combiner=None):
    """The plain loop a user writes (the test's subject is the ~30 lines below)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    if combiner is None:  # the reference: torch's DDP and its optimizer, nothing of ours
        opt, net, (part, parts) = (
            sgd,
            nn.parallel.DistributedDataParallel(model),
            (dist.get_rank(), dist.get_world_size()),
        )
    else:
        opt = combiner.wrap(sgd, model, env)
        net, (part, parts) = opt.model, opt.data_shard()
    train, val = digits_sets()
    sampler = DistributedSampler(train, num_replicas=parts, rank=part, seed=1, drop_last=True)
    loader = DataLoader(train, batch_size=BATCH, sampler=sampler, drop_last=True)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            opt.step()
    before = [p.detach().clone() for p in model.parameters()]  # this replica, as trained
    if combiner is None:
        evaluated = model
        accuracy = (model(val.tensors[0]).argmax(1) == val.tensors[1]).double().mean().item()
    else:
        with opt.evaluating() as evaluated:  # the whole held-out set on every rank
            logits = evaluated(val.tensors[0])
            accuracy = (logits.argmax(1) == val.tensors[1]).double().mean().item()
        opt.close()
    return {"accuracy": accuracy, "trained": before,
            "evaluated": [p.detach().clone() for p in evaluated.parameters()]}  # fmt: skip


def main(out: Path) -> None:
    torch.set_num_threads(1)
    with DistEnv.from_env(device="cpu") as env:
        res = {"ddp": loop(env)}
        res["average"] = loop(env, create_combiner("average", seed=0))
        res["localsgd"] = loop(env, create_combiner("localsgd", period=8, seed=0))
        res["ef-topk"] = loop(env, create_combiner("ef", compressor="topk", ratio=0.05, seed=0))
        torch.save(res, out / f"rank{env.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
