"""scripts/reproduce.py: the log comparison and, with a tiny stand-in script, the rerun."""

import importlib.util
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "reproduce.py"


def _load():
    spec = importlib.util.spec_from_file_location("reproduce_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reproduce = _load()

HEADER = {"kind": "header", "command": ["scripts/x.py"], "seed": 0, "world_size": 1}


def make_log(loss_scale=1.0, samples_per_sec=100.0):
    records = [dict(HEADER)]
    for step in (2, 4, 6):
        records.append(
            {
                "kind": "step",
                "epoch": (step - 1) // 4,
                "batch": (step - 1) % 4,
                "step": step,
                "loss": 1.0 / step * loss_scale,
                "lr": 0.1,
                "samples_per_sec": samples_per_sec,
            }
        )
        if step == 4:
            records.append(
                {
                    "kind": "epoch",
                    "epoch": 0,
                    "step": 4,
                    "loss": 0.4 * loss_scale,
                    "accuracy": 0.5,
                    "time_cost": 3.0,
                    "samples_per_sec": samples_per_sec,
                }
            )
            records.append({"kind": "eval", "epoch": 0, "step": 4, "top1": 0.6, "loss": 0.9})
    records.append({"kind": "end", "total_time": 12.0, "steps": 6})
    return records


def test_identical_logs_pass():
    lines = []
    ok, message = reproduce.compare_logs(make_log(), make_log(), report=lines.append)
    assert ok, message
    assert "6 records match" in message  # 3 step, epoch, eval and the end record
    assert len(lines) == 6 and lines[0].startswith("ok  step epoch=0 step=2")
    assert lines[-1].startswith("ok  end")


def test_a_record_missing_from_the_rerun_is_a_divergence():
    new = [r for r in make_log() if r["kind"] != "eval"]
    ok, message = reproduce.compare_logs(make_log(), new)
    assert not ok and "eval epoch=0 step=4: the rerun has no such record" in message


def test_a_field_missing_from_the_rerun_is_a_divergence():
    new = make_log()
    del new[2]["loss"]
    ok, message = reproduce.compare_logs(make_log(), new)
    assert not ok and "step epoch=0 step=4, field 'loss': the rerun's record lacks it" in message


def test_a_full_rerun_must_have_the_end_record():
    new = [r for r in make_log() if r["kind"] != "end"]  # reached step 6, as the original
    ok, message = reproduce.compare_logs(make_log(), new)
    assert not ok and "end epoch=None step=None: the rerun has no such record" in message


def test_perturbed_loss_fails_naming_record_and_field():
    new = make_log()
    new[2]["loss"] *= 1 + 1e-3  # step 4
    ok, message = reproduce.compare_logs(make_log(), new, rtol=1e-4, atol=1e-6)
    assert not ok
    assert "step epoch=0 step=4" in message and "'loss'" in message
    assert "original:" in message and "rerun:" in message


def test_perturbation_within_tolerance_passes():
    new = make_log(loss_scale=1 + 1e-6)
    assert reproduce.compare_logs(make_log(), new, rtol=1e-4, atol=1e-6)[0]


def test_first_divergence_is_reported():
    new = make_log(loss_scale=2.0)
    ok, message = reproduce.compare_logs(make_log(), new)
    assert not ok and "step epoch=0 step=2" in message


def test_timing_fields_ignored():
    new = make_log(samples_per_sec=5.0)
    new[-1]["total_time"] = 99.0
    assert reproduce.compare_logs(make_log(), new)[0]


def test_header_only_fails():
    ok, message = reproduce.compare_logs(make_log(), [dict(HEADER)])
    assert not ok and "no comparable records" in message


def test_prefix_of_a_shortened_rerun_is_compared():
    # A rerun with --max-steps 5: epoch 1 is cut short and logs its record at step 5.
    new = [r for r in make_log() if r.get("step", 0) <= 4 and r["kind"] != "end"]
    new.append({"kind": "epoch", "epoch": 1, "step": 5, "loss": 123.0, "accuracy": 0.0})
    ok, message = reproduce.compare_logs(make_log(), new)
    assert ok and "4 records match" in message, message


def test_stepless_epoch_record_of_a_shortened_rerun_is_skipped():
    original = make_log()
    original.insert(-1, {"kind": "epoch", "epoch": 1, "loss": 0.2})
    new = [r for r in make_log() if r.get("step", 0) <= 4 and r["kind"] != "end"]
    new.append({"kind": "epoch", "epoch": 1, "loss": 123.0})  # partial epoch
    assert reproduce.compare_logs(original, new)[0]


def test_nan_matches_nan_only():
    a, b = make_log(), make_log()
    a[1]["loss"] = b[1]["loss"] = float("nan")
    assert reproduce.compare_logs(a, b)[0]
    b[1]["loss"] = 1.0
    assert not reproduce.compare_logs(a, b)[0]


def test_build_command_replaces_flags_and_uses_torchrun():
    header = {
        "command": ["scripts/t.py", "--lr", "0.1", "--max-steps=9", "--run-log", "a.jsonl"],
        "world_size": 1,
    }
    cmd = reproduce.build_command(header, "/tmp/r.jsonl", max_steps=3, python="py")
    assert cmd == [
        "py",
        str(reproduce.REPO_ROOT / "scripts/t.py"),
        "--lr",
        "0.1",
        "--run-log",
        "/tmp/r.jsonl",
        "--max-steps",
        "3",
    ]
    header["world_size"] = 4
    cmd = reproduce.build_command(header, "r.jsonl", python="py")
    assert cmd[:6] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    assert "--max-steps=9" in cmd  # kept when no --max-steps is asked for
    # an elastic log: the project's torchrun (a fresh store each round), a fresh state dir
    header["command"] = [*header["command"], "--elastic-dir", "/old/job"]
    cmd = reproduce.build_command(header, "/tmp/x/r.jsonl", python="py")
    assert cmd[:7] == ["py", "-m", "trainers.elastic", "torchrun", "--standalone",
                       "--nproc-per-node", "4"]  # fmt: skip
    assert cmd[cmd.index("--elastic-dir") + 1] == "/tmp/x/elastic"


def test_default_tolerances_by_world_size():
    assert reproduce.default_tolerances(1) == (1e-4, 1e-6)
    assert reproduce.default_tolerances(8) == (1e-3, 1e-5)


FAKE_TRAINER = """
import argparse, json
p = argparse.ArgumentParser()
p.add_argument("--run-log"); p.add_argument("--max-steps", type=int, default=6)
p.add_argument("--noise", type=float, default=0.0)
a = p.parse_args()
with open(a.run_log, "w") as f:
    f.write(json.dumps({"kind": "header", "command": [], "world_size": 1}) + "\\n")
    for s in range(1, a.max_steps + 1):
        f.write(json.dumps({"kind": "step", "epoch": 0, "step": s, "loss": 1.0 / s + a.noise,
                            "samples_per_sec": 1.0}) + "\\n")
    f.write(json.dumps({"kind": "end", "steps": a.max_steps}) + "\\n")
"""


def _published_log(tmp_path, extra_args=(), fingerprint="here"):
    script = tmp_path / "fake_train.py"
    script.write_text(textwrap.dedent(FAKE_TRAINER))
    header = {"kind": "header", "command": [str(script), *extra_args], "world_size": 1}
    if fingerprint == "here":
        header["fingerprint"] = reproduce.native_fingerprint()
    elif fingerprint is not None:
        header["fingerprint"] = fingerprint
    records = (
        [header]
        + [
            {"kind": "step", "epoch": 0, "step": s, "loss": 1.0 / s, "samples_per_sec": 9.0}
            for s in range(1, 7)
        ]
        + [{"kind": "end", "steps": 6}]
    )
    log = tmp_path / "published.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    return log


def test_main_reruns_and_passes(tmp_path, capsys):
    log = _published_log(tmp_path)
    assert reproduce.main([str(log), "--max-steps", "3", "--python", sys.executable]) == 0
    out = capsys.readouterr().out
    assert "reproduced: 3 records match" in out


@pytest.mark.slow
def test_main_fails_on_divergence(tmp_path, capsys):
    log = _published_log(tmp_path, ["--noise", "0.01"])
    assert reproduce.main([str(log), "--python", sys.executable]) == 1
    err = capsys.readouterr().err
    assert "first divergence at step epoch=0 step=1" in err and "'loss'" in err


@pytest.mark.slow
def test_main_reports_failed_rerun(tmp_path, capsys):
    log = _published_log(tmp_path, ["--no-such-flag"])
    assert reproduce.main([str(log), "--python", sys.executable]) == 3
    assert "rerun failed" in capsys.readouterr().err


@pytest.mark.parametrize("content", ["", '{"kind": "step", "step": 1}\n'])
def test_main_rejects_log_without_header(tmp_path, capsys, content):
    log = tmp_path / "bad.jsonl"
    log.write_text(content)
    assert reproduce.main([str(log)]) == 2
    assert "header" in capsys.readouterr().err


def test_main_refuses_a_log_that_never_finished(tmp_path, capsys):
    log = _published_log(tmp_path)
    records = log.read_text().splitlines()
    log.write_text("\n".join(records[:-1]) + "\n")  # the end record is gone: a stopped run
    assert reproduce.main([str(log), "--python", sys.executable]) == 2
    err = capsys.readouterr().err
    assert "no end record" in err and "never finished" in err and "step 6" in err
    assert "Traceback" not in err


def test_rerun_uses_the_original_thread_count_and_pins():
    # CPU reductions sum in a thread-count-dependent order; the fingerprint records the count
    # and the ISA pins, which the rerun gets exactly (unrecorded pins are removed).
    header = {"fingerprint": {"threads": 1, "isa_pins": {"ATEN_CPU_CAPABILITY": "avx2"}}}
    base = {"OMP_NUM_THREADS": "8", "PATH": "/bin", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    env = reproduce.rerun_env(header, base=base)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and "ONEDNN_MAX_CPU_ISA" not in env
    assert env["PATH"] == "/bin" and str(reproduce.REPO_ROOT) in env["PYTHONPATH"].split(os.pathsep)
    # the statistical rerun of a log this machine cannot re-create keeps the caller's kernels
    assert reproduce.rerun_env(header, base=base, pins=False)["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    # an older log with the count at the top level and no fingerprint
    assert reproduce.rerun_env({"threads": 3}, base={})["OMP_NUM_THREADS"] == "3"
    cuda = {"fingerprint": {"device": {"type": "cuda"}, "deterministic": True}}
    env = reproduce.rerun_env(cuda, base={})
    assert env["MODELZOO_DETERMINISTIC"] == "1" and env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_main_says_not_comparable_for_a_log_without_fingerprint(tmp_path, capsys):
    log = _published_log(tmp_path, fingerprint=None)
    assert reproduce.main([str(log), "--max-steps", "3", "--python", sys.executable]) == 4
    out = capsys.readouterr().out
    assert "not comparable: the log has no machine fingerprint" in out
    assert "rerunning" not in out  # an exact check that cannot be made is not spent


@pytest.mark.slow
def test_main_says_not_comparable_for_another_processor(tmp_path, capsys):
    other = reproduce.native_fingerprint()
    other["cpu"] = {**other["cpu"], "vendor": "SomeOtherVendor", "model": -1}
    log = _published_log(tmp_path, fingerprint=other)
    assert reproduce.main([str(log), "--max-steps", "3", "--python", sys.executable]) == 4
    assert "not comparable: the log was made on SomeOtherVendor" in capsys.readouterr().out


def _claims(tmp_path, log, claim, *, trivial=None, diagnosis=None):
    path = tmp_path / "claims.json"
    entry = {
        "description": "fake", "metric": "loss", "source": "end", "documented_minimum": claim,
        "min_seeds": 1, "logs": [str(log.resolve())], "seeds": [0], "values": [claim], "n": 1,
        "mean": claim, "std": None, "min": claim, "max": claim, "claim": claim,
        "status": "negative" if diagnosis else "legacy", "baseline": None,
        "trivial": None if trivial is None else {"value": trivial, "how": "majority class (x)"},
        "diagnosis": diagnosis,
    }  # fmt: skip
    path.write_text(json.dumps({"recipes": {"fake": entry}}))
    return path


FULL_TRAINER = FAKE_TRAINER.replace(
    'json.dumps({"kind": "end", "steps": a.max_steps})',
    'json.dumps({"kind": "end", "steps": a.max_steps, "loss": 1.0 / a.max_steps})',
)


@pytest.mark.slow
def test_full_rerun_checks_the_claim(tmp_path, capsys):
    log = _published_log(tmp_path)
    (tmp_path / "fake_train.py").write_text(textwrap.dedent(FULL_TRAINER))
    # the fake run ends at loss 1/6 ~ 0.167 ("higher is better" for every published metric)
    met = _claims(tmp_path, log, 0.1)
    assert reproduce.main([str(log), "--full", "--claims", str(met)]) == 0
    out = capsys.readouterr().out
    assert "reproduced:" in out and "claim met: recipe fake: loss=0.166667" in out
    missed = _claims(tmp_path, log, 0.5)
    assert reproduce.main([str(log), "--full", "--claims", str(missed)]) == 1
    assert "claim missed" in capsys.readouterr().err


@pytest.mark.slow
def test_full_rerun_at_the_trivial_level_fails_whatever_the_band(tmp_path, capsys):
    log = _published_log(tmp_path)
    (tmp_path / "fake_train.py").write_text(textwrap.dedent(FULL_TRAINER))
    # loss 1/6 meets the band (>= 0.1) but a constant predictor reaches 0.2 here
    at_trivial = _claims(tmp_path, log, 0.1, trivial=0.2)
    assert reproduce.main([str(log), "--full", "--claims", str(at_trivial)]) == 1
    assert "at the task's trivial level (majority class (x))" in capsys.readouterr().err


@pytest.mark.slow
def test_full_rerun_of_a_negative_result_checks_that_the_failure_reproduces(tmp_path, capsys):
    log = _published_log(tmp_path)
    (tmp_path / "fake_train.py").write_text(textwrap.dedent(FULL_TRAINER))
    stays = _claims(tmp_path, log, 0.2, diagnosis="diverges")  # loss 1/6 stays under 0.2
    assert reproduce.main([str(log), "--full", "--claims", str(stays)]) == 0
    assert "negative result reproduced" in capsys.readouterr().out
    fixed = _claims(tmp_path, log, 0.1, diagnosis="diverges")  # 1/6 > 0.1: it learns now
    assert reproduce.main([str(log), "--full", "--claims", str(fixed)]) == 1
    assert "negative result NOT reproduced" in capsys.readouterr().err


@pytest.mark.slow
def test_full_rerun_on_a_machine_that_cannot_compare_exits_4_when_the_claim_holds(tmp_path, capsys):
    log = _published_log(tmp_path, fingerprint=None)
    (tmp_path / "fake_train.py").write_text(textwrap.dedent(FULL_TRAINER))
    assert reproduce.main([str(log), "--full", "--claims", str(_claims(tmp_path, log, 0.1))]) == 4
    out = capsys.readouterr().out
    assert "not comparable" in out and "claim met" in out and "reproduced:" not in out
    assert reproduce.main([str(log), "--full", "--claims", str(_claims(tmp_path, log, 0.5))]) == 1


def test_full_rerun_of_an_unpublished_log_is_refused_before_running(tmp_path, capsys):
    log = _published_log(tmp_path)
    other = tmp_path / "other.jsonl"
    other.write_text(log.read_text())
    assert reproduce.main([str(other), "--full", "--claims", str(_claims(tmp_path, log, 0.1))]) == 2
    err = capsys.readouterr().err
    assert "not a seed of any recipe" in err


def _listed(note: str) -> list[str]:
    """The files a code_changes note lists (not the git command it quotes)."""
    return note.split(" these files changed: ", 1)[1].split(" (git diff ", 1)[0].split(", ")


def test_code_changes_since_the_log_commit_are_reported(tmp_path):
    # A repository of its own: the answer must not depend on this checkout's work tree.
    import subprocess

    def git(*args: str) -> str:
        env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
               "GIT_COMMITTER_EMAIL": "t@t", "PATH": os.environ["PATH"]}  # fmt: skip
        done = subprocess.run(["git", *args], cwd=tmp_path, capture_output=True, text=True,
                              env=env, check=True)  # fmt: skip
        return done.stdout.strip()

    (tmp_path / "scripts").mkdir()
    (tmp_path / "modelzoo").mkdir()
    (tmp_path / "scripts" / "train.py").write_text("print(1)\n")
    (tmp_path / "scripts" / "other.py").write_text("print(2)\n")
    (tmp_path / "modelzoo" / "a.py").write_text("A = 1\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "first")
    first = git("rev-parse", "HEAD")
    header = {"git": first, "command": ["scripts/train.py"]}
    assert reproduce.code_changes(header, root=tmp_path) is None  # nothing changed

    (tmp_path / "modelzoo" / "a.py").write_text("A = 2\n")  # uncommitted: counted
    (tmp_path / "scripts" / "other.py").write_text("print(3)\n")  # another script: not
    note = reproduce.code_changes(header, root=tmp_path)
    assert note is not None and first[:12] in note and _listed(note) == ["modelzoo/a.py"]

    git("commit", "-qam", "second")
    (tmp_path / "scripts" / "train.py").write_text("print(4)\n")
    note = reproduce.code_changes(header, root=tmp_path)
    assert note is not None and _listed(note) == ["modelzoo/a.py", "scripts/train.py"]
    head = {"git": git("rev-parse", "HEAD"), "command": ["scripts/train.py"]}
    assert _listed(reproduce.code_changes(head, root=tmp_path)) == ["scripts/train.py"]

    missing = reproduce.code_changes({"git": "0" * 40, "command": ["scripts/x.py"]}, root=tmp_path)
    assert missing is not None and "not in this checkout" in missing
