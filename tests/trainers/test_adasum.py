"""Adasum: the pairwise rule, the reduction over 2, 3 and 4 gloo processes, the combiners.

Oracles: the rule's published properties with Horovod's tolerance
(``||expected - got|| / ||expected|| / 100 < eps(dtype)``), and a numpy binary tree written
here from the paper's formula, Horovod's ``sqrt(DBL_MIN)`` guard and the documented
non-power-of-two rule. The delta path against a transcription of Horovod's optimizer and
adasum.h is in test_faithful_comm.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from modelzoo import _native as native_loader
from tests._tiers import slow_fixture
from tests.trainers._trainer_toys import ToyDataset, lr_fn, make_mlp, train_step
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig
from trainers.cli import add_distributed_args, add_optimizer_args, build_combiner, build_optimizer
from trainers.comm import GradCombiner
from trainers.comm.adasum import EPS as GUARD
from trainers.comm.adasum import (
    AdasumCombiner,
    adasum_allreduce_,
    adasum_pair,
)
from trainers.comm.adasum import allreduce as adasum_module
from trainers.comm.adasum import combiners as adasum_combiners
from trainers.comm.adasum import gpu as adasum_gpu
from trainers.comm.adasum import kernels as adasum_kernels
from trainers.comm.adasum import native as adasum_native
from trainers.comm.adasum.rule import _coefficient_pair, _coefficients
from trainers.optim import create_optimizer, list_optimizers

REPO = Path(__file__).resolve().parents[2]
NP_DTYPES = {torch.float32: np.float32, torch.float16: np.float16}


# ================================================================================================
# the numpy reference (float64)
# ================================================================================================
SQRT_DBL_MIN = math.sqrt(sys.float_info.min)  # Horovod's guard (adasum.h: sqrt_double_min)


def np_rule(a: np.ndarray, b: np.ndarray, eps: float = SQRT_DBL_MIN) -> np.ndarray:
    """Maleki et al.'s pairwise rule with Horovod's guard."""
    dot = float(np.dot(a, b))
    ca = 1.0 - dot / (2.0 * float(np.dot(a, a))) if np.dot(a, a) >= eps else 1.0
    cb = 1.0 - dot / (2.0 * float(np.dot(b, b))) if np.dot(b, b) >= eps else 1.0
    return ca * a + cb * b


def np_tree(xs: list[np.ndarray]) -> np.ndarray:
    """Binary tree over ranks in order; N = 2^k + r: the first r adjacent pairs fold first."""
    n = len(xs)
    p2 = 2 ** int(math.floor(math.log2(n)))
    r = n - p2
    level = [np_rule(xs[2 * i], xs[2 * i + 1]) for i in range(r)] + list(xs[2 * r :])
    while len(level) > 1:
        level = [np_rule(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def diff_ratio(expected: np.ndarray, got: np.ndarray) -> float:
    """Horovod's test measure."""
    return float(np.linalg.norm(expected - got) / np.linalg.norm(expected) / 100.0)


def as64(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().reshape(-1).numpy()


# ================================================================================================
# the pairwise rule
# ================================================================================================
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_orthogonal_vectors_add(dtype):
    rng = np.random.default_rng(2)
    for n in (3, 23, 1000, 2**16):
        q = np.linalg.qr(rng.normal(size=(n, 2)))[0].astype(NP_DTYPES[dtype])
        a, b = torch.from_numpy(q[:, 0].copy()), torch.from_numpy(q[:, 1].copy())
        expected = q[:, 0].astype(np.float64) + q[:, 1].astype(np.float64)
        assert diff_ratio(expected, as64(adasum_pair(a, b))) < np.finfo(NP_DTYPES[dtype]).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", [1.0, 3.0, 0.25, -1.0, -4.0])
def test_parallel_vectors_average_for_any_sign(dtype, k):
    rng = np.random.default_rng(3)
    for n in (5, 1000, 2**16):
        a64 = rng.normal(size=n)
        a = torch.from_numpy(a64.astype(NP_DTYPES[dtype]))
        b = torch.from_numpy((k * a64).astype(NP_DTYPES[dtype]))
        expected = (as64(a) + as64(b)) / 2
        if k == -1.0:  # the mean is ~0: compare with the inputs' scale instead
            assert np.abs(as64(adasum_pair(a, b)) - expected).max() < 1e-6 * np.abs(a64).max()
            continue
        assert diff_ratio(expected, as64(adasum_pair(a, b))) < np.finfo(NP_DTYPES[dtype]).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_zero_gives_the_other_and_the_rule_is_symmetric(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 50, generator=g).to(dtype)
    b = torch.randn(3, 50, generator=g).to(dtype)
    zero = torch.zeros_like(a)
    assert torch.equal(adasum_pair(zero, b), b)
    assert torch.equal(adasum_pair(a, zero), a)
    assert torch.equal(adasum_pair(zero, zero), zero)
    assert torch.equal(adasum_pair(a, b), adasum_pair(b, a))
    assert adasum_pair(a, b).dtype == dtype and adasum_pair(a, b).shape == a.shape


def test_matches_the_formula_in_float64():
    rng = np.random.default_rng(4)
    for _ in range(5):
        a, b = rng.normal(size=300) * rng.uniform(0.1, 10), rng.normal(size=300)
        b += rng.uniform(-1, 1) * a
        got = adasum_pair(torch.from_numpy(a), torch.from_numpy(b)).numpy()
        np.testing.assert_allclose(got, np_rule(a, b), rtol=1e-12, atol=1e-12)


def _parallel_columns(dtype, scales: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Horovod's stability data for two ranks: columns a * scales[i], rounded to dtype."""
    a = np.random.default_rng(seed).normal(size=(1024, 1))
    q = (a @ scales.reshape(1, 2)).astype(NP_DTYPES[dtype])
    return q[:, 0], q[:, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tiny_magnitudes(dtype):
    """Horovod's stability test: parallel columns at the dtype's smallest normal magnitude."""
    np_dtype = NP_DTYPES[dtype]
    tiny = float(np.finfo(np_dtype).tiny)
    x, y = _parallel_columns(dtype, np.array([1.3, -0.7]) * tiny, seed=5)
    a, b = torch.from_numpy(x), torch.from_numpy(y)
    mean = (x.astype(np.float64) + y.astype(np.float64)) / 2
    # squared norms ~1e-73 (fp32) and ~1e-6 (fp16): above Horovod's sqrt(DBL_MIN) guard
    assert diff_ratio(mean, as64(adasum_pair(a, b))) < np.finfo(np_dtype).eps
    assert diff_ratio(mean, as64(adasum_pair(a, b, eps=0.0))) < np.finfo(np_dtype).eps
    if dtype == torch.float32:
        # a guard of 1e-8 (this library's earlier default) counts both sides as zero: a sum
        total = x.astype(np.float64) + y.astype(np.float64)
        assert diff_ratio(total, as64(adasum_pair(a, b, eps=1e-8))) < np.finfo(np_dtype).eps


def test_the_default_guard_is_horovods():
    assert math.sqrt(sys.float_info.min) == GUARD == AdasumCombiner().options.eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_near_overflow_magnitudes(dtype):
    """Horovod's stability test 2: magnitudes from tiny up to sqrt(max) in one pair."""
    np_dtype = NP_DTYPES[dtype]
    lo, hi = float(np.finfo(np_dtype).tiny), math.sqrt(float(np.finfo(np_dtype).max))
    for scales in (np.array([math.sqrt(lo * hi), hi]), np.array([hi, -math.sqrt(lo * hi)])):
        x, y = _parallel_columns(dtype, scales, seed=6)
        a, b = torch.from_numpy(x), torch.from_numpy(y)
        mean = (x.astype(np.float64) + y.astype(np.float64)) / 2
        got = adasum_pair(a, b, eps=0.0 if dtype == torch.float32 else 1e-8)
        assert torch.isfinite(got).all()
        assert diff_ratio(mean, as64(got)) < np.finfo(np_dtype).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.slow
def test_fused_dots_match_the_blas_dots_and_numpy(dtype, monkeypatch):
    """The compiled one-pass kernel (long spans on CPU) against the chunked BLAS path and
    numpy in float64: exact products, float64 sums (only the summation order differs)."""
    g = torch.Generator().manual_seed(7)
    n = adasum_kernels._FUSED_MIN + 12345  # uneven; the views below start unaligned
    a = (torch.randn(n + 3, generator=g) * 3).to(dtype)[3:]
    b = (torch.randn(n + 1, generator=g) * 1e-2).to(dtype)[1:] + a
    for x, y in ((a, b), (torch.zeros_like(a), b), (a, -a), (b[:-7], a[7:])):
        fused = torch.zeros(3, dtype=torch.float64)
        adasum_kernels._dots(x, y, fused)
        if adasum_kernels._FUSED[0] is None:
            pytest.skip("TorchInductor cannot compile here: only the BLAS path runs")
        blas = torch.zeros(3, dtype=torch.float64)
        monkeypatch.setattr(adasum_kernels, "_FUSED_MIN", 1 << 62)
        adasum_kernels._dots(x, y, blas)
        monkeypatch.undo()
        x64, y64 = as64(x), as64(y)
        want = np.array([x64 @ y64, x64 @ x64, y64 @ y64])
        bound = 1e-13 * np.array([np.abs(x64 * y64).sum(), x64 @ x64, y64 @ y64])
        for got in (fused.numpy(), blas.numpy()):
            assert (np.abs(got - want) <= bound).all(), (got, want)
        if not x.any():  # a zero side (the guard's case) sums to exactly 0
            assert fused[0] == fused[1] == 0.0


def _lane_dots(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """numpy's float64 arithmetic in the C kernel's documented order: element ``i`` in lane
    ``i % 16``, each lane summed in order, then the lanes in order (no FMA: products of
    widened fp32 values are exact, fp64 products round as numpy's do)."""
    acc = np.zeros((3, 16))
    for start in range(0, len(x), 16):
        u, v = x[start : start + 16], y[start : start + 16]
        acc[:, : len(u)] += np.stack([u * v, u * u, v * v])  # one lane per element
    out = np.zeros(3)
    for j in range(16):
        out += acc[:, j]
    return out


def _spans_problem(dtype: torch.dtype, lengths: list[int]):
    """``(generator, x, y, offs, before)``: two unaligned views of ``sum(lengths)`` values
    (``x`` of magnitude 3, ``y`` of 1e-3), the spans' offsets, and float64 rows of partial
    sums for the dots to add to."""
    g = torch.Generator().manual_seed(11)
    n = sum(lengths)
    x = (torch.randn(n + 1, generator=g, dtype=torch.float64) * 3).to(dtype)[1:]
    y = (torch.randn(n + 2, generator=g, dtype=torch.float64) * 1e-3).to(dtype)[2:]
    offs = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    before = torch.randn(len(lengths), 3, generator=g, dtype=torch.float64)
    return g, x, y, offs, before


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_c_kernels_give_the_documented_bits(dtype):
    """``seg_dots_`` and ``seg_axpby_`` against numpy in float64, bit for bit: the dots in
    the documented lane order (so the same bits on every instruction set), the rule as
    ``p x + q y`` in float64 rounded once. Spans of every awkward length, one empty,
    unaligned views, and accumulation into rows already holding partial sums."""
    if not adasum_native.available(torch.zeros(1, dtype=dtype)):
        pytest.fail("Adasum's C kernels did not build (a C compiler is a test requirement)")
    g, x, y, offs, before = _spans_problem(dtype, [1, 15, 16, 17, 0, 33, 1000, 4099])
    out = before.clone()
    adasum_native.seg_dots_(x, y, offs, out)
    x64, y64 = x.double().numpy(), y.double().numpy()
    for s, (lo, hi) in enumerate(zip(offs, offs[1:], strict=False)):
        want = before[s].numpy() + _lane_dots(x64[lo:hi], y64[lo:hi])
        assert np.array_equal(out[s].numpy(), want), (s, out[s], want)
    p = torch.randn(len(offs) - 1, generator=g, dtype=torch.float64).tolist()
    q = torch.randn(len(offs) - 1, generator=g, dtype=torch.float64).tolist()
    z = x.clone()
    adasum_native.seg_axpby_(z, y, offs, p, q)
    for s, (lo, hi) in enumerate(zip(offs, offs[1:], strict=False)):
        want = (p[s] * x64[lo:hi] + q[s] * y64[lo:hi]).astype(x.numpy().dtype)
        assert np.array_equal(z[lo:hi].numpy(), want), s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_cuda_kernels_interpreted_match_numpy(dtype, monkeypatch):
    """The CUDA (Triton) ``seg_dots_`` and ``seg_axpby_``, run in Triton's interpreter with
    64-element tiles, against numpy in float64: the dots of exact products summed in another
    order (so within 1e-13 of the sum of magnitudes), accumulated into rows already holding
    partial sums; the rule ``p x + q y`` in float64 rounded once as torch rounds a double (to
    fp16 / bf16 through float32), bit for bit. Spans of every awkward length, one empty."""
    pytest.importorskip("triton", reason="the Triton kernels' tests need the triton package")
    monkeypatch.setenv("MODELZOO_TRITON", "interpret")
    monkeypatch.setattr(adasum_gpu, "BLOCK", 64)
    assert adasum_gpu.available(torch.zeros(1, dtype=dtype))
    g, x, y, offs, before = _spans_problem(dtype, [1, 15, 16, 17, 0, 33, 64, 65, 1000, 4099])
    out = before.clone()
    adasum_gpu.seg_dots_(x, y, offs, out)
    x64, y64 = x.double().numpy(), y.double().numpy()
    for s, (lo, hi) in enumerate(zip(offs, offs[1:], strict=False)):
        u, v = x64[lo:hi], y64[lo:hi]
        want = before[s].numpy() + np.array([u @ v, u @ u, v @ v])
        bound = 1e-13 * np.array([np.abs(u * v).sum(), u @ u, v @ v]) + 1e-300
        assert (np.abs(out[s].numpy() - want) <= bound).all(), (s, out[s], want)
    p = torch.randn(len(offs) - 1, generator=g, dtype=torch.float64).tolist()
    q = torch.randn(len(offs) - 1, generator=g, dtype=torch.float64).tolist()
    z = x.clone()
    adasum_gpu.seg_axpby_(z, y, offs, p, q)
    for s, (lo, hi) in enumerate(zip(offs, offs[1:], strict=False)):
        want = torch.from_numpy(p[s] * x64[lo:hi] + q[s] * y64[lo:hi]).to(dtype)
        assert torch.equal(z[lo:hi], want), s
    # exact ties (1 + eps / 2, between 1 and 1 + eps) round to the even neighbour, 1
    ones = torch.ones(8, dtype=dtype)
    half_eps = torch.finfo(dtype).eps / 2
    adasum_gpu.seg_axpby_(ones, torch.zeros_like(ones), [0, 8], [1.0 + half_eps], [0.0])
    assert torch.equal(ones, torch.ones(8, dtype=dtype))


def test_cuda_kernels_that_cannot_be_built_fall_back_to_torch(monkeypatch):
    """A Triton kernel whose build fails (an unsupported GPU, ...) warns once and leaves the
    dots and the rule to the torch kernels: the same results as with Triton switched off."""
    pytest.importorskip("triton", reason="the Triton kernels' tests need the triton package")
    from types import SimpleNamespace

    from modelzoo import _triton

    class Unbuildable:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no kernel image is available for this device")

            return launch

    monkeypatch.setattr(adasum_native, "available", lambda x: False)
    monkeypatch.setattr(_triton, "_DISABLED", set())
    monkeypatch.setattr(
        adasum_gpu,
        "_kernels",
        lambda mode: SimpleNamespace(dots=Unbuildable(), axpby=Unbuildable()),
    )
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(5000, generator=g), torch.randn(5000, generator=g)
    bounds = [0, 10, 3000, 5000]

    def run(switch: str) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setenv("MODELZOO_TRITON", switch)
        part = torch.zeros(3, 3, dtype=torch.float64)
        adasum_kernels._accumulate_dots(a, b, 0, bounds, True, part)
        x = a.clone()
        adasum_kernels._apply_(x, b, 0, bounds, [0.5, 0.25, 2.0], [1.0, -1.0, 0.5])
        return part, x

    with pytest.warns(RuntimeWarning, match="could not be built.*no kernel image"):
        fell_back = run("interpret")
    assert not adasum_gpu.available(a)  # off for the rest of the process
    want = run("0")
    assert torch.equal(fell_back[0], want[0]) and torch.equal(fell_back[1], want[1])


def test_scalar_coefficients_are_the_tensor_rule_bit_for_bit():
    """The allreduce computes its coefficients in Python floats (no tensor ops per level):
    the same bits as the tensor rule, over magnitudes from 1e-170 to 1e150 (overflow to
    infinity included) and zero sides."""
    g = torch.Generator().manual_seed(5)

    def magnitudes(lo: int, hi: int) -> torch.Tensor:
        return 10.0 ** torch.randint(lo, hi, (500,), generator=g).double()

    dot = torch.randn(500, generator=g, dtype=torch.float64) * magnitudes(-150, 150)
    na = dot.abs() * torch.rand(500, generator=g, dtype=torch.float64) * 3
    nb = torch.rand(500, generator=g, dtype=torch.float64) * magnitudes(-170, 5)
    na[:5], nb[5:10], dot[10:12] = 0.0, 0.0, -0.0
    for eps in (GUARD, 0.0):
        ca, cb = _coefficients(dot, na, nb, eps)
        assert (ca[:5] == 1).all() and (cb[5:10] == 1).all()  # a zero side: coefficient 1
        pairs = [
            _coefficient_pair(d, a, b, eps)
            for d, a, b in zip(dot.tolist(), na.tolist(), nb.tolist(), strict=True)
        ]
        assert torch.equal(ca, torch.tensor([c[0] for c in pairs], dtype=torch.float64))
        assert torch.equal(cb, torch.tensor([c[1] for c in pairs], dtype=torch.float64))


def test_a_zero_side_with_no_guard_gives_the_other_side():
    """``eps=0``: coefficient 1 only for an exactly zero side (it used to divide 0 by 0)."""
    b = torch.tensor([1.0, -2.0, 3.0])
    assert torch.equal(adasum_pair(torch.zeros(3), b, eps=0.0), b)
    assert torch.equal(adasum_pair(b, torch.zeros(3), eps=0.0), b)


@pytest.mark.slow
def test_c_kernels_fall_back_without_a_compiler(monkeypatch):
    monkeypatch.setattr(native_loader, "_LOADED", {})
    monkeypatch.setattr(native_loader.shutil, "which", lambda name: None)
    with pytest.warns(RuntimeWarning, match="need a C compiler"):
        assert not adasum_native.available(torch.zeros(3))
    monkeypatch.setattr(native_loader, "_LOADED", {})
    monkeypatch.setenv("MODELZOO_ADASUM_NATIVE", "0")
    assert not adasum_native.available(torch.zeros(3))
    # without them the allreduce's kernels are the torch ones: the in-process rule is kept
    a, b = torch.randn(40000), torch.randn(40000)
    part = torch.zeros(1, 3, dtype=torch.float64)
    adasum_kernels._accumulate_dots(a, b, 0, [0, 40000], True, part)
    a64, b64 = a.double(), b.double()
    want = torch.stack([a64 @ b64, a64 @ a64, b64 @ b64])
    assert torch.allclose(part[0], want, rtol=1e-12, atol=0)


def test_without_a_process_group_the_allreduce_is_the_identity():
    xs = [torch.randn(5), torch.randn(2, 3).half()]
    before = [x.clone() for x in xs]
    assert adasum_allreduce_(xs) is xs
    assert all(torch.equal(x, y) for x, y in zip(xs, before, strict=True))


# ================================================================================================
# who talks to whom: the plan for sizes this machine cannot launch cheaply
# ================================================================================================
def _plans(size: int, local: int, monkeypatch) -> list:
    monkeypatch.setattr(adasum_module, "_group", lambda ranks, world_size: tuple(ranks))
    return [adasum_module._build_plan(None, size, r, local) for r in range(size)]


def test_plan_folds_adjacent_pairs_for_non_power_of_two(monkeypatch):
    plans = _plans(5, 1, monkeypatch)  # adasum(adasum(adasum(x0, x1), x2), adasum(x3, x4))
    assert [(p.fold_peer, p.fold_keeper) for p in plans] == [
        (1, True), (0, False), (None, False), (None, False), (None, False)
    ]  # fmt: skip
    assert [[(lv.peer, lv.left) for lv in p.levels] for p in plans] == [
        [(2, True), (3, True)], [], [(0, False), (4, True)], [(4, True), (0, False)],
        [(3, False), (2, False)],
    ]  # fmt: skip
    assert plans[0].levels[0].group == (0, 2) and plans[3].levels[0].group == (3, 4)
    assert plans[0].levels[1].group == (0, 2, 3, 4)


def test_plan_hierarchical_three_nodes(monkeypatch):
    plans = _plans(6, 2, monkeypatch)  # nodes {0,1} {2,3} {4,5}: node 1 folds into node 0
    assert [p.position for p in plans] == [0, 1, 0, 1, 0, 1]
    assert [p.fold_peer for p in plans] == [2, 3, 0, 1, None, None]
    assert [p.fold_keeper for p in plans] == [True, True, False, False, False, False]
    assert plans[0].fold_group == (0, 1) and plans[1].node_group == (0, 1)
    assert [[lv.peer for lv in p.levels] for p in plans] == [[4], [5], [], [], [0], [1]]
    assert plans[0].levels[0].group == (0, 1, 4, 5)


# ================================================================================================
# combiners with one rank: exactly the plain optimizer
# ================================================================================================
def _fit(combiner: GradCombiner, optimizer: str, precision: str = "fp32") -> list[torch.Tensor]:
    model = make_mlp(seed=0)
    opt = create_optimizer(optimizer, model, lr=0.05, weight_decay=1e-3)
    trainer = Trainer(
        model,
        opt,
        TrainerConfig(epochs=2, batch_size=8, seed=1, log_interval=0, precision=precision),
        env=DistEnv(),
        logger=RunLogger(None, enabled=False),
        lr_schedule=lr_fn,
        train_step=train_step,
        combiner=combiner,
    )
    trainer.fit(ToyDataset(40))
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("optimizer", list_optimizers())
def test_delta_mode_with_one_rank_is_the_plain_optimizer(optimizer):
    plain = _fit(GradCombiner(), optimizer)
    for got, want in zip(_fit(AdasumCombiner(mode="delta"), optimizer), plain, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("optimizer", ["sgd", "nag"])
def test_gradient_mode_with_one_rank_is_plain_sgd(optimizer):
    plain = _fit(GradCombiner(), optimizer)
    for got, want in zip(_fit(AdasumCombiner(mode="gradient"), optimizer), plain, strict=True):
        assert torch.equal(got, want)


def test_gradient_mode_scales_the_guard_with_the_fp16_loss_scale(monkeypatch):
    """Scaled gradients combine like unscaled ones: eps grows with the square of the scale."""
    seen = []
    monkeypatch.setattr(adasum_combiners.dist, "all_reduce", lambda *args, **kwargs: None)
    monkeypatch.setattr(adasum_combiners.dist, "broadcast", lambda *args, **kwargs: None)
    monkeypatch.setattr(adasum_combiners, "broadcast_", lambda *args, **kwargs: None)
    monkeypatch.setattr(
        adasum_combiners,
        "adasum_bucket_allreduce_",
        lambda tensors, **kwargs: seen.append(dict(n=len(tensors), **kwargs)),
    )
    combiner = AdasumCombiner(mode="gradient", overlap=False)
    model = make_mlp()
    combiner.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), DistEnv(rank=0, world_size=2)
    )
    for p in combiner.model.parameters():
        p.grad = torch.ones_like(p)
    combiner.reduce_gradients(torch.amp.GradScaler("cpu", init_scale=1024.0))
    assert sum(s["n"] for s in seen) == 4
    assert all(s["eps"] == pytest.approx(GUARD * 1024.0**2) for s in seen)
    seen.clear()
    combiner.reduce_gradients(None)
    assert seen and {s["eps"] for s in seen} == {GUARD}


def test_hierarchical_on_one_node_raises_instead_of_averaging():
    env = DistEnv(rank=0, world_size=4, local_world_size=4)  # no collective runs before the check
    for mode in ("gradient", "delta"):
        combiner = AdasumCombiner(mode=mode, hierarchical=True)
        model = make_mlp()
        with pytest.raises(ValueError, match="single node"):
            combiner.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), env)


# ================================================================================================
# command line
# ================================================================================================
def _combiner(*argv: str) -> GradCombiner:
    """The combiner the flags build, prepared (one rank) with the optimizer they build."""
    parser = argparse.ArgumentParser()
    add_optimizer_args(parser)
    add_distributed_args(parser)
    args = parser.parse_args(["--lr", "0.1", *argv])
    model = make_mlp()
    combiner = build_combiner(args, DistEnv())
    combiner.prepare(model, build_optimizer(args, model), DistEnv())
    return combiner


def test_cli_defaults_to_horovods_delta_mode_for_every_optimizer():
    for name in ("nag", "sgd", "adam", "adamw", "lamb", "lans"):
        assert _combiner("--grad-combine", "adasum", "--optimizer", name).mode == "delta"
    assert _combiner("--grad-combine", "adasum", "--adasum-mode", "auto").mode == "gradient"  # nag
    auto = _combiner("--grad-combine", "adasum", "--adasum-mode", "auto", "--optimizer", "adam")
    assert auto.mode == "delta"
    explicit = _combiner("--grad-combine", "adasum", "--adasum-mode", "gradient")
    assert isinstance(explicit, AdasumCombiner) and explicit.mode == "gradient"
    hier = _combiner(
        "--grad-combine", "adasum", "--adasum-mode", "gradient", "--adasum-hierarchical"
    )
    assert hier.mode == "gradient" and hier.options.hierarchical


def test_cli_rejects_adasum_flags_without_adasum():
    with pytest.raises(ValueError, match="only applies with --grad-combine adasum"):
        _combiner("--adasum-hierarchical")
    with pytest.raises(SystemExit):
        _combiner("--grad-combine", "adasum", "--adasum-mode", "sometimes")


# ================================================================================================
# 4, 3 and 2 gloo processes (one launch; see _adasum_worker.py)
# ================================================================================================
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@slow_fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("adasum")
    ports = [str(free_port()) for _ in range(3)]
    procs = []
    for rank in range(4):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=ports[0],
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.trainers._adasum_worker", str(out), *ports[1:]],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for rank, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{text}"
    load = lambda w, r: torch.load(out / f"w{w}_r{r}.pt", weights_only=True)  # noqa: E731
    return {w: [load(w, r) for r in range(w)] for w in (4, 3, 2)}


# Relative error bound of the tree for low-precision inputs: one rounding per level.
TOLERANCE = {"fp64": 1e-12, "fp32": 1e-5, "fp16": 4e-3, "bf16": 3e-2}
EPS = {"fp32": float(np.finfo(np.float32).eps), "fp16": float(np.finfo(np.float16).eps)}
EPS["fp64"] = float(np.finfo(np.float64).eps)
EPS["bf16"] = 2.0**-7


def check_parity(per_rank: list[dict], reference, dtype: str) -> None:
    """Every rank holds the same result, within tolerance of the numpy reference per tensor."""
    for i in range(len(per_rank[0]["in"])):
        outs = [r["out"][i] for r in per_rank]
        assert all(torch.equal(outs[0], o) for o in outs[1:]), f"tensor {i} differs across ranks"
        assert outs[0].dtype == per_rank[0]["in"][i].dtype
        expected = reference([as64(r["in"][i]) for r in per_rank])
        got = as64(outs[0])
        if expected.size == 0:
            continue
        assert diff_ratio(expected, got) < EPS[dtype], f"tensor {i}"
        rel = np.linalg.norm(expected - got) / np.linalg.norm(expected)
        assert rel < TOLERANCE[dtype], f"tensor {i}: relative error {rel:.2e}"


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_allreduce_matches_the_numpy_tree(ranks, world, dtype):
    check_parity([r["random"][dtype] for r in ranks[world]], np_tree, dtype)


@pytest.mark.dist
@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_allreduce_in_many_small_messages_matches_the_numpy_tree(ranks, world, dtype):
    check_parity([r["pieces"][dtype] for r in ranks[world]], np_tree, dtype)


@pytest.mark.dist
@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("dtype", ["fp64", "fp32", "fp16", "bf16"])
def test_in_place_layout_matches_the_numpy_tree_and_the_packed_buffer(ranks, world, dtype):
    """Large tensors combined in their own memory (non-contiguous, passed twice, zero on some
    ranks, sizes around the packing threshold) against the numpy tree, and against the same
    call with every tensor packed into one fusion buffer (the earlier layout)."""
    per_rank = [r["layout"][dtype] for r in ranks[world]]
    check_parity(per_rank, np_tree, dtype)
    packed = [{"in": r["in"], "out": r["packed"]} for r in per_rank]
    check_parity(packed, np_tree, dtype)
    assert all(r["non_contiguous_stays"] for r in per_rank)
    for got, want in zip(per_rank[0]["out"], per_rank[0]["packed"], strict=True):
        # the two layouts add the partial dot sums in another order: a last-bit difference
        scale = float(want.double().abs().max()) or 1.0
        assert float((got.double() - want.double()).abs().max()) <= 4 * EPS[dtype] * scale


@pytest.mark.dist
@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("dtype", ["fp64", "fp32", "fp16"])
def test_kernel_paths_and_the_early_rule(ranks, world, dtype):
    """The C kernels, the torch kernels and the CUDA (Triton) kernels, interpreted here, all
    match the numpy tree (and each other to the last bits); combining a rank's own tensors as
    their dots complete gives exactly the bits of combining everything after the level's dot
    allreduce, also in 1000-element messages."""
    per_rank = [r["kernels"][dtype] for r in ranks[world]]
    if dtype in ("fp64", "fp32"):
        assert per_rank[0]["native"], "the C kernels did not build on this machine"
    paths = ["native", "torch", "pieces"]
    if importlib.util.find_spec("triton") is not None:  # a test requirement where it has wheels
        launches = per_rank[0]["triton_launches"]
        assert launches["dots"] > 0 and launches["axpby"] > 0, "the Triton kernels did not run"
        paths.append("triton")
    for kernels in paths:
        for early in (True, False):
            check_parity([{"in": r["in"], "out": r["out"][kernels, early]} for r in per_rank],
                         np_tree, dtype)  # fmt: skip
        for got, want in zip(per_rank[0]["out"][kernels, True], per_rank[0]["out"][kernels, False],
                             strict=True):  # fmt: skip
            assert torch.equal(got, want), kernels
    for other in [path for path in paths if path in ("torch", "triton")]:
        for got, want in zip(per_rank[0]["out"]["native", True], per_rank[0]["out"][other, True],
                             strict=True):  # fmt: skip
            scale = float(want.double().abs().max()) or 1.0
            assert float((got.double() - want.double()).abs().max()) <= 4 * EPS[dtype] * scale


@pytest.mark.dist
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_four_ranks_orthogonal_sum_parallel_mean(ranks, dtype):
    """Horovod's distributed tests: orthogonal columns add up, parallel ones average."""
    for kind, combine in (("orthogonal", np.sum), ("parallel", np.mean)):
        per_rank = [r[f"{kind}_{dtype}"] for r in ranks[4]]
        for i in range(len(per_rank[0]["in"])):
            expected = combine(np.stack([as64(r["in"][i]) for r in per_rank]), axis=0)
            assert diff_ratio(expected, as64(per_rank[0]["out"][i])) < EPS[dtype]


@pytest.mark.dist
def test_hierarchical_is_adasum_over_node_means(ranks):
    def reference(xs):
        return np_rule((xs[0] + xs[1]) / 2, (xs[2] + xs[3]) / 2)

    check_parity([r["hier"] for r in ranks[4]], reference, "fp32")
    check_parity([r["hier_odd"] for r in ranks[4]], reference, "fp32")  # an odd total: padding
    assert "single node" in ranks[4][0]["one_node_error"]


@pytest.mark.dist
def test_thousands_of_small_tensors_cost_few_messages(ranks):
    per_rank = [r["small"] for r in ranks[4]]
    check_parity(per_rank, np_tree, "fp32")
    capped = [{"in": r["in"], "out": r["out_capped"]} for r in per_rank]
    check_parity(capped, np_tree, "fp32")
    # 3000 tensors, one bucket: 2 levels of halving + 2 of gathering = 4 exchanges.
    assert per_rank[0]["messages"] == 4
    nbytes = sum(t.numel() * 4 for t in per_rank[0]["in"])
    buckets = math.ceil(nbytes / (0.05 * 2**20))
    assert 4 * buckets <= per_rank[0]["messages_capped"] <= 4 * (buckets + 1)


@pytest.mark.dist
def test_gradient_mode_keeps_three_ranks_identical(ranks):
    params = [r["grad_mode_params"] for r in ranks[3]]
    for tensors in zip(*params, strict=True):
        assert all(torch.equal(tensors[0], t) for t in tensors[1:])


# Held-out accuracy of 2 ranks with Adasum (per-worker batch 32, the single-worker lr) vs one
# process with batch 32: stated tolerance 3 points.
DIGITS_TOLERANCE = 0.03


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["gradient", "delta"])
def test_two_ranks_on_digits_reach_the_single_process_accuracy(ranks, mode):
    from tests.trainers._adasum_worker import digits_fit

    single, _ = digits_fit(DistEnv(), mode)
    (top1_0, params_0), (top1_1, params_1) = (r["digits"][mode] for r in ranks[2])
    assert top1_0 == top1_1
    assert all(torch.equal(a, b) for a, b in zip(params_0, params_1, strict=True))
    assert single > 0.9
    assert top1_0 >= single - DIGITS_TOLERANCE, (mode, top1_0, single)


@pytest.mark.dist
def test_delta_mode_resumes_bit_for_bit(ranks):
    for r in ranks[2]:
        for a, b in zip(r["resume"]["straight"], r["resume"]["resumed"], strict=True):
            assert torch.equal(a, b)
