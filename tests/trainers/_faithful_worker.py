"""One rank of the faithfulness tests in test_faithful_comm.py (torchrun's variables set).

Four processes start as a 4-rank gloo world (Adasum runs), then ranks 0-1 re-form a 2-rank
world (Adasum and Local AdaAlter runs). Every run trains a float64 linear softmax classifier
through the :class:`~trainers.Trainer` and records, per optimizer step, the batch this rank
saw, the learning rates of its parameter groups and the parameters after the step; the test
replays the recorded batches through numpy transcriptions of the authors' code. Each rank
saves ``OUTDIR/w{world}_r{rank}.pt``.

Usage: python -m tests.trainers._faithful_worker OUTDIR PORT2
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from trainers import DistEnv, RunLogger, Trainer, TrainerConfig
from trainers.comm import GradCombiner
from trainers.comm.adasum import AdasumCombiner
from trainers.comm.localsgd import LocalAdaAlterCombiner

FEATURES, CLASSES, SAMPLES, BATCH, EPOCHS = 5, 3, 48, 3, 3
WEIGHT_DECAY = 0.05
BIAS_LR_SCALE = 1e-4  # Adasum runs: the bias updates' squared norms fall below 1e-8


def lr_of(step: int) -> float:
    return 0.3 / (1 + 0.05 * step)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(SAMPLES, FEATURES, generator=g, dtype=torch.float64)
    w = torch.randn(FEATURES, CLASSES, generator=g, dtype=torch.float64)
    y = (x @ w + 0.5 * torch.randn(SAMPLES, CLASSES, generator=g, dtype=torch.float64)).argmax(1)
    return TensorDataset(x, y)


def make_model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(FEATURES, CLASSES, dtype=torch.float64)


class Record:
    """The batches, learning rates and parameters of every optimizer step of one run."""

    def __init__(self) -> None:
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.lrs: list[list[float]] = []
        self.params: list[list[torch.Tensor]] = []

    def train_step(self, model: nn.Module, batch: Any):
        x, y = batch
        self.batches.append((x.clone(), y.clone()))
        logits = model(x)
        return F.cross_entropy(logits, y), {"count": y.numel()}

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        self.lrs.append([float(g["lr"]) for g in trainer.optimizer.param_groups])
        self.params.append([p.detach().clone() for p in trainer.model.parameters()])


def fit(
    env: DistEnv,
    combiner: GradCombiner,
    *,
    momentum: float,
    weight_decay: float,
    bias_lr_scale: float = 1.0,
) -> dict:
    model = make_model()
    start = [p.detach().clone() for p in model.parameters()]
    groups = [
        {"params": [model.weight]},
        {"params": [model.bias], "lr_scale": bias_lr_scale},
    ]
    opt = torch.optim.SGD(groups, lr=lr_of(0), momentum=momentum, weight_decay=weight_decay)
    record = Record()
    trainer = Trainer(
        model,
        opt,
        TrainerConfig(epochs=EPOCHS, batch_size=BATCH, seed=7, log_interval=0, progress=False),
        env=env,
        logger=RunLogger(None, enabled=False),
        lr_schedule=lr_of,
        train_step=record.train_step,
        combiner=combiner,
        hooks=[record],
    )
    trainer.fit(dataset())
    return {
        "start": start,
        "x": [b[0] for b in record.batches],
        "y": [b[1] for b in record.batches],
        "lrs": record.lrs,
        "params": record.params,
    }


def adasum_runs(env: DistEnv, *, plain: bool) -> dict:
    """Momentum SGD with weight decay in every mode; with ``plain``, also momentum-free SGD."""
    kw = {"momentum": 0.9, "weight_decay": WEIGHT_DECAY, "bias_lr_scale": BIAS_LR_SCALE}
    res = {
        "default": fit(env, AdasumCombiner(), **kw),
        "gradient": fit(env, AdasumCombiner(mode="gradient"), **kw),
    }
    if plain:
        res["auto"] = fit(env, AdasumCombiner(mode="auto"), **kw)
        res["eps_1e-8"] = fit(env, AdasumCombiner(eps=1e-8), **kw)
        for wd in (0.0, WEIGHT_DECAY):
            for mode in ("delta", "gradient"):
                run = fit(env, AdasumCombiner(mode=mode), momentum=0.0, weight_decay=wd)
                res[f"sgd_wd{wd}_{mode}"] = run
    return res


ADAALTER_RUNS = {  # name: options (period 4 everywhere: 24 steps span several periods)
    "default": {},
    "warmup3_eps0.01": {"warmup_steps": 3, "eps": 0.01},
    "per_step": {"warmup_steps": 3, "eps": 0.01, "eps_mode": "per_step"},
    "in_gradient": {"warmup_steps": 3, "eps": 0.01, "weight_decay_mode": "in_gradient"},
    "no_warmup": {"warmup_steps": 0, "eps": 0.01},
}


def adaalter_runs(env: DistEnv) -> dict:
    return {
        name: fit(
            env,
            LocalAdaAlterCombiner(period=4, **options),
            momentum=0.0,
            weight_decay=WEIGHT_DECAY,
        )
        for name, options in ADAALTER_RUNS.items()
    }


def init(rank: int, world: int, port: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_PORT=port,
    )
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )


def main(out: Path, port2: str) -> None:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    init(rank, 4, os.environ["MASTER_PORT"])
    env = DistEnv.from_env(device="cpu")
    torch.save({"adasum": adasum_runs(env, plain=False)}, out / f"w4_r{rank}.pt")
    dist.barrier()  # no rank leaves while a peer still talks to it
    dist.destroy_process_group()
    if rank < 2:
        init(rank, 2, port2)
        env = DistEnv.from_env(device="cpu")
        res = {"adasum": adasum_runs(env, plain=True), "adaalter": adaalter_runs(env)}
        torch.save(res, out / f"w2_r{rank}.pt")
        dist.barrier()  # no rank leaves while a peer still talks to it
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
