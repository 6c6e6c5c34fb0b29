"""One rank of test_coded.py (torchrun's variables set): CodedReduce through the Trainer.

``python -m tests.trainers._coded_worker OUTDIR BRANCHING STRAGGLERS``: a float64 toy run of
6 steps with a recording subclass (each step's local gradient, ``None`` where the rank skipped
the step, and the applied mean) and, per step, one injected slow rank (a sleep before its
forward); with STRAGGLERS 0 also the same run under DDP averaging. With a fourth argument
``persistent``: 12 steps of 50 ms of "compute" each, rank 2 slowed 2x at every step by
``--inject-straggler 2:2`` (with 7 ranks: rank 1, 3x), the same run without the straggler, and that run again with rank
2 starting ``DELAY`` late. Each rank saves
``OUTDIR/rank{r}.pt``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.trainers._trainer_toys import ToyDataset, lr_fn, make_mlp
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig
from trainers.comm import AverageCombiner
from trainers.comm.coded import CodedReduceCombiner
from trainers.comm.flat import flat_grads

STEPS, BATCH, SEED, DELAY = 6, 2, 3, 1.0
# The rank slowed at each step: at most one per group over the whole run, since a rank
# that fell behind stays behind (nobody waits for it): the root's child 1 (first of its
# group), grandchild 3 (first under 1), grandchild 6 (second under 2). None: no straggler.
SLOW = {7: [None, 1, None, 3, None, 6], 3: [None, 2, None, None, None, None]}
# (rank, factor) slowed at every step in ``persistent`` mode: a leaf of the one-level tree
# (2x), an inner node (parent of 3 and 4) of the two-level one (3x: with 7 processes on few
# cores every step is slow, and 2x left it only 1 step behind in some loaded runs)
PERSISTENT = {3: (2, 2.0), 7: (1, 3.0)}


class Recording(CodedReduceCombiner):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.local: list[torch.Tensor] = []
        self.applied: list[torch.Tensor] = []

    def reduce_gradients(self, scaler) -> None:
        self.local.append(None if self._skip else flat_grads(self._params(), torch.float64))
        super().reduce_gradients(scaler)
        self.applied.append(flat_grads(self._params(), torch.float64))


def run(
    env: DistEnv,
    combiner,
    slow: list,
    *,
    compute: float = 0.0,
    straggler=None,
    steps: int = STEPS,
    log_interval: int = 1,
    late: float = 0.0,
) -> Trainer:
    model = make_mlp(seed=0).double()

    def step(m, batch):
        if slow[trainer.global_step] == env.rank:
            time.sleep(DELAY)
        time.sleep(compute)
        x, y = batch
        return F.cross_entropy(m(x.double()), y), {"acc": torch.tensor(1.0)}

    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=lr_fn(0), momentum=0.9),
        TrainerConfig(epochs=1, max_steps=steps, batch_size=BATCH, seed=SEED, log_interval=log_interval,
                      progress=False, inject_straggler=straggler),
        env=env, logger=RunLogger(None, enabled=False), lr_schedule=lr_fn, train_step=step,
        combiner=combiner,
    )  # fmt: skip
    if env.rank == 2:  # after the constructor's broadcast: the root decides step 0 without us
        time.sleep(late)
    trainer.fit(ToyDataset(48))
    return trainer


def persistent(out: Path, env: DistEnv) -> None:
    steps = 12
    coded = Recording(stragglers=1)
    slowed = run(
        env,
        coded,
        [None] * steps,
        compute=0.05,
        straggler=PERSISTENT[env.world_size],
        steps=steps,
        log_interval=0,
    )  # step records are collectives: every rank would wait
    reference = run(env, CodedReduceCombiner(stragglers=1), [None] * steps, steps=steps)
    # rank 2 starts DELAY late with metrics logged every step: step 0 is decided (and the root
    # waits in the step's metric reduction) when it starts; it must still compute step 0, or
    # it would not know the metric names the reduction needs (the collective would mismatch)
    late = Recording(stragglers=1)
    late_run = run(env, late, [None] * steps, steps=steps, late=DELAY)
    torch.save({
        "late_local": late.local, "late_params": [p.detach().clone() for p in late_run.model.parameters()],
        "skipped": coded.skipped, "local": coded.local, "waited": coded.waited,
        "params": [p.detach().clone() for p in slowed.model.parameters()],
        "reference": [p.detach().clone() for p in reference.model.parameters()],
    }, out / f"rank{env.rank}.pt")  # fmt: skip


def main(out: Path, branching: int, stragglers: int, mode: str = "") -> None:
    torch.set_num_threads(1)
    with DistEnv.from_env(device="cpu") as env:
        if mode == "persistent":
            return persistent(out, env)
        slow = SLOW[env.world_size] if stragglers else [None] * STEPS
        coded = Recording(branching=branching, stragglers=stragglers)
        trainer = run(env, coded, slow)
        res = {
            "local": coded.local, "applied": coded.applied, "waited": coded.waited,
            "part": coded.data_shard(), "slow": slow,
            "params": [p.detach().clone() for p in trainer.model.parameters()],
        }  # fmt: skip
        if stragglers == 0:
            reference = run(env, AverageCombiner(), [None] * STEPS)
            res["ddp"] = [p.detach().clone() for p in reference.model.parameters()]
        torch.save(res, out / f"rank{env.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:])
