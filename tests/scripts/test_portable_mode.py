"""The portable exact mode (issue 43): MODELZOO_PORTABLE=2 turns oneDNN off and is recorded;
a portable log from another processor is re-created here once a cross-processor pair has
verified its recipe, and refused (exit 4) otherwise or without the mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainers.fingerprint import not_comparable_reason
from trainers.logs import (
    ISA_PIN_VARIABLES,
    PORTABLE_CPU_PINS,
    PORTABLE_EXACT_PINS,
    PORTABLE_ONEDNN_PINS,
    machine_fingerprint,
)

from ._scripts import ROOT, load_script, read_records

INTEL = {"arch": "x86_64", "vendor": "GenuineIntel", "family": 6, "model": 207,
         "model_name": "Intel(R) Xeon(R) Processor", "flags": ["avx", "avx2", "fma"]}  # fmt: skip
AMD = {"arch": "x86_64", "vendor": "AuthenticAMD", "family": 25, "model": 17,
       "model_name": "AMD EPYC", "flags": ["avx", "avx2", "fma"]}  # fmt: skip
# The processor the logs' headers are forged to: another model than this machine's (the
# development machines are Intel or AMD).
ELSEWHERE = AMD if machine_fingerprint()["cpu"].get("vendor") == "GenuineIntel" else INTEL


def _fingerprint(pins: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ISA_PIN_VARIABLES}
    env.update(pins, PYTHONPATH=str(ROOT))
    code = "import json, trainers; from trainers.logs import machine_fingerprint as m; print(json.dumps(m()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
def test_the_mode_turns_onednn_off_and_the_fingerprint_records_it():
    portable, pinned = _fingerprint(PORTABLE_EXACT_PINS), _fingerprint(PORTABLE_CPU_PINS)
    assert portable["onednn"] is False and pinned["onednn"] is True
    assert portable["isa_pins"]["MODELZOO_PORTABLE"] == "2"  # the mode's current version
    # MKL's only branch documented for non-Intel processors; AVX2 is Intel-only (refuted here)
    assert portable["isa_pins"]["MKL_CBWR"] == "COMPATIBLE"
    assert portable["isa_pins"]["MKL_DYNAMIC"] == "FALSE"
    assert pinned["isa_pins"]["MODELZOO_PORTABLE"] is None


def test_only_a_verified_portable_log_escapes_the_processor_rule():
    here = _fingerprint(PORTABLE_EXACT_PINS)
    forged = {**here, "cpu": ELSEWHERE}
    unverified = not_comparable_reason(forged, here)
    assert unverified is not None and "no rerun" in unverified and "portable" in unverified
    assert not_comparable_reason(forged, here, portable_verified="made on A, rerun on B") is None
    usual = {**forged, "isa_pins": {**dict.fromkeys(ISA_PIN_VARIABLES), **PORTABLE_CPU_PINS}}
    reason = not_comparable_reason(usual, here, portable_verified="made on A, rerun on B")
    assert reason is not None and "oneDNN and MKL choose kernels" in reason


def test_publish_runs_each_mode_under_its_pins():
    publish = load_script("publish", "portable_env")
    base = {"MKL_CBWR": "AVX512", "PATH": "/bin"}

    def pins(**kw):
        env = publish.run_env(2, native=False, base=base, **kw)
        return {k: env[k] for k in ISA_PIN_VARIABLES if k in env}

    assert pins() == PORTABLE_CPU_PINS
    assert pins(portable=True) == PORTABLE_EXACT_PINS
    assert pins(portable="onednn") == PORTABLE_ONEDNN_PINS
    assert PORTABLE_ONEDNN_PINS["MODELZOO_PORTABLE"] == "2-onednn"
    assert publish.run_env(2, native=True, base=base).get("MKL_CBWR") is None


@pytest.mark.parametrize("flags", [["--portable", "--portable-onednn"], ["--native", "--portable"]])
def test_publish_refuses_two_environments_in_one_line_exit_2(flags):
    done = subprocess.run(
        [sys.executable, "scripts/publish.py", "run", "x", "--metric", "m", "--minimum", "0",
         "--description", "d", *flags, "--", "scripts/train_linear.py"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "not allowed with argument" in done.stderr and "Traceback" not in done.stderr
    assert not (ROOT / "logs" / "x").exists()


def _linear_log(tmp_path, *, portable: bool):
    """A real run of a short linear recipe made here (publish.py's environment)."""
    publish = load_script("publish", "portable_mode")
    recipe = tmp_path / "linear_portable_test"
    recipe.mkdir()
    log = recipe / "seed0.jsonl"
    command = ["scripts/train_linear.py", "--dataset", "breast_cancer", "--solver", "sgd",
               "--batch-size", "16", "--num-epochs", "1", "--no-progress", "--seed", "0",
               "--run-log", str(log)]  # fmt: skip
    env = publish.run_env(1, native=False, portable=portable)
    done = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return log


@pytest.fixture
def portable_log(tmp_path):
    """A real portable run of a linear recipe made here, its header forged to another processor."""
    log = _linear_log(tmp_path, portable=True)
    records = read_records(log)
    assert records[0]["fingerprint"]["isa_pins"]["MODELZOO_PORTABLE"] == "2"

    def forge(pins: dict[str, str]) -> None:
        header = dict(records[0])
        header["fingerprint"] = {**header["fingerprint"], "cpu": ELSEWHERE,
                                 "isa_pins": {**dict.fromkeys(ISA_PIN_VARIABLES), **pins}}  # fmt: skip
        log.write_text("".join(json.dumps(r) + "\n" for r in [header, *records[1:]]))

    return log, forge


def _pair(log, *, identical: bool = True, pins: dict[str, str] = PORTABLE_EXACT_PINS) -> dict:
    return {"log": f"logs/{log.parent.name}/seed0.jsonl", "publisher": "AuthenticAMD 25/17 (AMD EPYC)",
            "rerun": "GenuineIntel 6/207 (Intel(R) Xeon(R) Processor)", "pins": pins,
            "records_compared": 5, "records_identical": 5 if identical else 4, "missing": [],
            "first_difference": None if identical else "step epoch=0 step=3",
            "complete": True}  # fmt: skip


@pytest.mark.slow
def test_a_verified_portable_log_from_another_processor_is_re_created_exactly(
    portable_log, tmp_path, monkeypatch, capsys
):
    log, forge = portable_log
    reproduce = load_script("reproduce", "portable_mode")
    results = tmp_path / "cross_processor.json"
    monkeypatch.setattr(reproduce, "CROSS_PROCESSOR", results)
    forge(PORTABLE_EXACT_PINS)

    results.write_text(json.dumps({"pairs": []}))
    assert reproduce.main([str(log), "--max-steps", "5"]) == 4  # no pair yet
    assert "has verified the mode for this recipe yet" in capsys.readouterr().out

    # an identical pair between two models of one vendor is no evidence for the mode
    one_vendor = {**_pair(log), "publisher": "GenuineIntel 6/207 (Intel(R) Xeon(R) Processor)",
                  "rerun": "GenuineIntel 6/167 (Intel(R) Xeon(R) Processor)"}  # fmt: skip
    results.write_text(json.dumps({"pairs": [one_vendor]}))
    assert reproduce.main([str(log), "--max-steps", "5"]) == 4
    assert "processor of the other vendor has verified" in capsys.readouterr().out

    results.write_text(json.dumps({"pairs": [_pair(log, identical=False)]}))
    assert reproduce.main([str(log), "--max-steps", "5"]) == 4  # a pair that differed
    out = capsys.readouterr().out
    assert "refuted the mode for this recipe" in out and "step epoch=0 step=3" in out

    # an identical pair of another mode's pins (the first mode: MKL's AVX2 branch) is no evidence
    first_mode = {**PORTABLE_EXACT_PINS, "MKL_CBWR": "AVX2,STRICT"}
    first_mode.pop("MKL_DYNAMIC")
    results.write_text(json.dumps({"pairs": [_pair(log, pins=first_mode)]}))
    assert reproduce.main([str(log), "--max-steps", "5"]) == 4
    assert "has verified the mode for this recipe yet" in capsys.readouterr().out

    # nor is one of the mode's version 1 (ATen's sqrt) for a log of version 2
    version_1 = {**PORTABLE_EXACT_PINS, "MODELZOO_PORTABLE": "1"}
    results.write_text(json.dumps({"pairs": [_pair(log, pins=version_1)]}))
    assert reproduce.main([str(log), "--max-steps", "5"]) == 4
    assert "has verified the mode for this recipe yet" in capsys.readouterr().out

    results.write_text(json.dumps({"pairs": [_pair(log)]}))
    assert reproduce.main([str(log), "--max-steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "verified across processors" in out and "reproduced:" in out

    forge(PORTABLE_CPU_PINS)  # the same log without the mode: the processor rule stands
    assert reproduce.main([str(log), "--max-steps", "5"]) == 4
    assert "not comparable" in capsys.readouterr().out


@pytest.mark.slow
def test_a_log_from_another_processor_compares_with_this_processors_trace(tmp_path, capsys):
    """Per-processor traces (scripts/cross_processor.py --add-trace): a log made elsewhere is
    re-created exactly against the trace its run left on this processor model."""
    reproduce = load_script("reproduce", "processor_trace")
    log = _linear_log(tmp_path, portable=False)
    records = read_records(log)
    here = records[0]["fingerprint"]["cpu"]
    header = dict(records[0])
    header["fingerprint"] = {**header["fingerprint"], "cpu": ELSEWHERE}
    log.write_text("".join(json.dumps(r) + "\n" for r in [header, *records[1:]]))
    assert reproduce.main([str(log), "--max-steps", "5"]) == 4  # no trace for this processor
    capsys.readouterr()

    trace = log.parent / "processors" / reproduce.processor_key(here) / log.name
    trace.parent.mkdir(parents=True)
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))  # the run as made here
    assert reproduce.main([str(log), "--max-steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "this processor model's trace" in out and "reproduced:" in out

    bad = [dict(r) for r in records]
    step = next(r for r in bad if r.get("kind") == "step")
    step["loss"] = step["loss"] * 1.01  # a trace that does not match the rerun is a divergence
    trace.write_text("".join(json.dumps(r) + "\n" for r in bad))
    assert reproduce.main([str(log), "--max-steps", "5"]) == 1


@pytest.mark.slow
def test_a_pair_shown_identical_lets_that_processor_models_logs_be_re_created(
    tmp_path, monkeypatch, capsys
):
    """Without the portable mode: a whole rerun on this processor model of a log made on
    another, identical in every record, lets the recipe's logs made there be re-created here
    (only between those two models, with those pins)."""
    reproduce = load_script("reproduce", "pair_evidence")
    results = tmp_path / "cross_processor.json"
    monkeypatch.setattr(reproduce, "CROSS_PROCESSOR", results)
    log = _linear_log(tmp_path, portable=False)
    records = read_records(log)
    here = records[0]["fingerprint"]
    header = dict(records[0])
    header["fingerprint"] = {**here, "cpu": ELSEWHERE}
    log.write_text("".join(json.dumps(r) + "\n" for r in [header, *records[1:]]))
    pins = {k: v for k, v in here["isa_pins"].items() if v}
    pair = {"log": f"logs/{log.parent.name}/seed3.jsonl",
            "publisher": reproduce.processor_name(ELSEWHERE),
            "rerun": reproduce.processor_name(here["cpu"]), "pins": pins,
            "records_compared": 9, "records_identical": 9, "missing": [], "complete": True}  # fmt: skip
    for other in ({"rerun": "AuthenticAMD 23/49 (AMD EPYC 7742)"}, {"complete": False},
                  {"records_identical": 8}, {"pins": {**pins, "MKL_CBWR": "AVX512"}}):  # fmt: skip
        results.write_text(json.dumps({"pairs": [{**pair, **other}]}))
        assert reproduce.main([str(log), "--max-steps", "5"]) == 4, other
        capsys.readouterr()
    results.write_text(json.dumps({"pairs": [pair]}))
    assert reproduce.main([str(log), "--max-steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "shown to compute the same bits" in out and "reproduced:" in out
