"""LAMB and LANS against float64 numpy transcriptions of their authors' code (issue 23).

Each reference function below is written from reading the named source file (the commit is
the one read), not from a paper: the fused kernels are transcribed element by element,
including their zero-norm guards, eps placements, clip formulas and step counters. Every
reference runs 6 steps on the same random problem (a 4-D conv kernel, matrices, one with a
large norm so that DeepSpeed's trust clamp binds, and 1-D bias / LayerNorm tensors, which
form the no-weight-decay group when "exclusions" is on) at three gradient scales: x0.01
(the global norm is below 1, a clip at 1.0 is inactive), x1 and x100 (the clip binds). Our
optimizer runs in float64 on the same problem; agreement is measured as
max|ours - ref| / max|ref| per tensor and must be below 1e-12 (float64 rounding of
differently ordered operations accumulates to ~1e-15 over 6 steps). Each group also checks
that a configuration that should *not* match does not, so that every test can fail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from trainers.optim import Lamb, Lans

STEPS = 6
LR = 0.02
TOL = 1e-12
# name: (shape, weight scale); the 1-D tensors are the no-weight-decay group
SHAPES = {
    "conv": ((4, 3, 3, 3), 0.5),
    "dense": ((8, 5), 0.5),
    "large": ((6, 6), 50.0),  # DeepSpeed's ||w|| / ||u|| ~ 16 at t = 1: max_coeff 10 binds
    "bias": ((5,), 0.1),
    "ln_weight": ((8,), None),  # ~1, as a LayerNorm gain
    "ln_bias": ((8,), 0.1),
}
NO_WD = frozenset({"bias", "ln_weight", "ln_bias"})
GRAD_SCALES = {"x0.01": 0.01, "x1": 1.0, "x100": 100.0}


def make_problem(seed: int, grad_scale: float):
    rng = np.random.default_rng(seed)
    weights = {}
    for name, (shape, scale) in SHAPES.items():
        weights[name] = (
            1.0 + 0.1 * rng.standard_normal(shape)
            if scale is None
            else scale * rng.standard_normal(shape)
        )
    # per-tensor gradient magnitudes differ, so the per-tensor normalisation matters
    magnitude = {name: 10.0 ** rng.uniform(-1, 0.5) for name in SHAPES}
    grads = [
        {n: grad_scale * magnitude[n] * rng.standard_normal(s) for n, (s, _) in SHAPES.items()}
        for _ in range(STEPS)
    ]
    return weights, grads


def ref_groups(exclusions: bool, weight_decay: float):
    """(names, weight decay) per param group, as the authors' scripts build them."""
    if not exclusions:
        return [(list(SHAPES), weight_decay)]
    return [([n for n in SHAPES if n not in NO_WD], weight_decay), (sorted(NO_WD), 0.0)]


def run_ours(make_opt, weights, grads, *, exclusions: bool, dtype=torch.float64):
    """Our optimizer in float64 (or ``dtype``); the no-decay group as
    ``param_groups(no_wd=True)`` makes it."""
    params = {n: nn.Parameter(torch.tensor(w, dtype=dtype)) for n, w in weights.items()}
    if exclusions:
        groups = [
            {"params": [params[n] for n in SHAPES if n not in NO_WD]},
            {"params": [params[n] for n in sorted(NO_WD)], "weight_decay": 0.0, "no_wd": True},
        ]
    else:
        groups = [{"params": list(params.values())}]
    opt = make_opt(groups)
    for gs in grads:
        for n, p in params.items():
            p.grad = torch.tensor(gs[n], dtype=dtype)
        opt.step()
    return {n: p.detach().double().numpy() for n, p in params.items()}


def max_rel_diff(actual, expected) -> float:
    return max(
        float(np.max(np.abs(actual[n] - expected[n])) / np.max(np.abs(expected[n])))
        for n in expected
    )


def norm(x) -> float:
    return float(np.sqrt(np.sum(x * x)))


CASES = [
    pytest.param(
        scale, clip, excl, id=f"{sname}-{'clip1' if clip else 'noclip'}-{'excl' if excl else 'all'}"
    )
    for sname, scale in GRAD_SCALES.items()
    for clip in (1.0, None)
    for excl in (True, False)
]


# ---- LANS: the authors' kernel --------------------------------------------------------------
def fused_lans_reference(weights, grads, *, groups, lr, betas, eps, bias_correction, clip):
    """szhengac/apex@a26873e889d1510fe84a9e85d8d073fac0553f20 csrc/multi_tensor_lans.cu
    (LANSStage1Functor / LANSStage2Functor, adam_w_mode=1, grad_averaging=1,
    normalize_grad=True) driven by apex/optimizers/fused_lans.py, after the recipe's
    ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)`` (dmlc/gluon-nlp@
    14553a0c19790a3b03e8107471c987c7aa4f8faa scripts/pretraining/torch/bert/run_pretraining.py;
    its src/gluonnlp/torch/clib/multi_tensor_lans.cu has the same update). FusedLANS counts
    steps per group; every parameter has a gradient every step here, so that is t."""
    b1, b2 = betas
    w = {n: x.copy() for n, x in weights.items()}
    m = {n: np.zeros_like(x) for n, x in w.items()}
    v = {n: np.zeros_like(x) for n, x in w.items()}
    for t, gs in enumerate(grads, start=1):
        gs = dict(gs)
        if clip is not None:  # clip_grad_norm_: g *= min(1, max_norm / (total + 1e-6))
            total = np.sqrt(sum(np.sum(g * g) for g in gs.values()))
            coef = min(1.0, clip / (total + 1e-6))
            gs = {n: g * coef for n, g in gs.items()}
        bc1 = 1 - b1**t if bias_correction else 1.0
        bc2 = 1 - b2**t if bias_correction else 1.0
        beta3 = 1 - b1
        for names, decay in groups:
            for n in names:
                g, p = gs[n], w[n]
                grad_norm, param_norm = norm(g), norm(p)  # both before stage 1
                scaled = g / (grad_norm + eps) if grad_norm != 0.0 else g
                m[n] = m[n] * b1 + beta3 * scaled
                v[n] = v[n] * b2 + (1 - b2) * scaled * scaled
                denom = np.sqrt(v[n] / bc2) + eps
                scaled_p = decay * (p if decay != 0 else 0.0)
                update_m = (m[n] / bc1) / denom + scaled_p
                update_g = scaled / denom + scaled_p
                um, ug = norm(update_m), norm(update_g)
                ratio_m = lr * (param_norm / um) if um != 0 and param_norm != 0 else lr
                ratio_g = lr * (param_norm / ug) if ug != 0 and param_norm != 0 else lr
                w[n] = p - (ratio_m * b1) * update_m - (ratio_g * beta3) * update_g
    return w


@pytest.mark.parametrize("bias_correction", [True, False], ids=["bc", "no-bc"])
@pytest.mark.parametrize(("grad_scale", "clip", "exclusions"), CASES)
def test_lans_matches_the_authors_fused_lans(grad_scale, clip, exclusions, bias_correction):
    """Our default LANS is the authors' FusedLANS + the recipe's clip (see
    fused_lans_reference for the files); the old default, no trust ratio on the no-decay
    group (``adapt_no_wd=False``), is not."""
    weights, grads = make_problem(21, grad_scale)
    options = dict(lr=LR, betas=(0.9, 0.999), eps=1e-6, bias_correction=bias_correction)
    expected = fused_lans_reference(
        weights, grads, groups=ref_groups(exclusions, 0.01), clip=clip, **options
    )
    ours = run_ours(
        lambda g: Lans(g, weight_decay=0.01, max_grad_norm=clip, **options),
        weights,
        grads,
        exclusions=exclusions,
    )
    assert max_rel_diff(ours, expected) < TOL
    old = run_ours(
        lambda g: Lans(g, weight_decay=0.01, max_grad_norm=clip, adapt_no_wd=False, **options),
        weights,
        grads,
        exclusions=exclusions,
    )
    if exclusions:
        assert max_rel_diff(old, expected) > 1e-3
    else:  # without a no_wd group the flag changes nothing
        assert max_rel_diff(old, expected) < TOL


def test_lans_clip_is_clip_grad_norm_with_its_1e_6():
    """The clip follows torch's clip_grad_norm_ (scale max_norm / (G + 1e-6)): with a large
    eps and a global norm just above max_norm the 1e-6 is visible, and ours follows it."""
    weights, grads = make_problem(22, 0.01)
    total = np.sqrt(sum(np.sum(g * g) for g in grads[0].values()))
    clip = total - 5e-7  # G > max_norm, but G + 1e-6 - max_norm is twice G - max_norm
    options = dict(lr=LR, betas=(0.9, 0.999), eps=1e-2, bias_correction=True)
    groups = ref_groups(False, 0.01)
    expected = fused_lans_reference(weights, grads, groups=groups, clip=clip, **options)
    ours = run_ours(
        lambda g: Lans(g, weight_decay=0.01, max_grad_norm=clip, **options),
        weights,
        grads,
        exclusions=False,
    )
    assert max_rel_diff(ours, expected) < TOL


# ---- LANS: MXNet -----------------------------------------------------------------------------
def _mxnet_ratio(r1, r2):
    """MXNet lans.py / lamb.py: ``nan_or_zero = 1 - ratio / ratio``, 1 where it is NaN or 1."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.float64(r1) / np.float64(r2)
        nan_or_zero = 1 - ratio / ratio
    return 1.0 if nan_or_zero else float(ratio)


def _bounded(r1, lower_bound, upper_bound):
    if lower_bound is not None:
        r1 = max(r1, lower_bound)
    if upper_bound is not None:
        r1 = min(r1, upper_bound)
    return r1


def mxnet_lans_sequential_reference(weights, grads, *, wds, lr, betas, eps, bounds):
    """apache/mxnet@b84609d3fc73d20929c114eab95faaa56e6c5ede python/mxnet/optimizer/lans.py,
    ``LANS.step`` (use_fused_step=False; rescale_grad 1, clip_gradient None). ``wds`` is the
    per-parameter weight decay (0 where the scripts set wd_mult 0)."""
    b1, b2 = betas
    lower_bound, upper_bound = bounds
    w = {n: x.copy() for n, x in weights.items()}
    m = {n: np.zeros_like(x) for n, x in w.items()}
    v = {n: np.zeros_like(x) for n, x in w.items()}
    for t, gs in enumerate(grads, start=1):
        for n, grad in gs.items():
            wd, weight = wds[n], w[n]
            grad = grad / norm(grad)
            m[n] = m[n] * b1 + (1.0 - b1) * grad
            v[n] = v[n] * b2 + (1.0 - b2) * np.square(grad)
            r1 = _bounded(norm(weight), lower_bound, upper_bound)
            mean_hat = m[n] / (1.0 - b1**t)
            var_hat = np.sqrt(v[n] / (1.0 - b2**t)) + eps
            g = mean_hat / var_hat + wd * weight
            r_m = _mxnet_ratio(r1, norm(g))
            weight = weight - g * (lr * r_m * b1)
            g = grad / var_hat + wd * weight  # the weight already moved by the first term
            r_g = _mxnet_ratio(r1, norm(g))
            w[n] = weight - g * (lr * r_g * (1 - b1))
    return w


def mxnet_multi_lans_reference(weights, grads, *, wds, lr, betas, eps, bounds):
    """apache/mxnet@b84609d3fc73d20929c114eab95faaa56e6c5ede src/operator/contrib/
    multi_lans.cc (MultiLANSKernelStep1 / MultiLANSKernelStep2) with multi_lans-inl.h
    (r1 and the gradient norms from MultiSumSqRun before step 1); what ``LANS.fused_step``,
    MXNet's default, calls. The bounds are passed only when set (lans.py: ``if
    self.lower_bound``); unset they are -1, i.e. off."""
    b1, b2 = betas
    lower_bound, upper_bound = bounds
    w = {n: x.copy() for n, x in weights.items()}
    m = {n: np.zeros_like(x) for n, x in w.items()}
    v = {n: np.zeros_like(x) for n, x in w.items()}
    for t, gs in enumerate(grads, start=1):
        for n, grad in gs.items():
            weight = w[n]
            sum_sq_weights = np.sum(weight * weight)
            g_norm = np.sqrt(np.sum(grad * grad))
            scaled_grad = grad / g_norm
            m[n] = b1 * m[n] + (1.0 - b1) * scaled_grad
            v[n] = b2 * v[n] + (1.0 - b2) * scaled_grad * scaled_grad
            mean_hat = m[n] / (1.0 - b1**t)
            var_hat = np.sqrt(v[n] / (1.0 - b2**t)) + eps
            scaled_w = wds[n] * weight
            temp_m = mean_hat / var_hat + scaled_w
            temp_g = scaled_grad / var_hat + scaled_w
            r1 = np.sqrt(sum_sq_weights)
            r2_m, r2_g = norm(temp_m), norm(temp_g)
            if lower_bound is not None:
                r1 = max(r1, lower_bound)
            if upper_bound is not None:
                r1 = min(r1, upper_bound)
            r_m = 1.0 if r1 == 0 or r2_m == 0 else r1 / r2_m
            r_g = 1.0 if r1 == 0 or r2_g == 0 else r1 / r2_g
            w[n] = weight - (lr * r_m * b1 * temp_m + lr * r_g * (1.0 - b1) * temp_g)
    return w


def _wds(exclusions: bool, weight_decay: float) -> dict[str, float]:
    return {n: 0.0 if exclusions and n in NO_WD else weight_decay for n in SHAPES}


MXNET_BOUNDS = {"no-bounds": (None, None), "bounds": (0.5, 10.0)}


@pytest.mark.parametrize("bounds", MXNET_BOUNDS.values(), ids=MXNET_BOUNDS.keys())
@pytest.mark.parametrize(("grad_scale", "clip", "exclusions"), CASES)
def test_lans_mxnet_fused_multi_lans_update(grad_scale, clip, exclusions, bounds):
    """``Lans(variant="mxnet", weight_norm_clamp=(lower_bound, upper_bound))`` is MXNet's
    fused operator (see mxnet_multi_lans_reference); ``max_grad_norm`` does not change it
    (g / ||g|| is scale-free), so MXNet's lack of a clip is matched with the clip on too.
    The default variant differs from it only through eps in the normalisation: visible (and
    bounded) on gradients of norm ~1e-4, where eps / ||g|| ~ 1e-2."""
    weights, grads = make_problem(23, grad_scale)
    options = dict(lr=LR, betas=(0.9, 0.999), eps=1e-6)
    expected = mxnet_multi_lans_reference(
        weights, grads, wds=_wds(exclusions, 0.01), bounds=bounds, **options
    )
    clamp = None if bounds == (None, None) else bounds
    ours = run_ours(
        lambda g: Lans(
            g, weight_decay=0.01, max_grad_norm=clip, weight_norm_clamp=clamp, variant="mxnet",
            **options,
        ),
        weights,
        grads,
        exclusions=exclusions,
    )  # fmt: skip
    assert max_rel_diff(ours, expected) < TOL


def test_lans_default_differs_from_mxnet_by_the_normalisation_eps():
    weights, grads = make_problem(24, 1e-5)
    options = dict(lr=LR, betas=(0.9, 0.999), eps=1e-6)
    expected = mxnet_multi_lans_reference(
        weights, grads, wds=_wds(True, 0.01), bounds=(None, None), **options
    )
    ours = run_ours(
        lambda g: Lans(g, weight_decay=0.01, max_grad_norm=None, **options),
        weights,
        grads,
        exclusions=True,
    )
    assert 1e-9 < max_rel_diff(ours, expected) < 1e-2


@pytest.mark.parametrize("bounds", MXNET_BOUNDS.values(), ids=MXNET_BOUNDS.keys())
@pytest.mark.parametrize(("grad_scale", "clip", "exclusions"), CASES)
def test_lans_mxnet_sequential_lans_py(grad_scale, clip, exclusions, bounds):
    """MXNet's sequential ``LANS.step`` (see mxnet_lans_sequential_reference) differs from
    every fused rule: it applies the u_c term after the u_m term has moved the weight. We
    reproduce it exactly with ``variant="mxnet-sequential"`` (an option, not a bound); the
    fused ``variant="mxnet"`` differs from it by O(lr^2 wd) per step, nonzero here."""
    weights, grads = make_problem(25, grad_scale)
    options = dict(lr=LR, betas=(0.9, 0.999), eps=1e-6)
    expected = mxnet_lans_sequential_reference(
        weights, grads, wds=_wds(exclusions, 0.01), bounds=bounds, **options
    )
    clamp = None if bounds == (None, None) else bounds

    def make(variant):
        return lambda g: Lans(
            g, weight_decay=0.01, max_grad_norm=clip, weight_norm_clamp=clamp, variant=variant,
            **options,
        )  # fmt: skip

    ours = run_ours(make("mxnet-sequential"), weights, grads, exclusions=exclusions)
    assert max_rel_diff(ours, expected) < TOL
    fused = run_ours(make("mxnet"), weights, grads, exclusions=exclusions)
    # per step |diff| <= lr * (1 - b1) * ||w|| * lr * b1 * wd-ish: well below lr^2
    assert 1e-10 < max_rel_diff(fused, expected) < STEPS * LR**2


# ---- LAMB: NVIDIA apex ----------------------------------------------------------------------
def apex_fused_lamb_reference(
    weights, grads, *, groups, lr, betas, eps, bias_correction, max_grad_norm, use_nvlamb
):
    """NVIDIA/apex@6424da3b4faa6c8f062da4a48c424fff3f02d42d csrc/multi_tensor_lamb.cu
    (LAMBStage1Functor, LAMBStage2Functor, adam_w_mode=1, grad_averaging=1) driven by
    apex/optimizers/fused_lamb.py (one global gradient norm over all groups; group step
    counters). ``max_grad_norm=None`` stands for apex's ``max_grad_norm=inf`` (never clips);
    apex has no off switch."""
    b1, b2 = betas
    w = {n: x.copy() for n, x in weights.items()}
    m = {n: np.zeros_like(x) for n, x in w.items()}
    v = {n: np.zeros_like(x) for n, x in w.items()}
    for t, gs in enumerate(grads, start=1):
        global_grad_norm = np.sqrt(sum(np.sum(g * g) for g in gs.values()))
        clipped = 1.0
        if max_grad_norm is not None and global_grad_norm > max_grad_norm:
            clipped = global_grad_norm / max_grad_norm
        bc1 = 1 - b1**t if bias_correction else 1.0
        bc2 = 1 - b2**t if bias_correction else 1.0
        beta3 = 1 - b1
        for names, decay in groups:
            for n in names:
                p = w[n]
                param_norm = norm(p)
                scaled_grad = gs[n] / clipped
                m[n] = m[n] * b1 + beta3 * scaled_grad
                v[n] = v[n] * b2 + (1 - b2) * scaled_grad * scaled_grad
                denom = np.sqrt(v[n] / bc2) + eps
                update = (m[n] / bc1) / denom + decay * (p if decay != 0 else 0.0)
                ratio = lr
                if use_nvlamb or decay != 0.0:
                    update_norm = norm(update)
                    if update_norm != 0 and param_norm != 0:
                        ratio = lr * (param_norm / update_norm)
                w[n] = p - ratio * update
    return w


@pytest.mark.parametrize("bias_correction", [True, False], ids=["bc", "no-bc"])
@pytest.mark.parametrize(("grad_scale", "clip", "exclusions"), CASES)
def test_lamb_default_matches_apex_fused_lamb(grad_scale, clip, exclusions, bias_correction):
    """``Lamb()`` is apex FusedLAMB's default (see apex_fused_lamb_reference); with a
    no-decay group, ``use_nvlamb=True`` is not."""
    weights, grads = make_problem(31, grad_scale)
    options = dict(lr=LR, betas=(0.9, 0.999), eps=1e-6, bias_correction=bias_correction)
    expected = apex_fused_lamb_reference(
        weights, grads, groups=ref_groups(exclusions, 0.01), max_grad_norm=clip,
        use_nvlamb=False, **options,
    )  # fmt: skip
    ours = run_ours(
        lambda g: Lamb(g, weight_decay=0.01, max_grad_norm=clip, **options),
        weights,
        grads,
        exclusions=exclusions,
    )
    assert max_rel_diff(ours, expected) < TOL
    if exclusions:
        nvlamb = run_ours(
            lambda g: Lamb(g, weight_decay=0.01, max_grad_norm=clip, use_nvlamb=True, **options),
            weights,
            grads,
            exclusions=True,
        )
        assert max_rel_diff(nvlamb, expected) > 1e-3


@pytest.mark.parametrize("weight_decay", [0.01, 0.0], ids=["wd", "wd0"])
@pytest.mark.parametrize(("grad_scale", "clip", "exclusions"), CASES)
def test_lamb_use_nvlamb_matches_apex_use_nvlamb(grad_scale, clip, exclusions, weight_decay):
    """``Lamb(use_nvlamb=True)`` is apex ``FusedLAMB(use_nvlamb=True)`` (the trust ratio on
    every tensor, see apex_fused_lamb_reference); ``always_adapt=True`` alone is not (it
    leaves the no_wd group unadapted), nor is ``adapt_no_wd=True`` alone."""
    weights, grads = make_problem(32, grad_scale)
    options = dict(lr=LR, betas=(0.9, 0.999), eps=1e-6, bias_correction=True)
    expected = apex_fused_lamb_reference(
        weights, grads, groups=ref_groups(exclusions, weight_decay), max_grad_norm=clip,
        use_nvlamb=True, **options,
    )  # fmt: skip

    def make(**flags):
        return lambda g: Lamb(g, weight_decay=weight_decay, max_grad_norm=clip, **flags, **options)

    ours = run_ours(make(use_nvlamb=True), weights, grads, exclusions=exclusions)
    assert max_rel_diff(ours, expected) < TOL
    both = run_ours(
        make(always_adapt=True, adapt_no_wd=True), weights, grads, exclusions=exclusions
    )
    assert max_rel_diff(both, ours) == 0.0
    if exclusions:
        for flags in (dict(always_adapt=True), dict(adapt_no_wd=True)):
            partial = run_ours(make(**flags), weights, grads, exclusions=True)
            assert max_rel_diff(partial, expected) > 1e-3


# ---- LAMB: DeepSpeed ------------------------------------------------------------------------
def deepspeed_fused_lamb_reference(
    weights, grads, *, groups, lr, betas, eps, bias_correction, max_grad_norm, max_coeff,
    min_coeff,
):  # fmt: skip
    """microsoft/DeepSpeed@38327e07f6cd39b63418f60cedd1651b0be3e7c3 csrc/lamb/
    fused_lamb_cuda_kernel.cu (lamb_cuda_kernel_part1/2/3, fused_lamb_cuda; eps mode 1,
    eps_inside_sqrt=False) driven by deepspeed/ops/lamb/fused_lamb.py ``FusedLamb.step``,
    with ``grad_norms`` the per-group gradient norms and ``scale=1`` as
    deepspeed/runtime/fp16/fused_optimizer.py passes them (``norm_groups``).
    ``max_grad_norm=None`` is DeepSpeed's 0 (off)."""
    b1, b2 = betas
    w = {n: x.copy() for n, x in weights.items()}
    m = {n: np.zeros_like(x) for n, x in w.items()}
    v = {n: np.zeros_like(x) for n, x in w.items()}
    step = dict.fromkeys(w, 0)
    scale = 1.0
    for gs in grads:
        for names, decay in groups:
            grad_norm = np.sqrt(sum(np.sum(gs[n] * gs[n]) for n in names))
            combined_scale = scale
            if max_grad_norm is not None and max_grad_norm > 0:
                clip = ((grad_norm / scale) + 1e-6) / max_grad_norm
                if clip > 1:
                    combined_scale = clip * scale
            for n in names:
                step[n] += 1
                p = w[n]
                scaled_grad = gs[n] / combined_scale
                m[n] = b1 * m[n] + (1 - b1) * scaled_grad
                v[n] = b2 * v[n] + (1 - b2) * scaled_grad * scaled_grad
                denom = np.sqrt(v[n]) + eps
                update = (m[n] / denom) + (decay * p)
                reg_w, reg_u = np.sqrt(np.sum(p * p)), np.sqrt(np.sum(update * update))
                lamb_coeff = 1.0
                if reg_w != 0 and reg_u != 0:
                    lamb_coeff = reg_w / reg_u
                    if lamb_coeff > max_coeff:
                        lamb_coeff = max_coeff
                    if lamb_coeff < min_coeff:
                        lamb_coeff = min_coeff
                if bias_correction:
                    step_size = lr * np.sqrt(1 - b2 ** step[n]) / (1 - b1 ** step[n])
                else:
                    step_size = lr
                w[n] = p - (step_size * lamb_coeff * update)
    return w


@pytest.mark.parametrize(
    ("eps", "weight_decay", "bias_correction"),
    [(1e-8, 0.0, True), (1e-8, 0.01, True), (1e-6, 0.01, False)],
    ids=["ds-defaults", "wd", "no-bc"],
)
@pytest.mark.parametrize(("grad_scale", "clip", "exclusions"), CASES)
def test_lamb_deepspeed_variant_matches_deepspeed_fused_lamb(
    grad_scale, clip, exclusions, eps, weight_decay, bias_correction
):
    """``Lamb(variant="deepspeed", trust_clamp=(min_coeff, max_coeff))`` is DeepSpeed's
    FusedLamb (see deepspeed_fused_lamb_reference): per-group clip with its 1e-6, trust
    ratio before the bias correction, every tensor adapted, the clamp binding on the large
    tensor. The apex rule with the same options is not (with bias correction)."""
    weights, grads = make_problem(41, grad_scale)
    options = dict(lr=LR, betas=(0.9, 0.999), eps=eps, bias_correction=bias_correction)
    expected = deepspeed_fused_lamb_reference(
        weights, grads, groups=ref_groups(exclusions, weight_decay), max_grad_norm=clip,
        max_coeff=10.0, min_coeff=0.01, **options,
    )  # fmt: skip

    def make(variant):
        return lambda g: Lamb(
            g, weight_decay=weight_decay, max_grad_norm=clip, trust_clamp=(0.01, 10.0),
            variant=variant, **options,
        )  # fmt: skip

    ours = run_ours(make("deepspeed"), weights, grads, exclusions=exclusions)
    assert max_rel_diff(ours, expected) < TOL
    # the clamp binds: at t = 1, m / sqrt(v) = (1 - b1) / sqrt(1 - b2) sign(g)
    w = weights["large"]
    assert norm(w) / (0.1 / np.sqrt(0.001) * np.sqrt(w.size)) > 10.0
    if bias_correction:
        apex = run_ours(make("apex"), weights, grads, exclusions=exclusions)
        assert max_rel_diff(apex, expected) > 1e-3


# ---- LAMB: MXNet ----------------------------------------------------------------------------
def mxnet_lamb_reference(weights, grads, *, wds, lr, betas, eps, bounds, bias_correction):
    """apache/mxnet@b84609d3fc73d20929c114eab95faaa56e6c5ede python/mxnet/optimizer/lamb.py,
    ``LAMB.step`` (rescale_grad 1, clip_gradient None); the fused multi_lamb.cc
    (MultiLAMBKernelStep1/2) computes the same. No global clip: MXNet's optimizer has none."""
    b1, b2 = betas
    lower_bound, upper_bound = bounds
    w = {n: x.copy() for n, x in weights.items()}
    mean = {n: np.zeros_like(x) for n, x in w.items()}
    var = {n: np.zeros_like(x) for n, x in w.items()}
    for t, gs in enumerate(grads, start=1):
        for n, grad in gs.items():
            wd, weight = wds[n], w[n]
            mean[n] = mean[n] * b1 + (1.0 - b1) * grad
            var[n] = var[n] * b2 + (1.0 - b2) * np.square(grad)
            r1 = _bounded(norm(weight), lower_bound, upper_bound)
            if bias_correction:
                mean_hat = mean[n] / (1.0 - b1**t)
                var_hat = np.sqrt(var[n] / (1.0 - b2**t)) + eps
                mean_hat = mean_hat / var_hat + wd * weight
            else:
                mean_hat = mean[n] / (np.sqrt(var[n]) + eps) + wd * weight
            g = mean_hat
            r = _mxnet_ratio(r1, norm(g))
            w[n] = weight - g * (lr * r)
    return w


@pytest.mark.parametrize("bias_correction", [True, False], ids=["bc", "no-bc"])
@pytest.mark.parametrize("bounds", MXNET_BOUNDS.values(), ids=MXNET_BOUNDS.keys())
@pytest.mark.parametrize("grad_scale", GRAD_SCALES.values(), ids=GRAD_SCALES.keys())
@pytest.mark.parametrize("exclusions", [True, False], ids=["excl", "all"])
def test_lamb_mxnet(exclusions, grad_scale, bounds, bias_correction):
    """``Lamb(max_grad_norm=None, use_nvlamb=True, weight_norm_clamp=(lower_bound,
    upper_bound), bias_correction=...)`` is MXNet's LAMB (see mxnet_lamb_reference); MXNet
    adapts the wd_mult-0 parameters too, so the default (no trust ratio on no_wd groups) is
    not it. MXNet has no global clip, hence no clip cases."""
    weights, grads = make_problem(51, grad_scale)
    options = dict(lr=LR, betas=(0.9, 0.999), eps=1e-6)
    expected = mxnet_lamb_reference(
        weights, grads, wds=_wds(exclusions, 0.01), bounds=bounds,
        bias_correction=bias_correction, **options,
    )  # fmt: skip
    clamp = None if bounds == (None, None) else bounds

    def make(**flags):
        return lambda g: Lamb(
            g, weight_decay=0.01, max_grad_norm=None, weight_norm_clamp=clamp,
            bias_correction=bias_correction, **flags, **options,
        )  # fmt: skip

    ours = run_ours(make(use_nvlamb=True), weights, grads, exclusions=exclusions)
    assert max_rel_diff(ours, expected) < TOL
    if exclusions:
        default = run_ours(make(), weights, grads, exclusions=True)
        assert max_rel_diff(default, expected) > 1e-3
