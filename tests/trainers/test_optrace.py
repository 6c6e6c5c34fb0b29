"""trainers.optrace: per-operator digests find the first kernel where two runs differ.

The oracle is a difference we inject ourselves: two recordings of the same code where one
operator is given another algorithm (GELU's tanh approximation instead of erf: the same ATen
operator and shapes, other values). The first difference must be that operator, of kind
"values", with its source line; everything before it identical.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainers.optrace import OpRecorder, first_difference, load_trace, save_trace

ROOT = Path(__file__).resolve().parents[2]


def _compute(approximate: str) -> torch.Tensor:
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    h = torch.nn.functional.gelu(layer(x), approximate=approximate)  # the injected kernel
    return (h * 2).sum()


def _record(approximate: str) -> OpRecorder:
    with OpRecorder() as rec:
        _compute(approximate)
    return rec


def test_the_same_code_records_the_same_trace_uninitialized_memory_aside():
    a, b = _record("none"), _record("none")
    assert len(a.records) == len(b.records) > 5
    assert first_difference(a.records, b.records) is None
    # torch.nn.Linear's parameters start as torch.empty: recorded by shape, not by bytes
    empties = [r for r in a.records if r.op.startswith("aten.empty")]
    assert empties and all(r.digest == "" for r in empties)


def test_the_first_difference_is_the_operator_that_computes_differently():
    a, b = _record("none"), _record("tanh")
    found = first_difference(a.records, b.records)
    assert found is not None and found["kind"] == "values"
    index = found["index"]
    assert a.records[index].op == "aten.gelu.default" == b.records[index].op
    assert a.records[index].where.startswith("tests/trainers/test_optrace.py:")
    assert [r.digest for r in a.records[:index]] == [r.digest for r in b.records[:index]]
    assert found["differing_after"] >= 2  # the product and the sum that read it


def test_another_path_and_a_shorter_trace_are_told_apart():
    a = _record("none").records
    other = list(a)
    other[3] = type(a[3])("aten.other.default", a[3].shapes, a[3].digest, a[3].where)
    assert first_difference(a, other)["kind"] == "path"
    assert first_difference(a, a[:-2])["kind"] == "length"


def test_bookkeeping_a_data_loader_does_ahead_of_time_is_not_a_difference():
    """A DataLoader's worker can hand over one batch more before a step on one machine (each
    rebuilt by empty + set_ under a profiler range): no computation, so no difference; a
    value that differs after it is still found, at its own position in each trace."""
    a = _record("none").records
    R = type(a[0])
    handover = [R("profiler._record_function_enter_new.default", "", "", "x.py:1"),
                R("aten.empty.memory_format", "float32[0]", "", "x.py:1"),
                R("aten.set_.source_Storage_storage_offset", "float32[64, 3]", "", "x.py:1"),
                R("profiler._record_function_exit._RecordFunction", "", "", "x.py:1")]  # fmt: skip
    b = a[:2] + handover + a[2:]
    assert first_difference(a, b) is None
    changed = list(b)
    last = len(changed) - 1
    changed[last] = R(b[last].op, b[last].shapes, "0" * 16, b[last].where)
    found = first_difference(a, changed)
    assert found["kind"] == "values"
    assert (found["index"], found["index_b"]) == (len(a) - 1, last)
    # a computing operator without a digest (no tensor output) still counts
    other = list(a)
    other[2] = R("aten._local_scalar_dense.default", "", "", "x.py:1")
    assert first_difference(a, other)["kind"] == "path"


def test_a_model_built_on_the_meta_device_records_nothing():
    """A model built on the meta device (shapes only, e.g. to count its parameters) computes
    nothing: a script that does so first records the same trace as one that does not."""
    a = _record("none").records
    with OpRecorder() as rec:
        with torch.device("meta"):
            meta = torch.nn.Linear(16, 8)
        assert meta.weight.is_meta
        _compute("none")
    assert first_difference(a, rec.records) is None
    assert len(rec.records) == len(a)


def test_trace_files_round_trip(tmp_path):
    rec = _record("none")
    path = save_trace(tmp_path / "t.json.gz", rec.records, command=["x.py"])
    meta, records = load_trace(path)
    assert meta == {"command": ["x.py"]} and records == rec.records


@pytest.mark.slow
def test_the_command_line_records_a_script_and_names_the_kernel(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import sys, torch\n"
        "torch.manual_seed(0)\n"
        "x = torch.randn(32, 32)\n"
        "y = torch.nn.functional.gelu(x @ x, approximate=sys.argv[1])\n"
        "print(float(y.sum()))\n"
    )
    run = [sys.executable, "-m", "trainers.optrace"]
    for name, mode in (("a", "none"), ("b", "none"), ("c", "tanh")):
        done = subprocess.run([*run, "record", str(tmp_path / f"{name}.json.gz"), "--",
                               str(script), mode], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, done.stderr
    same = subprocess.run([*run, "compare", str(tmp_path / "a.json.gz"), str(tmp_path / "b.json.gz")],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert same.returncode == 0 and "identical" in same.stdout
    other = subprocess.run([*run, "compare", str(tmp_path / "a.json.gz"), str(tmp_path / "c.json.gz")],
                           cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert other.returncode == 1 and "aten.gelu.default" in other.stdout, other.stdout


def test_the_same_script_from_another_checkout_is_not_a_warning(tmp_path, capsys):
    from trainers.optrace import main

    rec = _record("none").records
    paths = {}
    for name, script in (("here", "scripts/train_gnn.py"),
                         ("exported", "/tmp/optrace-x1/scripts/train_gnn.py"),
                         ("other", "scripts/train_linear.py")):  # fmt: skip
        paths[name] = save_trace(tmp_path / f"{name}.json.gz", rec, command=[script, "--seed", "0"])
    assert main(["compare", str(paths["here"]), str(paths["exported"])]) == 0
    assert "different scripts" not in capsys.readouterr().err
    assert main(["compare", str(paths["here"]), str(paths["other"])]) == 0
    err = capsys.readouterr().err
    assert "different scripts (scripts/train_gnn.py, scripts/train_linear.py)" in err
