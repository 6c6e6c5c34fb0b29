"""One worker of the elastic tests in test_elastic.py (launched by torchrun agents) and
test_recovery.py (launched by ``python -m trainers.elastic inproc``).

Usage: python -m torch.distributed.run ... -m tests.trainers._elastic_worker OUTDIR

Trains the toy MLP on a dataset whose samples carry their index, with an ElasticState in
``OUTDIR/elastic``, and writes what the test needs to watch and judge the run:

* ``OUTDIR/procs/<pid>.json``: rank, world size and the agent's pid (to kill a "node");
* ``OUTDIR/observed/<run>.rank<r>.jsonl``: the ids train_step actually received per step;
* ``OUTDIR/run.jsonl``: the run log (rank 0), appended to by later worker groups;
* ``OUTDIR/final.json``: the last evaluation (rank 0, at the end);
* ``OUTDIR/procs/<pid>.final``: every process's final rank, step and a hash of its weights.

Pacing: while ``OUTDIR/gate`` holds a number ``n``, no worker starts step ``n + 1`` (the test
moves the gate, so the scenario does not depend on how loaded the machine is).

Fault injection: when ``OUTDIR/hang_next_save`` exists, rank 0 claims it and its next
``state.pt`` write stops halfway (half the bytes written and flushed to the temporary file)
after writing ``OUTDIR/hanging.json``; the test then kills the node.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

from tests.trainers._trainer_toys import ToyDataset, eval_step, make_mlp
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig, make_header
from trainers.comm import create_combiner
from trainers.elastic import ElasticState, repair_run_log

# The scenario; test_elastic.py imports these.
NUM_SAMPLES, BATCH, EPOCHS, LR = 96, 4, 6, 0.2
CHECKPOINT_STEPS, RAMP_STEPS = 4, 4
STEP_SECONDS = 0.05


class Indexed(Dataset):
    """Samples ``lo .. hi - 1`` of one ToyDataset (one labelling rule) as ``(x, y, index)``."""

    def __init__(self, data: ToyDataset, lo: int, hi: int) -> None:
        self.data, self.lo, self.hi = data, lo, hi

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, i: int):
        x, y = self.data[self.lo + i]
        return x, y, i


def datasets() -> tuple[Indexed, Indexed]:
    """The training set (NUM_SAMPLES) and a held-out set of 300 from the same rule."""
    data = ToyDataset(NUM_SAMPLES + 300)
    return Indexed(data, 0, NUM_SAMPLES), Indexed(data, NUM_SAMPLES, NUM_SAMPLES + 300)


def build(env: DistEnv, out: Path, logger: RunLogger) -> tuple[Trainer, ElasticState]:
    model = make_mlp(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    observed: dict[str, object] = {}

    def train_step(model, batch):
        x, y, ids = batch
        wait_for_gate(out, trainer.global_step)
        elastic = observed["state"]
        with open(out / "observed" / f"{elastic.run_id}.rank{env.rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": trainer.global_step + 1, "ids": ids.tolist()}) + "\n")
        time.sleep(STEP_SECONDS)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        return loss, {"accuracy": (logits.argmax(1) == y).sum(), "count": y.numel()}

    config = TrainerConfig(
        epochs=EPOCHS, batch_size=BATCH, seed=3, log_interval=1, drop_last=False, progress=False
    )
    trainer = Trainer(
        model,
        optimizer,
        config,
        env=env,
        logger=logger,
        train_step=train_step,
        eval_step=lambda m, b: eval_step(m, b[:2]),
        # test_recovery runs the job with other DDP-based modes too
        combiner=create_combiner(os.environ.get("ELASTIC_TEST_COMBINER", "average")),
    )
    elastic = ElasticState(
        trainer, out / "elastic", checkpoint_steps=CHECKPOINT_STEPS, ramp_steps=RAMP_STEPS
    )
    observed["state"] = elastic
    return trainer, elastic


def wait_for_gate(out: Path, done_steps: int) -> None:
    while True:
        try:
            limit = int((out / "gate").read_text())
        except FileNotFoundError:
            return
        except ValueError:  # being written
            limit = done_steps
        if done_steps < limit:
            return
        time.sleep(0.1)


def hang_in_next_save(out: Path) -> None:
    """Rank 0: if asked, stop the next state.pt write halfway (the test kills us there)."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        flag = out / "hang_next_save"
        if not (isinstance(obj, dict) and "model" in obj):  # torch.save also pickles tensors
            return real_save(obj, f, *args, **kwargs)
        try:
            flag.rename(out / "hang_claimed")
        except FileNotFoundError:
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        tmp = sorted(str(p) for p in (out / "elastic").glob(".state.pt.*.tmp"))
        marker = {"pid": os.getpid(), "step": obj["step"], "tmp": tmp}
        (out / "hanging.json").write_text(json.dumps(marker))
        while True:
            time.sleep(1)

    torch.save = save


def main(out: Path) -> None:
    for sub in ("procs", "observed"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    with DistEnv.from_env(device="cpu") as env:
        info = {
            "rank": env.rank,
            "world_size": env.world_size,
            "pid": os.getpid(),
            "agent_pid": os.getppid(),
            "time": time.time(),
        }
        (out / "procs" / f"{os.getpid()}.json").write_text(json.dumps(info))
        if env.is_main:
            hang_in_next_save(out)
        run_log = out / "run.jsonl"
        resuming = ElasticState.has_checkpoint(out / "elastic")
        if resuming and env.is_main:
            repair_run_log(run_log)
        logger = RunLogger(
            run_log, enabled=env.is_main, console=False, mode="a" if resuming else "w"
        )
        if not resuming:
            logger.write(make_header(sys.argv, seed=3, world_size=env.world_size))
        trainer, _ = build(env, out, logger)
        train_set, eval_set = datasets()
        trainer.fit(train_set, eval_dataset=eval_set)
        logger.close()
        digest = hashlib.sha256(
            b"".join(p.detach().numpy().tobytes() for p in trainer.model.parameters())
        )
        (out / "procs" / f"{os.getpid()}.final").write_text(
            json.dumps({"rank": env.rank, "world_size": env.world_size, "step": trainer.global_step,
                        "params_sha256": digest.hexdigest()})
        )  # fmt: skip
        if env.is_main:
            (out / "final.json").write_text(json.dumps(trainer.last_eval))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
