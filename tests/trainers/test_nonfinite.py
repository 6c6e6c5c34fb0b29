"""Nothing silently wrong: a non-finite loss stops the Trainer, --skip-nonfinite skips exactly
the bad steps, no non-finite checkpoint is written, and a run cut short by max_steps ends with
an evaluation of the model it has.

Oracles: batches planted with a NaN input at known steps (unshuffled data, so the step of
each sample is known in advance), the plain PyTorch loop over the same batches with the bad
ones left out, the weights before the bad step, accuracy computed directly from the model's
logits, and the count of collectives (a step-count-independent number when no per-step sync
is added).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests.trainers._trainer_toys import ToyDataset, eval_step, make_mlp, params, train_step
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig
from trainers.checkpoint import load_checkpoint, save_checkpoint
from trainers.errors import NonFiniteError, UsageError

BATCH = 8


def _poisoned(n: int, bad_steps: tuple[int, ...]) -> ToyDataset:
    """Unshuffled batches of 8: the first sample of each 1-based step in ``bad_steps`` is NaN."""
    data = ToyDataset(n)
    for step in bad_steps:
        data.x[(step - 1) * BATCH, 0] = float("nan")
    return data


class CountingEnv(DistEnv):
    """A world of one that counts its all-reduces (each one a host sync)."""

    def __init__(self) -> None:
        super().__init__()
        self.reductions = 0

    def all_reduce_sum(self, tensor):
        self.reductions += 1
        return super().all_reduce_sum(tensor)


def _trainer(model, config, *, lr=0.1, momentum=0.9, env=None, log=None, hooks=()):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return Trainer(
        model, opt, config, env=env or DistEnv(),
        logger=RunLogger(log, enabled=log is not None, console=False),
        train_step=train_step, eval_step=eval_step, hooks=hooks,
    )  # fmt: skip


def _config(**kw) -> TrainerConfig:
    return TrainerConfig(**{"batch_size": BATCH, "shuffle": False, "log_interval": 0, **kw})


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _plain(model, data, steps, skip=(), lr=0.1, momentum=0.9):
    """SGD over the unshuffled batches 1..steps, leaving out the updates of ``skip``."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for step in range(1, steps + 1):
        idx = slice((step - 1) * BATCH, step * BATCH)
        if step in skip:
            continue
        loss = F.cross_entropy(model(data.x[idx]), data.y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return model, losses


# -- stopping ------------------------------------------------------------------------------------
@pytest.mark.parametrize("log_interval", [0, 2])
def test_a_nan_loss_stops_the_run_naming_its_step(log_interval):
    trainer = _trainer(make_mlp(), _config(epochs=2, log_interval=log_interval))
    with pytest.raises(NonFiniteError) as info:
        trainer.fit(_poisoned(48, (3,)))  # 6 steps an epoch; step 3's loss is NaN
    message = str(info.value)
    assert isinstance(info.value, UsageError)
    assert "non-finite loss (nan) at step 3" in message
    assert "lower --lr (now 0.1)" in message and "--skip-nonfinite N" in message
    # found where the loop synchronizes anyway: the log interval, else the epoch's end
    assert trainer.global_step == (4 if log_interval else 6)
    assert trainer.epoch == 0  # the epoch never ended: no epoch record, no evaluation


def test_an_infinite_learning_rate_stops_at_the_first_step_it_spoils():
    trainer = _trainer(make_mlp(), _config(epochs=1), lr=float("inf"), momentum=0.0)
    with pytest.raises(NonFiniteError, match=r"at step 2: .*lower --lr \(now inf\)"):
        trainer.fit(ToyDataset(48))


def test_a_bad_first_batch_points_at_the_data():
    trainer = _trainer(make_mlp(), _config(epochs=1))
    with pytest.raises(NonFiniteError, match="at step 1, before any update: check the data"):
        trainer.fit(_poisoned(48, (1,)))


def test_weights_spoiled_by_the_last_step_fail_the_end_of_fit():
    # lr=inf: the first loss is finite, the weights after its update are not
    trainer = _trainer(make_mlp(), _config(epochs=1, max_steps=1), lr=float("inf"), momentum=0)
    with pytest.raises(NonFiniteError, match=r"non-finite weights after step 1 \(parameter '0"):
        trainer.fit(ToyDataset(48))


def test_no_host_sync_per_step_by_default():
    def reductions(n, **kw):
        env = CountingEnv()
        _trainer(make_mlp(), _config(epochs=1, **kw), env=env).fit(ToyDataset(n))
        return env.reductions

    assert reductions(48) == reductions(96)  # 6 or 12 steps: the same collectives
    assert reductions(96, skip_nonfinite=1) - reductions(48, skip_nonfinite=1) == 6  # per step


# -- skipping ------------------------------------------------------------------------------------
def test_skip_nonfinite_skips_exactly_the_bad_steps(tmp_path):
    data = _poisoned(48, (3, 5))
    kept = {}

    class Snapshots:
        def on_step_end(self, trainer, step):
            kept[step] = params(trainer.model)

    log = tmp_path / "run.jsonl"
    trainer = _trainer(
        make_mlp(), _config(epochs=1, skip_nonfinite=2), log=log, hooks=[Snapshots()]
    )
    trainer.fit(data)
    assert trainer.nonfinite_skipped == [3, 5] and trainer.global_step == 6
    for step in (3, 5):  # the bad step changed nothing
        for a, b in zip(kept[step], kept[step - 1], strict=True):
            assert torch.equal(a, b)
    reference, losses = _plain(make_mlp(), data, 6, skip=(3, 5))
    for got, want in zip(params(trainer.model), params(reference), strict=True):
        assert torch.equal(got, want)
    records = _records(log)
    epoch = next(r for r in records if r["kind"] == "epoch")
    assert epoch["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-6)  # NaN left out
    assert records[-1]["kind"] == "end" and records[-1]["nonfinite_steps_skipped"] == 2


def test_one_bad_step_more_than_allowed_stops_the_run():
    trainer = _trainer(make_mlp(), _config(epochs=1, skip_nonfinite=1))
    with pytest.raises(NonFiniteError) as info:
        trainer.fit(_poisoned(48, (2, 4)))
    message = str(info.value)
    assert "at step 4, one more than --skip-nonfinite 1 tolerates (skipped: 2)" in message
    assert trainer.global_step == 3  # raised at step 4, before its update


def test_fp16_overflow_stays_the_loss_scalers_business():
    """Scaled gradients that overflow while the loss is finite: the GradScaler skips those
    steps and lowers its scale; nothing is counted or raised here."""

    def huge_loss_step(model, batch):
        loss, metrics = train_step(model, batch)
        return loss * 1e36, metrics  # finite; times the scale 65536 it overflows float32

    opt_model = make_mlp()
    trainer = Trainer(
        opt_model, torch.optim.SGD(opt_model.parameters(), lr=0.0),
        _config(epochs=1, precision="fp16", skip_nonfinite=1), env=DistEnv(),
        logger=RunLogger(None, enabled=False), train_step=huge_loss_step,
    )  # fmt: skip
    metrics = trainer.fit(ToyDataset(96))
    assert trainer.scaler is not None and trainer.scaler.get_scale() < 65536.0
    assert trainer.nonfinite_skipped == [] and metrics["nonfinite_steps_skipped"] == 0


# -- checkpoints -----------------------------------------------------------------------------------
def test_save_checkpoint_refuses_non_finite_tensors_and_writes_nothing(tmp_path):
    path = tmp_path / "latest.pt"
    save_checkpoint(path, {"model": {"w": torch.ones(2)}})
    before = path.read_bytes()
    state = {"model": {"w": torch.ones(2)}, "optimizer": {"state": {0: {"m": torch.ones(1)}}}}
    state["optimizer"]["state"][0]["m"][0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"optimizer\['state'\]\[0\]\['m'\]"):
        save_checkpoint(path, state)
    with pytest.raises(NonFiniteError, match=r"model\['w'\] has a non-finite value"):
        save_checkpoint(tmp_path / "new.pt", {"model": {"w": torch.tensor([1.0, math.nan])}})
    assert path.read_bytes() == before and not (tmp_path / "new.pt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.pt"]  # no temporary file


def test_the_trainer_writes_no_checkpoint_of_a_diverged_model(tmp_path):
    # lr=inf: step 1's loss is finite but its update spoils the weights; the save after it
    # is refused (the weights), and nothing is in the folder
    cfg = _config(epochs=1, save_dir=str(tmp_path), save_interval_steps=1)
    trainer = _trainer(make_mlp(), cfg, lr=float("inf"), momentum=0.0)
    with pytest.raises(NonFiniteError, match=r"model\['0.weight'\]"):
        trainer.fit(ToyDataset(48))
    assert list(tmp_path.iterdir()) == []
    # a NaN loss seen before a save stops the run before the file is written
    cfg = _config(epochs=1, save_dir=str(tmp_path), save_interval_steps=3)
    with pytest.raises(NonFiniteError, match="at step 2"):
        _trainer(make_mlp(), cfg).fit(_poisoned(48, (2,)))
    assert list(tmp_path.iterdir()) == []


def test_skipped_steps_survive_a_resume(tmp_path):
    cfg = _config(epochs=2, skip_nonfinite=2, save_dir=str(tmp_path), max_steps=4)
    first = _trainer(make_mlp(), cfg)
    first.fit(_poisoned(48, (2,)))
    assert load_checkpoint(tmp_path / "latest.pt")["nonfinite_skipped"] == [2]
    resumed = _trainer(make_mlp(), _config(epochs=2, skip_nonfinite=2))
    resumed.resume(tmp_path / "latest.pt")
    assert resumed.fit(_poisoned(48, (2,)))["nonfinite_steps_skipped"] == 2  # step 8 too


# -- max_steps ends with an evaluation -----------------------------------------------------------
def _accuracy(model, data) -> float:
    with torch.no_grad():
        return int((model(data.x).argmax(1) == data.y).sum()) / len(data)


def test_max_steps_inside_an_epoch_ends_with_an_evaluation(tmp_path):
    log = tmp_path / "run.jsonl"
    val = ToyDataset(20, seed=9)
    trainer = _trainer(make_mlp(), _config(epochs=3, max_steps=7), log=log)
    final = trainer.fit(ToyDataset(40), eval_dataset=val)  # 5 steps an epoch
    records = _records(log)
    evals = [r for r in records if r["kind"] == "eval"]
    assert [(r["epoch"], r["step"]) for r in evals] == [(0, 5), (1, 7)]
    assert evals[-1]["top1"] == pytest.approx(_accuracy(trainer.model, val), abs=1e-12)
    assert final["top1"] == evals[-1]["top1"]
    end = records[-1]
    assert end["kind"] == "end" and end["steps"] == 7 and end["epochs"] == pytest.approx(1.4)


def test_max_steps_at_an_epoch_boundary_without_an_evaluation_evaluates(tmp_path):
    log = tmp_path / "run.jsonl"
    val = ToyDataset(20, seed=9)
    trainer = _trainer(make_mlp(), _config(epochs=4, max_steps=5, eval_interval=2), log=log)
    trainer.fit(ToyDataset(40), eval_dataset=val)
    evals = [r for r in _records(log) if r["kind"] == "eval"]
    assert [(r["epoch"], r["step"]) for r in evals] == [(0, 5)]  # the epoch it finished
    assert _records(log)[-1]["epochs"] == 1


def test_runs_that_do_not_stop_early_keep_their_records(tmp_path):
    val = ToyDataset(20, seed=9)

    def numbers(log, **kw):
        _trainer(make_mlp(), _config(epochs=2, log_interval=2, **kw), log=log).fit(
            ToyDataset(40), eval_dataset=val
        )
        drop = {"samples_per_sec", "time_cost", "total_time"}
        return [{k: v for k, v in r.items() if k not in drop} for r in _records(log)[1:]]

    plain = numbers(tmp_path / "a.jsonl")
    assert [r["kind"] for r in plain].count("eval") == 2
    assert numbers(tmp_path / "b.jsonl", max_steps=10) == plain  # max_steps = the whole run


# -- every rank agrees -----------------------------------------------------------------------------
@pytest.mark.dist
@pytest.mark.slow
def test_ranks_agree_on_a_nan_loss_that_only_one_rank_sees(tmp_path):
    from tests.trainers._launch import run_ranks

    run_ranks("tests.trainers._nonfinite_worker", [str(tmp_path)], timeout=240)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    assert r0["stop"] == r1["stop"]  # both stopped, at the same step, with the same message
    message, step = r0["stop"]
    assert "non-finite loss (nan) at step 3 on rank 1" in message and step == 6
    assert r0["skipped"] == r1["skipped"] == [3]
    for a, b in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(a, b)
