"""LAMB's and LANS's Triton passes (trainers/optim/_triton.py), run in Triton's interpreter.

The kernels are the CUDA path; without a GPU they run here on CPU tensors under
``MODELZOO_TRITON=interpret``, with tiles of 32 elements so that tensors span several tiles.
Oracles: the float64 numpy transcriptions of the spec's rule (tests/trainers/test_lamb.py,
test_lans.py) and of the authors' code (test_faithful_optim.py), and the torch path of the
same optimizer. Each test also checks that the kernels ran (their launches are counted), so
a path that quietly fell back to torch would fail it. On a GPU, ``-m gpu`` runs the compiled
kernels against the same references (test_lamb.py, test_lans.py and the CUDA test below).
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from modelzoo import _triton
from tests.trainers import test_faithful_optim as faithful
from tests.trainers._optim_checks import assert_close_lists, make_problem, run_torch
from tests.trainers.test_lamb import LR, lamb_reference
from tests.trainers.test_lamb import VARIANTS as LAMB_VARIANTS
from tests.trainers.test_lans import VARIANTS as LANS_VARIANTS
from tests.trainers.test_lans import lans_reference
from trainers.optim import Lamb, Lans
from trainers.optim import _triton as optim_triton

pytest.importorskip("triton", reason="the Triton kernels' tests need the triton package")


class _Counted:
    """A kernel whose launches are logged as ``(name, number of programs)``."""

    def __init__(self, kernel, name: str, log: list[tuple[str, int]]) -> None:
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.name, grid[0]))
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.fixture
def launches(monkeypatch) -> list[tuple[str, int]]:
    """Interpret the kernels on CPU at 32 elements a tile; the launches, as they happen."""
    monkeypatch.setenv(_triton.SWITCH, "interpret")
    monkeypatch.setattr(optim_triton, "BLOCK", 32)
    log: list[tuple[str, int]] = []
    built = optim_triton._kernels("interpret")
    counted = SimpleNamespace(
        moments=_Counted(built.moments, "moments", log), apply=_Counted(built.apply, "apply", log)
    )
    monkeypatch.setattr(optim_triton, "_kernels", lambda mode: counted)
    return log


def _torch_path(monkeypatch) -> None:
    monkeypatch.setenv(_triton.SWITCH, "0")


def _assert_two_launches_per_bucket_step(log, buckets_per_step: int, steps: int) -> None:
    names = [name for name, _ in log]
    assert names == ["moments", "apply"] * (buckets_per_step * steps)


# ---- against the spec's rule ----------------------------------------------------------------
@pytest.mark.parametrize("options", LAMB_VARIANTS.values(), ids=LAMB_VARIANTS.keys())
def test_lamb_twenty_steps_match_the_reference(options, launches):
    weights, grads = make_problem(seed=1)
    expected = lamb_reference(weights, grads, **options)
    actual = run_torch(lambda ps: Lamb(ps, lr=LR, **options), weights, grads)
    assert_close_lists(actual, expected, rtol=2e-5, atol=2e-6)
    _assert_two_launches_per_bucket_step(launches, 1, len(grads))
    # the 108-element conv kernel spans 4 tiles of 32, the others 1 to 2
    assert launches[0][1] == sum(-(-w.size // 32) for w in weights)


@pytest.mark.parametrize("options", LANS_VARIANTS.values(), ids=LANS_VARIANTS.keys())
def test_lans_twenty_steps_match_the_reference(options, launches):
    weights, grads = make_problem(seed=11)
    expected = lans_reference(weights, grads, **options)
    actual = run_torch(lambda ps: Lans(ps, lr=LR, **options), weights, grads)
    assert_close_lists(actual, expected, rtol=2e-5, atol=2e-6)
    _assert_two_launches_per_bucket_step(launches, 1, len(grads))


# ---- against the authors' code (float32 here, so float32's tolerance) -----------------------
FP32_TOL = 2e-5  # max |ours - ref| / max |ref| per tensor after 6 float32 steps
AUTHORS = {
    "apex-fused-lamb": (
        lambda g, clip: Lamb(g, lr=faithful.LR, weight_decay=0.01, max_grad_norm=clip),
        lambda w, gs, excl, clip: faithful.apex_fused_lamb_reference(
            w, gs, groups=faithful.ref_groups(excl, 0.01), max_grad_norm=clip,
            use_nvlamb=False, lr=faithful.LR, betas=(0.9, 0.999), eps=1e-6,
            bias_correction=True,
        ),
    ),
    "deepspeed-fused-lamb": (
        lambda g, clip: Lamb(
            g, lr=faithful.LR, eps=1e-8, weight_decay=0.01, max_grad_norm=clip,
            trust_clamp=(0.01, 10.0), variant="deepspeed",
        ),
        lambda w, gs, excl, clip: faithful.deepspeed_fused_lamb_reference(
            w, gs, groups=faithful.ref_groups(excl, 0.01), max_grad_norm=clip, max_coeff=10.0,
            min_coeff=0.01, lr=faithful.LR, betas=(0.9, 0.999), eps=1e-8, bias_correction=True,
        ),
    ),
    "authors-fused-lans": (
        lambda g, clip: Lans(g, lr=faithful.LR, weight_decay=0.01, max_grad_norm=clip),
        lambda w, gs, excl, clip: faithful.fused_lans_reference(
            w, gs, groups=faithful.ref_groups(excl, 0.01), clip=clip, lr=faithful.LR,
            betas=(0.9, 0.999), eps=1e-6, bias_correction=True,
        ),
    ),
    "mxnet-multi-lans": (
        lambda g, clip: Lans(
            g, lr=faithful.LR, weight_decay=0.01, max_grad_norm=clip,
            weight_norm_clamp=(0.5, 10.0), variant="mxnet",
        ),
        lambda w, gs, excl, clip: faithful.mxnet_multi_lans_reference(
            w, gs, wds=faithful._wds(excl, 0.01), bounds=(0.5, 10.0), lr=faithful.LR,
            betas=(0.9, 0.999), eps=1e-6,
        ),
    ),
}  # fmt: skip


@pytest.mark.parametrize("exclusions", [True, False], ids=["excl", "all"])
@pytest.mark.parametrize("grad_scale", [0.01, 100.0], ids=["x0.01", "x100"])
@pytest.mark.parametrize("name", AUTHORS.keys())
def test_matches_the_authors_code(name, grad_scale, exclusions, launches):
    make_opt, reference = AUTHORS[name]
    weights, grads = faithful.make_problem(31, grad_scale)
    expected = reference(weights, grads, exclusions, 1.0)
    ours = faithful.run_ours(
        lambda g: make_opt(g, 1.0), weights, grads, exclusions=exclusions, dtype=torch.float32
    )
    assert faithful.max_rel_diff(ours, expected) < FP32_TOL
    _assert_two_launches_per_bucket_step(launches, 2 if exclusions else 1, faithful.STEPS)


# ---- against the torch path -----------------------------------------------------------------
def _steps(make_opt, params, grads):
    opt = make_opt(params)
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.to(p.dtype)
        opt.step()
    return opt


def _problem(n_tensors: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3 + 7 * (i % 5), 1 + i % 4) for i in range(n_tensors)]
    weights = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    return [nn.Parameter(w.to(dtype)) for w in weights], grads


@pytest.mark.parametrize("n_tensors", [3, 40])
def test_launches_do_not_grow_with_the_number_of_tensors(n_tensors, launches):
    """Two launches per step whatever the number of tensors (the torch path's last pass
    launches once per tensor on CUDA), with one program per tile."""
    params, grads = _problem(n_tensors)
    _steps(lambda ps: Lans(ps, lr=0.01), params, grads)
    _assert_two_launches_per_bucket_step(launches, 1, len(grads))
    assert launches[0][1] == sum(-(-p.numel() // 32) for p in params)


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: Lamb(ps, lr=0.01),
        lambda ps: Lamb(ps, lr=0.01, weight_decay=0.0),  # no trust ratio: no norms taken
        lambda ps: Lans(ps, lr=0.01, variant="mxnet"),
    ],
    ids=["lamb", "lamb-wd0", "lans-mxnet"],
)
def test_bf16_parameters_step_as_on_the_torch_path(make_opt, launches, monkeypatch):
    """bf16 parameters: fp32 masters and moments go through the kernels, the parameter is
    the master rounded, as on the torch path."""
    params, grads = _problem(6, torch.bfloat16)
    opt = _steps(make_opt, params, grads)
    assert launches
    _torch_path(monkeypatch)
    ref_params, _ = _problem(6, torch.bfloat16)
    ref = _steps(make_opt, ref_params, grads)
    for p, q in zip(params, ref_params, strict=True):
        master, ref_master = opt.state[p]["master_param"], ref.state[q]["master_param"]
        torch.testing.assert_close(master, ref_master, rtol=1e-5, atol=1e-6)
        assert torch.equal(p.detach(), master.to(torch.bfloat16))


def test_sequential_lans_keeps_the_torch_path(launches, monkeypatch):
    """MXNet's lans.py order (``variant="mxnet-sequential"``) moves w between the two terms,
    which the fused passes do not: it stays on the torch path, bit for bit."""
    params, grads = _problem(5)
    _steps(lambda ps: Lans(ps, lr=0.01, variant="mxnet-sequential"), params, grads)
    assert launches == []
    _torch_path(monkeypatch)
    ref_params, _ = _problem(5)
    _steps(lambda ps: Lans(ps, lr=0.01, variant="mxnet-sequential"), ref_params, grads)
    for p, q in zip(params, ref_params, strict=True):
        assert torch.equal(p, q)


def test_mixed_layouts_keep_the_torch_path(launches):
    """A gradient laid out unlike its parameter (a transposed view) cannot be walked by the
    same offsets: the bucket takes the torch path."""
    p = nn.Parameter(torch.randn(6, 5))
    p.grad = torch.randn(5, 6).t()
    Lamb([p], lr=0.01).step()
    assert launches == []


class _Unbuildable:
    """A kernel whose build fails, as Triton's compiler fails on an unsupported GPU."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise RuntimeError("PTX .version 9.9 does not support .target sm_30")

        return launch


@pytest.mark.parametrize("cls", [Lamb, Lans])
def test_a_kernel_that_cannot_be_built_falls_back_to_torch_once(cls, monkeypatch):
    """The first pass failing to build warns once, leaves the state untouched, and the step
    (and every later one) runs on the torch path: the same weights as the torch path's."""
    monkeypatch.setenv(_triton.SWITCH, "interpret")
    monkeypatch.setattr(_triton, "_DISABLED", set())
    broken = SimpleNamespace(moments=_Unbuildable(), apply=_Unbuildable())
    monkeypatch.setattr(optim_triton, "_kernels", lambda mode: broken)
    params, grads = _problem(4)
    with pytest.warns(RuntimeWarning, match="could not be built.*sm_30.*torch kernels"):
        _steps(lambda ps: cls(ps, lr=0.01), params, grads[:1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = cls(params, lr=0.01)
        _steps(lambda ps: opt, params, grads[1:])
    _torch_path(monkeypatch)
    ref_params, _ = _problem(4)
    _steps(lambda ps: cls(ps, lr=0.01), ref_params, grads[:1])
    ref = cls(ref_params, lr=0.01)
    _steps(lambda ps: ref, ref_params, grads[1:])
    for p, q in zip(params, ref_params, strict=True):
        assert torch.equal(p, q)


# ---- the switch and the tables ----------------------------------------------------------------
def test_switch_values(monkeypatch):
    monkeypatch.setenv(_triton.SWITCH, "yes")
    with pytest.raises(ValueError, match="MODELZOO_TRITON='yes'.*1 .*0 .*interpret"):
        _triton.mode()
    monkeypatch.setenv(_triton.SWITCH, "0")
    assert not _triton.usable(torch.device("cuda"), "x")
    monkeypatch.setenv(_triton.SWITCH, "1")
    assert not _triton.usable(torch.device("cpu"), "x")  # CPU: the C kernels or torch
    monkeypatch.setenv(_triton.SWITCH, "interpret")
    assert _triton.usable(torch.device("cpu"), "x")
    assert not _triton.usable(torch.device("cuda"), "x")


def test_cuda_without_triton_warns_once_and_uses_torch(monkeypatch):
    monkeypatch.setenv(_triton.SWITCH, "1")
    monkeypatch.setattr(_triton, "_importable", lambda: False)
    monkeypatch.setattr(_triton, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="triton package.*MODELZOO_TRITON=0"):
        assert not _triton.usable(torch.device("cuda"), "LAMB's passes")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _triton.usable(torch.device("cuda"), "LAMB's passes")


def test_tiles_cover_every_element_once():
    sizes = [0, 1, 31, 32, 33, 100]
    table = _triton.tiles(sizes, 32, torch.device("cpu"))
    assert table.count.tolist() == [1, 1, 1, 1, 2, 4]
    covered = [np.zeros(n, dtype=int) for n in sizes]
    for t, start in zip(table.tensor.tolist(), table.start.tolist(), strict=True):
        covered[t][start : start + 32] += 1
    assert all(np.all(c == 1) for c in covered)
    assert table.n == sum(table.count.tolist())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_step_runs_the_kernels_without_synchronizing(monkeypatch):
    """On CUDA the compiled kernels run (counted), and a step after the first (whose tables
    are built) never waits for the device."""
    monkeypatch.setenv(_triton.SWITCH, "1")
    calls = []
    moments = optim_triton.moments_
    monkeypatch.setattr(
        optim_triton, "moments_", lambda *a, **k: calls.append(1) or moments(*a, **k)
    )
    params = [nn.Parameter(torch.randn(s, device="cuda")) for s in [(64, 3, 3, 3), (64,), (10, 64)]]
    opt = Lans(params, lr=0.01)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        if step:
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert len(calls) == 3


# ---- the compiled kernels, built for NVIDIA GPUs without one ----------------------------------
_PTR, _I32, _F32 = "*i64", "i32", "fp32"
_OPTIM_ARGS = dict(
    g_addr=_PTR, m_addr=_PTR, v_addr=_PTR, w_addr=_PTR, sizes=_PTR, tile_tensor="*i32",
    tile_start=_PTR, scale="*fp32", scale_stride=_I32, partial="*fp32", coef_m="*fp32",
    coef_c="*fp32", coef_stride=_I32, one_minus_beta1=_F32, beta2=_F32, one_minus_beta2=_F32,
    eps=_F32, alpha_m=_F32, alpha_c=_F32,
)  # fmt: skip


def _kernel_builds():
    """(name, function, argument types, constants) of every kernel variant the code launches."""
    from trainers.comm.adasum import _gpu_kernels as adasum_kernels
    from trainers.optim import _triton_kernels as optim_kernels

    for lans in (False, True):
        for scaled in (False, True):
            for norms in (False, True):
                consts = dict(SCALED=scaled, NORMS=norms, LANS=lans, BLOCK=optim_triton.BLOCK)
                yield "moments", optim_kernels.moments, _OPTIM_ARGS, consts
            consts = dict(SCALED=scaled, LANS=lans, BLOCK=optim_triton.BLOCK)
            yield "apply", optim_kernels.apply, _OPTIM_ARGS, consts
    for dtype in ("fp32", "fp64", "fp16", "bf16"):
        spans = dict(x=f"*{dtype}", y=f"*{dtype}", base=_PTR, sizes=_PTR, tile_tensor="*i32",
                     tile_start=_PTR, partial="*fp64", p="*fp64", q="*fp64")  # fmt: skip
        yield f"seg_dots {dtype}", adasum_kernels.seg_dots, spans, dict(BLOCK=4096)
        yield f"seg_axpby {dtype}", adasum_kernels.seg_axpby, spans, dict(BLOCK=4096)


@pytest.mark.parametrize("capability", [80, 90], ids=["sm80-a100", "sm90-h100-h200"])
def test_the_kernels_compile_for_nvidia_gpus(capability):
    """Every variant of the LAMB/LANS and Adasum kernels through Triton's real compiler (not
    the interpreter) down to a cubin for A100 and H100/H200, with no GPU: Triton's NVIDIA
    backend and its bundled ptxas do not need one. What only a GPU can show (speed, and the
    results of the compiled code) is left to benchmarks/gpu_check.py."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton build has no NVIDIA backend")
    target = GPUTarget("cuda", capability, 32)
    built = 0
    for name, fn, types, consts in _kernel_builds():
        kernel = triton.jit(fn)
        signature = {a: "constexpr" if a in consts else types[a] for a in kernel.arg_names}
        compiled = triton.compile(ASTSource(kernel, signature, consts), target=target)
        assert len(compiled.asm["cubin"]) > 1000, name
        built += 1
    assert built == 20
