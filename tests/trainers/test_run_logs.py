"""Run logs: JSONL records of docs/run_logs.md and GluonCV-style console lines."""

from __future__ import annotations

import datetime
import json
import math
import re
import sys

import numpy as np
import pytest
import torch

from tests.trainers._trainer_toys import ToyDataset, eval_step, make_mlp, train_step
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig, make_header, progress_bar
from trainers.logs import _REPO_ROOT, PhasedRunLogger, gluonnlp_step_line, ratio_metrics

FLOAT = r"-?\d+\.\d{6}"


def run(tmp_path, **logger_kwargs):
    logger = RunLogger(tmp_path / "run.jsonl", **logger_kwargs)
    argv = [str(_REPO_ROOT / "scripts" / "train_x.py"), "--lr", "0.1"]
    logger.header(make_header(argv, seed=0, world_size=1, config={"lr": 0.1, "dir": tmp_path}))
    model = make_mlp()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TrainerConfig(epochs=2, batch_size=4, log_interval=2),
        env=DistEnv(),
        logger=logger,
        train_step=train_step,
        eval_step=eval_step,
    )
    trainer.fit(ToyDataset(16), eval_dataset=ToyDataset(6))
    logger.close()
    return tmp_path / "run.jsonl"


def test_jsonl_records(tmp_path):
    path = run(tmp_path, console=False)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds == ["header"] + (["step"] * 2 + ["epoch", "eval"]) * 2 + ["end"]
    header = records[0]
    assert header["command"] == ["scripts/train_x.py", "--lr", "0.1"]
    assert header["seed"] == 0 and header["world_size"] == 1
    fp = header["fingerprint"]
    assert fp["threads"] == torch.get_num_threads() and fp["world_size"] == 1
    assert fp["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert (
        fp["versions"]["torch"] == torch.__version__ and fp["versions"]["numpy"] == np.__version__
    )
    assert {"python", "modelzoo", "Pillow", "scikit-learn", "tokenizers", "torch_geometric",
            "safetensors"} <= set(fp["versions"])  # fmt: skip
    assert set(fp["isa_pins"]) == {"ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR",
                                   "MKL_ENABLE_INSTRUCTIONS", "MKL_DYNAMIC",
                                   "MODELZOO_PORTABLE"}  # fmt: skip
    assert fp["onednn"] is torch.backends.mkldnn.enabled
    assert fp["device"]["type"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert header["git"] is None or re.fullmatch(r"[0-9a-f]{40}", header["git"])
    assert fp["git"]["commit"] == header["git"]
    assert header["config"] == {"lr": 0.1, "dir": str(tmp_path)}
    assert datetime.datetime.fromisoformat(header["time"]).utcoffset().total_seconds() == 0
    steps = [r for r in records if r["kind"] == "step"]
    assert [(r["epoch"], r["batch"], r["step"]) for r in steps] == [
        (0, 1, 2),
        (0, 3, 4),
        (1, 1, 6),
        (1, 3, 8),
    ]
    for r in steps:
        assert {"loss", "lr", "samples_per_sec", "accuracy"} <= set(r) and r["lr"] == 0.1
        assert 0 <= r["accuracy"] <= 1 and r["samples_per_sec"] > 0
    epoch = next(r for r in records if r["kind"] == "epoch")
    assert {"epoch", "loss", "samples_per_sec", "time_cost", "accuracy"} <= set(epoch)
    # The epoch loss is the mean of the per-micro-batch losses of both intervals.
    assert abs(epoch["loss"] - (steps[0]["loss"] + steps[1]["loss"]) / 2) < 1e-6
    evals = [r for r in records if r["kind"] == "eval"]
    assert [(r["epoch"], r["step"]) for r in evals] == [(0, 4), (1, 8)]
    assert {"top1", "loss"} <= set(evals[0]) and "count" not in evals[0]
    end = records[-1]
    assert end["steps"] == 8 and end["epochs"] == 2 and end["total_time"] > 0
    assert end["top1"] == evals[-1]["top1"]


def test_console_lines_in_gluoncv_style(tmp_path, capsys):
    run(tmp_path, logging_file=tmp_path / "train.log")
    out = capsys.readouterr().out.splitlines()
    # No Namespace(...) line: the header record holds the configuration (--print-config).
    step = rf"Epoch\[0\] Batch \[1\]\tSpeed: \d+\.\d\d samples/sec\tloss={FLOAT}\taccuracy={FLOAT}\tlr=0\.100000"
    assert re.fullmatch(step, out[0]), out[0]
    assert re.fullmatch(rf"\[Epoch 0\] training: loss={FLOAT} accuracy={FLOAT}", out[2])
    assert re.fullmatch(r"\[Epoch 0\] speed: \d+ samples/sec\ttime cost: \d+\.\d\d", out[3])
    assert re.fullmatch(rf"\[Epoch 0\] validation: top1={FLOAT} loss={FLOAT}", out[4])
    assert re.fullmatch(r"Training time for 2 epochs: \d+\.\d\d sec\.", out[-1])
    assert (tmp_path / "train.log").read_text().splitlines() == out


def test_an_unstarted_log_is_discarded_and_a_started_or_appended_one_kept(tmp_path):
    """A run that fails before training leaves no log (nor the folders made for it); a log
    with training records, or one this process appended to, stays."""
    from trainers.logs import discard_unstarted_logs

    fresh = RunLogger(tmp_path / "new" / "sub" / "run.jsonl", console=False,
                      logging_file=tmp_path / "new" / "console.log")  # fmt: skip
    fresh.header(make_header(["x.py"], seed=0, world_size=1))
    started = RunLogger(tmp_path / "started.jsonl", console=False)
    started.header(make_header(["x.py"], seed=0, world_size=1))
    started.step(epoch=0, batch=0, step=1, loss=1.0, lr=0.1, samples_per_sec=1.0)
    (tmp_path / "elastic.jsonl").write_text('{"kind": "header"}\n')
    appended = RunLogger(tmp_path / "elastic.jsonl", console=False, mode="a")
    discard_unstarted_logs()
    assert not (tmp_path / "new").exists()
    assert (tmp_path / "started.jsonl").is_file()
    assert (tmp_path / "elastic.jsonl").read_text() == '{"kind": "header"}\n'
    appended.close()


def test_an_unstarted_runs_tensorboard_folder_is_discarded_an_existing_one_kept(tmp_path):
    """The TensorBoard folder a failed run made (the writer creates it and an event file at
    once) goes with its log; a folder the user already had is left alone."""
    pytest.importorskip("tensorboard")
    from trainers.logs import discard_unstarted_logs

    fresh = RunLogger(tmp_path / "a.jsonl", console=False, tensorboard=tmp_path / "tb" / "new")
    fresh.header(make_header(["x.py"], seed=0, world_size=1))
    assert any((tmp_path / "tb" / "new").iterdir())  # the event file exists before training
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("x")
    kept = RunLogger(tmp_path / "b.jsonl", console=False, tensorboard=tmp_path / "mine")
    kept.header(make_header(["x.py"], seed=0, world_size=1))
    discard_unstarted_logs()
    assert not (tmp_path / "tb").exists() and not (tmp_path / "a.jsonl").exists()
    assert (tmp_path / "mine" / "keep.txt").read_text() == "x"


def test_only_rank_zero_writes(tmp_path, capsys):
    logger = RunLogger(tmp_path / "rank1.jsonl", enabled=False, logging_file=tmp_path / "r1.log")
    logger.header(make_header(["x.py"], seed=0, world_size=2))
    logger.step(epoch=0, batch=0, step=1, loss=1.0, lr=0.1, samples_per_sec=1.0)
    logger.end(total_time=1.0, steps=1, epochs=1)
    logger.close()
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().out == ""


def test_non_finite_numbers_are_null(tmp_path):
    with RunLogger(tmp_path / "a.jsonl", console=False) as logger:
        logger.eval(epoch=0, step=1, loss=float("nan"), top1=torch.tensor(0.5))
    record = json.loads((tmp_path / "a.jsonl").read_text())
    assert record == {"kind": "eval", "epoch": 0, "step": 1, "loss": None, "top1": 0.5}


def test_progress_bar_only_on_a_terminal(monkeypatch):
    items = [1, 2]
    assert progress_bar(items, enabled=False) is items
    monkeypatch.setattr(sys, "stderr", open(__file__))  # not a TTY  # noqa: SIM115
    try:
        assert progress_bar(items, enabled=True) is items
    finally:
        sys.stderr.close()


# -- the machine fingerprint and when two of them are comparable --------------------------------
def _pinned_fingerprint(env_extra):
    import os
    import subprocess

    code = "import json; from trainers.logs import machine_fingerprint as m; print(json.dumps(m()))"
    env = {**os.environ, "PYTHONPATH": str(_REPO_ROOT), **env_extra}
    for name in (
        "ATEN_CPU_CAPABILITY",
        "ONEDNN_MAX_CPU_ISA",
        "MKL_CBWR",
        "MKL_ENABLE_INSTRUCTIONS",
    ):
        if name not in env_extra:
            env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
def test_fingerprint_records_the_pins_in_force_and_the_capability_they_give():
    from trainers.logs import PORTABLE_CPU_PINS

    fp = _pinned_fingerprint({"OMP_NUM_THREADS": "1"})
    assert fp["threads"] == 1 and all(v is None for v in fp["isa_pins"].values())
    if "avx2" not in fp["cpu"]["flags"]:
        pytest.skip("needs an x86-64 CPU with AVX2")
    pinned = _pinned_fingerprint(PORTABLE_CPU_PINS)
    assert pinned["isa_pins"] == {**dict.fromkeys(pinned["isa_pins"]), **PORTABLE_CPU_PINS}
    # torch itself reports the pinned dispatch level: the pin is in force, not just recorded
    assert pinned["cpu_capability"] == "AVX2"


def test_fingerprint_cpu_matches_proc_cpuinfo():
    from pathlib import Path

    from trainers.logs import cpu_info

    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo")
    text = cpuinfo.read_text()
    info = cpu_info()
    vendor = re.search(r"^vendor_id\s*:\s*(.+)$", text, re.M)
    assert info["vendor"] == (vendor.group(1).strip() if vendor else None)
    flags = re.search(r"^(flags|Features)\s*:\s*(.+)$", text, re.M)
    if flags:
        assert ("avx2" in flags.group(2).split()) == ("avx2" in info["flags"])


def test_comparability_rules():
    from trainers.logs import machine_fingerprint, not_comparable_reason

    here = machine_fingerprint()
    assert "no machine fingerprint" in not_comparable_reason(None, here)

    def variant(**changes):
        fp = json.loads(json.dumps(here))
        for path, value in changes.items():
            node = fp
            *parents, leaf = path.split("__")
            for p in parents:
                node = node[p]
            node[leaf] = value
        return fp

    unpinned = variant(isa_pins__ATEN_CPU_CAPABILITY=None)
    assert not_comparable_reason(unpinned, here) is None  # this machine, same capability
    assert "arm64" in not_comparable_reason(variant(cpu__arch="arm64"), here)
    # another processor than this one (on an AMD EPYC, an Intel Xeon; else an AMD EPYC)
    if here["cpu"].get("vendor") == "AuthenticAMD":
        vendor, family, model = "GenuineIntel", 6, 207
    else:
        vendor, family, model = "AuthenticAMD", 25, 17
    other = variant(cpu__vendor=vendor, cpu__family=family, cpu__model=model)
    assert f"{vendor} family {family} model {model}" in not_comparable_reason(other, here)
    other_isa = variant(isa_pins__ATEN_CPU_CAPABILITY=None, cpu_capability="ZVECTOR")
    assert "only logs made with the ISA pinned" in not_comparable_reason(other_isa, here)
    no_avx2 = {**here, "cpu": {**here["cpu"], "flags": ["avx"]}}
    pinned = variant(isa_pins__ATEN_CPU_CAPABILITY="avx2")
    assert "lacks avx2" in not_comparable_reason(pinned, no_avx2)
    gpu = variant(device={"type": "cuda", "name": "NVIDIA H200", "capability": "9.0"})
    if here["device"]["type"] == "cpu":
        assert "CUDA device (NVIDIA H200)" in not_comparable_reason(gpu, here)


def test_git_state_counts_code_not_published_logs(tmp_path):
    """Publishing rewrites logs/claims.json between seeds: that is not a dirty tree."""
    import subprocess

    from trainers.fingerprint import _git_state

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "logs").mkdir()
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "logs" / "claims.json").write_text("{}\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    assert _git_state(tmp_path)["dirty"] is False
    (tmp_path / "logs" / "claims.json").write_text('{"recipes": {}}\n')
    (tmp_path / "untracked.txt").write_text("run output\n")
    state = _git_state(tmp_path)
    assert state["dirty"] is False and state["dirty_paths"] == ["logs/claims.json"]
    (tmp_path / "code.py").write_text("x = 2\n")
    state = _git_state(tmp_path)
    assert state["dirty"] is True and set(state["dirty_paths"]) == {"code.py", "logs/claims.json"}


def test_ratio_metrics_are_ratios_of_the_totals():
    # two micro-batches: 3/4 and 1/6 correct; the trainer reports the means of the sums
    means = {"correct": (3 + 1) / 2, "count": (4 + 6) / 2, "loss": 0.5}
    out = ratio_metrics(means, {"accuracy": ("correct", "count"), "other": ("a", "b")})
    assert out == {"loss": 0.5, "accuracy": pytest.approx(4 / 10)}
    assert math.isnan(ratio_metrics({"c": 1.0, "n": 0.0}, {"acc": ("c", "n")})["acc"])


def test_phased_logger_counts_steps_across_phases(tmp_path, capsys):
    """Two fits of 4 steps each (the second a new trainer counting from 0) in one log."""
    logger = PhasedRunLogger(tmp_path / "run.jsonl", ratios={"accuracy": ("hits", "n")})
    logger.header(make_header(["x.py"], seed=0, world_size=1, config={}))

    def counted_step(model, batch):
        x, y = batch
        logits = model(x)
        hits = (logits.argmax(1) == y).sum().float()
        return torch.nn.functional.cross_entropy(logits, y), {"hits": hits, "n": len(y)}

    def counted_eval(model, batch):
        return counted_step(model, batch)[1]

    done = 0
    for phase in (1, 2):
        model = make_mlp()
        trainer = Trainer(
            model, torch.optim.SGD(model.parameters(), lr=0.1),
            TrainerConfig(epochs=1, batch_size=4, log_interval=2, eval_interval=1),
            env=DistEnv(), logger=logger, train_step=counted_step, eval_step=counted_eval,
        )  # fmt: skip
        logger.start_phase(phase, done, trainer)
        trainer.fit(ToyDataset(16), eval_dataset=ToyDataset(6))
        done += trainer.global_step
    logger.finish(total_time=1.0, steps=done, **trainer.last_eval)
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    steps = [(r["phase"], r["step"]) for r in records if r["kind"] == "step"]
    assert steps == [(1, 2), (1, 4), (2, 6), (2, 8)]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [(r["phase"], r["step"]) for r in evals] == [(1, 4), (2, 8)]
    assert [r["step"] for r in records if r["kind"] == "epoch"] == [4, 8]
    for r in evals + [r for r in records if r["kind"] == "step"]:
        assert "hits" not in r and 0.0 <= r["accuracy"] <= 1.0
    ends = [r for r in records if r["kind"] == "end"]
    assert len(ends) == 1 and records[-1] is ends[0] and ends[0]["steps"] == 8
    assert ends[0]["accuracy"] == evals[-1]["accuracy"]
    assert set(logger.phase_results) == {1, 2}
    assert "[Phase 2] 4 steps" in capsys.readouterr().out


def test_gluonnlp_step_line(tmp_path, capsys):
    logger = RunLogger(tmp_path / "r.jsonl", step_line=gluonnlp_step_line(42))
    logger.step(epoch=0, batch=4, step=5, loss=4.84371, lr=5e-5, samples_per_sec=9.871)
    out = capsys.readouterr().out.strip()
    assert out == "Epoch: 0, Batch: 5/42, Loss=4.8437, lr=0.0000500 Thoughput=9.87 samples/s"
    logger.close()
    record = json.loads((tmp_path / "r.jsonl").read_text())
    assert record == {"kind": "step", "epoch": 0, "batch": 4, "step": 5, "loss": 4.84371,
                      "lr": 5e-5, "samples_per_sec": 9.871}  # fmt: skip
