"""Learning-rate schedules against GluonCV's documented formulas and the LANS paper's schedule.

The oracles below are transcribed from the references, not from trainers.schedules:
GluonCV's LRScheduler computed lr from (batch i, epoch) with T = epoch * niters + i and
  warmup (epoch < warmup_epochs): warmup_lr + (base - warmup_lr) * T / warmup_N
  step:   base * factor ** #{s in step_epochs: s <= epoch}
  poly:   target + (base - target) * (1 - (T - warmup_N) / (N - warmup_N)) ** power
  cosine: target + (base - target) * (1 + cos(pi * (T - warmup_N) / (N - warmup_N))) / 2
and the LANS schedule, with x = step / total, is
  base * x / warmup (x < warmup), base (x < warmup + const),
  base * ((1 - x) / (1 - warmup - const)) ** degree otherwise.
"""

import math

import numpy as np
import pytest
import torch

from trainers.schedules import LRSchedule, apply_lr, create_schedule

NITERS, NEPOCHS, WARMUP_EPOCHS = 10, 12, 2
N, WARMUP_N = NITERS * NEPOCHS, NITERS * WARMUP_EPOCHS
BASE, TARGET, WARMUP_LR = 0.4, 0.004, 0.01


def gluoncv_lr(mode, i, epoch, *, step=(5, 9), factor=0.1, power=2.0, warmup_lr=WARMUP_LR):
    T = epoch * NITERS + i
    if epoch < WARMUP_EPOCHS:
        return warmup_lr + (BASE - warmup_lr) * T / WARMUP_N
    if mode == "step":
        return BASE * np.power(factor, sum(1 for s in step if s <= epoch))
    progress = (T - WARMUP_N) / (N - WARMUP_N)
    if mode == "poly":
        return TARGET + (BASE - TARGET) * np.power(1 - progress, power)
    if mode == "linear":
        return TARGET + (BASE - TARGET) * (1 - progress)
    return TARGET + (BASE - TARGET) * (1 + np.cos(np.pi * progress)) / 2


def lans_lr(step, total, warmup, const, degree, base=BASE):
    x = step / total
    if x < warmup:
        return base * x / warmup
    if x < warmup + const:
        return base
    return base * np.power((1 - x) / (1 - warmup - const), degree)


# step 0, last warmup step, end of warmup, mid-run, last step
POINTS = [(0, 0), (9, 1), (0, 2), (3, 7), (9, 11)]


@pytest.mark.parametrize("mode", ["cosine", "poly", "linear", "step"])
def test_matches_gluoncv(mode):
    sched = create_schedule(
        mode,
        base_lr=BASE,
        total_steps=N,
        warmup_steps=WARMUP_N,
        warmup_lr=WARMUP_LR,
        steps_per_epoch=NITERS,
        decay_epochs=(5, 9),
        decay_factor=0.1,
        final_lr=TARGET,
    )
    for i, epoch in POINTS:
        expected = gluoncv_lr(mode, i, epoch)
        assert sched(epoch * NITERS + i) == pytest.approx(expected, rel=1e-12), (i, epoch)


def test_poly_power_default_is_two_and_ends_at_final():
    sched = create_schedule(
        "poly", base_lr=BASE, total_steps=N, warmup_steps=WARMUP_N, final_lr=TARGET
    )
    assert sched(70) == pytest.approx(gluoncv_lr("poly", 0, 7, power=2.0))
    assert sched(N) == pytest.approx(TARGET)
    assert sched(10 * N) == pytest.approx(TARGET)  # clamped past the end


def test_cosine_midpoint_and_end():
    sched = create_schedule("cosine", base_lr=BASE, total_steps=100, final_lr=0.0)
    assert sched(0) == BASE
    assert sched(50) == pytest.approx(BASE / 2)
    assert sched(100) == pytest.approx(0.0, abs=1e-15)


def test_step_decays_at_decay_epochs():
    sched = create_schedule(
        "step",
        base_lr=BASE,
        total_steps=N,
        warmup_steps=WARMUP_N,
        steps_per_epoch=NITERS,
        decay_epochs=(5, 9),
        decay_factor=0.1,
    )
    for epoch in (4, 5, 8, 9):
        for i in (0, NITERS - 1):
            assert sched(epoch * NITERS + i) == pytest.approx(gluoncv_lr("step", i, epoch))
    assert sched(5 * NITERS - 1) == pytest.approx(BASE)
    assert sched(5 * NITERS) == pytest.approx(BASE * 0.1)
    assert sched(9 * NITERS) == pytest.approx(BASE * 0.01)


def test_step_decay_epoch_inside_warmup_applies_after_it():
    sched = create_schedule(
        "step", base_lr=1.0, total_steps=100, warmup_steps=20, steps_per_epoch=10, decay_epochs=(1,)
    )
    assert sched(10) == pytest.approx(0.5)  # still warming up
    assert sched(20) == pytest.approx(0.1)


def test_constant_mode():
    sched = create_schedule("constant", base_lr=BASE, total_steps=50, warmup_steps=10)
    assert sched(5) == pytest.approx(BASE / 2)
    assert [sched(t) for t in (10, 30, 50, 80)] == [BASE] * 4


def test_warmup_const_poly_matches_lans_recipe():
    total = 1000
    warmup, const = 0.05, 0.25
    sched = create_schedule(
        "warmup_const_poly",
        base_lr=BASE,
        total_steps=total,
        warmup_steps=round(warmup * total),
        constant_steps=round(const * total),
        power=1.0,
    )
    for step in (0, 25, 50, 200, 300, 301, 650, 999, 1000):
        assert sched(step) == pytest.approx(lans_lr(step, total, warmup, const, 1.0), abs=1e-12)
    assert sched(0) == 0.0
    assert sched(50) == pytest.approx(BASE)
    assert sched(300) == pytest.approx(BASE)
    assert sched(1000) == pytest.approx(0.0, abs=1e-15)


def test_warmup_const_poly_degree_two():
    sched = create_schedule(
        "warmup_const_poly", base_lr=BASE, total_steps=200, warmup_steps=20, constant_steps=40
    )
    for step in (10, 59, 60, 130, 200):
        assert sched(step) == pytest.approx(lans_lr(step, 200, 0.1, 0.2, 2.0), abs=1e-12)


def test_ratio_form_round_trips_and_old_state_dicts_load():
    a = create_schedule(
        "warmup_const_poly", base_lr=1.0, total_steps=30, warmup_ratio=0.05, constant_ratio=0.25
    )
    b = create_schedule("cosine", base_lr=1.0, total_steps=5)
    b.load_state_dict(a.state_dict())
    assert b == a and [b(t) for t in range(31)] == [a(t) for t in range(31)]
    old = create_schedule("cosine", base_lr=1.0, total_steps=5).state_dict()
    del old["warmup_ratio"], old["constant_ratio"]  # a checkpoint from before the ratio form
    b.load_state_dict(old)
    assert b.mode == "cosine" and b(5) == 0.0


def test_state_dict_round_trip():
    a = create_schedule(
        "step", base_lr=0.1, total_steps=90, steps_per_epoch=3, decay_epochs=[10, 20]
    )
    b = create_schedule("cosine", base_lr=1.0, total_steps=5)
    b.load_state_dict(a.state_dict())
    assert b == a and [b(t) for t in range(91)] == [a(t) for t in range(91)]
    assert isinstance(a.state_dict()["decay_epochs"], list)
    with pytest.raises(KeyError, match="bogus"):
        b.load_state_dict({"bogus": 1})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(mode="exp"), "unknown learning-rate mode 'exp'"),
        (dict(mode="step"), "needs steps_per_epoch"),
        (dict(mode="cosine", warmup_steps=80, constant_steps=30), "exceeds total_steps"),
        (dict(mode="cosine", total_steps=0), "total_steps must be positive"),
        (dict(mode="step", steps_per_epoch=10, constant_steps=5), "constant_steps is not used"),
        (dict(mode="nvidia_poly_warmup", constant_steps=5), "has no constant phase"),
        (dict(mode="nvidia_poly_warmup", warmup_ratio=0.1, constant_ratio=0.2), "no constant"),
        (dict(mode="cosine", warmup_ratio=0.1), "warmup_ratio is used by"),
        (dict(mode="warmup_const_poly", warmup_ratio=0.1, warmup_steps=10), "not both"),
        (dict(mode="warmup_const_poly", constant_ratio=0.2), "constant_ratio needs warmup_ratio"),
        (dict(mode="warmup_const_poly", warmup_ratio=0.8, constant_ratio=0.3), "sum <= 1"),
    ],
)
def test_invalid_configurations(kwargs, match):
    args = dict(base_lr=0.1, total_steps=100) | kwargs
    with pytest.raises(ValueError, match=match):
        create_schedule(args.pop("mode"), **args)


def test_apply_lr_respects_lr_scale():
    w1, w2 = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([{"params": [w1]}, {"params": [w2], "lr_scale": 0.1}], lr=1.0)
    apply_lr(opt, 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.5, pytest.approx(0.05)]


def test_schedule_is_pure():
    sched = LRSchedule("cosine", base_lr=1.0, total_steps=10, warmup_steps=2)
    forward = [sched(t) for t in range(11)]
    assert [sched(t) for t in reversed(range(11))] == forward[::-1]
    assert math.isclose(sched(1), 0.5)
