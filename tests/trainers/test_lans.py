"""LANS against a float64 numpy transcription of the spec's reference rule (Zheng et al. 2020).

Oracle (docs/specs: LANS), per tensor w, gradient g, step t, after the optional global
pre-clip g <- g * max_grad_norm / (||g_all|| + 1e-6) when that factor is below 1
(torch.nn.utils.clip_grad_norm_, as the authors' recipe calls it):
    g = g / (||g|| + eps)
    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;  m^, v^ bias-corrected
    um = m^/(sqrt(v^)+eps) + wd w;   uc = g/(sqrt(v^)+eps) + wd w     (w before the update)
    rm = ||w||/||um||;  rc = ||w||/||uc||   (1 when either norm is 0; every tensor, also
    no_wd groups, unless adapt_no_wd=False)
    w = w - lr b1 rm um - lr (1-b1) rc uc
The transcriptions of the authors' and MXNet's code are in test_faithful_optim.py.
and the schedule, with x = step/total: base x/warmup (x < warmup), base (x < warmup +
const), base ((1-x)/(1-warmup-const))**degree otherwise.
"""

from __future__ import annotations

import argparse
import io

import numpy as np
import pytest
import torch
from torch import nn

from tests.trainers._optim_checks import (
    ZERO_GRAD,
    ZERO_WEIGHT,
    HostSync,
    assert_close_lists,
    host_reads_raise,
    make_problem,
    run_torch,
    step_on_meta,
    train_digits_mlp,
)
from trainers.cli import add_optimizer_args, add_schedule_args, build_optimizer, build_schedule
from trainers.optim import Lamb, Lans, create_optimizer

LR = 0.05


def _ratio(w, u, weight_norm_clamp, trust_clamp):
    wn = np.linalg.norm(w)
    if weight_norm_clamp is not None:
        wn = np.clip(wn, *weight_norm_clamp)
    un = np.linalg.norm(u)
    r = wn / un if wn > 0 and un > 0 else 1.0
    return np.clip(r, *trust_clamp) if trust_clamp is not None else r


def lans_reference(
    weights,
    grad_steps,
    *,
    lr=LR,
    betas=(0.9, 0.999),
    eps=1e-6,
    weight_decay=0.01,
    bias_correction=True,
    max_grad_norm=1.0,
    trust_clamp=None,
    weight_norm_clamp=None,
    adapt_no_wd=True,
    no_wd=frozenset(),
):
    b1, b2 = betas
    w = [x.astype(np.float64).copy() for x in weights]
    m = [np.zeros_like(x) for x in w]
    v = [np.zeros_like(x) for x in w]
    for t, grads in enumerate(grad_steps, start=1):
        grads = [g.astype(np.float64) for g in grads]
        if max_grad_norm is not None:
            total = np.sqrt(sum(np.sum(g * g) for g in grads))
            coef = min(1.0, max_grad_norm / (total + 1e-6))
            grads = [g * coef for g in grads]
        for i, g in enumerate(grads):
            wd = 0.0 if i in no_wd else weight_decay
            g = g / (np.linalg.norm(g) + eps)
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            mh = m[i] / (1 - b1**t) if bias_correction else m[i]
            vh = v[i] / (1 - b2**t) if bias_correction else v[i]
            um = mh / (np.sqrt(vh) + eps) + wd * w[i]
            uc = g / (np.sqrt(vh) + eps) + wd * w[i]
            rm = rc = 1.0
            if i not in no_wd or adapt_no_wd:
                rm = _ratio(w[i], um, weight_norm_clamp, trust_clamp)
                rc = _ratio(w[i], uc, weight_norm_clamp, trust_clamp)
            w[i] = w[i] - lr * b1 * rm * um - lr * (1 - b1) * rc * uc
    return w


VARIANTS = {
    "recipe-default": {},
    "no-bias-correction": dict(bias_correction=False),
    "no-pre-clip": dict(max_grad_norm=None),
    "wd0": dict(weight_decay=0.0),
    "beta1-0": dict(betas=(0.0, 0.999)),
    "betas-eps-wd": dict(betas=(0.8, 0.99), eps=1e-4, weight_decay=0.1),
    "trust-clamp": dict(trust_clamp=(0.01, 10.0)),
    "weight-norm-clamp": dict(weight_norm_clamp=(0.5, 3.0)),
}


@pytest.mark.parametrize("options", VARIANTS.values(), ids=VARIANTS.keys())
def test_twenty_steps_match_reference(options):
    weights, grads = make_problem(seed=11)
    expected = lans_reference(weights, grads, **options)
    actual = run_torch(lambda ps: Lans(ps, lr=LR, **options), weights, grads)
    assert_close_lists(actual, expected, rtol=2e-5, atol=2e-6)
    assert np.all(weights[ZERO_WEIGHT] == 0) and not np.all(expected[ZERO_WEIGHT] == 0)
    assert np.all(grads[0][ZERO_GRAD] == 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("options", VARIANTS.values(), ids=VARIANTS.keys())
def test_twenty_steps_match_reference_cuda(options):
    weights, grads = make_problem(seed=11)
    expected = lans_reference(weights, grads, **options)
    actual = run_torch(lambda ps: Lans(ps, lr=LR, **options), weights, grads, device="cuda")
    assert_close_lists(actual, expected, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("max_grad_norm", [1.0, None], ids=["pre-clip", "no-pre-clip"])
@pytest.mark.parametrize("scale", [1e-2, 1e2, 1e5])
def test_invariant_to_scaling_the_gradient(scale, max_grad_norm):
    weights, grads = make_problem(seed=12)
    scaled = [[g * scale for g in gs] for gs in grads]

    def make(ps):
        return Lans(ps, lr=LR, max_grad_norm=max_grad_norm)

    assert_close_lists(
        run_torch(make, weights, scaled), run_torch(make, weights, grads), rtol=1e-4, atol=1e-5
    )


def test_beta1_zero_is_lamb_on_the_normalised_gradient():
    weights, grads = make_problem(seed=13)
    eps = 1e-6
    normalised = [[g / (np.linalg.norm(g) + eps) for g in gs] for gs in grads]
    lans = run_torch(
        lambda ps: Lans(ps, lr=LR, betas=(0.0, 0.999), max_grad_norm=None), weights, grads
    )
    lamb = run_torch(
        lambda ps: Lamb(ps, lr=LR, betas=(0.0, 0.999), max_grad_norm=None, always_adapt=True),
        weights,
        normalised,
    )
    assert_close_lists(lans, lamb, rtol=1e-5, atol=1e-6)


def test_caller_gradients_are_not_normalised():
    p = nn.Parameter(torch.ones(10))
    p.grad = torch.full((10,), 5.0)
    Lans([p], lr=0.1).step()
    assert torch.equal(p.grad, torch.full((10,), 5.0))


def test_trust_clamp_bounds_both_ratios():
    # ||w|| = 1000, ||u_m|| = ||u_c|| ~ sqrt(100) at step 1 without decay: ratios ~ 100
    torch.manual_seed(0)
    w0 = torch.randn(100)
    w0 = w0 / w0.norm() * 1000.0
    for bounds, expected in (((None, 10.0), 10.0 * 10.0), (None, 1000.0)):
        p = nn.Parameter(w0.clone())
        p.grad = torch.randn(100)
        Lans([p], lr=1.0, weight_decay=0.0, trust_clamp=bounds).step()
        # step 1: u_m == u_c (m^ = g^), so the two terms add up to one step of r ||u||
        assert float((p.detach() - w0).norm()) == pytest.approx(expected, rel=1e-3)


# ---- no_wd groups ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options",
    [{}, dict(adapt_no_wd=True), dict(adapt_no_wd=False)],
    ids=["default-adapts", "adapt-no-wd", "excluded"],
)
def test_no_wd_group_has_no_decay_and_by_default_both_trust_ratios(options):
    weights, grads = make_problem(seed=14)
    no_wd = {1, 2, ZERO_GRAD}
    expected = lans_reference(weights, grads, no_wd=no_wd, **options)

    def make(params):
        decay = [p for i, p in enumerate(params) if i not in no_wd]
        plain = [p for i, p in enumerate(params) if i in no_wd]
        groups = [{"params": decay}, {"params": plain, "no_wd": True, "weight_decay": 0.5}]
        return Lans(groups, lr=LR, **options)

    actual = run_torch(make, weights, grads)
    assert_close_lists(actual, expected, rtol=2e-5, atol=2e-6)
    # a zero gradient gets g^ = 0; with the no_wd flag no decay either, so it stays put
    np.testing.assert_array_equal(actual[ZERO_GRAD], weights[ZERO_GRAD].astype(np.float32))
    # the default (the authors' kernel) is not the old one (no trust ratio on no_wd groups)
    old = lans_reference(weights, grads, no_wd=no_wd, adapt_no_wd=False)
    if options.get("adapt_no_wd", True):
        assert not np.allclose(expected[1], old[1], rtol=1e-3)


# ---- variants -------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["mxnet", "mxnet-sequential"])
def test_mxnet_variants_keep_zero_gradients_finite(variant):
    # MXNet's g / ||g|| is NaN for an all-zero gradient; ours keeps g^ = 0 there
    weights, grads = make_problem(seed=18)
    actual = run_torch(lambda ps: Lans(ps, lr=LR, variant=variant), weights, grads)
    assert all(np.all(np.isfinite(a)) for a in actual)
    default = run_torch(lambda ps: Lans(ps, lr=LR), weights, grads)
    assert_close_lists(actual, default, rtol=1e-2, atol=1e-3)  # close, not equal
    assert not np.array_equal(actual[0], default[0])


def test_bad_variant_names_the_choices():
    with pytest.raises(ValueError, match="'gluonnlp'.*'mxnet'.*'mxnet-sequential'"):
        Lans([nn.Parameter(torch.ones(2))], variant="deepspeed")


# ---- engineering ----------------------------------------------------------------------------
def _params(weights, dtype=torch.float32):
    return [nn.Parameter(torch.tensor(w, dtype=dtype)) for w in weights]


def _steps(opt, params, grads, dtype=torch.float32):
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = torch.tensor(g, dtype=dtype)
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_dict_round_trip_continues_identically(dtype):
    weights, grads = make_problem(seed=15)
    ref_params = _params(weights, dtype)
    ref = Lans(ref_params, lr=LR)
    _steps(ref, ref_params, grads, dtype)

    params = _params(weights, dtype)
    opt = Lans(params, lr=LR)
    _steps(opt, params, grads[:10], dtype)
    buffer = io.BytesIO()
    torch.save({"model": [p.detach() for p in params], "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    resumed_params = [nn.Parameter(t.clone()) for t in saved["model"]]
    resumed = Lans(resumed_params, lr=0.5)
    resumed.load_state_dict(saved["opt"])
    assert resumed.param_groups[0]["lr"] == LR
    for p in resumed_params:
        assert resumed.state[p]["exp_avg_sq"].dtype == torch.float32
    _steps(resumed, resumed_params, grads[10:], dtype)
    for a, b in zip(resumed_params, ref_params, strict=True):
        assert torch.equal(a, b)


def test_bf16_params_keep_fp32_state_and_track_fp32_run():
    weights, grads = make_problem(seed=16)
    fp32 = run_torch(lambda ps: Lans(ps, lr=LR), weights, grads)
    params = _params(weights, torch.bfloat16)
    opt = Lans(params, lr=LR)
    _steps(opt, params, grads, torch.bfloat16)
    for p, expected in zip(params, fp32, strict=True):
        state = opt.state[p]
        assert {state[k].dtype for k in ("exp_avg", "exp_avg_sq", "master_param")} == {
            torch.float32
        }
        np.testing.assert_allclose(p.detach().double().numpy(), expected, rtol=2e-2, atol=2e-2)


def test_step_reads_no_tensor_value_on_the_host():
    with host_reads_raise(), pytest.raises(HostSync):
        torch.tensor([2.0]).item()
    weights, grads = make_problem(seed=17)
    for options in (
        {},
        dict(trust_clamp=(0.01, 10.0), weight_norm_clamp=(0.1, 5.0)),
        dict(variant="mxnet-sequential", adapt_no_wd=False),
    ):
        params = _params(weights)
        opt = Lans(params, lr=LR, **options)
        with host_reads_raise():
            _steps(opt, params, grads[:3])
        step_on_meta(lambda ps, options=options: Lans(ps, lr=LR, **options))


def test_converges_on_digits():
    # 8x8 handwritten digits, 1/4 held out, MLP, batch 128, 10 epochs (measured: 0.982)
    assert train_digits_mlp("lans", lr=0.01) >= 0.96


def test_create_optimizer_and_cli_flags():
    parser = argparse.ArgumentParser()
    add_optimizer_args(parser)
    args = parser.parse_args(
        [
            *("--optimizer", "lans", "--lr", "0.005", "--wd", "0.01", "--no-wd"),
            *("--max-grad-norm", "0", "--trust-clamp", "0.01,10", "--no-bias-correction"),
        ]
    )
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = build_optimizer(args, model)
    assert isinstance(opt, Lans)
    group = opt.param_groups[0]
    assert group["max_grad_norm"] is None and group["trust_clamp"] == (0.01, 10.0)
    assert not group["bias_correction"] and group["eps"] == 1e-6
    assert [g["no_wd"] for g in opt.param_groups] == [False, True]
    assert group["adapt_no_wd"] and group["variant"] == "gluonnlp"  # the defaults
    assert isinstance(create_optimizer("lans", model, lr=0.1), Lans)

    parser = argparse.ArgumentParser()
    add_optimizer_args(parser)
    args = parser.parse_args(
        [
            *("--optimizer", "lans", "--lr", "0.005", "--no-adapt-no-wd"),
            *("--optimizer-variant", "mxnet-sequential"),
        ]
    )
    group = build_optimizer(args, model).param_groups[0]
    assert not group["adapt_no_wd"] and group["variant"] == "mxnet-sequential"
    args = parser.parse_args(
        ["--optimizer", "lans", "--lr", "1", "--optimizer-variant", "deepspeed"]
    )
    with pytest.raises(ValueError, match="variant must be 'gluonnlp'"):
        build_optimizer(args, model)
    args = parser.parse_args(["--optimizer", "adamw", "--lr", "1", "--no-adapt-no-wd"])
    with pytest.raises(ValueError, match="--no-adapt-no-wd is not an option of --optimizer adamw"):
        build_optimizer(args, model)


# ---- the schedule used with LANS ------------------------------------------------------------
def lans_schedule(x, base, warmup, const, degree):
    if x < warmup:
        return base * x / warmup
    if x < warmup + const:
        return base
    return base * ((1 - x) / (1 - warmup - const)) ** degree


def test_warmup_const_poly_from_the_cli_flags():
    parser = argparse.ArgumentParser()
    add_optimizer_args(parser, default="lans")
    add_schedule_args(parser)
    args = parser.parse_args(
        [
            *("--lr", "0.005", "--lr-mode", "warmup_const_poly"),
            *("--warmup-epochs", "1", "--const-epochs", "5", "--lr-decay-power", "1"),
        ]
    )
    steps_per_epoch, epochs = 20, 20  # x: warmup 0.05, const 0.25 (the recipe's phase 1)
    sched = build_schedule(args, steps_per_epoch=steps_per_epoch, epochs=epochs)
    total = steps_per_epoch * epochs
    for step in (0, 10, 20, 21, 119, 120, 121, 260, 399, 400):
        expected = lans_schedule(step / total, 0.005, 0.05, 0.25, 1.0)
        assert sched(step) == pytest.approx(expected, abs=1e-12), step
    assert (sched(0), sched(20), sched(120), sched(400)) == (0.0, 0.005, 0.005, 0.0)
