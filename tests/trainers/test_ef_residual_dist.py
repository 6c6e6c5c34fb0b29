"""Error feedback without buckets on 2 and 3 gloo processes: every rank keeps its own residual.

Oracle: per-process error feedback written here from its definition (Seide et al. 2014;
Karimireddy et al. 2019), ``x_i = g_i + e_i``, ``c_i = C(x_i)``, the average of the ``c_i``
to the optimizer, ``e_i' = x_i - c_i`` for rank ``i``'s own ``x_i``, with ``C`` transcribed
in numpy from each compressor's documented definition (trainers/comm/compressors.py). Where
a compressor draws (randblock's offset, importance's choosing worker, QSGD's rounding), the
reference draws from generators seeded by the library's documented rule: ``derive_seed(seed,
step, salt)`` shared by every rank, ``derive_seed(seed, step, salt, 1 + rank)`` for rank's
own, salt 0 without buckets. The ranks' gradients differ (``_ef_residual_worker.gradient``),
so a combiner that fed back the all-rank mean residual fails here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.trainers._ef_residual_worker import (
    LR,
    MOMENTUM_FIRST,
    MU,
    QSGD_BUCKET,
    RATIO,
    SEED,
    STEPS,
    WD,
    lr_at,
)
from tests.trainers._launch import run_ranks
from trainers.comm import COMPRESSORS
from trainers.data import derive_seed

pytestmark = pytest.mark.dist
IMPORTANCE_EPS = 1e-6  # the compressor's default (importance: |x| / (|w| + eps))


@pytest.fixture(
    scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)], ids=["2ranks", "3ranks"]
)
def ranks(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"ef{world}")
    run_ranks("tests.trainers._ef_residual_worker", [str(out)], world=world, timeout=240)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)]


# ---- the compressors, from their definitions --------------------------------------------------
def _k(n: int) -> int:
    return min(n, max(1, round(n * RATIO)))


def _keep(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x)
    out[idx] = x[idx]
    return out


def _shared(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(SEED, step, 0))


def _local(step: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(SEED, step, 0, 1 + rank))


def ref_none(xs, step, w):
    return [x.copy() for x in xs]


def ref_fp16(xs, step, w):
    return [x.astype(np.float16).astype(np.float32) for x in xs]


def ref_bf16(xs, step, w):  # numpy has no bfloat16: round through torch's dtype
    return [torch.from_numpy(x).to(torch.bfloat16).float().numpy() for x in xs]


def ref_topk(xs, step, w):
    """Each rank keeps its own k largest magnitudes."""
    return [_keep(x, np.argsort(-np.abs(x), kind="stable")[: _k(x.size)]) for x in xs]


def ref_randblock(xs, step, w):
    """k contiguous entries from an offset all ranks draw alike, wrapping around."""
    n = xs[0].size
    offset = int(torch.randint(n, (), generator=_shared(step)))
    idx = (np.arange(_k(n)) + offset) % n
    return [_keep(x, idx) for x in xs]


def ref_importance(xs, step, w):
    """The drawn rank's k largest |x| / (|w| + eps); every rank sends its x there."""
    chooser = int(torch.randint(len(xs), (), generator=_shared(step)))
    score = np.abs(xs[chooser]) / (np.abs(w) + np.float32(IMPORTANCE_EPS))
    idx = np.argsort(-score, kind="stable")[: _k(w.size)]
    return [_keep(x, idx) for x in xs]


def ref_sign(xs, step, w):
    """mean|x| * sign(x), zeros as +."""
    return [np.where(x >= 0, 1.0, -1.0).astype(np.float32) * np.abs(x).mean() for x in xs]


def ref_qsgd(xs, step, w):
    """Levels l = s |x| / m against the max over ranks of each bucket's L2 norm, rounded up
    with probability l - floor(l); decoded as m / s * level."""
    n, world, d = xs[0].size, len(xs), QSGD_BUCKET
    s = np.float32(127 // world)
    buckets = [np.concatenate([x, np.zeros((-n) % d, np.float32)]).reshape(-1, d) for x in xs]
    norm = np.max([np.sqrt((b.astype(np.float64) ** 2).sum(1)) for b in buckets], axis=0)
    norm = norm.astype(np.float32)
    safe = np.where(norm > 0, norm, np.float32(1))
    out = []
    for rank, b in enumerate(buckets):
        level = np.minimum(np.abs(b) * (s / safe)[:, None], s)
        low = np.floor(level)
        u = torch.rand(b.shape, generator=_local(step, rank)).numpy()
        q = (low + (u < level - low)) * np.sign(b)
        out.append((q * (norm / s)[:, None]).reshape(-1)[:n].astype(np.float32))
    return out


REFERENCES = {
    "none": ref_none,
    "fp16": ref_fp16,
    "bf16": ref_bf16,
    "topk": ref_topk,
    "randblock": ref_randblock,
    "importance": ref_importance,
    "sign": ref_sign,
    "qsgd": ref_qsgd,
}
# The sum travels in the wire type: its rounding, relative to sum |c_i|.
MEAN_TOL = {"fp16": 2.0**-10, "bf16": 2.0**-7}


def test_every_registered_compressor_has_a_reference():
    assert set(REFERENCES) == set(COMPRESSORS)


def reference_run(name: str, ranks: list[dict]) -> tuple[list, list]:
    """Per-process error feedback: (mean per step, each rank's residuals per step)."""
    world = len(ranks)
    residual = [np.zeros_like(ranks[0][name]["grads"][0].numpy()) for _ in range(world)]
    means, residuals = [], []
    for step in range(STEPS):
        xs = [ranks[r][name]["grads"][step].numpy() + residual[r] for r in range(world)]
        weights = ranks[0][name]["weights"][step].numpy()
        cs = REFERENCES[name](xs, step, weights)
        means.append((sum(c.astype(np.float64) for c in cs) / world, cs))
        residual = [x - c for x, c in zip(xs, cs, strict=True)]  # each rank its own
        residuals.append(residual)
    return means, residuals


@pytest.mark.parametrize("name", list(REFERENCES))
def test_each_rank_feeds_back_its_own_residual(ranks, name):
    world = len(ranks)
    assert all(r["world_size"] == world for r in ranks)
    means, residuals = reference_run(name, ranks)
    for step in range(STEPS):
        for rank, got in enumerate(ranks):
            np.testing.assert_allclose(
                got[name]["residuals"][step].numpy(),
                residuals[step][rank],
                rtol=1e-5,
                atol=1e-5,
                err_msg=f"{name}: rank {rank}'s residual after step {step}",
            )
            mean, cs = means[step]
            got_mean = got[name]["means"][step].numpy()
            error = np.abs(got_mean - mean)
            bound = MEAN_TOL.get(name, 1e-5) * sum(np.abs(c) for c in cs) + 1e-6
            assert (error <= bound).all(), (name, rank, step, float(error.max()))
            if step + 1 < STEPS:  # the optimizer stepped on the average
                w0, w1 = got[name]["weights"][step : step + 2]
                np.testing.assert_allclose(
                    w1.numpy(), w0.numpy() - LR * got_mean, rtol=0, atol=1e-6, err_msg=name
                )
    if name != "none":  # the residuals differ between ranks: a shared one would fail above
        own = [residuals[0][r] for r in range(world)]
        assert max(np.abs(own[0] - o).max() for o in own[1:]) > 1e-4, name


# ---- momentum before compression (--ef-momentum; the DEF authors' error-feedback baseline) ----
def _per_tensor(name: str, xs: list[np.ndarray], step: int, salt: int) -> list[np.ndarray]:
    """Compressor ``name`` on one tensor, drawing from the generators salted with ``salt``."""
    n = xs[0].size
    k = min(n, max(1, round(n * RATIO)))
    if name == "randblock":
        shared = torch.Generator().manual_seed(derive_seed(SEED, step, salt))
        offset = int(torch.randint(n, (), generator=shared))
        idx = (np.arange(k) + offset) % n
        return [_keep(x, idx) for x in xs]
    assert name == "topk"
    return [_keep(x, np.argsort(-np.abs(x), kind="stable")[:k]) for x in xs]


@pytest.mark.parametrize("name", MOMENTUM_FIRST)
def test_momentum_before_compression_as_the_authors(ranks, name):
    """The authors' EF (anxuthu/DEF optimizers/ef.py), per rank: m = mu m + g + wd w;
    p = m + (lr_prev / lr) e; each tensor compressed on its own (salt: its index);
    w -= lr mean_j C(p_j); e = p - C(p). Fails if momentum comes after the average, if the
    residual is not rescaled when the lr changes, or if the weight decay is applied twice."""
    world = len(ranks)
    runs = [r["momentum_first"][name] for r in ranks]
    sizes = [int(s) for s in runs[0]["sizes"]]
    bounds = np.cumsum([0, *sizes])
    m = [np.zeros(bounds[-1], np.float64) for _ in range(world)]
    e = [np.zeros(bounds[-1], np.float64) for _ in range(world)]
    w = runs[0]["weights"][0].numpy().astype(np.float64)
    for step in range(STEPS):
        lr, prev = lr_at(step), lr_at(max(step - 1, 0))
        for r in range(world):  # the replicas stay equal
            np.testing.assert_allclose(runs[r]["weights"][step].numpy(), w, rtol=0, atol=1e-5)
        ps = []
        for r in range(world):
            m[r] = MU * m[r] + runs[r]["grads"][step].numpy() + WD * w
            ps.append(m[r] + (prev / lr) * e[r])
        mean = np.zeros_like(w)
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            cs = _per_tensor(name, [p[a:b].astype(np.float32) for p in ps], step, salt=i)
            mean[a:b] = sum(c.astype(np.float64) for c in cs) / world
            for r in range(world):
                e[r][a:b] = ps[r][a:b] - cs[r]
        w = w - lr * mean
        for r in range(world):
            np.testing.assert_allclose(runs[r]["residuals"][step].numpy(), e[r], rtol=1e-4,
                                       atol=1e-4, err_msg=f"{name}: rank {r}, step {step}")  # fmt: skip
    np.testing.assert_allclose(runs[0]["weights"][-1].numpy(), w, rtol=0, atol=1e-5)


def test_momentum_before_compression_needs_sgd_without_momentum():
    from tests.trainers._trainer_toys import make_mlp
    from trainers import DistEnv
    from trainers.comm import create_combiner

    model = make_mlp(seed=0)
    combiner = create_combiner("ef", compressor="randblock", momentum=0.9)
    with pytest.raises(ValueError, match="--momentum 0"):
        combiner.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         DistEnv())  # fmt: skip
    with pytest.raises(ValueError, match="--ef-bucket-mb"):
        create_combiner("ef", compressor="randblock", momentum=0.9, bucket_mb=1.0)
