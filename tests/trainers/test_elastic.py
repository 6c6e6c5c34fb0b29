"""Elastic training: the lr rule, commits and restarts in one process, then real torchrun
agents on 127.0.0.1 that lose a node (killed while writing a checkpoint) and gain one.

Oracles: the Dynamic-SGD ramp values are computed by hand from the documented rule;
folded-momentum compensation is checked against torch's unfolded SGD; resumed runs against
an uninterrupted run; the ledger against the ids train_step really received and against
"every sample of every epoch exactly once".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests._tiers import slow_fixture
from tests.trainers import _elastic_worker as worker
from tests.trainers._trainer_toys import ToyDataset, eval_step, lr_fn, make_mlp, params, train_step
from trainers import DistEnv, GradCombiner, RunLogger, Trainer, TrainerConfig
from trainers.checkpoint import CheckpointError, load_checkpoint
from trainers.cli import add_elastic_args, build_elastic, elastic_resuming
from trainers.elastic import (
    ElasticState,
    LRRamp,
    committed_samples,
    register_folded_momentum,
    repair_run_log,
    target_lr_factor,
)

REPO = Path(__file__).resolve().parents[2]


# -- the learning-rate rule ------------------------------------------------------------------
def test_ramp_values_follow_the_documented_rule():
    # 2 -> 3 workers, W_ref = 2, 4 ramp steps, change before (0-based) step 10.
    ramp = LRRamp().after_change(10, target_lr_factor(3, 2, "linear"), 4)
    assert [ramp.factor(t) for t in range(8, 16)] == [1, 1, 1.125, 1.25, 1.375, 1.5, 1.5, 1.5]
    # 3 -> 2 in the middle of that ramp (before step 12): from 1.25 back to 1.0 over 4 steps.
    back = ramp.after_change(12, target_lr_factor(2, 2, "linear"), 4)
    assert [back.factor(t) for t in range(11, 17)] == [1.25, 1.1875, 1.125, 1.0625, 1.0, 1.0]
    # 0 ramp steps: at once. Adasum ("none"): never scaled.
    assert LRRamp().after_change(5, 0.5, 0).factor(5) == 0.5
    assert target_lr_factor(8, 2, "none") == 1.0
    assert target_lr_factor(1, 4, "linear") == 0.25
    with pytest.raises(ValueError, match="linear"):
        target_lr_factor(2, 1, "sqrt")


def _trainer(tmp_path, *, env=None, model=None, opt=None, logger=None, lr=lr_fn, **cfg):
    model = model if model is not None else make_mlp(seed=0)
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=1e-3)
    config = TrainerConfig(**{"epochs": 2, "batch_size": 8, "seed": 5, "log_interval": 0, **cfg})
    return Trainer(
        model,
        opt,
        config,
        env=env or DistEnv(),
        logger=logger or RunLogger(None, enabled=False),
        lr_schedule=lr,
        train_step=train_step,
        eval_step=eval_step,
        combiner=GradCombiner(),
    )


def test_world_size_change_sets_ramp_schedule_offset_and_logs_membership(tmp_path):
    first = _trainer(tmp_path, max_steps=6)
    ElasticState(first, tmp_path / "job", checkpoint_steps=3, ramp_steps=4, ledger=False)
    first.fit(ToyDataset(48))  # 6 steps of global batch 8 at world size 1; state at step 6
    # A worker group of 2 resumes it (rank 0's view; load() needs no communication).
    log = tmp_path / "run.jsonl"
    logger = RunLogger(log, console=False)
    second = _trainer(tmp_path, env=DistEnv(rank=0, world_size=2), logger=logger, max_steps=20)
    state = ElasticState(second, tmp_path / "job", ramp_steps=4, ledger=False)
    _unfinish(tmp_path / "job")
    assert state.load() and second.global_step == 6
    logger.close()
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["kind"] == "membership"
    assert (record["old_world_size"], record["new_world_size"], record["step"]) == (1, 2, 6)
    assert record["lr_ramp"] == {"start_step": 6, "steps": 4, "from_factor": 1.0, "to_factor": 2.0}
    # The schedule keeps its position in samples: step 6 at batch 8 = step 3 at batch 16.
    for step, factor in zip(range(6, 12), [1.25, 1.5, 1.75, 2.0, 2.0, 2.0], strict=True):
        position = 3 + (step - 6)
        assert second.lr_at(step) == pytest.approx(lr_fn(position) * factor, rel=1e-12)


def test_after_a_world_size_change_the_schedule_is_the_new_worlds(tmp_path):
    """A schedule given in epochs is rebuilt for the new world (steps per epoch at its global
    batch), not restored from the old world's checkpoint: the position the offset gives is in
    steps of the current world (docs/elastic.md). Oracle: the schedule formula for the new
    world's steps, read at step + offset."""
    from trainers.schedules import LinearWarmupRatio, create_schedule

    schedule = LinearWarmupRatio(0.2, 0.25)
    first = _trainer(tmp_path, lr=schedule, epochs=4, max_steps=6)
    ElasticState(first, tmp_path / "job", checkpoint_steps=3, ramp_steps=0, ledger=False)
    first.fit(ToyDataset(48))  # 6 steps/epoch at world 1: 24 steps, warm-up 6
    second = _trainer(tmp_path, lr=schedule, env=DistEnv(rank=0, world_size=2), epochs=4)
    state = ElasticState(second, tmp_path / "job", ramp_steps=0, ledger=False)
    _unfinish(tmp_path / "job")
    second.lr_schedule = second._build_schedule(48)  # what fit does before it loads
    assert state.load() and second.global_step == 6
    new_world = create_schedule("linear", base_lr=0.2, total_steps=12, warmup_steps=3)
    for step in range(6, 15):
        assert second.lr_at(step) == pytest.approx(new_world(step - 3) * 2.0, rel=1e-12)


def _unfinish(directory: Path) -> None:
    """Mark a finished job's state as resumable (to reuse it as a mid-run state)."""
    path = directory / "state.pt"
    state = load_checkpoint(path)
    for part in state["hooks"]:
        if isinstance(part, dict) and "elastic" in part:
            part["finished"] = False
    torch.save(state, path)


# -- momentum that folds the lr in -------------------------------------------------------------
class FoldedSGD(torch.optim.Optimizer):
    """MXNet's SGD: ``m = mu m - lr (g + wd w); w += m`` (the lr lives in ``m``)."""

    def __init__(self, params, lr, momentum, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "mom" not in state:
                    state["mom"] = torch.zeros_like(p)
                g = p.grad + group["weight_decay"] * p
                state["mom"].mul_(group["momentum"]).sub_(group["lr"] * g)
                p.add_(state["mom"])


class Compensated(FoldedSGD):
    pass


register_folded_momentum(Compensated, "mom")


@pytest.mark.parametrize("cls, equal", [(Compensated, True), (FoldedSGD, False)])
def test_folded_momentum_is_rescaled_with_the_lr(tmp_path, cls, equal):
    def run(make_opt):
        model = make_mlp(seed=0)
        trainer = _trainer(tmp_path, model=model, opt=make_opt(model), lr=None, max_steps=9)
        state = ElasticState(trainer, tmp_path / f"j{id(trainer)}", checkpoint_steps=0)
        state.ramp = LRRamp().after_change(2, 3.0, 5)  # lr x1 -> x3 over steps 2..6
        trainer.fit(ToyDataset(48))
        return params(model)

    reference = run(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    got = run(lambda m: cls(m.parameters(), lr=0.1, momentum=0.9))
    close = all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got, reference, strict=True)
    )
    assert close == equal


# -- commits and restarts in one process ---------------------------------------------------
class Crash(Exception):
    pass


def _crash_at(trainer: Trainer, step: int) -> None:
    """Make the trainer's train_step raise once, in the first micro-step of ``step``."""
    real, fired = trainer.train_step, []

    def crashing(model, batch):
        if trainer.global_step == step and not fired:
            fired.append(True)
            raise Crash(f"injected at step {step}")
        return real(model, batch)

    trainer.train_step = crashing


def test_in_memory_commit_restore_continues_bit_for_bit(tmp_path):
    reference = _trainer(tmp_path, epochs=3)
    reference.fit(ToyDataset(48))

    trainer = _trainer(tmp_path, epochs=3)
    state = ElasticState(trainer, tmp_path / "job", checkpoint_steps=0, commit_steps=4)
    _crash_at(trainer, 9)  # mid-epoch 1 (6 steps per epoch); last commit at step 8
    with pytest.raises(Crash):
        trainer.fit(ToyDataset(48))
    state.restore()
    assert trainer.global_step == 8
    trainer.fit(ToyDataset(48))
    assert trainer.global_step == reference.global_step == 18
    for a, b in zip(params(trainer.model), params(reference.model), strict=True):
        assert torch.equal(a, b)
    # The ledger: step 9's use before the crash is not committed, its redo is.
    samples = committed_samples(tmp_path / "job")
    assert sorted(samples) == [0, 1, 2]
    for ids in samples.values():
        assert sorted(ids) == list(range(48))


def test_durable_checkpoint_restart_resumes_and_finished_job_refuses(tmp_path):
    reference = _trainer(tmp_path, epochs=2)
    reference.fit(ToyDataset(48))

    job = tmp_path / "job"
    first = _trainer(tmp_path, epochs=2)
    ElasticState(first, job, checkpoint_steps=4)
    _crash_at(first, 6)  # the process "dies" in step 7; state.pt holds step 4
    with pytest.raises(Crash):
        first.fit(ToyDataset(48))
    assert load_checkpoint(job / "state.pt")["step"] == 4
    torn = job / ".state.pt.dead.tmp"
    torn.write_bytes(b"PK\x03\x04 torn")  # what a writer killed mid-save leaves
    log = tmp_path / "run.jsonl"
    logger = RunLogger(log, console=False)
    second = _trainer(tmp_path, epochs=2, logger=logger)
    state = ElasticState(second, job, checkpoint_steps=4)
    second.fit(ToyDataset(48))
    logger.close()
    assert state.restored_step == 4 and not torn.exists()
    for a, b in zip(params(second.model), params(reference.model), strict=True):
        assert torch.equal(a, b)
    membership = json.loads(log.read_text().splitlines()[0])
    assert membership["kind"] == "membership" and membership["restored_step"] == 4
    assert (membership["old_world_size"], membership["new_world_size"]) == (1, 1)
    samples = committed_samples(job)
    assert {e: sorted(ids) for e, ids in samples.items()} == {
        0: list(range(48)),
        1: list(range(48)),
    }
    # Steps 5 and 6 of the first process were redone: both uses are in the ledger files.
    raw = [json.loads(x) for p in (job / "ledger").glob("*.jsonl") for x in p.read_text().split()]
    assert sorted(r["step"] for r in raw if r["kind"] == "step").count(5) == 2

    third = _trainer(tmp_path, epochs=2)
    ElasticState(third, job)
    with pytest.raises(RuntimeError, match="already finished"):
        third.fit(ToyDataset(48))


def test_cli_flags_build_the_state_and_resume_the_run_log(tmp_path):
    parser = argparse.ArgumentParser()
    parser.add_argument("--grad-combine", default="average")
    add_elastic_args(parser)
    assert build_elastic(parser.parse_args([]), None) is None
    args = parser.parse_args(
        ["--elastic-dir", str(tmp_path), "--elastic-ramp-steps", "7", "--grad-combine", "adasum"]
    )
    trainer = _trainer(tmp_path)
    state = build_elastic(args, trainer)
    assert (state.lr_scaling, state.ramp_steps, state.checkpoint_steps) == ("none", 7, 50)
    assert trainer.hooks[-1] is state
    log = tmp_path / "run.jsonl"
    log.write_text('{"kind": "header"}\n{"kind": "st')
    assert not elastic_resuming(args, str(log), is_main=True)  # no state yet: a fresh start
    (tmp_path / "state.pt").write_bytes(b"x")
    assert elastic_resuming(args, str(log), is_main=True)
    assert log.read_text() == '{"kind": "header"}\n'  # the torn line is gone
    assert repair_run_log(tmp_path / "missing.jsonl") is False


# -- real agents ----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _records(path: Path) -> list[dict]:
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):  # a line being written
                out.append(json.loads(line))
    return out


class _Job:
    """torchrun agents (one worker each) sharing a c10d rendezvous on a store we host."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.port = _free_port()
        # The rendezvous store lives here, so any agent may die (see docs/elastic.md).
        self.store = torch.distributed.TCPStore(
            "127.0.0.1", self.port, is_master=True, wait_for_workers=False
        )
        self.agents: dict[str, subprocess.Popen] = {}

    def start_agent(self, name: str) -> None:
        conf = "last_call_timeout=1,is_host=false,keep_alive_interval=1,keep_alive_max_attempt=5"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2:3", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}",
            "--rdzv-id=elastic-test", "--max-restarts=3", "--monitor-interval=0.1",
            f"--rdzv-conf={conf}", "-m", "tests.trainers._elastic_worker", str(self.out),
        ]  # fmt: skip
        env = dict(
            os.environ,
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        )
        self.agents[name] = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=open(self.out / f"agent_{name}.log", "w"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killpg takes the whole agent
        )

    def gate(self, step: int) -> None:
        """Let the workers run up to ``step`` (see _elastic_worker)."""
        (self.out / "gate.tmp").write_text(str(step))
        os.replace(self.out / "gate.tmp", self.out / "gate")

    def reached(self, step: int, world_size: int) -> bool:
        return any(r["step"] >= step and r["world_size"] == world_size for r in self.ledger())

    def procs(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in (self.out / "procs").glob("*.json")]

    def ledger(self) -> list[dict]:
        return [
            r
            for p in (self.out / "elastic" / "ledger").glob("*.jsonl")
            for r in _records(p)
            if r["kind"] == "step"
        ]

    def wait_for(self, what: str, predicate, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            failed = {n: a.returncode for n, a in self.agents.items() if a.poll() not in (None, 0)}
            if failed and not getattr(self, "killed", None):
                raise AssertionError(
                    f"agents failed while waiting for {what}: {failed}\n{self.logs()}"
                )
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{self.logs()}")

    def kill_node(self, worker_pid: int) -> str:
        """SIGKILL a worker and its agent, as if the node died; returns the agent's name."""
        agent_pid = next(p["agent_pid"] for p in self.procs() if p["pid"] == worker_pid)
        name = next(n for n, a in self.agents.items() if a.pid == agent_pid)
        os.kill(worker_pid, signal.SIGKILL)
        os.killpg(agent_pid, signal.SIGKILL)
        self.killed = name
        return name

    def logs(self) -> str:
        return "\n".join(
            f"--- agent {n}:\n" + (self.out / f"agent_{n}.log").read_text()[-3000:]
            for n in self.agents
        )

    def cleanup(self) -> None:
        for agent in self.agents.values():
            if agent.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        if (self.out / "procs").is_dir():
            for proc in self.procs():  # workers run in their own sessions
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc["pid"], signal.SIGKILL)
        del self.store


@slow_fixture(scope="module")
def elastic_job(tmp_path_factory):
    """2 agents -> a third joins -> rank 0's node dies while writing state.pt -> 2 finish."""
    out = tmp_path_factory.mktemp("elastic")
    job = _Job(out)
    result: dict = {"out": out}
    try:
        job.gate(6)
        job.start_agent("a")
        job.start_agent("b")
        job.wait_for("step 6 at world size 2", lambda: job.reached(6, world_size=2))
        job.start_agent("c")  # joins: the group restarts from the commit at step 4
        job.wait_for("the world of 3", lambda: any(p["world_size"] == 3 for p in job.procs()))
        job.gate(9)
        job.wait_for("step 9 at world size 3", lambda: job.reached(9, world_size=3))
        (out / "hang_next_save").touch()  # rank 0's save at step 12 stops halfway
        job.gate(10**6)
        job.wait_for("rank 0 to hang inside a checkpoint write", (out / "hanging.json").exists)
        hanging = json.loads((out / "hanging.json").read_text())
        kill_time = time.time()
        result["killed"] = job.kill_node(hanging["pid"])
        result["hanging"] = hanging
        # Right now the writer is dead halfway: state.pt must be the previous commit, intact.
        result["intact_step"] = load_checkpoint(out / "elastic" / "state.pt")["step"]
        (torn,) = hanging["tmp"]
        with pytest.raises(CheckpointError):
            load_checkpoint(torn)
        survivors = [a for n, a in job.agents.items() if n != result["killed"]]
        deadline = time.monotonic() + 300
        for agent in survivors:
            agent.wait(timeout=max(1.0, deadline - time.monotonic()))
        result["returncodes"] = [a.returncode for a in survivors]
        result["logs"] = job.logs()
        after = [r for r in job.ledger() if r["time"] > kill_time]
        result["restart_seconds"] = min(r["time"] for r in after) - kill_time if after else None
        result["ledger"] = job.ledger()
        print(f"elastic job: first step {result['restart_seconds']:.1f} s after the kill")
    finally:
        job.cleanup()
    return result


@pytest.mark.dist
def test_job_finishes_with_the_remaining_workers(elastic_job):
    assert elastic_job["returncodes"] == [0, 0], elastic_job["logs"]
    records = _records(elastic_job["out"] / "run.jsonl")
    assert records[0]["kind"] == "header" and records[-1]["kind"] == "end"
    changes = [
        (r["old_world_size"], r["new_world_size"]) for r in records if r["kind"] == "membership"
    ]
    assert changes == [(2, 3), (3, 2)]
    assert records[-1]["steps"] == max(r["step"] for r in records if r["kind"] == "step")


@pytest.mark.dist
def test_previous_checkpoint_loads_intact_after_a_kill_mid_write(elastic_job):
    hanging = elastic_job["hanging"]
    assert elastic_job["intact_step"] == hanging["step"] - worker.CHECKPOINT_STEPS
    records = _records(elastic_job["out"] / "run.jsonl")
    last_change = [r for r in records if r["kind"] == "membership"][-1]
    assert last_change["restored_step"] == elastic_job["intact_step"]


def check_ledger(out: Path, ledger: list[dict]) -> None:
    """Every sample of every epoch committed exactly once (the worker's dataset, drop_last
    off), and each ledger step's ids what train_step really received (the worker's own
    ``observed`` files)."""
    samples = committed_samples(out / "elastic")
    assert sorted(samples) == list(range(worker.EPOCHS))
    for epoch, ids in samples.items():
        assert sorted(ids) == list(range(worker.NUM_SAMPLES)), f"epoch {epoch}"
    observed = {}
    for path in (out / "observed").glob("*.jsonl"):
        run, rank = path.stem.rsplit(".rank", 1)
        for r in _records(path):
            observed.setdefault((run, int(rank), r["step"]), []).extend(r["ids"])
    for r in ledger:
        assert observed[(r["run"], r["rank"], r["step"])] == r["ids"]


@pytest.mark.dist
def test_each_sample_is_used_exactly_once_per_epoch(elastic_job):
    check_ledger(elastic_job["out"], elastic_job["ledger"])
    assert {r["world_size"] for r in elastic_job["ledger"]} == {2, 3}


@pytest.mark.dist
def test_lr_ramps_after_each_membership_change(elastic_job):
    records = _records(elastic_job["out"] / "run.jsonl")
    lr, k = worker.LR, worker.RAMP_STEPS
    marks = [i for i, r in enumerate(records) if r["kind"] == "membership"]
    # Join 2 -> 3 (reference world 2): x1 -> x1.5; leave 3 -> 2: x(where it was) -> x1.
    expected = {0: [1.125, 1.25, 1.375, 1.5, 1.5], 1: [1.375, 1.25, 1.125, 1.0, 1.0]}
    for n, i in enumerate(marks):
        change = records[i]
        ramp = change["lr_ramp"]
        assert ramp["steps"] == k and ramp["start_step"] == change["step"]
        assert ramp["to_factor"] == change["new_world_size"] / 2
        end = marks[n + 1] if n + 1 < len(marks) else len(records)
        steps = [r for r in records[i:end] if r["kind"] == "step"][:5]
        factors = expected[n]
        assert [s["step"] for s in steps] == list(range(change["step"] + 1, change["step"] + 6))
        assert [s["lr"] for s in steps] == pytest.approx([lr * f for f in factors], rel=1e-12)
    assert records[marks[1]]["lr_ramp"]["from_factor"] == 1.5


@pytest.mark.dist
def test_final_accuracy_is_close_to_an_uninterrupted_run(elastic_job):
    got = json.loads((elastic_job["out"] / "final.json").read_text())["top1"]
    # Uninterrupted: the same recipe at the reference world size 2 (global batch 8), here in
    # one process.
    train_set, eval_set = worker.datasets()
    model = make_mlp(seed=0)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=worker.LR, momentum=0.9),
        TrainerConfig(
            epochs=worker.EPOCHS,
            batch_size=2 * worker.BATCH,
            seed=3,
            log_interval=0,
            drop_last=False,
            progress=False,
        ),  # fmt: skip
        env=DistEnv(),
        logger=RunLogger(None, enabled=False),
        train_step=lambda m, b: train_step(m, b[:2]),
        eval_step=lambda m, b: eval_step(m, b[:2]),
    )
    trainer.fit(train_set, eval_dataset=eval_set)
    want = trainer.last_eval["top1"]
    print(f"held-out top-1: elastic {got:.4f}, uninterrupted {want:.4f}")
    assert abs(got - want) <= 0.05
