"""scripts/publish.py and trainers.claims: seeds under the pins, claims, docs tables."""

from __future__ import annotations

import importlib.util
import json
import statistics
import textwrap
from pathlib import Path

import pytest

from trainers.claims import (
    ClaimsError,
    at_trivial_level,
    claim_met,
    claim_value,
    find_recipe,
    load_claims,
    majority_level,
    make_recipe,
    metric_of,
    write_claims,
)

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("publish_script", ROOT / "scripts" / "publish.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


publish = _load()


def test_parse_seeds():
    assert publish.parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert publish.parse_seeds("3,1,7-8") == [3, 1, 7, 8]
    for bad in ("a", "4-2", "1,1"):
        with pytest.raises(SystemExit):
            publish.parse_seeds(bad)


def test_run_env_pins_or_unpins_and_sets_threads():
    base = {
        "PATH": "/bin",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    }
    env = publish.run_env(3, native=False, base=base)
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["MKL_CBWR"] == "AVX2" and "MKL_ENABLE_INSTRUCTIONS" not in env
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "3" and env["PATH"] == "/bin"
    native = publish.run_env(1, native=True, base=base)
    assert not {"ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR"} & set(native)


def test_seed_command_sets_seed_and_log_and_refuses_them_in_the_command():
    cmd = publish.seed_command(
        ["scripts/t.py", "--lr", "1"], 3, Path("logs/r/seed3.jsonl"), nproc=1, python="py"
    )
    assert cmd == [
        "py",
        "scripts/t.py",
        "--lr",
        "1",
        "--seed",
        "3",
        "--run-log",
        "logs/r/seed3.jsonl",
    ]
    cmd = publish.seed_command(["scripts/t.py"], 0, Path("x.jsonl"), nproc=2, python="py")
    assert cmd[:6] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    for bad in (["scripts/t.py", "--seed", "1"], ["scripts/t.py", "--run-log=x"], []):
        with pytest.raises(SystemExit):
            publish.seed_command(bad, 0, Path("x"), nproc=1)
    # an elastic recipe runs under the fault drill (3 nodes, kill at 30, join at 70)
    drill = publish.parse_drill("3:30:70")
    cmd = publish.seed_command(["scripts/t.py"], 1, Path("x.jsonl"), nproc=1, python="py",
                               drill=drill, threads=1)  # fmt: skip
    assert cmd == [
        "py", "-m", "trainers.elastic_drill", "--nodes", "3", "--kill-at-step", "30",
        "--join-at-step", "70", "--threads", "1", "--", "scripts/t.py", "--seed", "1",
        "--run-log", "x.jsonl",
    ]  # fmt: skip
    # the same drill with in-process recovery (python -m trainers.elastic inproc)
    cmd = publish.seed_command(["scripts/t.py"], 1, Path("x.jsonl"), nproc=1, python="py",
                               drill=drill, threads=1, drill_recovery="inproc")  # fmt: skip
    assert cmd == [
        "py", "-m", "trainers.elastic_drill", "--nodes", "3", "--kill-at-step", "30",
        "--join-at-step", "70", "--threads", "1", "--recovery", "inproc", "--", "scripts/t.py",
        "--seed", "1", "--run-log", "x.jsonl",
    ]  # fmt: skip
    with pytest.raises(SystemExit, match="NODES:KILL_STEP:JOIN_STEP"):
        publish.parse_drill("3:30")
    # a partition drill on the lab network: 3 nodes, node 2 cut at step 10 for 90 s
    cut = publish.parse_partition_drill("3:2:10:90")
    cmd = publish.seed_command(["scripts/t.py"], 2, Path("x.jsonl"), nproc=1, python="py",
                               partition_drill=cut, bandwidth="100mbit", threads=1)  # fmt: skip
    assert cmd == [
        "py", "-m", "trainers.elastic_drill", "--netlab", "--nodes", "3", "--bandwidth",
        "100mbit", "--partition", "2:10:90", "--threads", "1", "--", "scripts/t.py", "--seed",
        "2", "--run-log", "x.jsonl",
    ]  # fmt: skip
    with pytest.raises(SystemExit, match="NODES:NODE:STEP:SECONDS"):
        publish.parse_partition_drill("3:2:10")


FAKE = """
import argparse, json, os, sys
p = argparse.ArgumentParser()
p.add_argument("--seed", type=int); p.add_argument("--run-log"); p.add_argument("--fail-seed", type=int, default=-1)
p.add_argument("--trivial", type=float, default=0.5)  # the task's trivial level, as data gives it
p.add_argument("--base", type=float, default=0.9)
p.add_argument("--hang", action="store_true")  # write part of the log, then wait to be killed


def trivial_level(records):
    a = p.parse_args(records[0]["command"][1:])
    return {"value": a.trivial, "how": f"majority class (fake: {a.trivial})"}


if __name__ == "__main__":
    a = p.parse_args()
    from trainers.logs import make_header
    with open(a.run_log, "w") as f:
        f.write(json.dumps(make_header(sys.argv, a.seed, 1)) + "\\n")
        f.write(json.dumps({"kind": "eval", "epoch": 0, "step": 1, "top1": a.base + a.seed / 100}) + "\\n")
        f.flush()
        if a.hang:
            import time
            time.sleep(120)
        if a.seed == a.fail_seed:
            sys.exit(3)  # a crash after a partial log
        f.write(json.dumps({"kind": "end", "steps": 1, "top1": a.base + a.seed / 100}) + "\\n")
"""


@pytest.fixture
def fake_repo(tmp_path, monkeypatch):
    script = tmp_path / "scripts" / "fake.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(FAKE))
    monkeypatch.setattr(publish, "REPO_ROOT", tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    return tmp_path


def _run(*args: str) -> int:
    return publish.main(list(args))


@pytest.mark.slow
def test_run_publishes_seeds_and_their_claim(fake_repo):
    claims = fake_repo / "logs" / "claims.json"
    rc = _run("--claims", str(claims), "run", "fake", "--seeds", "0-2", "--metric", "top1",
              "--minimum", "0.85", "--description", "a fake", "--threads", "1",
              "--", "scripts/fake.py")  # fmt: skip
    assert rc == 0
    entry = load_claims(claims)["recipes"]["fake"]
    values = [0.90, 0.91, 0.92]
    assert entry["logs"] == [f"logs/fake/seed{k}.jsonl" for k in range(3)] and entry["seeds"] == [
        0,
        1,
        2,
    ]
    assert entry["values"] == pytest.approx(values)
    assert entry["std"] == pytest.approx(statistics.stdev(values))
    assert entry["claim"] == pytest.approx(
        max(0.85, statistics.fmean(values) - 3 * statistics.stdev(values))
    )
    assert entry["status"] == "published"
    header = json.loads((fake_repo / "logs/fake/seed1.jsonl").read_text().splitlines()[0])
    # the header records the final relative path and the pins it ran under
    assert header["command"][-2:] == ["--run-log", "logs/fake/seed1.jsonl"]
    assert header["fingerprint"]["isa_pins"]["ATEN_CPU_CAPABILITY"] == "avx2"
    assert header["fingerprint"]["threads"] == 1


@pytest.mark.slow
def test_a_failed_seed_leaves_no_log_and_restores_the_one_it_replaced(fake_repo):
    claims = fake_repo / "logs" / "claims.json"
    base = ["--claims", str(claims), "run", "fake", "--metric", "top1", "--minimum", "0.5",
            "--description", "x", "--threads", "1"]  # fmt: skip
    assert _run(*base, "--seeds", "0,1", "--", "scripts/fake.py") == 0
    before = (fake_repo / "logs/fake/seed1.jsonl").read_text()
    assert _run(*base, "--seeds", "2,1", "--", "scripts/fake.py", "--fail-seed", "2") == 1
    assert not (fake_repo / "logs/fake/seed2.jsonl").exists()
    assert (fake_repo / "logs/fake/seed1.jsonl").read_text() == before
    assert not list((fake_repo / "logs/fake").glob(".*"))  # no partial or backup file left
    assert load_claims(claims)["recipes"]["fake"]["n"] == 2  # the claim was not touched


def test_claims_helpers_and_errors(tmp_path):
    records = [{"kind": "header"}, {"kind": "eval", "top1": 0.5}, {"kind": "eval", "top1": 0.7},
               {"kind": "end", "f1": 40.0}]  # fmt: skip
    assert (
        metric_of(records, "top1", "last_eval") == 0.7 and metric_of(records, "f1", "end") == 40.0
    )
    with pytest.raises(KeyError, match="did the run finish"):
        metric_of(records[:-1], "f1", "end")
    assert (
        claim_value(0.9, 0.95, 0.01) == pytest.approx(0.92)
        and claim_value(0.96, 0.95, 0.01) == 0.96
    )
    assert claim_value(0.9, 0.95, None) == 0.9
    log = tmp_path / "a.jsonl"
    log.write_text(
        json.dumps({"kind": "header", "seed": 0})
        + "\n"
        + json.dumps({"kind": "end", "f1": 1.0})
        + "\n"
    )
    entry = make_recipe(
        [log], metric="f1", source="end", documented_minimum=0.5, description="d", root=tmp_path
    )
    assert entry["status"] == "legacy" and entry["std"] is None and entry["claim"] == 0.5
    with pytest.raises(ClaimsError, match="repeat a seed"):
        make_recipe(
            [log, log],
            metric="f1",
            source="end",
            documented_minimum=0.5,
            description="d",
            root=tmp_path,
        )
    with pytest.raises(ClaimsError, match="no claims file"):
        load_claims(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"recipes": {"x": {"metric": "f1"}}}')
    with pytest.raises(ClaimsError, match="recipe 'x' lacks"):
        load_claims(bad)
    with pytest.raises(ClaimsError, match="not a seed of any recipe"):
        find_recipe({"recipes": {}}, log, root=tmp_path)


def test_check_finds_a_tampered_claim_and_a_stale_docs_table(fake_repo, tmp_path):
    claims = fake_repo / "logs" / "claims.json"
    assert _run("--claims", str(claims), "run", "fake", "--seeds", "0,1", "--metric", "top1",
                "--minimum", "0.5", "--description", "x", "--threads", "1", "--", "scripts/fake.py") == 0  # fmt: skip
    docs = fake_repo / "docs"
    docs.mkdir()
    (docs / "page.md").write_text(
        "before\n<!-- claims: fake -->\nold table\n<!-- /claims -->\nafter\n"
        "It ends at <!--claim fake mean-->90 %<!--/claim-->.\n"
    )
    monkey_docs = publish.render_docs(load_claims(claims), docs)
    assert list(monkey_docs) == [docs / "page.md"]
    text = monkey_docs[docs / "page.md"]
    assert "| `fake` (x) | published | top1 | 90.50 % ± 0.71 % (2) | 90.00 % | 91.00 % |" in text
    assert text.startswith("before\n") and text.endswith(
        "<!-- /claims -->\nafter\nIt ends at <!--claim fake mean-->90.50 %<!--/claim-->.\n"
    )
    (docs / "page.md").write_text(text)
    assert publish.check(claims, docs, root=fake_repo) == []
    data = json.loads(claims.read_text())
    data["recipes"]["fake"]["mean"] = 0.99
    claims.write_text(json.dumps(data))
    problems = publish.check(claims, docs, root=fake_repo)
    assert any("fake: mean is 0.99, the logs give" in p for p in problems)
    assert any("claims tables out of date" in p for p in problems)
    # the inline marker (docs/run_logs.md) too, by file, line, recipe and field
    assert any(
        p.startswith("docs/page.md:8: fake mean: the marker reads '90.50 %', logs/claims.json "
                     "gives '99.00 %'") for p in problems
    ), problems  # fmt: skip


def test_docs_table_shows_fractions_in_percent_and_other_metrics_as_they_are():
    """A recipe's scale is judged on its mean and extremes: an F1 with a standard deviation
    below 1.5 stays an F1 (it printed "13.49 ± 31.89 %" before), an accuracy fraction is %."""
    entry = {"status": "published", "n": 5, "description": "d"}
    claims = {"recipes": {
        "f1": {**entry, "metric": "f1", "mean": 13.49, "std": 0.3189, "min": 13.05,
               "max": 13.82, "claim": 13.0},
        "acc": {**entry, "metric": "top1", "mean": 0.9712, "std": 0.0031, "min": 0.9677,
                "max": 0.9755, "claim": 0.96},
    }}  # fmt: skip
    table = publish.render_table(claims, ["f1", "acc"])
    assert "| 13.49 ± 0.32 (5) | 13.05 | 13.82 | ≥ 13.00 |" in table
    assert "| 97.12 % ± 0.31 % (5) | 96.77 % | 97.55 % | ≥ 96.00 % |" in table


def test_a_recipe_declared_with_one_seed_is_marked_single_seed(fake_repo):
    claims = fake_repo / "logs" / "claims.json"
    rc = _run("--claims", str(claims), "run", "one", "--seeds", "0", "--metric", "top1",
              "--minimum", "0.85", "--min-seeds", "1", "--description", "one run", "--threads",
              "1", "--", "scripts/fake.py")  # fmt: skip
    assert rc == 0
    entry = load_claims(claims)["recipes"]["one"]
    assert entry["status"] == "single-seed" and entry["n"] == 1 and entry["std"] is None
    assert entry["claim"] == 0.85  # no spread: the documented minimum
    assert "| single-seed |" in publish.render_table({"recipes": {"one": entry}}, ["one"])


# -- trivial levels, baselines and negative results (issue 40) ---------------------------------
def _publish(claims, *flags, command=("scripts/fake.py",), seeds="0-2", minimum="0.5"):
    return _run("--claims", str(claims), "run", "fake", "--seeds", seeds, "--metric", "top1",
                "--minimum", minimum, "--description", "x", "--threads", "1", *flags,
                "--", *command)  # fmt: skip


@pytest.mark.slow
def test_every_recipe_states_its_trivial_level_and_baseline(fake_repo):
    claims = fake_repo / "logs" / "claims.json"
    assert _publish(claims, command=("scripts/fake.py", "--trivial", "0.25")) == 0
    entry = load_claims(claims)["recipes"]["fake"]
    assert entry["trivial"] == {"value": 0.25, "how": "majority class (fake: 0.25)"}
    assert entry["baseline"] is None and entry["diagnosis"] is None
    assert _run("--claims", str(claims), "run", "other", "--seeds", "0", "--metric", "top1",
                "--minimum", "0.6", "--min-seeds", "1", "--description", "y", "--threads", "1",
                "--baseline", "fake", "--", "scripts/fake.py") == 0  # fmt: skip
    recipes = load_claims(claims)["recipes"]
    assert recipes["other"]["baseline"] == "fake"
    table = publish.render_table({"recipes": recipes}, ["other"])
    assert "| 50.00 % | `fake`: 91.00 % |" in table  # trivial level, the baseline's mean


@pytest.mark.slow
def test_a_claim_at_the_trivial_level_is_refused(fake_repo, capsys):
    claims = fake_repo / "logs" / "claims.json"
    # every seed at or below the level a constant predictor reaches
    assert _publish(claims, command=("scripts/fake.py", "--trivial", "0.95")) == 2
    err = capsys.readouterr().err
    assert "at or below the task's trivial level 0.95" in err and "--negative" in err
    assert not claims.exists()
    # the seeds beat it (0.90-0.92), but the claim, mean - 3 std = 0.88, does not
    assert _publish(claims, command=("scripts/fake.py", "--trivial", "0.89"), minimum="0.6") == 2
    err = capsys.readouterr().err
    assert "the claim 0.88 is at or below the task's trivial level 0.89" in err
    assert "every seed reaches 0.9" in err
    assert _publish(claims, command=("scripts/fake.py", "--trivial", "0.89"), minimum="0.895") == 0
    assert _publish(claims, "--baseline", "nope") == 2
    assert "--baseline nope: no such recipe" in capsys.readouterr().err


@pytest.mark.slow
def test_a_failure_is_published_as_a_negative_result_listed_apart(fake_repo):
    claims = fake_repo / "logs" / "claims.json"
    command = ("scripts/fake.py", "--trivial", "0.1", "--base", "0.1")  # 0.10, 0.11, 0.12
    assert _publish(claims, command=command, minimum="0") == 2  # no silent low claim
    assert _publish(claims, "--negative", "  ", command=command, minimum="0") == 2
    assert _publish(claims, "--negative", "it diverges", command=command, minimum="0") == 0
    entry = load_claims(claims)["recipes"]["fake"]
    values = [0.10, 0.11, 0.12]
    assert entry["status"] == "negative" and entry["diagnosis"] == "it diverges"
    # an upper bound a rerun stays under: the failure reproduces
    assert entry["claim"] == pytest.approx(statistics.fmean(values) + 3 * statistics.stdev(values))
    assert claim_met(0.11, entry) and not claim_met(0.5, entry)
    table = publish.render_table(load_claims(claims), ["fake"])
    held, _, failed = table.partition("**Negative results**")
    assert "`fake`" not in held and "| it diverges |" in failed


def test_claim_met_needs_more_than_the_trivial_level_whatever_the_band():
    entry = {"status": "published", "claim": 0.05, "trivial": {"value": 0.1, "how": "m"}}
    assert not claim_met(0.1, entry) and at_trivial_level(0.1, entry)
    assert claim_met(0.11, entry) and not claim_met(0.04, entry)
    assert claim_met(0.06, {"status": "published", "claim": 0.05, "trivial": None})


def test_majority_level_is_the_best_constant_predictor():
    sklearn_dummy = pytest.importorskip("sklearn.dummy")
    rng = __import__("numpy").random.default_rng(0)
    labels = rng.integers(0, 7, size=503).tolist()
    dummy = sklearn_dummy.DummyClassifier(strategy="most_frequent").fit([[0]] * 503, labels)
    level = majority_level(labels, what="rows")
    assert level["value"] == pytest.approx(dummy.score([[0]] * 503, labels), rel=1e-15)
    assert (
        f"{labels.count(dummy.classes_[dummy.class_prior_.argmax()])} of the 503 rows"
        in (level["how"])
    )
    with pytest.raises(ValueError, match="no labels"):
        majority_level([])


def _log(path, seed, value, fingerprint=True):
    header = {"kind": "header", "seed": seed, **({"fingerprint": {"x": 1}} if fingerprint else {})}
    path.write_text(json.dumps(header) + "\n" + json.dumps({"kind": "end", "f1": value}) + "\n")
    return path


def test_claims_refusals(tmp_path):
    a, b = _log(tmp_path / "a.jsonl", 0, 50.0), _log(tmp_path / "b.jsonl", 1, 52.0, False)
    kwargs = {"metric": "f1", "source": "end", "documented_minimum": 40, "description": "d",
              "root": tmp_path}  # fmt: skip
    with pytest.raises(
        ClaimsError, match="some logs .* have a machine fingerprint and some do not"
    ):
        make_recipe([a, b], **kwargs)
    with pytest.raises(ClaimsError, match="trivial level is not finite"):
        make_recipe([a], trivial={"value": float("nan"), "how": "x"}, **kwargs)
    entry = make_recipe([a], trivial={"value": 10.0, "how": "x"}, **kwargs)
    for field, bad in (("mean", float("nan")), ("std", float("inf")), ("claim", float("-inf"))):
        with pytest.raises(ClaimsError, match=f"{field} is not finite"):
            write_claims(tmp_path / "c.json", {"recipes": {"r": {**entry, field: bad}}})
    with pytest.raises(ClaimsError, match="trivial level is not finite"):
        write_claims(tmp_path / "c.json",
                     {"recipes": {"r": {**entry, "trivial": {"value": float("nan"), "how": ""}}}})  # fmt: skip
    assert not (tmp_path / "c.json").exists()  # nothing written on a refusal
    for broken, message in (
        ({**entry, "status": "negative"}, "only one, carries a diagnosis"),
        ({**entry, "diagnosis": "why"}, "only one, carries a diagnosis"),
        ({**entry, "baseline": "ghost"}, "its baseline 'ghost' is no recipe here"),
    ):
        (tmp_path / "c.json").write_text(json.dumps({"recipes": {"r": broken}}))
        with pytest.raises(ClaimsError, match=message):
            load_claims(tmp_path / "c.json")


@pytest.mark.slow
def test_a_terminated_publication_leaves_no_partial_log(fake_repo):
    """SIGTERM (a killed job) unwinds like a failure: the partial log goes, the old one comes
    back, and publish.py exits 128 + 15. The job is a real publish.py process (a copy in the
    fake repo, so that its REPO_ROOT is that repo), signalled from outside as a scheduler
    would: a signal sent by a thread of the test's own process need not reach its main thread
    while that thread waits for the seed's process (it once did not, in CI)."""
    import shutil
    import signal
    import subprocess
    import sys
    import time

    claims = fake_repo / "logs" / "claims.json"
    assert _publish(claims, seeds="0", minimum="0.6") == 0
    partial = fake_repo / "logs/fake/seed0.jsonl"
    before = partial.read_text()
    shutil.copy(ROOT / "scripts" / "publish.py", fake_repo / "scripts" / "publish.py")
    job = subprocess.Popen(
        [sys.executable, "scripts/publish.py", "--claims", str(claims), "run", "fake", "--seeds",
         "0", "--metric", "top1", "--minimum", "0.6", "--description", "x", "--threads", "1",
         "--", "scripts/fake.py", "--hang"],
        cwd=fake_repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (partial.is_file() and partial.stat().st_size and partial.read_text() != before):
            assert job.poll() is None, job.communicate()[0]
            assert time.monotonic() < deadline, "the seed wrote no partial log in 120 s"
            time.sleep(0.05)
        job.send_signal(signal.SIGTERM)
        output = job.communicate(timeout=60)[0]
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 128 + signal.SIGTERM, output
    assert partial.read_text() == before
    assert not list((fake_repo / "logs/fake").glob(".*"))
