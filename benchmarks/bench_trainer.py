"""Trainer overhead: ``trainers.Trainer`` vs a hand-written PyTorch loop, same work.

Both train the same model (ResNeSt-14 at 32x32, 10 classes) on the same in-memory data with
SGD + momentum for the same number of steps, in one process, alternating rounds so that
machine noise hits both alike. The Trainer does everything a script gets (per-sample
seeding, per-iteration lr, metric sums, logging every 10 steps to a JSONL file); the plain
loop does the minimum (DataLoader, forward, backward, step). Target: the Trainer at most
3 % slower (``ratio >= 0.97``).

    python benchmarks/bench_trainer.py [--steps 30] [--rounds 7] [--batch-size 32] [--json FILE]

Prints ``ratio=<plain_time / trainer_time>`` last.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _report import add_args, check_rounds, finish
from torch.utils.data import DataLoader, TensorDataset

import modelzoo
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig
from trainers.schedules import create_schedule


def make_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
    )


def make_model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = modelzoo.get_model("resnest14", num_classes=10)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def plain_loop(data: TensorDataset, steps: int, batch_size: int) -> float:
    model, opt = make_model_and_optimizer()
    loader = DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=True)
    schedule = create_schedule("cosine", base_lr=0.05, total_steps=steps)
    model.train()
    start = time.perf_counter()
    step = 0
    while step < steps:
        for x, y in loader:
            for group in opt.param_groups:
                group["lr"] = schedule(step)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step == steps:
                break
    return time.perf_counter() - start


def trainer_loop(data: TensorDataset, steps: int, batch_size: int, log: Path) -> float:
    model, opt = make_model_and_optimizer()

    def train_step(m, batch):
        x, y = batch
        logits = m(x)
        return F.cross_entropy(logits, y), {
            "accuracy": (logits.argmax(1) == y).sum(),
            "count": y.numel(),
        }

    config = TrainerConfig(
        epochs=10**6,
        max_steps=steps,
        batch_size=batch_size,
        log_interval=10,
        progress=False,
        eval_interval=0,
    )
    env = DistEnv.from_env()
    with RunLogger(log, enabled=True, console=False) as logger:
        trainer = Trainer(
            model, opt, config, env=env, logger=logger, train_step=train_step,
            lr_schedule=create_schedule("cosine", base_lr=0.05, total_steps=steps),
        )  # fmt: skip
        start = time.perf_counter()
        trainer.fit(data)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32)
    add_args(parser, rounds=7)
    args = parser.parse_args()
    check_rounds(args.rounds)
    data = make_data(args.batch_size * args.steps)
    plain, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        plain_loop(data, 3, args.batch_size)  # warm-up: allocator, oneDNN primitives
        trainer_loop(data, 3, args.batch_size, Path(tmp) / "warm.jsonl")
        for r in range(args.rounds):
            log = Path(tmp) / f"r{r}.jsonl"
            if r % 2:  # alternate which side goes first
                ours.append(trainer_loop(data, args.steps, args.batch_size, log))
                plain.append(plain_loop(data, args.steps, args.batch_size))
            else:
                plain.append(plain_loop(data, args.steps, args.batch_size))
                ours.append(trainer_loop(data, args.steps, args.batch_size, log))
            print(f"round {r}: plain {plain[-1]:.2f} s  trainer {ours[-1]:.2f} s", flush=True)
    finish(args.json, "bench_trainer", ours, plain,
           ours_label=f"trainers.Trainer, {args.steps} steps",
           peer_label=f"hand-written loop, {args.steps} steps", target=0.97)  # fmt: skip


if __name__ == "__main__":
    main()
