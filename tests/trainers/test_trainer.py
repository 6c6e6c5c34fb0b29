"""Trainer against a hand-written plain PyTorch loop, accumulation, clipping, AMP, resume."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import pytest
import torch

from tests.trainers._trainer_toys import (
    ToyDataset,
    eval_step,
    lr_fn,
    make_mlp,
    params,
    plain_loop,
    train_step,
)
from trainers import (
    DistEnv,
    GradCombiner,
    RunLogger,
    Trainer,
    TrainerConfig,
    load_checkpoint,
)
from trainers.config import ScheduleConfig
from trainers.errors import UsageError
from trainers.schedules import create_schedule

ENV = DistEnv()  # a world of one, no process group


def make_trainer(model, config, *, logger=None, lr_schedule=lr_fn, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=lr_fn(0), momentum=0.9, weight_decay=1e-3)
    return Trainer(
        model,
        opt,
        config,
        env=ENV,
        logger=logger or RunLogger(None, enabled=False),
        lr_schedule=lr_schedule,
        train_step=train_step,
        eval_step=eval_step,
        **kwargs,
    )


def test_matches_plain_loop_bit_for_bit():
    data = ToyDataset(40)  # 5 steps of 8 per epoch, 2 epochs
    cfg = TrainerConfig(epochs=2, batch_size=8, seed=7, log_interval=0)
    trainer = make_trainer(make_mlp(), cfg)
    trainer.fit(data)
    reference = plain_loop(make_mlp(), data, batch=8, steps=10, seed=7)
    assert trainer.global_step == 10
    for got, want in zip(params(trainer.model), params(reference), strict=True):
        assert torch.equal(got, want)


def test_max_steps_stops_mid_epoch():
    data = ToyDataset(40)
    trainer = make_trainer(make_mlp(), TrainerConfig(epochs=3, batch_size=8, max_steps=7, seed=1))
    trainer.fit(data)
    reference = plain_loop(make_mlp(), data, batch=8, steps=7, seed=1)
    assert (trainer.global_step, trainer.epoch, trainer.epoch_samples) == (7, 1, 16)
    for got, want in zip(params(trainer.model), params(reference), strict=True):
        assert torch.equal(got, want)


def test_gradient_accumulation_equals_big_batch():
    data = ToyDataset(64)
    cfg = TrainerConfig(epochs=2, batch_size=4, grad_accum_steps=4, seed=3, log_interval=0)
    trainer = make_trainer(make_mlp(), cfg)
    trainer.fit(data)
    reference = plain_loop(make_mlp(), data, batch=16, steps=8, seed=3)
    assert trainer.global_step == 8
    for got, want in zip(params(trainer.model), params(reference), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_gradient_clipping_matches_formula():
    data = ToyDataset(40)
    cfg = TrainerConfig(epochs=1, batch_size=8, clip_grad_norm=0.05, seed=5)
    trainer = make_trainer(make_mlp(), cfg)
    trainer.fit(data)
    reference = plain_loop(make_mlp(), data, batch=8, steps=5, seed=5, clip=0.05)
    unclipped = plain_loop(make_mlp(), data, batch=8, steps=5, seed=5)
    for got, want, free in zip(
        params(trainer.model), params(reference), params(unclipped), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert not torch.allclose(got, free, atol=1e-4)  # the clip was active


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_cpu(precision):
    seen = []

    def step(model, batch):
        loss, metrics = train_step(model, batch)
        seen.append(model(batch[0]).dtype)
        return loss, metrics

    data = ToyDataset(64)
    model = make_mlp()
    before = params(model)
    clip = 10.0 if precision == "fp16" else None  # exercises unscale_ before clipping
    cfg = TrainerConfig(
        epochs=4, batch_size=16, precision=precision, log_interval=0, clip_grad_norm=clip
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    trainer = Trainer(
        model, opt, cfg, env=ENV, logger=RunLogger(None, enabled=False), train_step=step
    )
    if precision == "fp16":
        assert isinstance(trainer.scaler, torch.amp.GradScaler) and trainer.scaler.is_enabled()
    else:
        assert trainer.scaler is None
    losses = []
    trainer.hooks.append(
        type("H", (), {"on_epoch_end": lambda self, t, e, m: losses.append(m["loss"])})()
    )
    trainer.fit(data)
    assert seen[0] == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert any(not torch.equal(a, b) for a, b in zip(before, params(model), strict=True))
    assert losses[-1] < losses[0]
    if precision == "fp16":
        assert trainer.state_dict()["scaler"]["scale"] > 0


def test_incomplete_last_batch_is_kept_without_drop_last():
    trainer = make_trainer(make_mlp(), TrainerConfig(epochs=2, batch_size=8, drop_last=False))
    trainer.fit(ToyDataset(20))
    assert (trainer.global_step, trainer.epoch) == (6, 2)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_evaluate_sees_each_sample_once():
    data = ToyDataset(10)
    trainer = make_trainer(make_mlp(), TrainerConfig(batch_size=3))
    metrics = trainer.evaluate(data)
    with torch.no_grad():
        logits = trainer.model(data.x)
    want_top1 = (logits.argmax(1) == data.y).double().mean().item()
    want_loss = torch.nn.functional.cross_entropy(logits, data.y).item()
    assert metrics["top1"] == pytest.approx(want_top1, abs=1e-12)
    assert metrics["loss"] == pytest.approx(want_loss, rel=1e-6)


def test_hooks_and_evaluation_do_not_change_training():
    calls = []

    class Hook:
        def on_train_start(self, trainer):
            calls.append("train_start")

        def on_epoch_start(self, trainer, epoch):
            calls.append(f"epoch_start{epoch}")

        def on_step_end(self, trainer, step):
            calls.append(f"step{step}")

        def on_epoch_end(self, trainer, epoch, metrics):
            calls.append(f"epoch_end{epoch}")

        def on_eval_end(self, trainer, metrics):
            calls.append("eval")

        def on_train_end(self, trainer, metrics):
            calls.append("train_end")

    data = ToyDataset(16)
    cfg = TrainerConfig(epochs=2, batch_size=8)
    with_eval = make_trainer(make_mlp(dropout=0.3), cfg, hooks=[Hook()])
    with_eval.fit(data, eval_dataset=ToyDataset(8, noise=0.5))
    without = make_trainer(make_mlp(dropout=0.3), cfg)
    without.fit(data)
    assert calls == [
        "train_start",
        "epoch_start0",
        "step1",
        "step2",
        "epoch_end0",
        "eval",
        "epoch_start1",
        "step3",
        "step4",
        "epoch_end1",
        "eval",
        "train_end",
    ]
    for a, b in zip(params(with_eval.model), params(without.model), strict=True):
        assert torch.equal(a, b)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_is_bit_for_bit(tmp_path, num_workers):
    data = ToyDataset(48, noise=0.3)  # 6 micro-batches of 8 = 3 steps per epoch
    cfg = dict(batch_size=8, grad_accum_steps=2, num_workers=num_workers, seed=11, log_interval=1)

    def build(log, **extra):
        model = make_mlp(seed=extra.pop("init", 0), dropout=0.2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return Trainer(
            model,
            opt,
            TrainerConfig(epochs=2, **cfg, **extra),
            env=ENV,
            logger=RunLogger(log, enabled=True, console=False),
            lr_schedule=sched,
            train_step=train_step,
        )

    straight = build(tmp_path / "straight.jsonl")
    straight.fit(data)

    first = build(tmp_path / "first.jsonl", max_steps=4)  # stops after 1 step of epoch 1
    first.fit(data)
    first.save_checkpoint(tmp_path / "mid.pt")
    resumed = build(tmp_path / "resumed.jsonl", init=99)
    resumed.resume(tmp_path / "mid.pt")
    assert (resumed.epoch, resumed.global_step, resumed.epoch_samples) == (1, 4, 16)
    resumed.fit(data)

    for a, b in zip(params(straight.model), params(resumed.model), strict=True):
        assert torch.equal(a, b)

    def numbers(records):  # everything but timing
        drop = {"samples_per_sec", "time_cost", "total_time"}
        return [
            {k: v for k, v in r.items() if k not in drop}
            for r in records
            if r["kind"] in ("step", "epoch")
        ]

    joined = numbers(_records(tmp_path / "first.jsonl")) + numbers(
        _records(tmp_path / "resumed.jsonl")
    )
    assert joined == numbers(_records(tmp_path / "straight.jsonl"))


def test_checkpoint_files_and_contents(tmp_path):
    data = ToyDataset(32)
    cfg = TrainerConfig(epochs=2, batch_size=8, save_dir=str(tmp_path), save_interval_steps=3)
    trainer = make_trainer(make_mlp(), cfg, logger=RunLogger(tmp_path / "log.jsonl"))
    trainer.fit(data)
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == ["epoch0.pt", "epoch1.pt", "latest.pt"]
    state = load_checkpoint(tmp_path / "latest.pt")  # weights_only=True
    assert (state["epoch"], state["step"], state["epoch_samples"]) == (2, 8, 0)
    assert state["world_size"] == 1 and len(state["ranks"]) == 1
    assert set(state["ranks"][0]["rng"]) == {"torch", "cuda", "numpy", "python"}
    assert state["config"]["batch_size"] == 8
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(state["model"][name], tensor)
    saved = [r for r in _records(tmp_path / "log.jsonl") if r["kind"] == "checkpoint"]
    assert [(r["step"], r["path"].rsplit("/", 1)[1]) for r in saved] == [
        (3, "latest.pt"),
        (4, "epoch0.pt"),
        (4, "latest.pt"),
        (6, "latest.pt"),
        (8, "epoch1.pt"),
        (8, "latest.pt"),
    ]


def test_config_validation():
    with pytest.raises(ValueError, match="precision"):
        TrainerConfig(precision="float16")
    with pytest.raises(ValueError, match="grad_accum_steps"):
        TrainerConfig(grad_accum_steps=0)
    trainer = make_trainer(make_mlp(), TrainerConfig(batch_size=64))
    with pytest.raises(ValueError, match="fewer than one global batch"):
        trainer.fit(ToyDataset(10))


class DeltaCombiner(GradCombiner):
    """Delta mode as Adasum will use it: local step, then combine w_new - w_start (identity)."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.steps = 0

    @contextlib.contextmanager
    def no_sync(self):
        self.calls.append("no_sync")
        yield

    def reduce_gradients(self, scaler):
        self.calls.append("reduce")

    def step(self, optimizer, scaler):
        self.calls.append("step")
        start = [p.detach().clone() for p in self.model.parameters()]
        super().step(optimizer, scaler)
        with torch.no_grad():
            for p, w0 in zip(self.model.parameters(), start, strict=True):
                p.copy_(w0 + (p - w0))
        self.steps += 1

    def metrics(self):
        return {"bytes_sent": 4.0 * sum(p.numel() for p in self.model.parameters())}

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state_dict):
        self.steps = state_dict["steps"]


def test_a_custom_combiner_plugs_in_without_touching_the_loop(tmp_path):
    data = ToyDataset(32)
    combiner = DeltaCombiner()
    cfg = TrainerConfig(epochs=1, batch_size=4, grad_accum_steps=2, log_interval=2)
    trainer = make_trainer(
        make_mlp(), cfg, combiner=combiner, logger=RunLogger(tmp_path / "l.jsonl", console=False)
    )
    assert trainer.forward_model is trainer.model
    trainer.fit(data)
    assert combiner.calls == ["no_sync", "reduce", "step"] * 4
    reference = plain_loop(make_mlp(), data, batch=8, steps=4, seed=0)
    for got, want in zip(params(trainer.model), params(reference), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    steps = [r for r in _records(tmp_path / "l.jsonl") if r["kind"] == "step"]
    assert steps and all(r["bytes_sent"] == 4.0 * 163 for r in steps)
    trainer.save_checkpoint(tmp_path / "c.pt")
    assert load_checkpoint(tmp_path / "c.pt")["ranks"][0]["combiner"] == {"steps": 4}
    again = make_trainer(make_mlp(), cfg, combiner=DeltaCombiner())
    again.resume(tmp_path / "c.pt")
    assert again.combiner.steps == 4


# ================================================================================================
# hooks steer the trainer through questions and public calls, never by writing its fields
# ================================================================================================
class _StopAt:
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer, step):
        if step == self.step:
            trainer.request_stop()


def test_request_stop_ends_fit_after_the_step():
    """Oracle: the plain loop for the same number of steps."""
    data = ToyDataset(40)
    trainer = make_trainer(make_mlp(), TrainerConfig(epochs=3, batch_size=8, seed=1))
    trainer.add_hook(_StopAt(7))
    trainer.fit(data)
    reference = plain_loop(make_mlp(), data, batch=8, steps=7, seed=1)
    assert trainer.global_step == 7 and trainer.config.max_steps is None
    for got, want in zip(params(trainer.model), params(reference), strict=True):
        assert torch.equal(got, want)


class _Shift:
    """Reads the schedule 2 steps ahead and halves it from step 3 on."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def schedule_position(self, step):
        return step + 2

    def lr_factor(self, step):
        return 0.5 if step >= 3 else 1.0

    def on_before_step(self, trainer, step):
        self.seen.append((step, None))

    def on_step_end(self, trainer, step):
        self.seen[-1] = (step - 1, trainer.optimizer.param_groups[0]["lr"])


def test_hooks_give_the_schedule_position_and_an_lr_factor():
    hook = _Shift()
    trainer = make_trainer(make_mlp(), TrainerConfig(epochs=1, batch_size=8, seed=1), hooks=[hook])
    trainer.fit(ToyDataset(40))
    assert [s for s, _ in hook.seen] == [0, 1, 2, 3, 4]
    for step, lr in hook.seen:
        want = lr_fn(step + 2) * (0.5 if step >= 3 else 1.0)
        assert lr == want and trainer.lr_at(step) == want


class _Best:
    def final_metrics(self):
        return {"best_thing": 42.0}


def test_final_metrics_join_the_end_record_and_evaluate_can_remember(tmp_path):
    log = tmp_path / "run.jsonl"
    logger = RunLogger(log, console=False)
    trainer = make_trainer(
        make_mlp(), TrainerConfig(epochs=1, batch_size=8, seed=1), logger=logger, hooks=[_Best()]
    )
    final = trainer.fit(ToyDataset(40), eval_dataset=ToyDataset(10, seed=5))
    logger.close()
    end = json.loads(log.read_text().splitlines()[-1])
    assert end["kind"] == "end" and end["best_thing"] == 42.0 and final["best_thing"] == 42.0
    assert end["top1"] == trainer.last_eval["top1"]
    before = dict(trainer.last_eval)
    metrics = trainer.evaluate(ToyDataset(12, seed=9))  # another set: another loss
    assert metrics["loss"] != before["loss"] and trainer.last_eval == before  # not remembered
    trainer.evaluate(ToyDataset(12, seed=9), remember=True)
    assert trainer.last_eval == metrics


class _SkipOdd(GradCombiner):
    """Skips every odd step (as a late CodedReduce rank does) and records what it was given."""

    def __init__(self):
        super().__init__()
        self.steps, self.grads_seen = 0, []

    def skips_step(self):
        return self.steps % 2 == 1

    def reduce_gradients(self, scaler):
        self.grads_seen.append(all(p.grad is not None for p in self.model.parameters()))

    def step(self, optimizer, scaler):
        super().step(optimizer, scaler)
        self.steps += 1


def test_a_skipped_step_draws_its_batches_but_computes_nothing(tmp_path):
    seen = []

    def recording_step(model, batch):
        seen.append(batch[0].clone())
        return train_step(model, batch)

    cfg = TrainerConfig(epochs=1, batch_size=4, grad_accum_steps=2, log_interval=1)
    combiner = _SkipOdd()
    trainer = make_trainer(make_mlp(), cfg, combiner=combiner,
                           logger=RunLogger(tmp_path / "l.jsonl", console=False))  # fmt: skip
    trainer.train_step = recording_step
    trainer.fit(ToyDataset(32))
    assert combiner.grads_seen == [True, False, True, False]  # reduce is called every step
    # the computed micro-batches are those a plain run draws at steps 0 and 2: the skipped
    # steps' batches were drawn, not shifted onto the next step
    everything = []
    plain = make_trainer(make_mlp(), cfg)

    def plain_step(model, batch):
        everything.append(batch[0].clone())
        return train_step(model, batch)

    plain.train_step = plain_step
    plain.fit(ToyDataset(32))
    assert len(everything) == 8 and len(seen) == 4
    for got, want in zip(seen, everything[0:2] + everything[4:6], strict=True):
        assert torch.equal(got, want)
    # an interval holding only a skipped step still gets its record, with no loss or metrics
    steps = [r for r in _records(tmp_path / "l.jsonl") if r["kind"] == "step"]
    assert [r["loss"] is None for r in steps] == [False, True, False, True]
    assert [r["accuracy"] is None for r in steps] == [False, True, False, True]


def test_an_injected_straggler_sleeps_its_factor():
    import time as _time

    def slow_step(model, batch):
        _time.sleep(0.05)
        return train_step(model, batch)

    cfg = TrainerConfig(epochs=1, batch_size=8, max_steps=3, inject_straggler=(0, 3.0),
                        log_interval=0)  # fmt: skip
    trainer = make_trainer(make_mlp(), cfg)
    trainer.train_step = slow_step
    start = _time.perf_counter()
    trainer.fit(ToyDataset(32))
    assert _time.perf_counter() - start >= 3 * 0.05 * 3  # 3 steps, each slept 3x its compute
    with pytest.raises(ValueError, match="inject_straggler needs a rank >= 0 and a factor >= 1"):
        TrainerConfig(inject_straggler=(0, 0.5))
    from trainers.cli import straggler_arg

    assert straggler_arg("2:2") == (2, 2.0)
    for bad in ("2", "a:2", "1:0.5", "-1:2"):
        with pytest.raises(Exception, match="expected RANK:FACTOR"):
            straggler_arg(bad)


def test_a_schedule_in_epochs_is_built_at_the_data_sets_steps_and_resumes(tmp_path):
    """A ScheduleConfig becomes per-step when fit learns the data's size: 44 samples at 4 x 2
    per step are 5 whole steps per epoch (the hand count create_schedule gets below), and the
    run equals one given that per-step schedule. A checkpoint's schedule wins on a resume
    before fit (as it does over a schedule given per step)."""
    data = ToyDataset(44)
    cfg = dict(batch_size=4, grad_accum_steps=2, seed=5, log_interval=0)
    in_epochs = ScheduleConfig(mode="cosine", base_lr=0.2, warmup_epochs=1.0, warmup_lr=0.01)
    per_step = create_schedule("cosine", base_lr=0.2, total_steps=15, warmup_steps=5,
                               warmup_lr=0.01, steps_per_epoch=5)  # fmt: skip
    ours = make_trainer(make_mlp(), TrainerConfig(epochs=3, **cfg), lr_schedule=in_epochs)
    assert ours.lr_schedule is None and ours.steps_per_epoch(44) == 5
    ours.fit(data)
    assert ours.lr_schedule == per_step
    given = make_trainer(make_mlp(), TrainerConfig(epochs=3, **cfg), lr_schedule=per_step)
    given.fit(data)
    assert ours.global_step == given.global_step == 18  # 6 steps an epoch, the last shorter
    for a, b in zip(params(ours.model), params(given.model), strict=True):
        assert torch.equal(a, b)

    first = make_trainer(make_mlp(), TrainerConfig(epochs=3, max_steps=8, **cfg),
                         lr_schedule=in_epochs)  # fmt: skip
    first.fit(data)
    first.save_checkpoint(tmp_path / "mid.pt")
    other = dataclasses.replace(in_epochs, base_lr=0.9)
    resumed = make_trainer(make_mlp(seed=3), TrainerConfig(epochs=3, **cfg), lr_schedule=other)
    resumed.resume(tmp_path / "mid.pt")
    resumed.fit(data)
    assert resumed.lr_schedule == per_step
    for a, b in zip(params(resumed.model), params(given.model), strict=True):
        assert torch.equal(a, b)

    with pytest.raises(UsageError, match="fewer than one global batch of 8"):
        make_trainer(make_mlp(), TrainerConfig(epochs=1, **cfg), lr_schedule=in_epochs).fit(
            ToyDataset(7)
        )
    short = dataclasses.replace(in_epochs, warmup_epochs=0.0, const_epochs=3.2)
    with pytest.raises(UsageError, match="at 5 steps per epoch x 3 epochs"):
        make_trainer(make_mlp(), TrainerConfig(epochs=3, **cfg), lr_schedule=short).fit(data)
