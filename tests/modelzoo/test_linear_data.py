"""modelzoo.linear data: the svmlight reader, the bundled sets, the synthetic generator.

Oracles: ``sklearn.datasets.load_svmlight_file`` on the same text; scikit-learn's own loaders
and ``train_test_split``; numpy formulas for the standardisation and the generating model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from modelzoo.linear import (
    SvmlightFormatError,
    add_intercept_column,
    column_slice,
    iter_svmlight,
    load_bundled,
    load_svmlight,
    row_slice,
    synthetic_sparse,
)

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")

TEXT = """# a header comment
1 qid:3 1:0.5 4:-2 10:1e-3
-1 qid:3 2:1.5   # trailing comment 7:9
+1 qid:4 3:2 4:0.25 5:1
0.5 qid:5

-1 qid:5 1:1 10:-7.5
"""


def _write(tmp_path, text: str, name: str = "data.svm"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _dense(X: torch.Tensor) -> np.ndarray:
    return X.to_dense().numpy()


@pytest.mark.parametrize("zero_based", [False, True, "auto"])
def test_reader_matches_sklearn(tmp_path, zero_based):
    from sklearn.datasets import load_svmlight_file

    path = _write(tmp_path, TEXT)
    ours = load_svmlight(path, zero_based=zero_based, dtype=torch.float64)
    X, y, qid = load_svmlight_file(str(path), zero_based=zero_based, query_id=True)
    width = max(X.shape[1], ours.X.shape[1])
    ref = np.zeros((X.shape[0], width))
    ref[:, : X.shape[1]] = X.toarray()
    got = np.zeros_like(ref)
    got[:, : ours.X.shape[1]] = _dense(ours.X)
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(ours.y.numpy(), y)
    np.testing.assert_array_equal(ours.qid.numpy(), qid)


def test_zero_based_auto_detects_index_zero(tmp_path):
    from sklearn.datasets import load_svmlight_file

    path = _write(tmp_path, "1 0:1 2:3\n0 1:2\n")
    ours = load_svmlight(path)  # "auto": a 0 index means 0-based
    X, y = load_svmlight_file(str(path))
    np.testing.assert_array_equal(_dense(ours.X), X.toarray())
    assert ours.qid is None


def test_streamed_batches_concatenate_to_the_whole_file(tmp_path):
    path = _write(tmp_path, TEXT)
    whole = load_svmlight(path, n_features=12, zero_based=False)
    batches = list(iter_svmlight(path, n_features=12, batch_size=2))
    assert [b.X.shape[0] for b in batches] == [2, 2, 1]
    assert [b.first_line for b in batches] == [2, 4, 7]  # comment and blank lines skipped
    stacked = np.vstack([_dense(b.X) for b in batches])
    np.testing.assert_array_equal(stacked, _dense(whole.X))
    np.testing.assert_array_equal(torch.cat([b.y for b in batches]).numpy(), whole.y.numpy())
    np.testing.assert_array_equal(torch.cat([b.qid for b in batches]).numpy(), whole.qid.numpy())


@pytest.mark.parametrize(
    "line,message",
    [
        ("abc 1:2", "the label 'abc' is not a number"),
        ("1 3:1 2:1", "strictly increasing"),
        ("1 2:1 2:3", "strictly increasing"),
        ("1 4", "is not an index:value pair"),
        ("1 x:1", "feature index 'x' is not an integer"),
        ("1 3:y", "the value 'y' of feature 3 is not a number"),
        ("1 qid:q 3:1", "bad query id"),
        ("1 0:1", "zero_based=True"),
    ],
)
def test_malformed_line_raises_with_file_and_line_number(tmp_path, line, message):
    path = _write(tmp_path, f"1 1:1\n# comment\n{line}\n0 2:1\n")
    with pytest.raises(SvmlightFormatError, match=message) as err:
        list(iter_svmlight(path, n_features=10))
    assert f"{path}:3:" in str(err.value)


def test_index_beyond_n_features_and_missing_file_raise_clearly(tmp_path):
    path = _write(tmp_path, "1 1:1\n0 12:1\n")
    with pytest.raises(SvmlightFormatError, match=rf"{path}:2: feature index 12 is beyond"):
        list(iter_svmlight(path, n_features=5))
    zero = _write(tmp_path, "1 0:1\n", "zero.svm")
    with pytest.raises(SvmlightFormatError, match=rf"{zero}:1: .*zero_based=True"):
        load_svmlight(zero, zero_based=False)
    with pytest.raises(SvmlightFormatError, match="n_features=5"):
        load_svmlight(path, n_features=5)
    with pytest.raises(FileNotFoundError, match="no such svmlight file"):
        load_svmlight(tmp_path / "missing.svm")
    with pytest.raises(SvmlightFormatError, match="qid"):
        load_svmlight(_write(tmp_path, "1 qid:1 1:1\n0 2:1\n", "mixed.svm"))


@pytest.mark.parametrize("name", ["breast_cancer", "digits", "wine", "diabetes"])
def test_bundled_sets_are_standardised_seeded_splits(name):
    import sklearn.datasets
    from sklearn.model_selection import train_test_split

    data = load_bundled(name, seed=3, dtype=torch.float64)
    loader = {"breast_cancer": "load_breast_cancer", "digits": "load_digits",
              "wine": "load_wine", "diabetes": "load_diabetes"}[name]  # fmt: skip
    X, y = getattr(sklearn.datasets, loader)(return_X_y=True)
    strat = None if name == "diabetes" else y
    X_tr, X_te, y_tr, y_te = train_test_split(X, y, test_size=0.25, random_state=3, stratify=strat)
    mean, std = X_tr.mean(0), X_tr.std(0)
    std[std == 0] = 1.0
    np.testing.assert_allclose(data.X_train.numpy(), (X_tr - mean) / std, atol=1e-12)
    np.testing.assert_allclose(data.X_test.numpy(), (X_te - mean) / std, atol=1e-12)
    np.testing.assert_array_equal(data.y_train.numpy(), y_tr)
    np.testing.assert_array_equal(data.y_test.numpy(), y_te)
    assert data.num_classes == {"breast_cancer": 2, "digits": 10, "wine": 3, "diabetes": 0}[name]
    with pytest.raises(ValueError, match="unknown bundled data set 'iris'"):
        load_bundled("iris")


@pytest.mark.parametrize("columns", ["zipf", "uniform"])
def test_synthetic_generator_shapes_determinism_and_labels(columns):
    n, d, k = 4000, 2_000_000, 12
    a = synthetic_sparse(n, d, k, seed=7, columns=columns)
    b = synthetic_sparse(n, d, k, seed=7, columns=columns)
    c = synthetic_sparse(n, d, k, seed=8, columns=columns)
    assert a.X.shape == (n, d) and a.w.shape == (d,) and a.y.shape == (n,)
    crow, cols = a.X.crow_indices(), a.X.col_indices()
    assert torch.equal(crow.diff(), torch.full((n,), k))  # exactly k non-zeros per row
    per_row = cols.view(n, k)
    assert bool((per_row.diff(dim=1) > 0).all()) and int(cols.max()) < d  # distinct, sorted
    assert torch.equal(a.X.values(), b.X.values()) and torch.equal(a.y, b.y)
    assert not torch.equal(a.X.col_indices(), c.X.col_indices())
    # the labels follow the generating logistic model: mean label = mean sigmoid(margin)
    X = a.X.to(torch.float64)
    margins = torch.zeros(n, dtype=torch.float64).index_add_(
        0, torch.repeat_interleave(torch.arange(n), k), X.values() * a.w.double()[cols]
    )
    p = torch.sigmoid(margins)
    assert abs(float(a.y.mean() - p.mean())) < 4 * float(p.var().sqrt()) / n**0.5 + 0.02
    assert float(((margins > 0).double() == a.y.double()).double().mean()) > 0.7
    lin = synthetic_sparse(n, 1000, 5, task="linear", noise=0.0, seed=1)
    dense = lin.X.to_dense().double()
    np.testing.assert_allclose(
        (dense @ lin.w.double()).numpy(), lin.y.numpy(), rtol=1e-4, atol=1e-4
    )


def test_slices_and_intercept_column_match_dense():
    g = torch.Generator().manual_seed(0)
    D = torch.randn(9, 7, generator=g) * (torch.rand(9, 7, generator=g) < 0.4)
    S = D.to_sparse_csr()
    assert torch.equal(row_slice(S, 2, 6).to_dense(), D[2:6])
    assert torch.equal(column_slice(S, 3, 7).to_dense(), D[:, 3:7])
    assert torch.equal(add_intercept_column(S).to_dense(), torch.cat([D, torch.ones(9, 1)], 1))
