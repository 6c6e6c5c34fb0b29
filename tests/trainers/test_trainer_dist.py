"""Two gloo processes on 127.0.0.1 against one process with the same global batch."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainers._launch import run_ranks
from tests.trainers._trainer_toys import ToyDataset, eval_step, lr_fn, make_mlp, train_step
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    run_ranks("tests.trainers._dist_worker", [str(out)], timeout=180)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def one_process(config, data, eval_data=None):
    model = make_mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr_fn(0), momentum=0.9, weight_decay=1e-3)
    trainer = Trainer(
        model,
        opt,
        config,
        env=DistEnv(),
        logger=RunLogger(None, enabled=False),
        lr_schedule=lr_fn,
        train_step=train_step,
        eval_step=eval_step,
    )
    trainer.fit(data, eval_dataset=eval_data)
    return trainer


def test_ddp_equals_one_process_with_the_same_global_batch(two_ranks):
    _, (r0, r1) = two_ranks
    for a, b in zip(r0["ddp"], r1["ddp"], strict=True):
        assert torch.equal(a, b)  # identical across ranks
    ref = one_process(
        TrainerConfig(epochs=2, batch_size=8, seed=5, log_interval=0),
        ToyDataset(48),
        ToyDataset(11),
    )
    for got, want in zip(r0["ddp"], ref.model.parameters(), strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-5)
    # Evaluation: every sample once across ranks (11 = uneven), sums all-reduced.
    assert r0["eval"] == r1["eval"]
    for name, value in ref.last_eval.items():
        assert r0["eval"][name] == pytest.approx(value, abs=1e-5)


def _same_on_both_and_as_one_process(rank0, rank1, *, grad_accum_steps):
    """Both ranks' weights equal, and (to float summation order) those of one process with
    the global batch of 2 ranks x 2 samples over ``grad_accum_steps`` micro-steps."""
    ref = one_process(
        TrainerConfig(epochs=2, batch_size=4, grad_accum_steps=grad_accum_steps, seed=6,
                      log_interval=0),
        ToyDataset(32),
    )  # fmt: skip
    for a, b, want in zip(rank0, rank1, ref.model.parameters(), strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, want.detach(), rtol=0, atol=1e-5)


def test_accumulation_skips_sync_on_non_final_micro_steps(two_ranks):
    _, (r0, r1) = two_ranks
    assert r0["accum_steps"] == 4
    # One bucket (a tiny model): one all-reduce per optimizer step, not per micro-step.
    assert r0["allreduce_calls"] == r1["allreduce_calls"] == 4
    _same_on_both_and_as_one_process(r0["accum"], r1["accum"], grad_accum_steps=4)


def test_a_compiled_ddp_run_trains_what_one_eager_process_trains(two_ranks):
    _, (r0, r1) = two_ranks
    assert r0["compiled_graphs"] >= 1 and r1["compiled_graphs"] >= 1  # dynamo captured it
    # 32 samples, global batch 2 x 2 ranks x 2 micro-steps: 4 steps a epoch, 8 all-reduces
    assert r0["compiled_allreduce_calls"] == r1["compiled_allreduce_calls"] == 8
    _same_on_both_and_as_one_process(r0["compiled"], r1["compiled"], grad_accum_steps=2)


def test_only_rank_zero_logs_and_saves(two_ranks):
    out, (r0, _) = two_ranks
    assert (out / "log_rank0.jsonl").exists() and not (out / "log_rank1.jsonl").exists()
    kinds = [
        json.loads(line)["kind"] for line in (out / "log_rank0.jsonl").read_text().splitlines()
    ]
    assert kinds[-1] == "end" and kinds.count("eval") == 2
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == [
        "epoch0.pt",
        "epoch1.pt",
        "latest.pt",
    ]


def test_two_rank_checkpoint_resumes_in_one_process(two_ranks):
    out, (r0, _) = two_ranks
    model = make_mlp(seed=42)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        TrainerConfig(epochs=3, batch_size=8, seed=5, log_interval=0),
        env=DistEnv(),
        logger=RunLogger(None, enabled=False),
        lr_schedule=lr_fn,
        train_step=train_step,
    )
    trainer.resume(out / "ckpt" / "latest.pt")  # world size 2 -> 1: RNGs reseeded
    assert (trainer.epoch, trainer.global_step) == (2, 12)
    for got, want in zip(trainer.model.parameters(), r0["ddp"], strict=True):
        assert torch.equal(got.detach(), want)
    trainer.fit(ToyDataset(48))
    assert trainer.global_step == 18
