"""One rank of the 2-process test in test_nonfinite.py: only rank 1 sees a NaN loss.

Usage: python -m tests.trainers._nonfinite_worker OUTDIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tests.trainers._trainer_toys import ToyDataset, eval_step, make_mlp, train_step
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig
from trainers.comm import GradCombiner
from trainers.errors import NonFiniteError


def build(env, combiner=None, **config):
    model = make_mlp(seed=0)
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        TrainerConfig(batch_size=4, shuffle=False, log_interval=0, **config),
        env=env,
        logger=RunLogger(None, enabled=False),
        train_step=train_step,
        eval_step=eval_step,
        combiner=combiner,
    )


def main(out: Path) -> None:
    # global batches of 8, unshuffled: rank 1 reads samples 4..7 of each; step 3's is NaN there
    data = ToyDataset(48)
    data.x[2 * 8 + 5, 0] = float("nan")
    results = {}
    with DistEnv.from_env(device="cpu") as env:
        # No gradient exchange: rank 0's own losses stay finite, yet it stops with rank 1
        # (at the epoch's end) instead of waiting there for a rank that left.
        trainer = build(env, GradCombiner(), epochs=2)
        try:
            trainer.fit(data, eval_dataset=ToyDataset(11))
        except NonFiniteError as err:
            results["stop"] = (str(err), trainer.global_step)
        # --skip-nonfinite: every rank skips step 3, so the replicas stay equal.
        trainer = build(env, epochs=1, skip_nonfinite=1)
        trainer.fit(data)
        results["skipped"] = list(trainer.nonfinite_skipped)
        results["params"] = [p.detach().clone() for p in trainer.model.parameters()]
        torch.save(results, out / f"rank{env.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
