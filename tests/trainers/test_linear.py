"""trainers.linear: data-parallel L-BFGS, its re-fit on arriving batches, CA-SGD.

Oracles: the closed-form ridge solution (XᵀX + nλP)⁻¹Xᵀy; scikit-learn's
LogisticRegression(solver="lbfgs") (C = 1 / (n λ); with sample weights s, C = 1 / (λ Σ s));
the 1-rank run on the concatenated data;
textbook mini-batch SGD written here in numpy; autograd and scikit-learn's metrics for the
margin losses.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from modelzoo.linear import (
    GLM,
    LOSSES,
    LinearRegression,
    LinearSVM,
    build_linear_model,
    load_bundled,
)
from tests._tiers import slow_fixture
from tests.trainers._launch import run_ranks
from tests.trainers._linear_worker import (
    CASGD_L2,
    CASGD_LR,
    S_VALUES,
    casgd_problem,
    lbfgs_iterates,
    lbfgs_problems,
    sa_stages,
    stream_batches,
)
from trainers.linear import (
    CumulativeBatchLBFGS,
    DataParallelLBFGS,
    FeaturePartitionedSGD,
    LBFGSConfig,
    epoch_batches,
)

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
TIGHT = LBFGSConfig(tolerance_grad=1e-12, tolerance_change=1e-15, history_size=20)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _fit(model: GLM, X: torch.Tensor, y: torch.Tensor, l2: float, iters: int = 500) -> None:
    solver = DataParallelLBFGS(
        model.parameters(), lambda: model.loss_sum(X, y), len(y),
        penalty=lambda: model.penalty(l2), config=TIGHT,
    )  # fmt: skip
    solver.run(iters)


def _ridge(X: np.ndarray, y: np.ndarray, l2: float, weights: np.ndarray | None = None):
    """argmin Σ_i c_i (x_i·w + b - y_i)² / (2 Σ c) + (λ/2)|w|²: the normal equations."""
    n, d = X.shape
    c = np.ones(n) if weights is None else weights
    A = np.hstack([X, np.ones((n, 1))])
    P = np.diag([1.0] * d + [0.0])  # the intercept is not penalised
    lhs = A.T @ (c[:, None] * A) + c.sum() * l2 * P
    return np.linalg.solve(lhs, A.T @ (c * y))


# -- the margin losses --------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_loss_derivative_is_the_autograd_gradient(name):
    g = torch.Generator().manual_seed(0)
    shape = (50, 4) if name == "multinomial" else (50,)
    m = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).requires_grad_()
    y = torch.randint(0, 4 if name == "multinomial" else 2, (50,), generator=g)
    if name == "squared":
        y = torch.randn(50, generator=g, dtype=torch.float64)
    loss = LOSSES[name]
    (grad,) = torch.autograd.grad(loss.value(m, y).sum(), m)
    torch.testing.assert_close(loss.derivative(m.detach(), y), grad)


def test_losses_match_sklearn_metrics():
    from sklearn.metrics import hinge_loss, log_loss, mean_squared_error

    g = torch.Generator().manual_seed(1)
    m = torch.randn(40, generator=g, dtype=torch.float64)
    y = torch.randint(0, 2, (40,), generator=g)
    assert float(LOSSES["hinge"].value(m, y).mean()) == pytest.approx(hinge_loss(y * 2 - 1, m))
    p = torch.sigmoid(m).numpy()
    assert float(LOSSES["logistic"].value(m, y).mean()) == pytest.approx(log_loss(y, p))
    t = torch.randn(40, generator=g, dtype=torch.float64)
    mse = mean_squared_error(t.numpy(), m.numpy())
    assert float(LOSSES["squared"].value(m, t).mean()) == pytest.approx(mse / 2)
    M = torch.randn(40, 3, generator=g, dtype=torch.float64)
    k = torch.randint(0, 3, (40,), generator=g)
    ce = log_loss(k, torch.softmax(M, 1).numpy(), labels=[0, 1, 2])
    assert float(LOSSES["multinomial"].value(M, k).mean()) == pytest.approx(ce)


def test_sparse_features_give_the_dense_loss_and_gradient():
    g = torch.Generator().manual_seed(2)
    X = torch.randn(30, 12, generator=g, dtype=torch.float64) * (
        torch.rand(30, 12, generator=g) < 0.3
    )
    y = torch.randint(0, 3, (30,), generator=g)
    model = build_linear_model("multinomial", 12, 3, dtype=torch.float64)
    torch.nn.init.normal_(model.weight)
    grads = []
    for features in (X, X.to_sparse_csr()):
        model.zero_grad()
        loss = model.loss(features, y, l2=0.1)
        loss.backward()
        grads.append((float(loss.detach()), model.weight.grad.clone()))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-12)
    torch.testing.assert_close(grads[0][1], grads[1][1])


def test_bad_model_options_raise_clearly():
    with pytest.raises(ValueError, match="'hinge' or 'squared_hinge'"):
        LinearSVM(3, loss="logistic")
    with pytest.raises(ValueError, match="is not one of"):
        build_linear_model("nope", 3)
    with pytest.raises(ValueError, match="4 columns, the model expects 3"):
        build_linear_model("logistic", 3)(torch.zeros(2, 4))


# -- L-BFGS against the references ----------------------------------------------------------------
@pytest.mark.parametrize("sparse", [False, True])
def test_ridge_reaches_the_closed_form(sparse):
    data = load_bundled("diabetes", dtype=torch.float64)
    X, y, l2 = data.X_train, data.y_train, 0.05
    model = LinearRegression(X.shape[1], dtype=torch.float64)
    _fit(model, X.to_sparse_csr() if sparse else X, y, l2)
    expected = _ridge(X.numpy(), y.numpy(), l2)
    np.testing.assert_allclose(_flat(model).numpy(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,classes", [("breast_cancer", 2), ("wine", 3), ("digits", 10)])
def test_logistic_matches_sklearn_lbfgs(name, classes):
    from sklearn.linear_model import LogisticRegression

    data = load_bundled(name, dtype=torch.float64)
    X, y, l2 = data.X_train, data.y_train, 1e-2
    n = len(y)
    reference = LogisticRegression(C=1.0 / (n * l2), solver="lbfgs", tol=1e-12, max_iter=20_000)
    reference.fit(X.numpy(), y.numpy())
    model = build_linear_model("logistic" if classes == 2 else "multinomial", X.shape[1], classes,
                               dtype=torch.float64)  # fmt: skip
    _fit(model, X, y, l2, iters=2000)
    np.testing.assert_allclose(model.weight.detach().numpy(), reference.coef_, atol=2e-5)
    np.testing.assert_allclose(model.bias.detach().numpy(), reference.intercept_, atol=2e-5)


def test_squared_hinge_matches_sklearn_linear_svc():
    """LIBLINEAR penalises its intercept: a bias-free model on [X, 1] is the same problem."""
    from sklearn.svm import LinearSVC

    data = load_bundled("breast_cancer", dtype=torch.float64)
    X = torch.cat([data.X_train, torch.ones(len(data.y_train), 1, dtype=torch.float64)], 1)
    y, l2 = data.y_train, 1e-2
    reference = LinearSVC(C=1.0 / (len(y) * l2), loss="squared_hinge", dual=False,
                          fit_intercept=False, tol=1e-12, max_iter=100_000)  # fmt: skip
    reference.fit(X.numpy(), y.numpy())
    model = LinearSVM(X.shape[1], loss="squared_hinge", bias=False, dtype=torch.float64)
    _fit(model, X, y, l2, iters=2000)
    np.testing.assert_allclose(model.weight.detach().numpy(), reference.coef_, atol=1e-5)


def test_arriving_batch_stages_reach_the_count_weighted_optimum():
    X, y, l2 = stream_batches()
    decay = 0.5
    stages = sa_stages(0, 1, decay=decay)
    for k in range(len(X)):
        # batch j counts decay^(k-j) per example: the weighted ridge normal equations
        weights = np.concatenate([np.full(len(y[j]), decay ** (k - j)) for j in range(k + 1)])
        Xk = torch.cat(X[: k + 1]).numpy()
        yk = torch.cat(y[: k + 1]).numpy()
        np.testing.assert_allclose(stages[k].numpy(), _ridge(Xk, yk, l2, weights), atol=1e-7)


def _thirds(n: int) -> list[tuple[int, int]]:
    cuts = [0, n // 3, 2 * n // 3, n]
    return list(zip(cuts, cuts[1:], strict=False))


@pytest.mark.parametrize(
    "name,classes,decay",
    [("breast_cancer", 2, 1.0), ("breast_cancer", 2, 0.5),
     pytest.param("digits", 10, 0.5, marks=pytest.mark.slow)],
)  # fmt: skip
def test_arriving_batch_stages_match_sklearn(name, classes, decay):
    """Three batches; after each, the weights against scikit-learn fitted on the rows so far
    with sample weights decay^(k-j) for batch j and C = 1 / (λ Σ weights): our F_k times
    1 / (C Σ weights) is sklearn's objective, so both have one optimum. The stage objective is
    exact (every arrived batch is re-read), so only the two stopping rules separate the
    solutions: run to convergence (max |∇F| ≤ 1e-10; sklearn tol 1e-12) they agree to < 5e-7
    on breast cancer and < 4e-6 on digits; atol 1e-5 and 2e-5 (the one-shot test's) leave
    margin for other BLAS builds and stay far below how much the optimum moves from one stage
    to the next (asserted: more than 100 atol)."""
    from sklearn.linear_model import LogisticRegression

    data = load_bundled(name, dtype=torch.float64)
    X, y, l2 = data.X_train, data.y_train, 1e-2
    batches = [(X[a:b], y[a:b]) for a, b in _thirds(len(y))]
    model = build_linear_model("logistic" if classes == 2 else "multinomial", X.shape[1], classes,
                               dtype=torch.float64)  # fmt: skip
    config = LBFGSConfig(tolerance_grad=1e-10, tolerance_change=1e-15, history_size=20)
    solver = CumulativeBatchLBFGS(model, penalty=lambda: model.penalty(l2), decay=decay,
                                  config=config)  # fmt: skip
    atol = 1e-5 if classes == 2 else 2e-5
    previous = None
    for k, (Xk, yk) in enumerate(batches):
        solver.fit_batch(Xk, yk, 1000)
        assert solver.solver is not None and solver.solver.converged, f"stage {k}"
        weights = np.concatenate([np.full(len(b[1]), decay ** (k - j))
                                  for j, b in enumerate(batches[: k + 1])])  # fmt: skip
        reference = LogisticRegression(C=1.0 / (l2 * weights.sum()), tol=1e-12, max_iter=20_000)
        reference.fit(X[: len(weights)].numpy(), y[: len(weights)].numpy(), sample_weight=weights)
        np.testing.assert_allclose(model.weight.detach().numpy(), reference.coef_, atol=atol,
                                   err_msg=f"stage {k}")  # fmt: skip
        np.testing.assert_allclose(model.bias.detach().numpy(), reference.intercept_, atol=atol,
                                   err_msg=f"stage {k}")  # fmt: skip
        if previous is not None:  # the stages differ by far more than the tolerance
            assert np.abs(reference.coef_ - previous).max() > 100 * atol
        previous = reference.coef_


class _CountingReads(torch.nn.Module):
    """A model whose ``loss_sum`` counts the calls on each batch (by its storage)."""

    def __init__(self, inner: GLM) -> None:
        super().__init__()
        self.inner = inner
        self.reads: dict[int, int] = {}

    def loss_sum(self, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.reads[X.data_ptr()] = self.reads.get(X.data_ptr(), 0) + 1
        return self.inner.loss_sum(X, y)


def test_arriving_batch_lbfgs_rereads_every_arrived_batch_at_every_evaluation():
    """What the docs say it does: full re-evaluation, not an incremental update. During the
    stage of batch k, every evaluation (each one message) reads batches 0..k once each."""
    X, y, l2 = stream_batches()
    model = _CountingReads(build_linear_model("squared", X[0].shape[1], dtype=torch.float64))
    solver = CumulativeBatchLBFGS(model, penalty=lambda: model.inner.penalty(l2), decay=0.5)
    for k in range(len(X)):
        before = dict(model.reads)
        evaluations = solver.solver.evaluations if solver.solver is not None else 0
        solver.fit_batch(X[k], y[k], 5)
        assert solver.solver is not None
        done = solver.solver.evaluations - evaluations
        assert done >= 1
        reads = [model.reads.get(X[j].data_ptr(), 0) - before.get(X[j].data_ptr(), 0)
                 for j in range(k + 1)]  # fmt: skip
        assert reads == [done] * (k + 1), f"stage {k}: reads per batch {reads}, {done} evaluations"


def test_the_old_name_is_a_deprecated_alias():
    from trainers import linear

    with pytest.warns(DeprecationWarning, match="renamed CumulativeBatchLBFGS"):
        old = linear.StatisticallyAdjustedLBFGS
    assert old is CumulativeBatchLBFGS
    with pytest.warns(DeprecationWarning, match="not SA L-BFGS"):
        from trainers.linear.lbfgs import StatisticallyAdjustedLBFGS
    assert StatisticallyAdjustedLBFGS is CumulativeBatchLBFGS


LINE_SEARCHES = {  # (line search, lr, evaluations per line search)
    "wolfe": ("strong_wolfe", 1.0, 25),
    # a step 20x too long and 2 evaluations: the accepted step is often an earlier trial
    "wolfe_truncated": ("strong_wolfe", 20.0, 2),
    "fixed_step": (None, 0.2, 25),
}


@pytest.mark.parametrize("search", sorted(LINE_SEARCHES))
@pytest.mark.parametrize("name", ["logistic", "multinomial"])
def test_lbfgs_iterates_are_torch_lbfgs_to_the_last_bit(name, search):
    """Oracle: ``torch.optim.LBFGS`` itself (its own line search, restores and gradient
    gathering) on the same objective: the weights after every iteration equal ours exactly
    (our solver reuses the reduced buffer and leaves the last line-search trial in place)."""
    loss_name, X, y, classes, l2 = lbfgs_problems()[name]
    n = len(y)
    line_search, lr, evals = LINE_SEARCHES[search]
    config = LBFGSConfig(history_size=5, line_search=line_search, lr=lr, max_evals=evals)

    def run(ours: bool) -> tuple[torch.Tensor, list[float], int]:
        model = build_linear_model(loss_name, X.shape[1], classes, dtype=torch.float64)
        params = list(model.parameters())
        iterates, losses = [], []
        # evaluations at weights that differ from the previous evaluation's (what ours sends
        # a message for: it keeps the last one)
        last: list[torch.Tensor] = []
        distinct = [0]
        if ours:
            solver = DataParallelLBFGS(params, lambda: model.loss_sum(X, y), n,
                                       penalty=lambda: model.penalty(l2), config=config)  # fmt: skip
            solver.evaluate()
            step = solver.step
        else:
            opt = torch.optim.LBFGS(
                params, lr=config.lr, max_iter=1, max_eval=config.max_evals + 1,
                tolerance_grad=config.tolerance_grad, tolerance_change=config.tolerance_change,
                history_size=config.history_size, line_search_fn=line_search,
            )  # fmt: skip

            def closure() -> torch.Tensor:
                now = [p.detach().clone() for p in params]
                if not (last and all(map(torch.equal, now, last))):
                    distinct[0] += 1
                last[:] = now
                local = model.loss_sum(X, y)
                grads = torch.autograd.grad(local, params)
                r = model.penalty(l2)
                extra = torch.autograd.grad(r, params, allow_unused=True)  # the bias: None
                for p, g, e in zip(params, grads, extra, strict=True):
                    p.grad = g / n if e is None else g / n + e
                return local.detach() / n + r.detach()

            def step() -> float:
                opt.step(closure)
                with torch.enable_grad():
                    return float(closure())

        for _ in range(25):
            losses.append(step())
            iterates.append(torch.cat([p.detach().reshape(-1) for p in params]))
        return torch.stack(iterates), losses, solver.evaluations if ours else distinct[0]

    ours, ours_losses, ours_evals = run(True)
    ref, ref_losses, ref_evals = run(False)
    assert ours_losses[-1] < ours_losses[0]  # it optimizes
    assert torch.equal(ours, ref), (ours - ref).abs().max()
    assert ours_losses == ref_losses
    assert ours_evals == ref_evals


def test_lbfgs_evaluation_at_the_same_weights_sends_no_message():
    """The last evaluation is kept: weights unchanged, or written back to the same values (a
    step that rounds to nothing near convergence), cost no message; any other write does."""
    loss_name, X, y, classes, l2 = lbfgs_problems()["logistic"]
    model = build_linear_model(loss_name, X.shape[1], classes, dtype=torch.float64)
    solver = DataParallelLBFGS(model.parameters(), lambda: model.loss_sum(X, y), len(y),
                               penalty=lambda: model.penalty(l2))  # fmt: skip
    solver.step()
    f = solver.evaluate()
    sent = solver.messenger.messages
    grads = [p.grad.clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.detach().clone())  # a write of the same values
    assert solver.evaluate() == f and solver.messenger.messages == sent
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    model.weight.grad.zero_()  # someone wrote to the gradient: the kept one is given back
    assert solver.evaluate() == f and solver.messenger.messages == sent
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    with torch.no_grad():
        model.weight[0, 0] += 1e-3
    assert solver.evaluate() != f and solver.messenger.messages == sent + 1


def test_one_rank_lbfgs_counts_one_message_per_evaluation():
    iterates, messages = lbfgs_iterates(lbfgs_problems()["logistic"], 0, 1)
    # one for the global example count, then one per evaluation; strong Wolfe takes at
    # least one evaluation per iteration
    assert messages >= 1 + len(iterates)


# -- CA-SGD against textbook mini-batch SGD -------------------------------------------------------
def _numpy_sgd(loss: str, X, y, classes: int, batches, lr: float, l2: float) -> np.ndarray:
    """w ← w − η (∇ mean_B ℓ + λ w), one mini-batch at a time (the oracle)."""
    X = X.to_dense().numpy() if X.layout == torch.sparse_csr else X.numpy()
    y = y.numpy()
    w = np.zeros((X.shape[1], classes))
    for rows in batches:
        rows = rows.numpy()
        m = X[rows] @ w
        if loss == "logistic":
            r = 1 / (1 + np.exp(-m[:, 0])) - y[rows]
            r = r[:, None]
        else:  # multinomial
            e = np.exp(m - m.max(1, keepdims=True))
            r = e / e.sum(1, keepdims=True)
            r[np.arange(len(rows)), y[rows]] -= 1
        w = w - lr * (X[rows].T @ r / len(rows) + l2 * w)
    return w


@pytest.mark.parametrize("name", ["logistic_dense", "multinomial_sparse"])
@pytest.mark.parametrize("s", [0, *S_VALUES])
def test_casgd_equals_minibatch_sgd_for_every_s(name, s):
    loss, X, y, classes, batches = casgd_problem()[name]
    sgd = FeaturePartitionedSGD(X, y, LOSSES[loss].derivative, num_outputs=classes, lr=CASGD_LR,
                                l2=CASGD_L2, precision="fp64")  # fmt: skip
    sgd.run(batches, s=s)
    expected = _numpy_sgd(loss, X, y, classes, batches, CASGD_LR, CASGD_L2)
    np.testing.assert_allclose(sgd.w.numpy(), expected, rtol=1e-11, atol=1e-12)
    assert sgd.messenger.messages == len(batches) // max(s, 1)  # 16 batches: steps / s
    # per round: the strictly block-lower Gram blocks s(s-1)/2 b² and the sb x C margins
    b, rounds = 8, len(batches) // max(s, 1)
    numbers = b * b * s * (s - 1) // 2 + b * max(s, 1) * classes
    assert sgd.messenger.bytes == rounds * numbers * 8  # float64
    assert sgd.steps == len(batches)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_loss_within_half_a_percent_of_fp32(precision):
    data = load_bundled("breast_cancer")
    X = torch.cat([data.X_train, torch.ones(len(data.y_train), 1)], dim=1)  # intercept column
    y = data.y_train
    batches = [b for epoch in range(10) for b in epoch_batches(len(y), 32, seed=0, epoch=epoch)]
    losses = {}
    for p, s in (("fp32", 0), (precision, 4)):
        sgd = FeaturePartitionedSGD(X, y, LOSSES["logistic"].derivative, lr=0.1, l2=1e-3,
                                    precision=p)  # fmt: skip
        sgd.run(batches, s=s)
        losses[p] = sgd.objective(LOSSES["logistic"].value)
    assert losses["fp32"] < 0.2  # it learned (chance is log 2 = 0.69)
    assert abs(losses[precision] - losses["fp32"]) <= 0.005 * losses["fp32"]


def test_casgd_bad_options_raise_clearly():
    X, y = torch.zeros(4, 3), torch.zeros(4)
    with pytest.raises(ValueError, match="precision='fp8'"):
        FeaturePartitionedSGD(X, y, LOSSES["squared"].derivative, lr=0.1, precision="fp8")
    with pytest.raises(ValueError, match="4 rows but y has 3"):
        FeaturePartitionedSGD(X, y[:3], LOSSES["squared"].derivative, lr=0.1)


# -- several processes ----------------------------------------------------------------------------
@slow_fixture(scope="module", params=[4])
def ranks(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"linear{world}")
    run_ranks("tests.trainers._linear_worker", [str(out)], world=world, timeout=240)
    return world, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)]


@pytest.mark.dist
def test_p_rank_lbfgs_iterates_equal_the_one_rank_iterates(ranks):
    world, results = ranks
    for name, problem in lbfgs_problems().items():
        single, single_messages = lbfgs_iterates(problem, 0, 1)
        for r in results:
            assert r[f"lbfgs_{name}"].shape == single.shape, name
            torch.testing.assert_close(r[f"lbfgs_{name}"], single, rtol=0, atol=1e-9)
            assert r[f"lbfgs_{name}_messages"] == single_messages
        torch.testing.assert_close(results[0][f"lbfgs_{name}"], results[-1][f"lbfgs_{name}"],
                                   rtol=0, atol=0)  # fmt: skip


@pytest.mark.dist
def test_p_rank_arriving_batch_stages_equal_the_weighted_optimum(ranks):
    _, results = ranks
    X, y, l2 = stream_batches()
    weights = np.concatenate([np.full(len(y[j]), 0.5 ** (2 - j)) for j in range(3)])
    expected = _ridge(torch.cat(X).numpy(), torch.cat(y).numpy(), l2, weights)
    for r in results:
        np.testing.assert_allclose(r["sa_stages"][-1].numpy(), expected, atol=1e-7)


@pytest.mark.dist
@pytest.mark.parametrize("name", ["logistic_dense", "multinomial_sparse"])
def test_feature_partitioned_casgd_equals_single_process_sgd(ranks, name):
    world, results = ranks
    loss, X, y, classes, batches = casgd_problem()[name]
    expected = _numpy_sgd(loss, X, y, classes, batches, CASGD_LR, CASGD_L2)
    for s in (0, *S_VALUES):
        w = torch.cat([r[f"casgd_{name}_s{s}"] for r in results])  # the column blocks in order
        np.testing.assert_allclose(w.numpy(), expected, rtol=1e-10, atol=1e-12, err_msg=f"s={s}")
        for r in results:
            assert r[f"casgd_{name}_s{s}_messages"] == len(batches) // max(s, 1)
