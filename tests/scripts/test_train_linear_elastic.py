"""scripts/train_linear.py --elastic-dir: a job killed mid-run resumes under another world size.

Oracles: the uninterrupted run of the same flags (its end record, its step losses, its final
weights); "every training row once per epoch" for the CA-SGD ledger. A failure strikes
before the solver's step N+1, after ``state.pt`` was written and later steps were logged:
an exception in every rank (the run's process group and files are left as a dead worker
leaves them; the next run builds everything anew), or, under torchrun, a real exit of every
worker in the first attempt (``TRAIN_LINEAR_TEST_CRASH_AT``).

This file is also the worker: ``python -m tests.scripts.test_train_linear_elastic FLAGS`` is
train_linear.py (with that crash), ``... --jobs FILE`` runs a JSON list of jobs
``{"flags": [...], "crash_at": N or null}`` one after the other in one process group, so
that the two-process parts of every test below cost one start of two processes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests._tiers import slow_fixture

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "train_linear.py"
CRASH_VAR = "TRAIN_LINEAR_TEST_CRASH_AT"
CRASH_CODE = 17
FREEZE_VAR = "TRAIN_LINEAR_TEST_FREEZE_AT"  # rank 1 stops itself (SIGSTOP) there: a partition
THAW_AFTER = 25.0  # ... and is continued this many seconds later

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")


def _load_script():
    spec = importlib.util.spec_from_file_location("train_linear_elastic_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Crash(RuntimeError):
    """The in-process stand-in for a dead worker."""


def _install_crash(at: int, die) -> None:
    """Call ``die()`` before the solver's step ``at + 1`` (L-BFGS iteration or mini-batch)."""
    from trainers.linear import DataParallelLBFGS, FeaturePartitionedSGD

    def guard(method, count):
        def wrapped(self, *args, **kwargs):
            if count(self) >= at:
                die()
            return method(self, *args, **kwargs)

        return wrapped

    DataParallelLBFGS.step = guard(DataParallelLBFGS.step, lambda s: s.iterations)
    for name in ("step", "unrolled_step"):
        setattr(FeaturePartitionedSGD, name,
                guard(getattr(FeaturePartitionedSGD, name), lambda s: s.steps))  # fmt: skip


@pytest.fixture(scope="module")
def script():
    return _load_script()


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    for var in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        CRASH_VAR,
        FREEZE_VAR,
        "MODELZOO_PEER_TIMEOUT",
    ):
        monkeypatch.delenv(var, raising=False)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip


def _launch_jobs(world: int, jobs: list[dict], directory: Path) -> None:
    """``world`` gloo ranks on 127.0.0.1 running ``jobs`` in turn (see the module docstring)."""
    from tests.trainers._launch import run_ranks

    path = directory / "jobs.json"
    path.write_text(json.dumps(jobs), encoding="utf-8")
    run_ranks("tests.scripts.test_train_linear_elastic", ["--jobs", str(path)], world=world,
              timeout=240)  # fmt: skip


def _crash_in_process(script, flags: list[str], at: int) -> None:
    """Run ``flags`` in this process; it "dies" (an exception) before the solver's step
    ``at + 1``. The solver classes are restored afterwards."""
    from trainers.linear import DataParallelLBFGS, FeaturePartitionedSGD

    def die():
        raise Crash(f"killed before step {at + 1}")

    originals = [(DataParallelLBFGS, "step", DataParallelLBFGS.step),
                 (FeaturePartitionedSGD, "step", FeaturePartitionedSGD.step),
                 (FeaturePartitionedSGD, "unrolled_step", FeaturePartitionedSGD.unrolled_step)]  # fmt: skip
    _install_crash(at, die)
    try:
        script.main(flags)
    except Crash:
        return
    finally:
        for cls, name, method in originals:
            setattr(cls, name, method)
    raise AssertionError(f"the run {flags} ended before step {at + 1}")


def _check_resumed_log(records: list[dict], oracle: list[dict], *, restored: int, old: int,
                       new: int, rtol: float) -> None:  # fmt: skip
    """Each step once, the step losses and the end metrics of the uninterrupted run, one
    membership record at the restored step."""
    kinds = [r["kind"] for r in records]
    assert kinds.count("header") == 1 and kinds[-1] == "end"
    (change,) = [r for r in records if r["kind"] == "membership"]
    assert (change["step"], change["old_world_size"], change["new_world_size"]) == (
        restored, old, new)  # fmt: skip
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps == [r["step"] for r in oracle if r["kind"] == "step"]
    assert len(steps) == len(set(steps))  # no redone step logged twice
    for kind in ("epoch", "eval"):
        assert [r["step"] for r in records if r["kind"] == kind] == [
            r["step"] for r in oracle if r["kind"] == kind]  # fmt: skip
    losses = [r["loss"] for r in records if r["kind"] == "step"]
    assert losses == pytest.approx([r["loss"] for r in oracle if r["kind"] == "step"], rel=rtol)
    for key in ("train_objective", "test_loss", "steps", "epochs", "messages"):
        assert records[-1][key] == pytest.approx(oracle[-1][key], rel=rtol), key


def _state(directory: Path) -> dict:
    from trainers.checkpoint import load_checkpoint

    return load_checkpoint(directory / "state.pt")


LBFGS = ["--dataset", "digits", "--precision", "fp64", "--iterations", "20",
         "--elastic-checkpoint-steps", "3"]  # fmt: skip
SA = ["--dataset", "breast_cancer", "--precision", "fp64", "--sa-batches", "3",
      "--iterations", "8", "--elastic-checkpoint-steps", "3"]  # fmt: skip
CASGD = ["--dataset", "wine", "--solver", "casgd", "--s-steps", "4", "--precision", "fp64",
         "--batch-size", "16", "--num-epochs", "3", "--elastic-checkpoint-steps", "6"]  # fmt: skip


@slow_fixture(scope="module")
def jobs(script, tmp_path_factory):
    """Every run of the three resume tests: the uninterrupted oracles, the crashed runs and
    their resumptions; in this process (1 rank) or in one launch of 2 ranks."""
    root = tmp_path_factory.mktemp("elastic_linear")
    paths = {name: (root / f"{name}.jsonl", root / name)
             for name in ("lbfgs", "lbfgs_oracle", "sa", "sa_oracle", "casgd", "casgd_oracle")}  # fmt: skip

    def flags(base: list[str], name: str, elastic: bool = True) -> list[str]:
        log, job = paths[name]
        return [*base, "--run-log", str(log), *(["--elastic-dir", str(job)] if elastic else [])]

    for base, name in ((LBFGS, "lbfgs"), (SA, "sa"), (CASGD, "casgd")):
        assert script.main(flags(base, f"{name}_oracle", elastic=name != "sa")) == 0
    seen: dict[str, dict] = {}
    # SA: 1 rank; saves at 3, 6, 8 (batch 0 done), 9 (batch 1, 1 iteration in); dies at 10.
    # CA-SGD: 133 rows, 9 mini-batches an epoch in rounds of 4, 4, 1: saves at 8, 9 (epoch 0
    # done) and 13; the round to step 17 is logged, then it dies.
    _crash_in_process(script, flags(SA, "sa"), at=10)
    _crash_in_process(script, flags(CASGD, "casgd"), at=14)
    for name in ("sa", "casgd"):
        seen[name] = {"crashed_state": _state(paths[name][1]),
                      "crashed_log": _records(paths[name][0])}  # fmt: skip
    _launch_jobs(2, [
        {"flags": flags(LBFGS, "lbfgs"), "crash_at": 7},  # saves at 3 and 6; dies after 7
        {"flags": flags(SA, "sa"), "crash_at": None},
        {"flags": flags(CASGD, "casgd"), "crash_at": None},
    ], root)  # fmt: skip
    seen["lbfgs"] = {"crashed_state": _state(paths["lbfgs"][1]),
                     "crashed_log": _records(paths["lbfgs"][0])}  # fmt: skip
    assert script.main(flags(LBFGS, "lbfgs")) == 0
    return {name: {"log": _records(log), "dir": job, **seen.get(name, {})}
            for name, (log, job) in paths.items()}  # fmt: skip


# -- L-BFGS: 2 processes die at iteration 7 (last save at 6), 1 process finishes ----------------
@pytest.mark.dist
def test_lbfgs_resumed_on_one_process_equals_the_uninterrupted_run(jobs):
    oracle, run = jobs["lbfgs_oracle"], jobs["lbfgs"]
    assert oracle["log"][-1]["steps"] == 20  # not converged early: the resumed part has work
    assert [r["step"] for r in run["crashed_log"] if r["kind"] == "step"][
        -1
    ] == 7  # logged, unsaved
    assert (run["crashed_state"]["step"], run["crashed_state"]["world_size"]) == (6, 2)
    _check_resumed_log(run["log"], oracle["log"], restored=6, old=2, new=1, rtol=1e-9)
    ours, theirs = _state(run["dir"]), _state(oracle["dir"])
    assert ours["finished"]
    for a, b in zip(ours["solver"]["solver"]["params"], theirs["solver"]["solver"]["params"],
                    strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


# -- SA L-BFGS: 1 process dies in the second arriving batch, 2 processes finish -----------------
@pytest.mark.dist
def test_sa_lbfgs_resumed_mid_batch_on_two_processes(jobs):
    oracle, run = jobs["sa_oracle"], jobs["sa"]
    assert oracle["log"][-1]["epochs"] == 3 and oracle["log"][-1]["steps"] == 24
    saved = run["crashed_state"]
    assert (saved["step"], saved["batch"], saved["iteration"], saved["in_batch"]) == (9, 1, 1, True)
    assert saved["solver"]["arrived"] == 2
    assert [r["step"] for r in run["crashed_log"] if r["kind"] == "step"][-1] == 10
    _check_resumed_log(run["log"], oracle["log"], restored=9, old=1, new=2, rtol=1e-9)


# -- CA-SGD (s = 4): 1 process dies mid-epoch, 2 processes (other column blocks) finish ---------
@pytest.mark.dist
def test_casgd_resumed_on_two_processes_equals_the_uninterrupted_run(jobs):
    from trainers.elastic import committed_samples

    oracle, run = jobs["casgd_oracle"], jobs["casgd"]
    saved = run["crashed_state"]
    assert (saved["step"], saved["epoch"], saved["batch"]) == (13, 1, 4)
    assert [r["step"] for r in run["crashed_log"] if r["kind"] == "step"][-1] == 17
    _check_resumed_log(run["log"], oracle["log"], restored=13, old=1, new=2, rtol=1e-9)
    torch.testing.assert_close(_state(run["dir"])["w"], _state(oracle["dir"])["w"], rtol=1e-9,
                               atol=1e-12)  # fmt: skip
    # the ledger: every training row's committed use is once per epoch, across both worlds
    used = committed_samples(run["dir"])
    assert sorted(used) == [0, 1, 2]
    for epoch, ids in used.items():
        assert sorted(ids) == list(range(133)), epoch
        assert max(Counter(ids).values()) == 1


# -- bad input ------------------------------------------------------------------------------------
def test_a_state_of_another_configuration_is_refused_naming_file_and_field(script, tmp_path):
    from trainers.checkpoint import save_checkpoint

    job = tmp_path / "job"
    flags = ["--dataset", "wine", "--solver", "casgd", "--s-steps", "4", "--max-steps", "8",
             "--elastic-dir", str(job)]  # fmt: skip
    assert script.main(flags) == 0
    state = job / "state.pt"
    cases = [
        (["--s-steps", "2"], "s=4"),
        (["--solver", "sgd"], "solver='casgd'"),
        (["--dataset", "breast_cancer"], "dataset='wine'"),
        (["--wd", "0.01"], "wd=0.001"),
        (["--precision", "fp64"], "precision='fp32'"),
        ([], "already finished"),  # the same flags: a finished job does not start again
    ]
    for change, field in cases:
        with pytest.raises(SystemExit) as err:
            script.main([*flags, *change])
        assert str(state) in str(err.value) and field in str(err.value), (change, err.value)
    save_checkpoint(state, {"step": 3, "model": {}, "hooks": []})  # a Trainer's state.pt
    with pytest.raises(SystemExit, match="is not a train_linear elastic state"):
        script.main(flags)
    with pytest.raises(SystemExit) as err:
        script.main(["--elastic-lr-scaling", "linear", "--elastic-dir", str(job)])
    assert err.value.code == 2


# -- torchrun restarts the workers after a crash or a silent peer --------------------------------
TORCHRUN_FLAGS = ["--dataset", "synthetic", "--synthetic-samples", "300",
                  "--synthetic-features", "40", "--nnz-per-row", "6", "--solver", "casgd",
                  "--s-steps", "4", "--precision", "fp64", "--batch-size", "16",
                  "--num-epochs", "2", "--elastic-checkpoint-steps", "20"]  # fmt: skip


def _torchrun_job(script, tmp_path, launcher: list[str], env: dict[str, str]):
    """The uninterrupted run's records, then the same flags as an elastic job of 2 workers
    under ``launcher`` (torchrun, one restart allowed); returns (oracle, run log, result)."""
    from tests.trainers._launch import free_port

    assert script.main([*TORCHRUN_FLAGS, "--run-log", str(tmp_path / "oracle.jsonl")]) == 0
    log = tmp_path / "run.jsonl"
    command = [sys.executable, "-m", *launcher, "--nnodes", "1", "--nproc-per-node", "2",
               "--max-restarts", "1", "--monitor-interval", "0.1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-conf", "last_call_timeout=1",
               "-m", "tests.scripts.test_train_linear_elastic", *TORCHRUN_FLAGS, "--run-log",
               str(log), "--elastic-dir", str(tmp_path / "job")]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env={**_env(), **env}, capture_output=True,
                            text=True, timeout=240)  # fmt: skip
    return _records(tmp_path / "oracle.jsonl"), log, result


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_max_restarts_resumes_after_a_crash(script, tmp_path):
    oracle, log, result = _torchrun_job(
        script, tmp_path, ["torch.distributed.run"],
        {CRASH_VAR: "19", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # 225 rows, 15 mini-batches an epoch (rounds of 4, 4, 4, 3): saved at 15 (epoch 0 done);
    # step 19 is logged, then both workers die; torchrun starts a new group, which redoes it
    _check_resumed_log(_records(log), oracle, restored=15, old=2, new=2, rtol=1e-9)
    assert _records(log)[0]["world_size"] == 2


@pytest.mark.dist
@pytest.mark.slow
def test_a_silent_peer_is_given_up_in_seconds_and_the_job_resumes(script, tmp_path):
    """A partition as the survivors see it: a peer that stops answering without closing its
    sockets (rank 1 SIGSTOPs itself before step 20, and is continued 25 s later). Rank 0's
    default watchdog (5 s for an elastic job under torchrun, nothing set) gives up with
    exit 75, torchrun re-forms the group, and the run equals the uninterrupted one. Without
    the watchdog rank 0 waits in its collective until the peer is continued, then the first
    attempt simply finishes: no give-up line, no restart."""
    import re

    from trainers.dist import PEER_LOST_EXIT_CODE

    oracle, log, result = _torchrun_job(
        script, tmp_path, ["trainers.elastic", "torchrun"], {FREEZE_VAR: "19"}
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    gave_up = re.search(r"rank 0: rank 1's heartbeat has not moved for ([0-9.]+) s", out)
    assert gave_up, out[-3000:]
    assert 5.0 <= float(gave_up.group(1)) < THAW_AFTER, gave_up.group(0)
    assert f"exitcode: {PEER_LOST_EXIT_CODE}" in out, out[-3000:]
    # saved at 15 (epoch 0 done); the new group redoes the steps after it
    _check_resumed_log(_records(log), oracle, restored=15, old=2, new=2, rtol=1e-9)


def _freeze_rank_one() -> None:
    """SIGSTOP this process (a silent peer: no exit, no closed socket) and have a helper
    continue it THAW_AFTER seconds later (then torchrun's pending SIGTERM ends it)."""
    import signal

    subprocess.Popen(["sh", "-c", f"sleep {THAW_AFTER}; kill -CONT {os.getpid()}"],
                     start_new_session=True)  # fmt: skip
    os.kill(os.getpid(), signal.SIGSTOP)
    os.environ.pop(FREEZE_VAR)


def _worker(argv: list[str]) -> int:
    script = _load_script()
    if argv[:1] != ["--jobs"]:  # under torchrun: really exit, in the first attempt only
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if os.environ.get(CRASH_VAR) and first:
            _install_crash(int(os.environ[CRASH_VAR]), lambda: os._exit(CRASH_CODE))
        if os.environ.get(FREEZE_VAR) and first and os.environ.get("RANK") == "1":
            at = int(os.environ[FREEZE_VAR])
            _install_crash(at, lambda: _freeze_rank_one() if FREEZE_VAR in os.environ else None)
        return script.main(argv)
    from trainers import DistEnv

    env = DistEnv.from_env()  # one process group for every job
    for job in json.loads(Path(argv[1]).read_text(encoding="utf-8")):
        if job["crash_at"] is not None:
            _crash_in_process(script, job["flags"], job["crash_at"])
        elif script.main(job["flags"]) != 0:
            return 1
    env.destroy(barrier=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
