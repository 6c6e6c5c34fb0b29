"""LAMB's and LANS's C passes (trainers.optim._native) compute the torch path's bits.

The oracle is torch's own CPU kernels: the ``torch._foreach_*`` sequence the optimizers ran
before the passes existed (and still run where the passes do not apply). Sizes cover the
vector tails (1-33 elements) and tensors split over threads (>= 64 Ki elements).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from trainers.optim import Lamb, Lans, _native

pytestmark = pytest.mark.skipif(
    _native._lib() is None or not _native._TORCH_FMA,
    reason="no C compiler, or torch's kernels below AVX2: the torch path is the only one",
)

SIZES = [1, 7, 15, 16, 17, 31, 33, 100, 1000, 4097, 40_000, 100_001, 262_147]


def _tensors(scale: float, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * scale for n in SIZES]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("beta1", [0.9, 0.3])  # lerp's two formulas: weight < 0.5 and >= 0.5
def test_moments_and_update_equal_the_foreach_sequence(threads, beta1):
    beta2, eps, alpha_m, alpha_c = 0.999, 1e-6 * 0.0316, 0.01 / 0.33, 0.01 / 0.0316
    g, m, w = _tensors(1e-3, 0), _tensors(1e-4, 1), _tensors(0.05, 2)
    v = [t.abs() * 1e-4 for t in _tensors(1.0, 3)]
    scale = torch.rand(len(SIZES)) + 0.5

    # the torch path (LANS's: per-tensor scale, g' kept, both updates)
    gt, mt, vt = [t.clone() for t in g], [t.clone() for t in m], [t.clone() for t in v]
    torch._foreach_mul_(gt, scale.unbind(0))
    torch._foreach_lerp_(mt, gt, 1.0 - beta1)
    torch._foreach_mul_(vt, beta2)
    torch._foreach_addcmul_(vt, gt, gt, value=1.0 - beta2)
    um = [t.clone() for t in vt]
    torch._foreach_sqrt_(um)
    torch._foreach_add_(um, eps)
    torch._foreach_reciprocal_(um)
    uc = [t.clone() for t in gt]
    torch._foreach_mul_(uc, um)
    torch._foreach_mul_(um, mt)
    torch._foreach_add_(um, w, alpha=alpha_m)
    torch._foreach_add_(uc, w, alpha=alpha_c)

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gn, mn, vn = (
            [torch.empty_like(t) for t in g],
            [t.clone() for t in m],
            [t.clone() for t in v],
        )
        assert _native.available(g, gn, mn, vn, w)
        _native.moments_(g, mn, vn, beta1=beta1, beta2=beta2, scale=scale, out=gn)
        assert all(torch.equal(a, b) for a, b in zip(gn, gt, strict=True))
        sq = [torch.sqrt(t) for t in vn]
        _native.update_(sq, mn, w, eps=eps, alpha_m=alpha_m, grads=gn, alpha_c=alpha_c)
    finally:
        torch.set_num_threads(old)
    for name, ours, ref in [("m", mn, mt), ("v", vn, vt), ("u_m", sq, um), ("u_c", gn, uc)]:
        diff = [n for n, a, b in zip(SIZES, ours, ref, strict=True) if not torch.equal(a, b)]
        assert not diff, f"{name} differs from the torch path at sizes {diff}"


def test_broadcast_scale_and_no_weight_decay():
    """LAMB's form: one clip coefficient for every tensor, g' not kept, no decay term."""
    g, m, w = _tensors(1e-3, 4), _tensors(1e-4, 5), _tensors(0.05, 6)
    v = [t.abs() * 1e-4 for t in _tensors(1.0, 7)]
    clip = torch.tensor(1.7)
    gt, mt, vt = [t.clone() for t in g], [t.clone() for t in m], [t.clone() for t in v]
    torch._foreach_mul_(gt, torch.reciprocal(clip))
    torch._foreach_lerp_(mt, gt, 0.1)
    torch._foreach_mul_(vt, 0.999)
    torch._foreach_addcmul_(vt, gt, gt, value=0.001)
    u = [t.clone() for t in vt]
    torch._foreach_sqrt_(u)
    torch._foreach_add_(u, 1e-6)
    torch._foreach_reciprocal_(u)
    torch._foreach_mul_(u, mt)

    g_before = [t.clone() for t in g]
    mn, vn = [t.clone() for t in m], [t.clone() for t in v]
    _native.moments_(g, mn, vn, beta1=0.9, beta2=0.999, scale=torch.reciprocal(clip))
    assert all(torch.equal(a, b) for a, b in zip(g, g_before, strict=True)), "g was written"
    sq = [torch.sqrt(t) for t in vn]
    _native.update_(sq, mn, w, eps=1e-6, alpha_m=0.0)
    assert all(torch.equal(a, b) for a, b in zip(mn + vn + sq, mt + vt + u, strict=True))


@pytest.mark.parametrize("threads", [1, 2])
def test_apply_equals_two_addcmuls(threads):
    w, a, b = _tensors(0.05, 8), _tensors(1e-3, 9), _tensors(1e-3, 10)
    ca, cb = -(torch.rand(len(SIZES)) * 1e-2), -(torch.rand(len(SIZES)) * 1e-3)
    ref = [t.clone() for t in w]
    torch._foreach_addcmul_(ref, a, ca.unbind(0))
    torch._foreach_addcmul_(ref, b, cb.unbind(0))
    one = [t.clone() for t in w]
    torch._foreach_addcmul_(one, a, ca.unbind(0))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours, ours_one = [t.clone() for t in w], [t.clone() for t in w]
        _native.apply_(ours, a, ca, b, cb)
        _native.apply_(ours_one, a, ca)
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(x, y) for x, y in zip(ours, ref, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(ours_one, one, strict=True))


def test_layouts_the_passes_do_not_take():
    a = torch.randn(8, 6)
    assert _native.available([a], [torch.empty_like(a)])
    cl = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    assert _native.available([cl], [torch.empty_like(cl)])  # dense in another order
    assert not _native.available([a], [a.t().contiguous().t()])  # same shape, other strides
    assert not _native.available([a[:, ::2]], [a[:, ::2]])  # gaps
    assert not _native.available([a.double()], [a.double()])  # float64: the torch path
    assert not _native.available([a], [a.half()])


def _run(cls, options, *, native: bool, dtype=torch.float32, steps=4, monkeypatch=None):
    torch.manual_seed(0)
    shapes = [(32, 16, 3, 3), (32,), (300, 256), (300,), (7,), (3, 5)]
    params = []
    for i, s in enumerate(shapes):
        t = torch.randn(s) * 0.05
        if i == 0:
            t = t.contiguous(memory_format=torch.channels_last)
        params.append(torch.nn.Parameter(t.to(dtype)))
    groups = [{"params": params[:4]}, {"params": params[4:], "no_wd": True}]
    opt = cls(groups, lr=1e-2, **options)
    with monkeypatch.context() as mp:
        if not native:
            mp.setattr(_native, "_lib", lambda: None)
        for step in range(steps):
            gen = torch.Generator().manual_seed(step)
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2 * (step + 1)).to(dtype)
            given = [p.grad.clone() for p in params]
            opt.step()
            assert all(torch.equal(a, p.grad) for a, p in zip(given, params, strict=True))
    return [p.detach().clone() for p in params], opt.state_dict()["state"]


CASES = [
    (Lamb, {}),
    (Lamb, {"max_grad_norm": None}),
    (Lamb, {"variant": "deepspeed", "max_grad_norm": 0.5}),
    (Lamb, {"use_nvlamb": True, "weight_decay": 0.0}),
    (Lamb, {"bias_correction": False, "trust_clamp": (0.01, 10)}),
    (Lans, {}),
    (Lans, {"variant": "mxnet"}),
    (Lans, {"variant": "mxnet-sequential"}),
    (Lans, {"weight_decay": 0.0}),
    (Lans, {"max_grad_norm": None, "adapt_no_wd": False}),
]


@pytest.mark.parametrize(
    ("cls", "options", "dtype"),
    [(c, o, d) for (c, o), d in itertools.product(CASES, [torch.float32, torch.bfloat16])],
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_optimizer_steps_equal_the_torch_path(cls, options, dtype, monkeypatch):
    calls = []
    real = _native.moments_
    monkeypatch.setattr(_native, "moments_", lambda *a, **k: calls.append(1) or real(*a, **k))
    ours, ours_state = _run(cls, options, native=True, dtype=dtype, monkeypatch=monkeypatch)
    assert calls, "the C passes were not taken"
    ref, ref_state = _run(cls, options, native=False, dtype=dtype, monkeypatch=monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))
    for key, state in ref_state.items():
        for name, value in state.items():
            if torch.is_tensor(value):
                assert torch.equal(ours_state[key][name], value), (key, name)


def test_switch_off_leaves_the_torch_path(monkeypatch):
    a = torch.randn(4)
    monkeypatch.setattr(_native, "_lib", lambda: None)
    assert not _native.available([a], [a.clone()])
    monkeypatch.undo()
    monkeypatch.setattr(_native, "_TORCH_FMA", False)  # torch at its "DEFAULT" level
    assert not _native.available([a], [a.clone()])
