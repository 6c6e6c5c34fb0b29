"""The elastic sample ledger with gradient accumulation across two restarts (one process).

A Trainer with 3 micro-batches per optimizer step (the last step of each epoch has 2, the
last micro-batch is short) and an ElasticState with durable checkpoints is killed twice in
the middle of a step (a later micro-batch raises); each restart is a new Trainer and
ElasticState that resume from ``state.pt``, as a torchrun worker group would.

Oracles: the ids ``train_step`` really received in every micro-batch of every step, and the
sampler's documented epoch order (``torch.randperm(n)`` seeded with ``derive_seed(seed,
epoch)``, contiguous global batches): every committed step records all its micro-batches'
ids, and each epoch's committed ids are that permutation, each sample exactly once.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch

from tests.trainers._elastic_worker import Indexed
from tests.trainers._trainer_toys import ToyDataset, make_mlp
from trainers import DistEnv, GradCombiner, RunLogger, Trainer, TrainerConfig
from trainers.data import derive_seed
from trainers.elastic import ElasticState, committed_samples

# 42 samples in micro-batches of 4: 10 full and one of 2; 3 per step: steps of 3, 3, 3, 2
# micro-batches, 4 steps per epoch, 12 in all. Checkpoints at steps 3, 6, 9.
N, BATCH, ACCUM, EPOCHS, SEED, CHECKPOINT_STEPS = 42, 4, 3, 3, 5, 3
STEPS_PER_EPOCH = 4
# (step, micro-batch) where each generation dies: after checkpoint 3 and after checkpoint 6.
CRASHES = [(5, 1), (7, 2)]


class Crash(Exception):
    pass


def generation(job, observed: dict, crash: tuple[int, int] | None) -> ElasticState:
    """One worker group: build, resume from ``job`` if it holds a state, train (or die)."""
    model = make_mlp(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    config = TrainerConfig(
        epochs=EPOCHS, batch_size=BATCH, grad_accum_steps=ACCUM, seed=SEED, drop_last=False,
        log_interval=0, progress=False,
    )  # fmt: skip
    micro = defaultdict(int)

    def train_step(model, batch):
        x, y, ids = batch
        step = trainer.global_step + 1
        if crash is not None and (step, micro[step]) == crash:
            raise Crash(f"step {step}, micro-batch {micro[step]}")
        micro[step] += 1
        observed[(state.run_id, step)].extend(int(i) for i in ids)
        return torch.nn.functional.cross_entropy(model(x), y), {"count": y.numel()}

    trainer = Trainer(
        model, optimizer, config, env=DistEnv(), logger=RunLogger(None, enabled=False),
        train_step=train_step, combiner=GradCombiner(),
    )  # fmt: skip
    state = ElasticState(trainer, job, checkpoint_steps=CHECKPOINT_STEPS, ramp_steps=0)
    data = Indexed(ToyDataset(N), 0, N)
    if crash is None:
        trainer.fit(data)
    else:
        with pytest.raises(Crash):
            trainer.fit(data)
    return state


def test_every_micro_batch_of_a_step_is_in_the_ledger_across_two_restarts(tmp_path):
    job = tmp_path / "job"
    observed: dict[tuple[str, int], list[int]] = defaultdict(list)
    states = [generation(job, observed, crash) for crash in [*CRASHES, None]]
    assert [s.restored_step for s in states] == [0, 3, 6]
    assert states[-1].trainer.global_step == EPOCHS * STEPS_PER_EPOCH

    records = [
        json.loads(line)
        for path in (job / "ledger").glob("*.jsonl")
        for line in path.read_text().splitlines()
    ]
    steps = {(r["run"], r["step"]): r for r in records if r["kind"] == "step"}
    # Every finished step, and only those, has a record, with all the ids train_step got.
    died = {(s.run_id, step) for s, (step, _) in zip(states, CRASHES, strict=False)}
    assert set(steps) == set(observed) - died
    for key, record in steps.items():
        assert record["ids"] == observed[key], key
    sizes = sorted({len(r["ids"]) for r in steps.values()})
    assert sizes == [6, 12], sizes  # the short last step (4 + 2) and full ones (3 x 4)

    # Committed: each epoch's permutation, in order, each sample once.
    samples = committed_samples(job)
    assert sorted(samples) == list(range(EPOCHS))
    for epoch, ids in samples.items():
        g = torch.Generator().manual_seed(derive_seed(SEED, epoch))
        assert ids == torch.randperm(N, generator=g).tolist(), epoch
