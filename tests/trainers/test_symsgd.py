"""trainers.linear.rowparallel: row-partitioned SGD with the allreduce, average and SymSGD
combiners.

Oracles (none is an output of the code under test):
- sequential mini-batch SGD written out here as a plain loop over dense float64 matrices,
  ``w ← (1 − ηλ) w − (η/b) X_Bᵀ ℓ'(X_B w, y_B)``: over the concatenated chunks (SymSGD's
  sound combiner with the exact maps on least squares), over the global batch of each round
  (``allreduce``), over each worker's chunk from the common model, averaged by hand
  (``average``);
- the law of large numbers for the projected combiner: the mean over 2000 projections lies
  within a few of its own standard errors of the exact result;
- first order in η: as η → 0 the combination is the sum of the workers' updates;
- on logistic regression (breast cancer), the sequential run itself: SymSGD's linearised
  combination lies far closer to it than plain averaging or summing the updates;
- projected SymSGD at 2 ranks against the algorithm written out with dense d x d maps.
"""

from __future__ import annotations

import math

import pytest
import torch

from modelzoo.linear import LOSSES, add_intercept_column, load_bundled
from tests.trainers._launch import run_ranks
from tests.trainers._rowparallel_worker import L2, LR, cases, problem
from trainers.linear import (
    CURVATURES,
    RowParallelSGD,
    epoch_batches,
    rademacher,
    round_partition,
    sound_combine,
)

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
F64 = torch.float64


@pytest.fixture(autouse=True)
def one_thread():
    """These tests run thousands of tiny steps: threads only add overhead on them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _sequential(X, y, batches, lr, l2, loss="squared", w=None, C=1):
    """Plain mini-batch SGD on dense X (float64), the textbook update."""
    X = X.to_dense() if X.layout == torch.sparse_csr else X
    w = torch.zeros(X.shape[1], C, dtype=F64) if w is None else w.clone()
    for rows in batches:
        Xb, yb = X[rows], y[rows]
        m = Xb @ w
        if loss == "squared":
            r = m - yb[:, None]
        elif loss == "logistic":
            r = torch.sigmoid(m) - yb[:, None]
        else:  # multinomial
            r = torch.softmax(m, dim=1) - torch.nn.functional.one_hot(yb, C).to(F64)
        w = (1.0 - lr * l2) * w - (lr / len(rows)) * (Xb.t() @ r)
    return w


def _regression(n=48, d=7, seed=0, sparse=False):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=F64)
    if sparse:
        X = X * (torch.rand(n, d, generator=g) < 0.5)
    y = X @ torch.randn(d, generator=g, dtype=F64) + 0.1 * torch.randn(n, generator=g, dtype=F64)
    return (X.to_sparse_csr() if sparse else X), X, y


def _solver(X, y, loss="squared", lr=0.05, l2=0.0, **options):
    options.setdefault("combine", "symsgd")
    return RowParallelSGD(X, y, LOSSES[loss].derivative, lr=lr, l2=l2, precision="fp64",
                          curvature=CURVATURES.get(loss), loss_value=LOSSES[loss].value,
                          **options)  # fmt: skip


def _combine(solver, w_g, chunks, projections=None):
    """SymSGD's combination of the chunks' local maps from ``w_g`` (exact when no
    projections), the sum of the updates, and their mean."""
    d = w_g.shape[0]
    deltas, curvatures = [], []
    for i, chunk in enumerate(chunks):
        A = torch.eye(d, dtype=F64) if projections is None else projections[i]
        w, N, _, _ = solver.local_sgd(w_g, chunk, A)
        deltas.append(w - w_g)
        curvatures.append(N)
    projection = None if projections is None else projections.__getitem__
    combined = w_g + sound_combine(deltas, curvatures, projection)
    return combined, w_g + sum(deltas), w_g + sum(deltas) / len(deltas)


# -- SymSGD's sound combiner, one process ------------------------------------------------------
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "csr"])
@pytest.mark.parametrize("l2", [0.0, 0.1])
@pytest.mark.parametrize("chunks", [2, 3, 4])
def test_exact_combination_is_sequential_sgd_on_least_squares(chunks, l2, sparse):
    X, Xd, y = _regression(sparse=sparse)
    solver = _solver(X, y, lr=0.05, l2=l2, exact=True)
    batches = epoch_batches(48, 4, seed=1, epoch=0)
    parts = round_partition(batches, chunks, 3)  # worker i: mini-batches [3i, 3i + 3)
    w_g = torch.randn(7, 1, generator=torch.Generator().manual_seed(9), dtype=F64)
    combined, summed, _ = _combine(solver, w_g, parts)
    reference = _sequential(Xd, y, [b for p in parts for b in p], 0.05, l2, w=w_g)
    torch.testing.assert_close(combined, reference, rtol=0, atol=1e-12)
    assert (summed - reference).abs().max() > 1e-2  # the combiner is doing the work


def test_projected_combination_is_unbiased():
    X, Xd, y = _regression()
    solver = _solver(X, y, lr=0.05, l2=0.1)
    parts = round_partition(epoch_batches(48, 4, seed=1, epoch=0), 3, 2)
    w_g = torch.randn(7, 1, generator=torch.Generator().manual_seed(9), dtype=F64)
    exact = _sequential(Xd, y, [b for p in parts for b in p], 0.05, 0.1, w=w_g)[:, 0]
    draws = []
    for t in range(2000):
        A = [rademacher(7, 2, seed=t, round_index=0, rank=i) for i in range(3)]
        draws.append(_combine(solver, w_g, parts, A)[0][:, 0])
    draws = torch.stack(draws)  # (2000, d)
    for count in (200, 2000):
        mean = draws[:count].mean(0)
        standard_error = draws[:count].std(0) / math.sqrt(count)
        assert ((mean - exact).abs() <= 4 * standard_error).all(), count
    spread = (draws - exact).norm(dim=1).mean()  # one draw is far off ...
    error = (draws.mean(0) - exact).norm()  # ... the mean of 2000 is not
    assert error < spread / 10
    # the standard error falls as 1/sqrt(draws): 200 -> 2000 is a factor sqrt(10)
    ratio = (draws.std(0) / math.sqrt(2000)).norm() / (draws[:200].std(0) / math.sqrt(200)).norm()
    assert 0.8 / math.sqrt(10) < ratio < 1.25 / math.sqrt(10)


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "projected"])
def test_small_steps_reduce_to_summing_the_updates(exact):
    X, _, y = _regression()
    parts = round_partition(epoch_batches(48, 4, seed=1, epoch=0), 3, 3)
    w_g = torch.randn(7, 1, generator=torch.Generator().manual_seed(9), dtype=F64)
    A = None if exact else [rademacher(7, 4, seed=0, round_index=0, rank=i) for i in range(3)]
    errors = []
    for lr in (1e-3, 1e-4):
        combined, summed, _ = _combine(_solver(X, y, lr=lr, l2=0.1), w_g, parts, A)
        errors.append(float((combined - summed).norm() / (combined - w_g).norm()))
    assert errors[0] < 0.05
    assert 0.07 < errors[1] / errors[0] < 0.13  # O(η): a tenth of the step, a tenth the error


def test_logistic_symsgd_is_closer_to_sequential_sgd_than_averaging():
    """Breast cancer (30 features and an intercept column), logistic loss, exact maps, 4
    workers x 2 mini-batches of 16 rows a round, 3 rounds from w = 0, η = 0.05, λ = 1e-3.
    Checked: the relative distance to the sequential run over the same 24 mini-batches is
    below a tenth of plain averaging's and a quarter of summing the updates'. (With η = 0.5
    the linearisation breaks down and averaging is closer: the claim is first order.)"""
    bc = load_bundled("breast_cancer", dtype=F64)
    X, y = add_intercept_column(bc.X_train), bc.y_train
    lr, l2 = 0.05, 1e-3
    solver = _solver(X, y, loss="logistic", lr=lr, l2=l2, exact=True)
    batches = epoch_batches(X.shape[0], 16, seed=0, epoch=0)[:24]
    w_sym = w_avg = w_sum = torch.zeros(X.shape[1], 1, dtype=F64)
    for r in range(3):
        parts = round_partition(batches[8 * r : 8 * r + 8], 4, 2)
        w_sym = _combine(solver, w_sym, parts)[0]
        w_sum = _combine(solver, w_sum, parts)[1]
        w_avg = _combine(solver, w_avg, parts)[2]
    reference = _sequential(X, y, batches, lr, l2, loss="logistic")
    distance = {name: float((w - reference).norm() / reference.norm())
                for name, w in (("symsgd", w_sym), ("average", w_avg), ("sum", w_sum))}  # fmt: skip
    assert distance["symsgd"] < distance["average"] / 10, distance
    assert distance["symsgd"] < distance["sum"] / 4, distance


# -- one process: every combiner is sequential SGD ----------------------------------------------
@pytest.mark.parametrize("features", ["dense", "sparse"])
@pytest.mark.parametrize(
    "combine,loss", [("allreduce", "multinomial"), ("average", "logistic"), ("symsgd", "squared")]
)
def test_one_process_is_plain_minibatch_sgd(combine, loss, features):
    data = problem()
    C = 3 if loss == "multinomial" else 1
    solver = _solver(data[features], data[loss], loss=loss, lr=LR, l2=L2, combine=combine,
                     num_outputs=C, round_batches=None if combine == "allreduce" else 3)  # fmt: skip
    solver.run(data["batches"])
    reference = _sequential(data["dense"] if features == "dense" else data["sparse"], data[loss],
                            data["batches"], LR, L2, loss=loss, C=C)  # fmt: skip
    torch.testing.assert_close(solver.w, reference, rtol=0, atol=1e-13)
    assert solver.steps == 20
    rounds = 20 if combine == "allreduce" else 7  # ceil(20 / 3)
    assert solver.messenger.messages == rounds and solver.bytes_sent == 0  # nothing to send


def test_bad_options_raise_clearly():
    X, _, y = _regression()
    with pytest.raises(ValueError, match="multinomial loss has C margins"):
        _solver(X, y.long().abs() % 3, loss="multinomial", num_outputs=3)
    with pytest.raises(ValueError, match="round_batches=0 must be at least 1"):
        _solver(X, y, combine="average", round_batches=0)
    with pytest.raises(ValueError, match="round_batches must be 1"):
        _solver(X, y, combine="allreduce", round_batches=2)
    with pytest.raises(ValueError, match="combine='hogwild'"):
        _solver(X, y, combine="hogwild")
    with pytest.raises(ValueError, match="sparse_algorithm='ring'"):
        _solver(X, y, combine="allreduce", sparse_algorithm="ring")
    with pytest.raises(ValueError, match="above 2048 features use the projection"):
        _solver(torch.zeros(2, 2049, dtype=F64), torch.zeros(2, dtype=F64), exact=True)
    with pytest.raises(ValueError, match="k >= 1"):
        _solver(X, y, symsgd_rank=0)


# -- two gloo processes -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("rowparallel")
    run_ranks("tests.trainers._rowparallel_worker", [str(out)], world=2, timeout=240)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _rounds(batches, size):
    return [batches[i : i + size] for i in range(0, len(batches), size)]


def _symsgd_reference(X, y, batches, R, world, lr, l2, loss, k, seed):
    """Projected SymSGD written out plainly: each worker's map M_i as the product of its
    dense d x d step maps a I - (η/b) X_Bᵀ D X_B (D = ℓ'' at the margins the step used),
    N_i = (M_i - I) A_i with A_i = rademacher(seed, round, i), then the rank-order rule."""
    X = X.to_dense() if X.layout == torch.sparse_csr else X
    d, a = X.shape[1], 1.0 - lr * l2
    w_g = torch.zeros(d, 1, dtype=F64)
    for index, group in enumerate(_rounds(batches, world * R)):
        u = None
        for i, part in enumerate(round_partition(group, world, R)):
            w, M = w_g.clone(), torch.eye(d, dtype=F64)
            for rows in part:
                m = X[rows] @ w
                p = torch.sigmoid(m[:, 0])
                h = torch.ones_like(p) if loss == "squared" else p * (1 - p)
                step = a * torch.eye(d, dtype=F64) - (lr / len(rows)) * X[rows].t() @ (
                    h[:, None] * X[rows]
                )
                M = step @ M
                w = _sequential(X, y, [rows], lr, l2, loss=loss, w=w)
            A = rademacher(d, k, seed=seed, round_index=index, rank=i)
            delta, N = w - w_g, (M - torch.eye(d, dtype=F64)) @ A
            u = delta if u is None else delta + u + N @ (A.t() @ u)
        w_g = w_g + u
    return w_g


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(cases()))
def test_two_ranks_equal_their_one_process_reference(two_ranks, name):
    """allreduce: sequential SGD on each round's global batch; average: the two workers'
    local runs averaged by hand (one worker alone in a short last round); symsgd with the
    exact maps on least squares: sequential SGD over all mini-batches; projected SymSGD on
    the logistic loss: the algorithm written out with dense maps (:func:`_symsgd_reference`).
    Every case: the replicas agree bit for bit."""
    options = cases()[name]
    data = problem()
    r0, r1 = two_ranks[0][name], two_ranks[1][name]
    assert torch.equal(r0["w"], r1["w"])  # every rank computes the same combination
    loss, X, y = options["loss"], data[options["features"]], data[options["loss"]]
    C = 3 if loss == "multinomial" else 1
    batches, R = data["batches"], options.get("round_batches", 1)
    combine = options["combine"]
    if combine == "allreduce":
        rounds = _rounds(batches, 2)
        w = torch.zeros(X.shape[1], C, dtype=F64)
        for group in rounds[:-1]:
            w = _sequential(X, y, [torch.cat(group)], LR, L2, loss=loss, w=w, C=C)
        last = torch.cat(rounds[-1])
        if loss != "multinomial":  # the last round's mean loss, at the margins it used
            m = (X.to_dense() if X.layout == torch.sparse_csr else X)[last] @ w
            assert r0["loss"] == pytest.approx(float(LOSSES[loss].value(m[:, 0], y[last]).mean()))
        reference = _sequential(X, y, [last], LR, L2, loss=loss, w=w, C=C)
        algorithm = options.get("sparse_algorithm", "auto")
        assert r0["algorithm"] == algorithm or algorithm == "auto"
        assert r0["bytes_sent"] > 0
    elif combine == "average":
        w = torch.zeros(X.shape[1], 1, dtype=F64)
        for group in _rounds(batches, 2 * R):
            runs = [_sequential(X, y, part, LR, L2, loss=loss, w=w) for part in
                    round_partition(group, 2, R) if part]  # fmt: skip
            w = sum(runs) / len(runs)
        reference = w
        assert r0["round_bytes"] == X.shape[1] * 8  # ring all-reduce: 2 (N - 1) / N · d · 8
    elif options.get("exact"):
        reference = _sequential(X, y, batches, LR, L2, loss=loss)
        assert r0["round_bytes"] == X.shape[1] * (1 + X.shape[1]) * 8  # (N - 1) d (1 + d) · 8
    else:  # projected, logistic: the algorithm written out with dense d x d maps
        k = options["symsgd_rank"]
        assert r0["round_bytes"] == X.shape[1] * (1 + k) * 8  # (N - 1) d (1 + k) · 8
        reference = _symsgd_reference(X, y, batches, R, 2, LR, L2, loss, k, seed=5)
    torch.testing.assert_close(r0["w"], reference, rtol=0, atol=1e-12)
    assert r0["steps"] == 20 and r0["messages"] == r0["rounds"] == len(_rounds(batches, 2 * R))
