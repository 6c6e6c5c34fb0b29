"""One rank of the decentralized/pipelined tests in test_decentralized.py (2, 4 or 8 ranks).

Drives SGP, AD-PSGD (synchronous rounds, asynchronous, hierarchical) and Pipe-SGD through the
Trainer (or the combiner protocol by hand) and records what the test compares against its
oracles. Each rank saves ``OUTDIR/rank{r}.pt``.

Usage: python -m tests.trainers._decentral_worker OUTDIR
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.trainers._adasum_worker import digits_sets
from tests.trainers._trainer_toys import ToyDataset, eval_step, lr_fn, make_mlp, train_step
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig, create_combiner
from trainers.comm.flat import flatten

N, BATCH, EPOCHS, SEED = 48, 3, 2, 5  # 4 ranks x 3 = global batch 12: 4 steps an epoch


class Recorder:
    """Parameters after every step and the gradients each step applied (per rank)."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.lrs: list[float] = []

    def on_before_step(self, trainer: Trainer, step: int) -> None:
        self.grads.append(flatten([p.grad for p in trainer.model.parameters()]))
        self.lrs.append(trainer.lr_at(step))

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        self.params.append(flatten(list(trainer.model.parameters())))


def trainer_for(env, mode, *, epochs=EPOCHS, momentum=0.9, wd=1e-3, hooks=(), data_noise=0.1,
                **options) -> Trainer:  # fmt: skip
    model = make_mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr_fn(0), momentum=momentum, weight_decay=wd)
    return Trainer(
        model,
        opt,
        TrainerConfig(epochs=epochs, batch_size=BATCH, seed=SEED, log_interval=0, progress=False),
        env=env,
        logger=RunLogger(None, enabled=False),
        lr_schedule=lr_fn,
        train_step=train_step,
        eval_step=eval_step,
        combiner=create_combiner(mode, seed=SEED, **options),
        hooks=hooks,
    )


def final(trainer: Trainer) -> torch.Tensor:
    return flatten(list(trainer.model.parameters()))


def resumed_vs_straight(env, mode: str, tmp: Path, **options) -> tuple:
    """Parameters after 2 epochs straight, and after 1 epoch + checkpoint + resume + 1."""
    straight = trainer_for(env, mode, epochs=2, **options)
    straight.fit(ToyDataset(N, noise=0.1))
    first = trainer_for(env, mode, epochs=1, **options)
    first.fit(ToyDataset(N, noise=0.1))
    path = tmp / f"{mode}-{'-'.join(f'{k}{v}' for k, v in options.items())}.pt"
    first.save_checkpoint(path)
    resumed = trainer_for(env, mode, epochs=2, **options)
    resumed.resume(path)
    resumed.fit(ToyDataset(N, noise=0.1))
    return final(straight), final(resumed), final(first), str(path)


# -- SGP's gossip alone (lr 0, no gradient): the mixing matrices -------------------------------------
def gossip_rounds(env, overlap: int, rounds: int) -> dict:
    """Distinct models per rank, lr 0: x after each round, sum x and sum w (incl. in flight)."""
    model = nn.Linear(5, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    combiner = create_combiner("sgp", overlap=overlap)
    combiner.prepare(model, opt, env)
    with torch.no_grad():
        g = torch.Generator().manual_seed(100 + env.rank)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cpu") * (1 + env.rank))
    start = flatten(list(model.parameters()))
    xs, sums, weights = [], [], []
    for _ in range(rounds):
        combiner.step(opt, None)
        xs.append(flatten(list(model.parameters())))
        # x = z w plus this rank's received messages still in flight: their sum is conserved
        x = flatten(list(model.parameters())).double() * combiner.weight
        w = torch.tensor([combiner.weight], dtype=torch.float64)
        for msg in combiner.in_flight:
            received = msg.wait().double()
            x += received[:-1]
            w += received[-1]
        total = torch.cat([x, w])
        dist.all_reduce(total)
        sums.append(total[:-1].clone())
        weights.append(float(total[-1]))
    combiner.synchronize()
    return {
        "start": start,
        "x": xs,
        "sum_x": sums,
        "sum_w": weights,
        "synchronized": flatten(list(model.parameters())),
        "weight_after_sync": combiner.weight,
    }


# -- AD-PSGD by hand on identical data: single-process SGD ---------------------------------------
def identical_data(env, mode: str, steps: int = 6, **options) -> torch.Tensor:
    model = make_mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    combiner = create_combiner(mode, seed=SEED, **options)
    combiner.prepare(model, opt, env)
    data = ToyDataset(N)
    for t in range(steps):
        x, y = data.x[t * 6 : (t + 1) * 6], data.y[t * 6 : (t + 1) * 6]  # the same on every rank
        F.cross_entropy(model(x), y).backward()
        combiner.reduce_gradients(None)
        combiner.step(opt, None)
        opt.zero_grad()
    return flatten(list(model.parameters()))


def consensus_at_lr_zero(env, steps: int = 8) -> list[float]:
    """sum_i ||x_i - mean||^2 after each synchronous AD-PSGD round, lr 0, distinct models."""
    model = make_mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    combiner = create_combiner("adpsgd", seed=SEED, asynchronous=False)
    combiner.prepare(model, opt, env)
    with torch.no_grad():
        g = torch.Generator().manual_seed(200 + env.rank)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))
    out = []
    for _ in range(steps + 1):
        x = flatten(list(model.parameters())).double()
        mean = x.clone()
        dist.all_reduce(mean)
        mean /= env.world_size
        d = torch.tensor([float(((x - mean) ** 2).sum())], dtype=torch.float64)
        dist.all_reduce(d)
        out.append(float(d))
        combiner.step(opt, None)
    return out


def async_mass_at_lr_zero(env, steps: int = 12) -> dict:
    """Asynchronous AD-PSGD, lr 0, distinct float64 models of small integers: the threads
    exchange while the main thread steps; after ``close`` (threads stopped, contributions
    applied; no all-reduce) the ranks' models still sum to exactly what they summed to.

    Exact arithmetic: an exchange averages two dyadic rationals, and at most one exchange per
    published step per active rank keeps every value well inside float64's 53 bits.
    """
    model = make_mlp(seed=0).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    combiner = create_combiner("adpsgd", seed=SEED)  # the default: the paper's asynchronous rule
    combiner.prepare(model, opt, env)
    with torch.no_grad():
        g = torch.Generator().manual_seed(300 + env.rank)
        for p in model.parameters():
            p.copy_(torch.randint(-8, 9, p.shape, generator=g).double())
    start = flatten(list(model.parameters())).clone()
    for _ in range(steps):
        combiner.step(opt, None)  # applies what the thread contributed, publishes the model
        time.sleep(0.02)  # room for the threads to exchange between steps
    combiner.close()
    end = flatten(list(model.parameters())).clone()
    exchanges = combiner.gossiper.exchanges
    totals = torch.stack([start, end])
    dist.all_reduce(totals)  # exact: sums of a few dyadic rationals
    return {"start": start, "end": end, "sum_start": totals[0], "sum_end": totals[1],
            "exchanges": exchanges}  # fmt: skip


class _Pace:
    """Rank ``slow`` sleeps ``delay`` s after each step; every rank notes when each step ends."""

    def __init__(self, rank: int, slow: int, delay: float) -> None:
        self.rank, self.slow, self.delay = rank, slow, delay
        self.times: list[float] = []

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if self.rank == self.slow:
            time.sleep(self.delay)
        self.times.append(time.monotonic())


def pace_with_slow_peer(env, asynchronous: bool, steps: int = 12, delay: float = 0.25) -> list:
    """The times of the first ``steps`` step ends on each rank while rank 1 sleeps ``delay``
    after each of its steps (one epoch of ``steps`` steps: no epoch-end collective inside)."""
    pace = _Pace(env.rank, slow=1, delay=delay)
    trainer = trainer_for(env, "adpsgd", epochs=1, momentum=0.0, wd=0.0, hooks=[pace],
                          asynchronous=asynchronous)  # fmt: skip
    trainer.fit(ToyDataset(steps * BATCH * env.world_size, noise=0.1))
    return pace.times[:steps]


def digits_accuracy(env, mode: str, lr: float = 0.05, **options) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    train, val = digits_sets()
    trainer = Trainer(
        model,
        opt,
        TrainerConfig(epochs=6, batch_size=16, seed=1, log_interval=0, progress=False),
        env=env,
        logger=RunLogger(None, enabled=False),
        train_step=train_step,
        eval_step=eval_step,
        combiner=create_combiner(mode, seed=1, **options),
    )
    trainer.fit(train, eval_dataset=val)
    return trainer.last_eval["top1"]


def nccl_checks(env, out: Path) -> None:
    """The NCCL code path (GPU tensors, point-to-point and asynchronous all-reduce)."""
    res = {"gossip": gossip_rounds(env, overlap=0, rounds={2: 1, 4: 2, 8: 3}[env.world_size])}
    res["gossip_overlap"] = gossip_rounds(env, overlap=2, rounds=6)
    torch.save(res, out / f"rank{env.rank}.pt")


def main(out: Path) -> None:
    torch.set_num_threads(1)
    if len(sys.argv) > 2 and sys.argv[2] == "cuda":
        with DistEnv.from_env(device="cuda") as env:
            torch.set_default_device(env.device)
            nccl_checks(env, out)
        return
    with DistEnv.from_env(device="cpu") as env:
        n, res = env.world_size, {}
        rounds = {2: 1, 4: 2, 8: 3}[n]
        res["gossip"] = gossip_rounds(env, overlap=0, rounds=rounds)
        res["gossip_overlap"] = gossip_rounds(env, overlap=2, rounds=6)
        if n == 2:
            res["sgp"] = final(fit_(trainer_for(env, "sgp")))
            res["localsgd_h1"] = final(fit_(trainer_for(env, "localsgd", period=1)))
        if n == 4:
            rec = Recorder()
            trainer = trainer_for(
                env, "adpsgd", momentum=0.0, wd=0.0, hooks=[rec], asynchronous=False
            )
            trainer.fit(ToyDataset(N, noise=0.1))
            res["adpsgd_sync"] = {"params": rec.params, "grads": rec.grads, "lrs": rec.lrs}
            res["identical_adpsgd"] = identical_data(env, "adpsgd", asynchronous=False)
            res["identical_h_adpsgd"] = identical_data(
                env, "adpsgd", node_size=2, asynchronous=False
            )
            res["consensus"] = consensus_at_lr_zero(env)
            res["h_adpsgd_one_node"] = final(
                fit_(trainer_for(env, "adpsgd", node_size=4, asynchronous=False))
            )
            res["average"] = final(fit_(trainer_for(env, "average")))
            rec = Recorder()
            fit_(trainer_for(env, "adpsgd", node_size=2, hooks=[rec], asynchronous=False))
            res["h_adpsgd_two_nodes"] = rec.params
            rec = Recorder()
            fit_(trainer_for(env, "pipesgd", hooks=[rec]), noise=0.0)
            res["pipesgd"] = {"params": rec.params, "lrs": rec.lrs}
            res["resume"] = {
                "sgp": resumed_vs_straight(env, "sgp", out),
                "sgp-overlap2": resumed_vs_straight(env, "sgp", out, overlap=2),
                "adpsgd": resumed_vs_straight(env, "adpsgd", out, asynchronous=False),
                "h-adpsgd": resumed_vs_straight(
                    env, "adpsgd", out, node_size=2, asynchronous=False
                ),
                "pipesgd": resumed_vs_straight(env, "pipesgd", out),
                "pipesgd-fp16": resumed_vs_straight(env, "pipesgd", out, compressor="fp16"),
            }
            # Asynchronous AD-PSGD: nondeterministic; after synchronize every rank is equal.
            trainer = trainer_for(env, "adpsgd")  # the default: asynchronous
            trainer.fit(ToyDataset(N, noise=0.1), eval_dataset=ToyDataset(12))
            res["async_after_sync"] = final(trainer)
            res["async_exchanges"] = trainer.combiner.gossiper.exchanges
            res["async_mass"] = async_mass_at_lr_zero(env)
            res["pace"] = {
                "async": pace_with_slow_peer(env, asynchronous=True),
                "sync": pace_with_slow_peer(env, asynchronous=False),
            }
            res["digits"] = {
                "average": digits_accuracy(env, "average"),
                "sgp": digits_accuracy(env, "sgp"),
                "sgp-overlap1": digits_accuracy(env, "sgp", overlap=1),
                "adpsgd": digits_accuracy(env, "adpsgd", asynchronous=False),
                "adpsgd-async": digits_accuracy(env, "adpsgd", asynchronous=True),
                "h-adpsgd": digits_accuracy(env, "adpsgd", node_size=2, asynchronous=False),
                "pipesgd": digits_accuracy(env, "pipesgd"),
                "pipesgd-qsgd": digits_accuracy(env, "pipesgd", compressor="qsgd"),
            }
        torch.save(res, out / f"rank{env.rank}.pt")


def fit_(trainer: Trainer, noise: float = 0.1) -> Trainer:
    trainer.fit(ToyDataset(N, noise=noise))
    return trainer


if __name__ == "__main__":
    main(Path(sys.argv[1]))  # argv[2] == "cuda": the NCCL checks
