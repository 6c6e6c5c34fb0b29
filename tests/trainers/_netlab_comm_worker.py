"""One rank of test_netlab_comm.py: every registered communication mode trains a few steps.

For every name in ``trainers.comm.list_combiners()`` (its options from :data:`OPTIONS`, its
defaults otherwise, so a new mode runs here without an edit), plus the variants in
:data:`VARIANTS`, a small MLP trains :data:`STEPS` steps on scikit-learn's digits through the
Trainer. Per run it saves this rank's loss at every step it computed, its final parameters,
the bytes its combiner says it sent, and the bytes that left this rank's interface in the
meantime (``/proc/net/dev``, read between barriers; ``None`` off the lab, where
``GLOO_SOCKET_IFNAME`` is unset). Saved to ``OUTDIR/rank{r}.pt``.

Usage: python -m tests.trainers._netlab_comm_worker OUTDIR
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.trainers._adasum_worker import digits_sets
from tests.trainers._trainer_toys import train_step
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig, create_combiner
from trainers.comm import combiner_class, list_combiners

STEPS, BATCH, SEED, LR, MOMENTUM = 50, 32, 1, 0.1, 0.9

# Options for modes whose defaults do not fit 4 ranks and 50 steps (periods of 8-48 steps
# would leave little averaging in 50). Every other registered mode runs with its defaults.
OPTIONS: dict[str, dict[str, Any]] = {
    "localsgd": {"period": 4},
    "slowmo": {"period": 2, "slow_period": 8},
    "local-adaalter": {"period": 4},
    "cser": {"period": 4},
    "cser-pl": {"period": 4},
    "cser-update": {"period": 4},
    # the default random block (1 % of the entries every step) learns little in 50 steps
    "def": {"period": 2, "ratio": 0.25},
    "powersgd": {"rank": 2, "start_iter": 2},
    # 4 ranks: the root and one group of 3 children sharing a data part (s = 2, the only
    # straggler-tolerant tree of 4; the default s = 1 needs groups of 2 under every parent)
    "coded": {"stragglers": 2, "branching": 3},
}
# Further runs of registered modes: (mode, options).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "adpsgd-sync": ("adpsgd", {"asynchronous": False}),  # the default is asynchronous
}
# (lr, momentum) where the SGD recipe does not fit: Local AdaAlter divides by its own
# accumulators (an AdaGrad step; the authors' lr 0.5) and takes no SGD momentum; Pipe-SGD
# applies every gradient one step late, which momentum 0.9 at lr 0.1 turns into oscillation.
RECIPES: dict[str, tuple[float, float]] = {"local-adaalter": (0.5, 0.0), "pipesgd": (0.1, 0.8)}


def runs() -> dict[str, tuple[str, dict[str, Any]]]:
    """Every run: name -> (registered mode, options)."""
    table = {mode: (mode, OPTIONS.get(mode, {})) for mode in list_combiners()}
    table.update(VARIANTS)
    return table


def tx_bytes() -> int | None:
    """Bytes sent so far through the lab interface (``GLOO_SOCKET_IFNAME``) of this rank's
    network namespace, from the kernel; ``None`` when there is no such interface."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname:
        return None
    with open("/proc/net/dev", encoding="ascii") as f:
        for line in f:
            name, sep, fields = line.partition(":")
            if sep and name.strip() == ifname:
                return int(fields.split()[8])  # receive: 8 fields, then transmit bytes
    return None


class LossRecorder:
    """``train_step`` that also keeps ``(step, loss)`` of every step this rank computed (no
    collective; CodedReduce's late ranks skip some steps)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.losses: list[tuple[int, float]] = []

    def __call__(self, model, batch):
        loss, metrics = train_step(model, batch)
        assert self.trainer is not None
        self.losses.append((self.trainer.global_step, float(loss.detach())))
        return loss, metrics


def train(env: DistEnv, name: str, mode: str, options: dict[str, Any], data) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    lr, momentum = RECIPES.get(name, (LR, MOMENTUM))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    combiner = create_combiner(mode, seed=SEED, **options)
    record = LossRecorder()
    trainer = Trainer(
        model,
        opt,
        TrainerConfig(
            epochs=10,
            max_steps=STEPS,
            batch_size=BATCH,
            seed=SEED,
            log_interval=0,
            eval_interval=0,
            progress=False,
        ),
        env=env,
        logger=RunLogger(None, enabled=False),
        train_step=record,
        combiner=combiner,
    )
    record.trainer = trainer
    dist.barrier()
    before = tx_bytes()
    trainer.fit(data)
    dist.barrier()  # every message of this run received, so sent: on the wire, counted
    after = tx_bytes()
    counter = getattr(combiner, "counter", None)
    return {
        "mode": mode,
        "options": options,
        "deterministic": combiner_class(mode).is_deterministic(combiner.options),
        "steps": trainer.global_step,
        "losses": record.losses,
        "params": [p.detach().clone() for p in model.parameters()],
        "reported_bytes": None if counter is None else int(counter.total_bytes),
        "measured_bytes": None if before is None else after - before,
    }


def main(out: Path) -> None:
    torch.set_num_threads(1)
    data, _ = digits_sets()
    with DistEnv.from_env(device="cpu") as env:
        results = {}
        for name, (mode, options) in runs().items():
            try:
                results[name] = train(env, name, mode, options, data)
            except Exception as e:
                traceback.print_exc()
                raise SystemExit(
                    f"rank {env.rank}: mode {name!r} ({mode}, {options}) failed: {e}"
                ) from e
        torch.save(results, out / f"rank{env.rank}.pt")
        dist.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
