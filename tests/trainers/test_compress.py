"""Compressors, error feedback and the command line of the communication-efficient modes.

Oracles: numpy transcriptions of each compressor's definition (top-k by argsort, the scaled
sign, QSGD's level and rounding rule), the statistical definition of unbiasedness, and error
feedback's residual identity ``e' = g + e - C(g + e)`` with ``C`` computed here.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest
import torch

from tests.trainers._trainer_toys import make_mlp
from trainers import DistEnv
from trainers.cli import add_distributed_args, add_optimizer_args, build_combiner, build_optimizer
from trainers.comm import (
    BF16,
    FP16,
    QSGD,
    CSERCombiner,
    CSERPLCombiner,
    CSERUpdateCombiner,
    ErrorFeedbackCombiner,
    Identity,
    LocalAdaAlterCombiner,
    LocalSGDCombiner,
    PowerSGDCombiner,
    RandomBlock,
    Sign,
    SlowMoCombiner,
    TopK,
    compressed_allreduce,
    create_compressor,
)


def vector(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.rand(n, generator=g) * 3


# ================================================================================================
# compressors
# ================================================================================================
@pytest.mark.parametrize("n,ratio", [(1000, 0.01), (37, 0.1), (5, 1.0), (10, 0.001)])
def test_topk_keeps_the_k_largest_magnitudes(n, ratio):
    x = vector(n)
    c = TopK(ratio=ratio)
    payload, ctx = c.compress(x)
    got = c.decompress(payload, ctx).numpy()
    k = max(1, round(n * ratio))
    largest = np.argsort(-np.abs(x.numpy()), kind="stable")[:k]
    want = np.zeros(n, dtype=np.float32)
    want[largest] = x.numpy()[largest]
    np.testing.assert_array_equal(got, want)
    assert c.payload_bytes(n) == 8 * k == sum(t.numel() * t.element_size() for t in payload)
    assert c.compression_ratio(n) == pytest.approx(4 * n / (8 * k))


def test_random_block_is_contiguous_shared_and_wraps():
    x = vector(100)
    c = RandomBlock(ratio=0.3)
    a, ctx_a = c.compress(x, shared=torch.Generator().manual_seed(5))
    b, ctx_b = c.compress(-x, shared=torch.Generator().manual_seed(5))
    assert ctx_a.shared == ctx_b.shared  # the same block on every worker
    got = c.decompress(a, ctx_a).numpy()
    start = ctx_a.shared
    idx = [(start + i) % 100 for i in range(30)]
    want = np.zeros(100, dtype=np.float32)
    want[idx] = x.numpy()[idx]
    np.testing.assert_array_equal(got, want)
    assert c.payload_bytes(100) == 120 and c.compression_ratio(100) == pytest.approx(400 / 120)
    offsets = {c.compress(x, shared=torch.Generator().manual_seed(s))[1].shared for s in range(20)}
    assert len(offsets) > 5  # the offset is random


@pytest.mark.parametrize("n", [1, 8, 13, 1001])
def test_sign_is_the_scaled_sign_packed_in_bits(n):
    x = vector(n, seed=n)
    c = Sign()
    payload, ctx = c.compress(x)
    xs = x.numpy().astype(np.float64)
    want = np.abs(xs).mean() * np.where(xs >= 0, 1.0, -1.0)
    np.testing.assert_allclose(c.decompress(payload, ctx).numpy(), want, rtol=1e-6)
    sent = sum(t.numel() * t.element_size() for t in payload)
    assert sent == c.payload_bytes(n) == math.ceil(n / 8) + 4


@pytest.mark.parametrize("cls,bits", [(FP16, 11), (BF16, 8)])
def test_casts_round_trip_within_their_precision(cls, bits):
    x = vector(500)
    c = cls()
    payload, ctx = c.compress(x)
    got = c.decompress(payload, ctx)
    assert got.dtype == torch.float32
    assert torch.all((got - x).abs() <= x.abs() * 2.0**-bits + 2.0**-25)  # fp16 subnormals
    assert c.compression_ratio(500) == 2.0


def test_identity_is_exact():
    x = vector(50)
    c = Identity()
    assert torch.equal(c.decompress(*c.compress(x)), x) and c.compression_ratio(50) == 1.0


def np_qsgd_levels(x: np.ndarray, norm: float, s: int, u: np.ndarray) -> np.ndarray:
    """QSGD's rule, transcribed: l = s|x|/norm, up with probability frac(l), times sign(x)."""
    level = s * np.abs(x) / norm
    low = np.floor(level)
    return np.sign(x) * (low + (u < level - low))


def test_qsgd_levels_follow_the_rule():
    x = vector(300)
    c = QSGD(levels=5, bucket_size=100)
    payload, ctx = c.compress(x, local=torch.Generator().manual_seed(3))
    u = torch.rand(3, 100, generator=torch.Generator().manual_seed(3)).numpy()
    xs = x.numpy().reshape(3, 100).astype(np.float64)
    norms = np.linalg.norm(xs, axis=1)
    want = np.stack([np_qsgd_levels(xs[i], norms[i], 5, u[i]) for i in range(3)])
    np.testing.assert_array_equal(payload[0].numpy().reshape(3, 100), want)
    assert payload[0].dtype == torch.int8
    decoded = c.decompress(payload, ctx).numpy().reshape(3, 100)
    np.testing.assert_allclose(decoded, want * norms[:, None] / 5, rtol=1e-6)
    assert c.payload_bytes(300) == 300 + 3 * 4


def test_qsgd_is_unbiased_over_many_draws():
    x = vector(200, seed=1)
    c = QSGD(levels=3, bucket_size=64)
    draws = 4000
    gen = torch.Generator().manual_seed(0)
    total = torch.zeros(200, dtype=torch.float64)
    for _ in range(draws):
        total += c.decompress(*c.compress(x, local=gen)).double()
    mean = total / draws
    # Each entry takes one of two neighbouring values norm/s apart: std <= norm / (2 s).
    norms = torch.cat([x[i : i + 64].norm().repeat(min(64, 200 - i)) for i in range(0, 200, 64)])
    bound = 5 * norms.double() / (2 * 3) / math.sqrt(draws)
    assert torch.all((mean - x.double()).abs() <= bound)
    one = c.decompress(*c.compress(x, local=gen))
    assert not torch.allclose(one, x, atol=1e-3)  # a single draw is not the input


@pytest.mark.parametrize("world", [2, 4])
def test_qsgd_allreduce_compatible_sum_then_decode_equals_decode_then_sum(world):
    c = QSGD(bucket_size=32).bind(world)
    xs = [vector(100, seed=10 + r) * (r + 1) for r in range(world)]
    shared = torch.stack([c.shared_stats(x) for x in xs]).amax(0)  # all_reduce(MAX)
    encoded = [c.compress(x, shared, local=torch.Generator().manual_seed(r)) for r, x in enumerate(xs)]  # fmt: skip
    assert c.levels * world <= 127 and encoded[0][0][0].dtype == torch.int8
    summed = sum(p[0].to(torch.int64) for p, _ in encoded)
    assert summed.abs().max() <= 127  # the int8 sum never overflows
    summed_then_decoded = c.decompress([summed.to(torch.int8)], encoded[0][1])
    decoded_then_summed = sum(c.decompress(p, ctx) for p, ctx in encoded)
    torch.testing.assert_close(summed_then_decoded, decoded_then_summed, rtol=1e-6, atol=1e-6)


def test_qsgd_widens_the_wire_type_when_the_sum_would_overflow_int8():
    c = QSGD(levels=100).bind(2)
    assert c.wire_dtype == torch.int32 and c.payload_bytes(1024) == 4 * 1024 + 8
    assert QSGD().bind(8).levels == 15


def test_random_block_sums_like_the_dense_vectors_on_its_block():
    c = RandomBlock(ratio=0.25)
    xs = [vector(40, seed=s) for s in range(3)]
    enc = [c.compress(x, shared=torch.Generator().manual_seed(1)) for x in xs]
    summed = [sum(p[0] for p, _ in enc)]
    torch.testing.assert_close(
        c.decompress(summed, enc[0][1]), sum(c.decompress(p, ctx) for p, ctx in enc)
    )


def test_without_a_process_group_the_reduction_is_the_own_decoded_vector():
    x = vector(64)
    mean, own, sent = compressed_allreduce(TopK(ratio=0.25), x, DistEnv())
    assert torch.equal(mean, own) and sent == 8 * 16


def test_bad_options_say_what_to_do():
    with pytest.raises(ValueError, match="fraction kept"):
        TopK(ratio=0.0)
    with pytest.raises(ValueError, match="choose one of"):
        create_compressor("zip")
    with pytest.raises(ValueError, match="levels"):
        QSGD(levels=0)


# ================================================================================================
# error feedback: the residual identity (one process; the average is this worker's own c)
# ================================================================================================
def np_topk(v: np.ndarray, k: int) -> np.ndarray:
    out = np.zeros_like(v)
    idx = np.argsort(-np.abs(v), kind="stable")[:k]
    out[idx] = v[idx]
    return out


def test_error_feedback_residual_identity():
    model = make_mlp()
    combiner = ErrorFeedbackCombiner(compressor=TopK(ratio=0.1))
    combiner.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0), DistEnv())
    n = sum(p.numel() for p in model.parameters())
    k = round(0.1 * n)
    residual = np.zeros(n, dtype=np.float32)
    sent_total = np.zeros(n, dtype=np.float64)
    grads_total = np.zeros(n, dtype=np.float64)
    for step in range(6):
        g = vector(n, seed=100 + step)
        offset = 0
        for p in model.parameters():
            p.grad = g[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        combiner.reduce_gradients(None)
        sent = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
        want = np_topk(g.numpy() + residual, k)
        np.testing.assert_allclose(sent, want, rtol=1e-6, atol=1e-7)
        residual = g.numpy() + residual - want  # e' = g + e - C(g + e)
        np.testing.assert_allclose(combiner.residual.numpy(), residual, rtol=1e-6, atol=1e-6)
        sent_total += sent
        grads_total += g.numpy()
        combiner.step(torch.optim.SGD(model.parameters(), lr=0.0), None)
    # Nothing is lost: what was sent plus what is kept is every gradient.
    np.testing.assert_allclose(sent_total + residual, grads_total, rtol=1e-5, atol=1e-5)


def test_residual_modes_refuse_fp16_loss_scaling():
    scaler = torch.amp.GradScaler("cpu")
    ef = ErrorFeedbackCombiner(compressor=TopK())
    model = make_mlp()
    ef.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), DistEnv())
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        ef.reduce_gradients(scaler)
    local = LocalSGDCombiner(period=2)
    local.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), DistEnv())
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        local.reduce_gradients(scaler)


# ================================================================================================
# command line
# ================================================================================================
def _combiner(*argv: str):
    """The combiner the flags build, prepared (one rank) with the optimizer they build."""
    parser = argparse.ArgumentParser()
    add_optimizer_args(parser)
    add_distributed_args(parser)
    args = parser.parse_args(["--lr", "0.1", *argv])
    model = make_mlp()
    combiner = build_combiner(args, DistEnv())
    combiner.prepare(model, build_optimizer(args, model), DistEnv())
    return combiner


def test_one_flag_selects_every_mode():
    ef = _combiner("--grad-combine", "ef", "--compressor", "qsgd", "--qsgd-levels", "7")
    assert isinstance(ef, ErrorFeedbackCombiner) and ef.compressor.levels == 7
    cser = _combiner(
        "--grad-combine", "cser-update", "--cser-period", "4", "--compress-ratio", "0.05"
    )  # fmt: skip
    assert isinstance(cser, CSERUpdateCombiner) and cser.period == 4
    assert isinstance(cser.compressor, TopK) and cser.compressor.ratio == 0.05
    assert isinstance(cser.reset_compressor, Identity)
    for hook in ("powersgd", "fp16", "bf16"):
        assert _combiner("--grad-combine", hook).name == hook
    local = _combiner("--grad-combine", "localsgd", "--local-steps", "4")
    assert isinstance(local, LocalSGDCombiner) and local.period == 4
    blocks = _combiner("--grad-combine", "cser", "--cser-rows", "0.125", "--cser-period", "4")
    assert isinstance(blocks, CSERCombiner) and blocks.period == 4
    assert (blocks.options.rows, blocks.options.reset_rows) == (0.125, 0.5)
    pl = _combiner("--grad-combine", "cser-pl", "--cser-rows", "0.5")
    assert isinstance(pl, CSERPLCombiner) and pl.options.rows == 0.5
    slowmo = _combiner("--grad-combine", "slowmo")
    assert isinstance(slowmo, SlowMoCombiner)
    assert (slowmo.period, slowmo.slow_period, slowmo.slow_momentum, slowmo.slow_lr) == (3, 48, 0.5, 1.0)  # fmt: skip
    ada = _combiner("--grad-combine", "local-adaalter", "--optimizer", "sgd", "--momentum", "0")
    assert isinstance(ada, LocalAdaAlterCombiner)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--local-steps", "4"], "--local-steps only applies with --grad-combine localsgd"),
        (["--grad-combine", "ef", "--cser-period", "4"], "--cser-period only applies"),
        (["--grad-combine", "ef", "--compressor", "sign", "--compress-ratio", "0.1"],
         "applies to topk / randblock .*--compress-ratio"),
        (["--grad-combine", "adasum", "--compressor", "topk"], "--compressor only applies"),
        (["--grad-combine", "local-adaalter"], "--optimizer sgd --momentum 0"),
        (["--grad-combine", "powersgd", "--powersgd-start-iter", "1"], "start_iter >= 2.*--powersgd-start-iter"),
        (["--grad-combine", "cser", "--cser-period", "0"], "period must be >= 1.*--cser-period"),
        (["--grad-combine", "cser-update", "--cser-period", "0"], "period must be >= 1.*--cser-period"),
        (["--grad-combine", "cser", "--cser-rows", "0"], r"rows must be in \(0, 1\].*--cser-rows"),
        (["--grad-combine", "cser-pl", "--cser-layers", "1.5"], "layers must be in.*--cser-layers"),
        (["--grad-combine", "cser", "--compressor", "topk"], "--compressor only applies"),
        (["--grad-combine", "cser-pl", "--cser-reset-rows", "0.5"], "--cser-reset-rows only applies"),
        (["--grad-combine", "slowmo", "--slowmo-momentum", "1.0"], "--slowmo-momentum"),
    ],
)  # fmt: skip
def test_bad_flag_combinations_name_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        _combiner(*argv)


def test_ddp_hook_combiner_counts_powersgd_factors():
    """PyTorch's rule: (rows + cols) * rank floats per matrix worth compressing."""
    c = PowerSGDCombiner(rank=2, start_iter=2)

    class Bucket:
        def __init__(self, grads):
            self._grads = grads

        def gradients(self):
            return self._grads

        def buffer(self):
            return torch.cat([g.reshape(-1) for g in self._grads])

    class State:
        iter, start_powerSGD_iter = 5, 2

    c.state = State()
    grads = [torch.zeros(64, 32), torch.zeros(10), torch.zeros(3, 3), torch.zeros(16, 4, 3, 3)]
    want = 4 * ((64 + 32) * 2 + 10 + 9 + (16 + 36) * 2)
    assert c._bucket_bytes(Bucket(grads)) == want
    State.iter = 1  # before start_iter: a plain all-reduce
    assert c._bucket_bytes(Bucket(grads)) == 4 * (64 * 32 + 10 + 9 + 16 * 36)
