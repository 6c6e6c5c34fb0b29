"""scripts/cross_processor.py's operator traces under candidate pins (issue 43): ``--pins``
overrides single ISA pins of a traced run, the trace's file name and its recorded fingerprint
say which, and bad values are refused with one line."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

import trainers.cross_processor
from trainers.errors import UsageError
from trainers.logs import PORTABLE_EXACT_PINS

from ._scripts import ROOT, load_script

cross_processor = load_script("cross_processor", "cross_processor_test")


def _error(message):
    raise SystemExit(message)


def test_pins_parse_with_commas_inside_values_and_empty_values_unset():
    parse = cross_processor.parse_pins
    assert parse("MKL_CBWR=AVX2,STRICT,MODELZOO_PORTABLE=", _error) == {
        "MKL_CBWR": "AVX2,STRICT",
        "MODELZOO_PORTABLE": "",
    }
    assert parse("MKL_CBWR=COMPATIBLE", _error) == {"MKL_CBWR": "COMPATIBLE"}
    with pytest.raises(SystemExit, match="not an ISA pin"):
        parse("OMP_NUM_THREADS=4", _error)
    with pytest.raises(SystemExit, match="expected NAME=VALUE"):
        parse("COMPATIBLE", _error)


def test_the_trace_name_carries_the_mode_and_the_overrides(tmp_path):
    log = tmp_path / "karate_gcn" / "seed0.jsonl"
    cpu = {"vendor": "GenuineIntel", "family": 6, "model": 207}
    plain = cross_processor.trace_path(log, cpu)
    assert plain.name == "karate_gcn-seed0.GenuineIntel-6-207.json.gz"
    portable = cross_processor.trace_path(log, cpu, portable=True)
    branch = PORTABLE_EXACT_PINS["MKL_CBWR"].lower()
    assert portable.name == f"karate_gcn-seed0.GenuineIntel-6-207.portable-{branch}-v2.json.gz"
    # version 1's traces keep their names
    assert cross_processor.portable_tag({**PORTABLE_EXACT_PINS, "MODELZOO_PORTABLE": "1"}) == (
        f"portable-{branch}"
    )
    candidate = cross_processor.trace_path(
        log, cpu, portable=True, pins={"MODELZOO_PORTABLE": "", "MKL_CBWR": "AVX2,STRICT"}
    )
    assert candidate.name.endswith(
        f".portable-{branch}-v2.pins-mkl_cbwr=avx2-strict-modelzoo_portable=.json.gz"
    )


def test_a_bad_pins_flag_is_one_line_and_exit_2():
    done = subprocess.run(
        [sys.executable, "scripts/cross_processor.py", "--optrace", "--pins", "FOO=1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "'FOO' is not an ISA pin" in done.stderr and "Traceback" not in done.stderr
    done = subprocess.run(
        [sys.executable, "scripts/cross_processor.py", "--pins", "MKL_CBWR=COMPATIBLE"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "go with --optrace" in done.stderr


@pytest.mark.slow
def test_a_traced_run_runs_under_the_overridden_pins(tmp_path, monkeypatch):
    """A real traced step of the published L-BFGS recipe, in the portable mode with oneDNN
    turned back on by ``MODELZOO_PORTABLE=``: the trace's fingerprint shows both."""
    log = ROOT / "logs" / "linear_breast_cancer_lbfgs" / "seed0.jsonl"
    out = tmp_path / "trace.json.gz"
    # record_trace is trainers.cross_processor's (the script re-exports it): patch it there
    monkeypatch.setattr(trainers.cross_processor, "trace_path", lambda *a, **k: out)
    cross_processor.record_trace(
        log, 1, sys.executable, portable=True, pins={"MODELZOO_PORTABLE": ""}
    )
    meta = json.loads(gzip.decompress(out.read_bytes()))["meta"]
    pins = {k: v for k, v in meta["fingerprint"]["isa_pins"].items() if v}
    assert pins == {k: v for k, v in PORTABLE_EXACT_PINS.items() if k != "MODELZOO_PORTABLE"}
    assert meta["fingerprint"]["onednn"] is True


@pytest.mark.slow
def test_a_processor_trace_is_also_a_pair(tmp_path):
    """--add-trace reruns a whole log made on another processor model: it writes this model's
    trace and records the comparison as a pair (whole log, every record), identical or not."""
    from .test_portable_mode import ELSEWHERE, _linear_log

    log = _linear_log(tmp_path, portable=False)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    records[0]["fingerprint"] = {**records[0]["fingerprint"], "cpu": ELSEWHERE}
    step = next(r for r in records if r.get("kind") == "step" and r.get("step", 0) >= 3)
    step["loss"] *= 1.01  # the published run differs from what this machine computes there
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    results, doc = tmp_path / "pairs.json", tmp_path / "doc.md"
    doc.write_text(f"x\n{cross_processor.START}{cross_processor.END}\ny\n")

    out = cross_processor.add_trace(log, sys.executable, results=results, doc=doc)
    assert out is not None and out.is_file()
    (pair,) = json.loads(results.read_text())["pairs"]
    assert pair["complete"] and pair["records_compared"] == len(records) - 1
    assert pair["records_identical"] == pair["records_compared"] - 1
    assert (
        pair["first_difference"].startswith("step")
        and str(step["step"]) in pair["first_difference"]
    )
    assert pair["publisher"] == cross_processor.processor(ELSEWHERE)
    assert str(log) in doc.read_text()  # the docs table, regenerated


def test_a_commit_is_exported_as_its_files_and_an_unknown_one_refused(tmp_path):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    assert trainers.cross_processor.export_commit("HEAD", tmp_path, ROOT) == head
    listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", "HEAD", "scripts"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert listed and all((tmp_path / name).is_file() for name in listed)
    committed = subprocess.run(["git", "show", "HEAD:scripts/cross_processor.py"], cwd=ROOT,
                               capture_output=True, check=True).stdout  # fmt: skip
    assert (tmp_path / "scripts" / "cross_processor.py").read_bytes() == committed
    with pytest.raises(UsageError, match="--at no-such-commit: no such commit"):
        trainers.cross_processor.export_commit("no-such-commit", tmp_path / "x", ROOT)
    done = subprocess.run([sys.executable, "scripts/cross_processor.py", "--at", "HEAD"],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "go with --optrace" in done.stderr


@pytest.mark.slow
def test_a_trace_at_a_commit_runs_that_commits_code(tmp_path, monkeypatch):
    """``--at HEAD`` records what a run of HEAD's files, exported apart, records: the same
    operators with the same digests; the file is named after the commit."""
    from trainers.optrace import first_difference, load_trace

    log = ROOT / "logs" / "linear_breast_cancer_lbfgs" / "seed0.jsonl"
    code = tmp_path / "code"
    code.mkdir()
    head = trainers.cross_processor.export_commit("HEAD", code, ROOT)
    reference = tmp_path / "reference.json.gz"
    monkeypatch.setattr(trainers.cross_processor, "trace_path", lambda *a, **k: reference)
    cross_processor.record_trace(log, 1, sys.executable, root=code)
    monkeypatch.undo()
    out = cross_processor.record_trace(log, 1, sys.executable, at="HEAD")
    try:
        assert out.parent == ROOT / "logs" / "optrace"
        assert out.name.endswith(f".at-{head[:12]}.json.gz")
        (_, a), (_, b) = load_trace(reference), load_trace(out)
        assert len(a) > 100 and first_difference(a, b) is None
    finally:
        out.unlink(missing_ok=True)


def _claims_with(tmp_path, recipes):
    """A repository at ``tmp_path`` with ``recipes`` ({name: the pins of its logs' headers})."""
    entries = {}
    for name, pins in recipes.items():
        logs = []
        for seed in range(2):
            log = tmp_path / "logs" / name / f"seed{seed}.jsonl"
            log.parent.mkdir(parents=True, exist_ok=True)
            header = {
                "kind": "header",
                "command": ["scripts/x.py"],
                "fingerprint": {"isa_pins": pins},
            }
            log.write_text(json.dumps(header) + "\n" + json.dumps({"kind": "end"}) + "\n")
            logs.append(f"logs/{name}/seed{seed}.jsonl")
        entries[name] = {"logs": logs}
    claims = tmp_path / "logs" / "claims.json"
    claims.write_text(json.dumps({"recipes": entries}))
    return claims


def test_the_portable_logs_are_seed_0_of_each_recipe_made_in_the_mode(tmp_path):
    claims = _claims_with(tmp_path, {
        "plain": {"ATEN_CPU_CAPABILITY": "avx2", "MODELZOO_PORTABLE": None},
        "v1": {**PORTABLE_EXACT_PINS, "MODELZOO_PORTABLE": "1"},
        "v2": dict(PORTABLE_EXACT_PINS),
        "conv": {**PORTABLE_EXACT_PINS, "MODELZOO_PORTABLE": "2-onednn"},
        "unknown": {**PORTABLE_EXACT_PINS, "MODELZOO_PORTABLE": "9"},
    })  # fmt: skip
    found = cross_processor.portable_logs(claims, root=tmp_path)
    assert found == [tmp_path / "logs" / r / "seed0.jsonl" for r in ("v1", "v2", "conv")]
    # none at all, or a listed log that is missing: one line naming the file
    none = _claims_with(tmp_path / "none", {"plain": {"ATEN_CPU_CAPABILITY": "avx2"}})
    with pytest.raises(UsageError, match="no recipe is published in the portable exact mode"):
        cross_processor.portable_logs(none, root=tmp_path / "none")
    (tmp_path / "logs" / "v2" / "seed0.jsonl").unlink()
    with pytest.raises(UsageError, match="recipe v2"):
        cross_processor.portable_logs(claims, root=tmp_path)


def test_the_published_portable_recipes_are_found_in_this_repository():
    found = {p.parent.name for p in cross_processor.portable_logs()}
    claims = json.loads((ROOT / "logs" / "claims.json").read_text())["recipes"]
    for name, recipe in claims.items():
        header = json.loads((ROOT / recipe["logs"][0]).read_text().splitlines()[0])
        portable = (header.get("fingerprint") or {}).get("isa_pins", {}).get("MODELZOO_PORTABLE")
        assert (name in found) == bool(portable), name


def test_portable_logs_and_table_are_refused_together():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cross_processor.py"), "--table", "--portable-logs"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--table only regenerates the docs table" in result.stderr


def test_portable_logs_are_rerun_after_the_named_ones_each_once(tmp_path, monkeypatch):
    claims = _claims_with(tmp_path, {"v2": dict(PORTABLE_EXACT_PINS), "plain": {}})
    v2, plain = (tmp_path / "logs" / r / "seed0.jsonl" for r in ("v2", "plain"))
    rerun = []
    monkeypatch.setattr(cross_processor, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(cross_processor, "RESULTS", tmp_path / "pairs.json")
    monkeypatch.setattr(cross_processor, "DOC", tmp_path / "doc.md")
    monkeypatch.setattr(cross_processor, "portable_logs",
                        lambda root: trainers.cross_processor.portable_logs(claims, root))  # fmt: skip
    monkeypatch.setattr(cross_processor, "measure", lambda log, *a, **k: rerun.append(log))
    monkeypatch.setattr(cross_processor, "write_table", lambda pairs, doc: None)
    assert cross_processor.main([str(plain), "--portable-logs", "--steps", "3"]) == 0
    assert rerun == [plain, v2]  # the named log, then the portable ones
    rerun.clear()
    assert cross_processor.main([str(v2), "--portable-logs", "--steps", "3"]) == 0
    assert rerun == [v2]  # named and portable: rerun once


def test_run_logs_md_lists_every_recipe_published_in_the_portable_mode():
    """docs/run_logs.md's table of the portable recipes names exactly the recipes whose logs
    were made in the mode (their headers say so), so the page cannot fall behind a republish."""
    text = (ROOT / "docs" / "run_logs.md").read_text(encoding="utf-8")
    after = text[text.index("The recipes published in the portable exact mode:") :]
    marker = after[after.index("<!-- claims:") :].split("-->", 1)[0]
    listed = marker.removeprefix("<!-- claims:").split()
    published = [p.parent.name for p in cross_processor.portable_logs()]
    assert sorted(listed) == sorted(published)
