"""The BERT recipes' learning-rate schedules against transcriptions of their sources.

Oracles (written from reading the sources, plain Python; none is imported):

* NVIDIA's ``PolyWarmUpScheduler`` driven as NVIDIA's BERT pretraining drives it:
  ``NVIDIA/DeepLearningExamples`` @ 729963dd47e7c8bd462ad10bfac7a7b0b604e6dd,
  PyTorch/LanguageModeling/BERT/schedulers.py (``PolyWarmUpScheduler``), run_pretraining.py
  (``take_optimizer_step`` calls ``lr_scheduler.step()`` before ``optimizer.step()``;
  ``total_steps=args.max_steps``, ``warmup=args.warmup_proportion``), lamb_amp_opt/fused_lamb/
  fused_lamb.py (``group['step']`` starts at 0 and counts the steps taken) and
  scripts/run_pretraining.sh (phase 1: 7038 steps, warmup 0.2843, lr 6e-3; phase 2: 1563,
  0.128, 4e-3).
* gluon-nlp's ``get_warmup_linear_const_decay_poly_schedule`` (a ``LambdaLR``) driven as its
  BERT script drives it: ``dmlc/gluon-nlp`` @ 14553a0c19790a3b03e8107471c987c7aa4f8faa,
  src/gluonnlp/torch/optimizers/schedules.py and scripts/pretraining/torch/bert/
  run_pretraining.py (``scheduler.step()`` after ``optimizer.step()``, ``num_steps`` steps;
  its README's command: 3870 steps, warmup 0.05, const 0.25, degree 1).
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from trainers.cli import ArgumentParser, add_schedule_args, build_schedule
from trainers.schedules import SCHEDULE_MODES, create_schedule

ROOT = Path(__file__).resolve().parents[2]

NVIDIA_PHASES = [(7038, 0.2843, 6e-3), (1563, 0.128, 4e-3)]  # run_pretraining.sh
# (steps, warmup, const): the LANS paper's 3519 + 782, gluon-nlp's README 3870
LANS_PHASES = [(3519, 0.05, 0.25), (782, 0.05, 0.25), (3870, 0.05, 0.25)]
ODD = [(1, 0.0), (1, 0.5), (7, 0.3), (13, 0.5), (17, 0.2843), (101, 0.128), (250, 0.1)]


# --- transcriptions ---------------------------------------------------------------------------


def nvidia_run(total: int, warmup: float, base: float, degree: float = 0.5) -> list[float]:
    """The lr of each optimizer step of an NVIDIA run (float64, as the 2019 schedulers.py)."""
    lrs = []
    # group_step: FusedLAMBAMP's group['step'], 0 at the start of a phase, + 1 per step taken
    # (no fp16 overflow); the loop stops once max_steps optimizer steps are done
    for group_step in range(total):
        last_epoch = group_step + 1  # PolyWarmUpScheduler.step(), before optimizer.step()
        progress = last_epoch / total
        if progress < warmup:  # noqa: SIM108  (the source's shape)
            lr = base * progress / warmup
        else:
            lr = base * ((1.0 - progress) ** degree)
        lrs.append(lr)
    return lrs


def nvidia_run_float32(total: int, warmup: float, base: float, degree: float = 0.5):
    """The same with the current schedulers.py's device tensors: float32 throughout."""
    warmup_t = torch.tensor(warmup)
    total_t = torch.tensor(float(total))  # --max_steps is parsed as a float
    degree_t = torch.tensor(degree)
    base_t = torch.tensor(base)
    step = torch.tensor([0], dtype=torch.int)
    lrs = []
    for _ in range(total):
        progress = (step + 1) / total_t
        lr = torch.where(
            progress < warmup_t,
            base_t * progress / warmup_t,
            base_t * ((1.0 - progress) ** degree_t),
        )
        lrs.append(lr)
        step += 1
    return torch.cat(lrs).double()


def gluonnlp_run(total: int, warmup: float, const: float, base: float, degree: float = 1.0):
    """The lr of each optimizer step of a gluon-nlp run (LambdaLR over lr_lambda)."""

    def lr_lambda(global_step):
        x = global_step / total
        if warmup == 0.0:
            return 1.0
        elif x < warmup:
            return x / warmup
        elif x < warmup + const:
            return 1.0
        return ((1.0 - x) / (1.0 - warmup - const)) ** degree

    last_epoch = 0  # LambdaLR.__init__ steps once: the first optimizer step sees lambda(0)
    lrs = []
    step_num = 0
    while step_num < total:
        step_num += 1
        lrs.append(base * lr_lambda(last_epoch))  # optimizer.step()
        last_epoch += 1  # scheduler.step()
    return lrs


def _ours(sched, total: int) -> list[float]:
    return [sched(t) for t in range(total)]


def _gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _argv(line: str) -> list[str]:
    return line.split()


# --- NVIDIA -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("total", "warmup", "base"), NVIDIA_PHASES + [(t, w, 1.0) for t, w in ODD])
def test_nvidia_poly_warmup_equals_polywarmupscheduler(total, warmup, base):
    """Ratio form vs NVIDIA's PolyWarmUpScheduler (schedulers.py, run_pretraining.py): equal."""
    sched = create_schedule(
        "nvidia_poly_warmup", base_lr=base, total_steps=total, warmup_ratio=warmup, power=0.5
    )
    assert _ours(sched, total) == nvidia_run(total, warmup, base)
    assert sched(total) == sched(total + 5) == 0.0  # past the end: the value at the end


def test_nvidia_indexing_and_the_drop_after_warmup():
    """The facts the docs state, on the transcription: first lr, the drop, the last step."""
    total, warmup, base = NVIDIA_PHASES[0]
    lrs = nvidia_run(total, warmup, base)
    sched = create_schedule(
        "nvidia_poly_warmup", base_lr=base, total_steps=total, warmup_ratio=warmup, power=0.5
    )
    assert sched(0) == lrs[0] == base * (1 / total) / warmup  # the first step sees k = 1
    last_warm = max(t for t in range(total) if (t + 1) / total < warmup)
    assert last_warm == 1999  # 2000 warmup steps, as NVIDIA's README says
    assert sched(last_warm) == pytest.approx(base, rel=5e-4)
    assert sched(last_warm + 1) / base == pytest.approx(0.846, abs=5e-4)  # not renormalised
    assert lrs[-1] == sched(total - 1) == 0.0  # NVIDIA's last step has lr 0
    # an off-by-one (k = t) would be a different schedule
    shifted = [sched(t - 1) if t else 0.0 for t in range(total)]
    assert _gap(shifted, lrs) > 0.1 * base


@pytest.mark.parametrize(("total", "warmup", "base"), NVIDIA_PHASES)
def test_nvidia_float32_device_tensors_round_only(total, warmup, base):
    """Vs the current schedulers.py computing on float32 tensors: same branches, 1e-6."""
    sched = create_schedule(
        "nvidia_poly_warmup", base_lr=base, total_steps=total, warmup_ratio=warmup, power=0.5
    )
    ours = torch.tensor(_ours(sched, total), dtype=torch.float64)
    theirs = nvidia_run_float32(total, warmup, base)
    assert torch.equal(ours == 0, theirs == 0)
    rel = ((ours - theirs).abs() / base).max().item()
    assert rel < 2e-6, rel  # measured 6.9e-7 (phase 1) and 1.2e-7 (phase 2)


@pytest.mark.parametrize(("total", "warmup"), [(7, 0.3), (13, 0.5), (101, 0.128), (1000, 0.25)])
def test_nvidia_step_form_is_nvidia_with_warmup_w_over_t(total, warmup):
    """Integer warmup_steps W (--lr-mode): NVIDIA's schedule with warmup = W / T, to 1e-15."""
    w = math.ceil(warmup * total)
    sched = create_schedule(
        "nvidia_poly_warmup", base_lr=1.0, total_steps=total, warmup_steps=w, power=0.5
    )
    ref = nvidia_run(total, w / total, 1.0)
    assert _gap(_ours(sched, total), ref) < 1e-15


def test_nvidia_rounded_warmup_steps_miss_a_step():
    """Why the script uses the ratio form: round(0.128 * 1563) = 200 ends warmup a step early."""
    total, warmup, base = NVIDIA_PHASES[1]
    ref = nvidia_run(total, warmup, base)
    rounded = create_schedule(
        "nvidia_poly_warmup",
        base_lr=base,
        total_steps=total,
        warmup_steps=round(warmup * total),
        power=0.5,
    )
    diff = [abs(a - b) for a, b in zip(_ours(rounded, total), ref, strict=True)]
    assert max(diff) / base == pytest.approx(0.0658, abs=1e-4)
    assert [t for t, d in enumerate(diff) if d > 1e-3 * base] == [199]


@pytest.mark.parametrize(
    ("total", "warmup", "base", "max_gap", "more_lr"),
    [(7038, 0.2843, 6e-3, 0.1541, 0.1346), (1563, 0.128, 4e-3, 0.0665, 0.0634)],
)
def test_continuous_warmup_const_poly_is_not_nvidias(total, warmup, base, max_gap, more_lr):
    """Our warmup_const_poly (const 0, power 0.5) vs PolyWarmUpScheduler: the stated gap."""
    ours = create_schedule(
        "warmup_const_poly",
        base_lr=base,
        total_steps=total,
        warmup_steps=round(warmup * total),
        power=0.5,
    )
    lrs, ref = _ours(ours, total), nvidia_run(total, warmup, base)
    gap = _gap(lrs, ref) / base
    assert gap == pytest.approx(max_gap, abs=1e-4)
    assert sum(lrs) / sum(ref) - 1 == pytest.approx(more_lr, abs=1e-4)


# --- gluon-nlp --------------------------------------------------------------------------------

GLUON_LENGTHS = LANS_PHASES + [(48, 0.05, 0.25), (24, 0.05, 0.25), (8, 0.05, 0.25)]
GLUON_LENGTHS += [(7, 0.3, 0.2), (13, 0.0, 0.25), (1, 0.05, 0.25), (11, 0.5, 0.5), (9, 0.0, 0.0)]


@pytest.mark.parametrize(("total", "warmup", "const"), GLUON_LENGTHS)
@pytest.mark.parametrize("degree", [1.0, 2.0])
def test_ratio_form_equals_gluonnlp(total, warmup, const, degree):
    """Ratio form vs gluon-nlp's warmup-linear-const-decay-poly (schedules.py): equal."""
    sched = create_schedule(
        "warmup_const_poly",
        base_lr=5e-3,
        total_steps=total,
        warmup_ratio=warmup,
        constant_ratio=const,
        power=degree,
    )
    assert _ours(sched, total) == gluonnlp_run(total, warmup, const, 5e-3, degree)


def test_gluonnlp_zero_warmup_is_constant():
    """gluon-nlp's lambda returns 1 for warmup_ratio 0: no decay; our step form decays."""
    ref = gluonnlp_run(100, 0.0, 0.25, 1.0)
    assert ref == [1.0] * 100
    steps = create_schedule(
        "warmup_const_poly", base_lr=1.0, total_steps=100, constant_steps=25, power=1.0
    )
    assert steps(99) == pytest.approx(0.01 / 0.75)


@pytest.mark.parametrize(
    ("total", "warmup", "const", "bound"),
    [
        (1000, 0.05, 0.25, 1e-15),  # 50 and 250 steps: whole numbers, equal to rounding
        (20, 0.05, 0.25, 1e-15),
        (3519, 0.05, 0.25, 2.9e-4),  # 175.95 -> 176, 879.75 -> 880
        (782, 0.05, 0.25, 2.6e-3),  # 39.1 -> 39, 195.5 -> 196
        (3870, 0.05, 0.25, 2.6e-3),  # 193.5 -> 194, 967.5 -> 968
        (48, 0.05, 0.25, 0.17),  # the published bert_pretrain_lans_b128 phase 1: 2.4 -> 2
        (8, 0.05, 0.25, 1.0),  # its phase 2: 0.4 -> 0 (no warmup: base at step 0, not 0)
    ],
)
def test_step_form_vs_gluonnlp_rounding(total, warmup, const, bound):
    """Our default (phases rounded to whole steps) vs gluon-nlp: the documented bound."""
    sched = create_schedule(
        "warmup_const_poly",
        base_lr=1.0,
        total_steps=total,
        warmup_steps=round(warmup * total),
        constant_steps=round(const * total),
        power=1.0,
    )
    ref = gluonnlp_run(total, warmup, const, 1.0)
    gap = _gap(_ours(sched, total), ref)
    assert gap <= bound
    if bound > 1e-15:
        assert gap > bound / 2  # the bound is the measured gap, not a loose one


# --- the scripts ------------------------------------------------------------------------------


def _pretrain_bert():
    spec = importlib.util.spec_from_file_location(
        "pretrain_bert_schedules_under_test", ROOT / "scripts" / "pretrain_bert.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pretrain_bert():
    return _pretrain_bert()


def test_pretrain_bert_nvidia_recipe_flags(pretrain_bert):
    """The docs' NVIDIA LAMB command gives NVIDIA's lr at every step of both phases."""
    args = pretrain_bert.parse_args(
        _argv(
            "--optimizer lamb --lr 6e-3 --phase2_lr 4e-3 --lr-schedule nvidia_poly_warmup "
            "--phase1_steps 7038 --phase1_warmup_ratio 0.2843 "
            "--phase2_steps 1563 --phase2_warmup_ratio 0.128"
        )
    )
    assert (args.const_ratio, args.decay_power) == (0.0, 0.5)
    for phase, (total, warmup, base) in zip((1, 2), NVIDIA_PHASES, strict=True):
        sched = pretrain_bert._schedule(args, phase, total)
        assert _ours(sched, total) == nvidia_run(total, warmup, base)
    with pytest.raises(SystemExit):
        pretrain_bert.parse_args(["--lr-schedule", "nvidia_poly_warmup", "--const-ratio", "0.25"])


def test_pretrain_bert_gluonnlp_flag(pretrain_bert):
    args = pretrain_bert.parse_args(
        _argv("--lr-schedule gluonnlp --phase1_steps 3870 --phase2_steps 782")
    )
    assert (args.const_ratio, args.decay_power, args.phase1_lr) == (0.25, 1.0, 5e-3)
    for phase, total in ((1, 3870), (2, 782)):
        sched = pretrain_bert._schedule(args, phase, total)
        assert _ours(sched, total) == gluonnlp_run(total, 0.05, 0.25, 5e-3)


@pytest.mark.parametrize(
    "name", ["bert_pretrain_adam_b16", "bert_pretrain_lans_b128", "bert_pretrain_lans_b256"]
)
def test_published_bert_runs_keep_their_lr(pretrain_bert, name):
    """The default is unchanged: every logged lr is recomputed bit for bit from the command;
    gluon-nlp's exact phases would change them (so they are not the default)."""
    records = [json.loads(line) for line in (ROOT / "logs" / name / "seed0.jsonl").open()]
    args = pretrain_bert.parse_args(records[0]["command"][1:])
    assert args.lr_schedule == "warmup_const_poly"
    steps = {1: args.phase1_steps, 2: args.phase2_steps}
    logged = [r for r in records if r.get("kind") == "step"]
    assert logged
    for r in logged:
        sched = pretrain_bert._schedule(args, r["phase"], steps[r["phase"]])
        t = r["step"] - 1 - (0 if r["phase"] == 1 else steps[1])  # "step": steps done
        assert sched(t) == r["lr"], r
    if name != "bert_pretrain_adam_b16":  # 384 and 32 steps: 5 % and 25 % are whole steps
        rounded = [pretrain_bert._schedule(args, p, n) for p, n in steps.items()]
        args.lr_schedule = "gluonnlp"
        exact = [pretrain_bert._schedule(args, p, n) for p, n in steps.items()]
        assert any(
            _ours(a, n) != _ours(b, n)
            for a, b, n in zip(exact, rounded, steps.values(), strict=True)
        )


def test_lr_mode_flag_offers_the_nvidia_schedule():
    p = ArgumentParser()
    add_schedule_args(p)
    assert "nvidia_poly_warmup" in SCHEDULE_MODES
    args = p.parse_args(
        _argv("--lr-mode nvidia_poly_warmup --warmup-epochs 2 --lr-decay-power 0.5")
    )
    args.lr = 1.0
    sched = build_schedule(args, steps_per_epoch=10, epochs=8)
    ref = nvidia_run(80, 20 / 80, 1.0)
    assert _gap(_ours(sched, 80), ref) < 1e-15
