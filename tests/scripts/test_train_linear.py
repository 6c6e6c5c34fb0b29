"""scripts/train_linear.py end to end: the default run, the solvers, two processes, errors.

Oracles: scikit-learn's LogisticRegression(lbfgs) on the same split and λ (C = 1 / (n λ));
the one-process run of the same flags (for the two-process, feature-partitioned run).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ._scripts import captured_parser

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "train_linear.py"

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_linear_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def _run(script, tmp_path: Path, name: str, *args: str) -> list[dict]:
    log = tmp_path / f"{name}.jsonl"
    assert script.main([*args, "--run-log", str(log)]) == 0
    return _records(log)


def test_default_run_matches_sklearn_logistic_regression(script, tmp_path, capsys):
    from sklearn.linear_model import LogisticRegression

    from modelzoo.linear import load_bundled

    records = _run(script, tmp_path, "default")
    header, end = records[0], records[-1]
    assert header["kind"] == "header" and "fingerprint" in header
    assert header["config"]["solver"] == "lbfgs" and header["config"]["dataset"] == "breast_cancer"
    kinds = [r["kind"] for r in records]
    assert {"step", "epoch", "eval"} <= set(kinds) and kinds[-1] == "end"
    assert all("step" in r for r in records if r["kind"] == "epoch")  # reproduce.py's contract
    assert "held-out accuracy" in capsys.readouterr().out
    data = load_bundled("breast_cancer")
    n, wd = len(data.y_train), header["config"]["wd"]
    reference = LogisticRegression(C=1.0 / (n * wd), solver="lbfgs", max_iter=10_000, tol=1e-10)
    reference.fit(data.X_train.double().numpy(), data.y_train.numpy())
    sk_accuracy = reference.score(data.X_test.double().numpy(), data.y_test.numpy())
    assert end["test_accuracy"] == pytest.approx(sk_accuracy, abs=1.0 / len(data.y_test) + 1e-9)
    assert end["test_accuracy"] > 0.93


def test_max_steps_cuts_the_run(script, tmp_path):
    records = _run(script, tmp_path, "short", "--max-steps", "3")
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps == [1, 2, 3] and records[-1]["steps"] == 3


@pytest.mark.parametrize(
    "args,metric,minimum",
    [
        (["--dataset", "digits"], "test_accuracy", 0.95),
        (["--dataset", "wine", "--solver", "casgd", "--s", "4", "--precision", "bf16"],
         "test_accuracy", 0.95),
        (["--dataset", "breast_cancer", "--solver", "sgd", "--num-epochs", "5"],
         "test_accuracy", 0.93),
        (["--dataset", "breast_cancer", "--sa-batches", "3", "--iterations", "15"],
         "test_accuracy", 0.93),
    ],
)  # fmt: skip
def test_solvers_learn(script, tmp_path, args, metric, minimum):
    end = _run(script, tmp_path, "run", *args)[-1]
    assert end[metric] >= minimum
    if "--s" in args:  # 134 rows / 32 = 5 mini-batches an epoch, rounds of 4: 2 messages each
        assert end["messages"] == 20 * 2 and end["steps"] == 20 * 5


def test_casgd_on_an_svmlight_file(script, tmp_path):
    from modelzoo.linear import load_bundled

    data = load_bundled("breast_cancer")
    lines = []
    for x, y in zip(data.X_train.tolist(), data.y_train.tolist(), strict=True):
        feats = " ".join(f"{j + 1}:{v:.6g}" for j, v in enumerate(x) if v != 0)
        lines.append(f"{'+1' if y else '-1'} {feats}")
    path = tmp_path / "bc.svm"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    end = _run(script, tmp_path, "svm", "--dataset", "svmlight", "--data-file", str(path),
               "--solver", "casgd", "--s", "2", "--num-epochs", "5")[-1]  # fmt: skip
    assert end["test_accuracy"] > 0.9


@pytest.mark.parametrize(
    "args,message",
    [
        (["--dataset", "svmlight"], "--dataset svmlight needs --data-file PATH"),
        (["--solver", "adam"], "--solver 'adam': choose one of lbfgs, sgd, casgd"),
        (["--s", "0", "--solver", "casgd"], "--s-steps must be at least 1"),
        (["--dataset", "iris"], "--dataset 'iris'"),
        (["--precision", "fp8"], "invalid choice: 'fp8'"),
        (["--solver", "casgd", "--sa-batches", "2"], "--sa-batches is an L-BFGS option"),
    ],
)
def test_bad_flags_error_clearly(script, capsys, args, message):
    with pytest.raises(SystemExit) as err:
        script.main(args)
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_data_errors_name_the_file_and_line(script, tmp_path):
    path = tmp_path / "bad.svm"
    path.write_text("1 1:0.5\n0 2:x\n", encoding="utf-8")
    with pytest.raises(SystemExit, match=rf"{path}:2: the value 'x' of feature 2"):
        script.main(["--dataset", "svmlight", "--data-file", str(path)])
    with pytest.raises(SystemExit, match="no such svmlight file"):
        script.main(["--dataset", "svmlight", "--data-file", str(tmp_path / "none.svm")])
    with pytest.raises(SystemExit, match="--loss multinomial does not fit the binary labels"):
        script.main(["--loss", "multinomial"])


@pytest.mark.slow
@pytest.mark.dist
def test_two_process_feature_partitioned_run_equals_one_process(script, tmp_path):
    flags = ["--dataset", "wine", "--solver", "casgd", "--s-steps", "4", "--num-epochs", "5"]
    single = _run(script, tmp_path, "single", *flags)
    log = tmp_path / "two.jsonl"
    from tests.trainers._launch import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT),
               *flags, "--run-log", str(log)]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    two = _records(log)
    assert two[0]["world_size"] == 2
    for key in ("train_objective", "test_loss", "test_accuracy", "steps", "messages"):
        assert two[-1][key] == pytest.approx(single[-1][key], rel=1e-5), key
    evals = [r["test_loss"] for r in two if r["kind"] == "eval"]
    assert evals == pytest.approx([r["test_loss"] for r in single if r["kind"] == "eval"], rel=1e-5)


def test_flags_are_dashed_and_never_abbreviated(script):
    parser = captured_parser(script)
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    assert "--run-log" in flags and "--max-steps" in flags and "--seed" in flags
    assert [f for f in flags if "_" in f] == [] and parser.allow_abbrev is False


def test_row_parallel_sgd_in_one_process_is_the_plain_sgd_run(script, tmp_path):
    """Every --grad-combine in a world of one is sequential mini-batch SGD: the run of plain
    (feature-partitioned) --solver sgd on the same flags, to the bit; the row-parallel flags
    are in the header only when used, and the step records carry the combiner and bytes."""
    flags = ["--solver", "sgd", "--num-epochs", "2"]
    plain = _run(script, tmp_path, "plain", *flags)
    assert "grad_combine" not in plain[0]["config"] and "round_batches" not in plain[0]["config"]
    for combine, rounds in (("allreduce", 28), ("average", 4), ("symsgd", 10)):
        extra = ["--round-batches", "3"] if combine == "symsgd" else []
        records = _run(script, tmp_path, combine, *flags, "--grad-combine", combine, *extra)
        end, config = records[-1], records[0]["config"]
        assert config["grad_combine"] == combine
        for key in ("train_objective", "test_loss", "test_accuracy", "steps"):
            assert end[key] == plain[-1][key], (combine, key)
        assert end["messages"] == rounds and end["combiner"] == combine  # 14 mini-batches an epoch
        steps = [r for r in records if r["kind"] == "step"]
        assert len(steps) == rounds and steps[-1]["step"] == 28
        assert all(r["combiner"] == combine and r["round_bytes"] == 0 for r in steps)
        if combine == "allreduce":
            assert {r["sparse_algorithm"] for r in steps} == {"local"}


@pytest.mark.parametrize(
    "args,message",
    [
        (["--solver", "lbfgs", "--grad-combine", "symsgd"], "use --solver sgd"),
        (["--solver", "casgd", "--grad-combine", "allreduce"], "use --solver sgd"),
        (["--solver", "sgd", "--grad-combine", "average", "--round-batches", "0"],
         "--round-batches must be at least 1, got 0"),
        (["--solver", "sgd", "--grad-combine", "allreduce", "--round-batches", "4"],
         "--round-batches must be 1"),
        (["--solver", "sgd", "--grad-combine", "symsgd", "--loss", "multinomial"],
         "--grad-combine symsgd needs a loss with one margin per example"),
        (["--dataset", "wine", "--solver", "sgd", "--grad-combine", "symsgd"],
         "--grad-combine symsgd needs a loss with one margin per example"),
        (["--solver", "sgd", "--round-batches", "2"], "--round-batches is a --grad-combine option"),
        (["--solver", "sgd", "--grad-combine", "average", "--symsgd-rank", "4"],
         "are --grad-combine symsgd options"),
    ],
)  # fmt: skip
def test_row_parallel_bad_flags_error_clearly(script, capsys, args, message):
    with pytest.raises(SystemExit) as err:
        script.main(args)
    if err.value.code == 2:  # the parser's errors
        assert message in capsys.readouterr().err
    else:  # the multinomial default of a multiclass data set is known once the data is read
        assert message in str(err.value.code)


def test_the_library_recipes_are_the_script_run(script, tmp_path):
    """``modelzoo.linear.data`` and ``trainers.linear.recipes`` without the script: the same
    split and, for CA-SGD and L-BFGS, the same records as ``main`` on the same flags."""
    import torch

    from modelzoo.linear import (
        LOSSES,
        add_intercept_column,
        build_linear_model,
        column_slice,
        row_slice,
    )
    from modelzoo.linear.data import TooFewExamples, load_linear_data
    from trainers import DistEnv, RunLogger
    from trainers.linear.recipes import MatrixOps, SolverConfig, train_lbfgs, train_sgd

    data = load_linear_data("wine", seed=0)
    assert (data.task, data.num_classes, data.X_train.shape) == ("multiclass", 3, (133, 13))
    ops = MatrixOps(row_slice, column_slice, add_intercept_column)
    config = SolverConfig(solver="casgd", lr=0.1, s_steps=4, num_epochs=2)
    with RunLogger(tmp_path / "lib.jsonl") as logger:
        end = train_sgd(config, DistEnv(), logger, data, LOSSES["multinomial"], ops)
    flags = ["--dataset", "wine", "--solver", "casgd", "--s-steps", "4", "--num-epochs", "2"]
    ran = _run(script, tmp_path, "script", *flags)
    lib = _records(tmp_path / "lib.jsonl")
    assert [r["loss"] for r in lib if r["kind"] == "step"] == [
        r["loss"] for r in ran if r["kind"] == "step"
    ]
    for key in ("train_objective", "test_loss", "test_accuracy", "steps", "messages"):
        assert end[key] == ran[-1][key], key

    data = load_linear_data("breast_cancer", seed=0, dtype=torch.float64)
    model = build_linear_model("logistic", data.X_train.shape[1], 2, dtype=torch.float64)
    with RunLogger(None) as logger:
        end = train_lbfgs(SolverConfig(iterations=10), DistEnv(), logger, data,
                          LOSSES["logistic"], model, ops)  # fmt: skip
    ran = _run(script, tmp_path, "lbfgs", "--iterations", "10", "--precision", "fp64")
    assert end["test_loss"] == ran[-1]["test_loss"] and end["steps"] == ran[-1]["steps"]

    path = tmp_path / "two.svm"
    path.write_text("1 1:0.5\n-1 2:1\n", encoding="utf-8")
    svm = load_linear_data("svmlight", data_file=path, test_fraction=0.5)
    assert (svm.task, svm.y_train.tolist(), svm.y_test.tolist()) == ("binary", [1.0], [0.0])
    with pytest.raises(TooFewExamples, match="2 examples: too few"):
        load_linear_data("svmlight", data_file=path, test_fraction=0.9)
