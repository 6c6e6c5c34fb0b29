"""In-process recovery (trainers.recovery; python -m trainers.elastic inproc).

The job of test_elastic.py (the same worker, gated steps, an index-carrying toy set), but its
members are plain processes that recover in place: two start, a third joins at a commit, the
first (rank 0, the run log's writer) is killed, one of the two left is frozen (SIGSTOP: a
node cut off) until the other goes on alone, then thawed: it rejoins and gets the state from
the survivor. Oracles: the ledger (every sample of every epoch committed exactly once, and
equal to what train_step received), the documented lr ramp, equal weights on the members at
the end, and the held-out accuracy of the same recipe run uninterrupted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests._tiers import slow_fixture
from tests.trainers import _elastic_worker as worker
from tests.trainers._trainer_toys import make_mlp
from tests.trainers.test_elastic import REPO, _free_port, _Job, _records, check_ledger
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig
from trainers.elastic import ElasticState, LRRamp
from trainers.recovery import MembershipChange, is_peer_failure, parse_nodes


# -- small pieces, no processes ----------------------------------------------------------------
def test_peer_failures_are_told_from_bugs():
    gloo = (
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4711: "
        "Connection reset by peer"
    )
    timeout = "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv"
    assert is_peer_failure(RuntimeError(gloo))
    assert is_peer_failure(RuntimeError(timeout))
    assert is_peer_failure(MembershipChange("a newcomer waits"))
    # a broadcast (DDP's buffer sync) across a cut link, seen in a lab drill
    assert is_peer_failure(RuntimeError("Application timeout caused pair closure"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(ValueError("Connection reset by peer"))  # not a collective's
    assert not is_peer_failure(KeyError("weight"))
    assert not is_peer_failure(RuntimeError("DataLoader timed out after 30 seconds"))


@pytest.mark.parametrize("text, want", [("2:4", (2, 4)), ("3", (3, 3)), ("1:1", (1, 1))])
def test_parse_nodes(text, want):
    assert parse_nodes(text) == want


@pytest.mark.parametrize("text", ["0:2", "4:2", "a:b", "", "2:"])
def test_parse_nodes_refuses_with_the_value(text):
    with pytest.raises(ValueError, match=f"--nodes {text!r}"):
        parse_nodes(text)


def test_a_regrouped_member_state_loads_as_after_a_world_change(tmp_path):
    """A local_state_dict of rank 1 of 3 (what a survivor sends) loads on rank 0 of 2 with
    regrouped=True: weights, optimizer and progress from it, RNGs reseeded from (seed,
    step); without the flag it is refused as another rank's."""
    from tests.trainers._trainer_toys import ToyDataset, train_step

    def trainer(env):
        model = make_mlp(seed=0)
        return Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            TrainerConfig(
                epochs=1, batch_size=4, seed=3, log_interval=0, progress=False, max_steps=3
            ),  # fmt: skip
            env=env,
            logger=RunLogger(None, enabled=False),
            train_step=train_step,
        )

    source = trainer(DistEnv())
    source.fit(ToyDataset(64))
    state = source.local_state_dict()
    state["world_size"], state["ranks"] = 3, [None, state["ranks"][0], None]
    target = trainer(DistEnv())
    with pytest.raises(ValueError, match="local_state_dict of another rank"):
        target.load_state_dict(state)
    target.load_state_dict(state, regrouped=True)
    assert target.global_step == 3
    for a, b in zip(source.model.parameters(), target.model.parameters(), strict=True):
        assert torch.equal(a, b)
    expected = torch.Generator().manual_seed(3)  # derive_seed is not the plain seed
    assert not torch.equal(torch.get_rng_state(), expected.get_state())


def test_a_former_rank_0_stops_writing(tmp_path):
    path = tmp_path / "run.jsonl"
    logger = RunLogger(path, console=False)
    logger.write({"kind": "header"})
    logger.release()
    logger.write({"kind": "step", "step": 1})  # another rank writes now: nothing from here
    logger.close()
    assert [json.loads(line)["kind"] for line in path.read_text().splitlines()] == ["header"]


def test_the_logger_of_a_new_rank_0_appends_after_a_torn_line(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text('{"kind": "header"}\n{"kind": "step", "st')  # the old rank 0 died here
    logger = RunLogger(path, enabled=False, console=False)
    logger.write({"kind": "step", "step": 1})  # disabled: nothing
    logger.take_over()
    logger.write({"kind": "membership", "step": 4})
    logger.close()
    assert [json.loads(line)["kind"] for line in path.read_text().splitlines()] == [
        "header",
        "membership",
    ]


@pytest.mark.slow  # three interpreter starts
def test_launcher_refuses_bad_flags_with_one_line(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "trainers.elastic", "inproc", *args],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    script = tmp_path / "job.py"
    script.write_text("print('ran')\n")
    for args, message in [
        (["--store", "nohost", "--job", "j", str(script)], "--store 'nohost': give HOST:PORT"),
        (["--store", "h:1", "--job", "j", "--nodes", "3:2", str(script)], "--nodes '3:2'"),
        (["--store", "h:1", "--job", "j", str(tmp_path / "none.py")], "not found"),
    ]:
        done = run(*args)
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr


def test_an_unreachable_store_is_named(tmp_path, monkeypatch):
    from trainers.recovery import Membership, RecoveryError

    port = _free_port()
    monkeypatch.setattr(
        torch.distributed, "TCPStore",
        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("connect() refused")),
    )  # fmt: skip
    with pytest.raises(RecoveryError, match=f"127.0.0.1:{port}.*trainers.elastic store"):
        Membership("127.0.0.1", port, "job", 1, 2)


def test_a_round_without_enough_members_fails_naming_the_job():
    from trainers.recovery import Membership, RecoveryError

    port = _free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    member = Membership("127.0.0.1", port, "lonely", 2, 4, join_timeout=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(RecoveryError, match="round 1 of job 'lonely' did not gather 2"):
            member.join()
        assert 1.0 <= time.monotonic() - started < 30
        assert member.round is None
    finally:
        member.leave()
        del store


def test_the_collective_timeout_follows_the_slowest_step(monkeypatch):
    from trainers import recovery

    set_to = []
    monkeypatch.setattr(
        torch.distributed.distributed_c10d, "_set_pg_timeout",
        lambda timeout, group=None: set_to.append(timeout.total_seconds()),
    )  # fmt: skip
    port = _free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    member = recovery.Membership("127.0.0.1", port, "timeouts", 1, 2)
    try:
        assert member.timeout == recovery.STARTUP_TIMEOUT  # before any step is measured
        assert member.adapt(0.05) == recovery.ADAPT_FLOOR  # 3 x 0.05 s is under the floor
        assert member.adapt(1.0) == pytest.approx(3.0)  # three times the slowest step
        assert member.adapt(1.01) == pytest.approx(3.0)  # within 5 %: left as it is
        assert set_to == [recovery.ADAPT_FLOOR, pytest.approx(3.0)]
        member.collective_timeout = 3.0  # MODELZOO_COLLECTIVE_TIMEOUT=3
        assert member.adapt(5.0) == 3.0
    finally:
        member.leave()
        del store


def _toy_trainer(train_step, **kwargs) -> Trainer:
    model = make_mlp(seed=0)
    return Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TrainerConfig(epochs=1, batch_size=4, progress=False),
        env=DistEnv(),
        logger=RunLogger(None, enabled=False),
        train_step=train_step,
        **kwargs,
    )


def test_modes_that_cannot_regroup_are_refused(tmp_path, monkeypatch):
    from tests.trainers._trainer_toys import train_step
    from trainers import recovery
    from trainers.comm import LocalSGDCombiner

    monkeypatch.setattr(recovery, "_ACTIVE", object())  # as if launched by inproc
    trainer = _toy_trainer(train_step, combiner=LocalSGDCombiner())
    with pytest.raises(ValueError, match="not re-form --grad-combine localsgd yet .it does "
                       "average, .*fp16.*powersgd"):  # fmt: skip
        ElasticState(trainer, tmp_path / "e", checkpoint_steps=2)


def test_a_fit_nothing_recovers_is_refused_under_the_launcher(monkeypatch):
    from tests.trainers._trainer_toys import ToyDataset, train_step
    from trainers import recovery
    from trainers.errors import UsageError

    monkeypatch.setattr(recovery, "_ACTIVE", object())
    trainer = _toy_trainer(train_step)
    with pytest.raises(UsageError, match="--elastic-dir"):
        trainer.fit(ToyDataset(16))
    assert trainer.global_step == 0


def test_the_linear_learners_refuse_the_in_process_launcher(tmp_path, monkeypatch):
    from trainers import recovery
    from trainers.dist import UnsafeLaunchError
    from trainers.linear.elastic import open_linear_elastic

    monkeypatch.setattr(recovery, "_ACTIVE", object())
    with pytest.raises(UnsafeLaunchError, match="trainers.elastic torchrun"):
        open_linear_elastic(tmp_path / "e", DistEnv(), identity={"model": "x"})
    assert not (tmp_path / "e").exists()


# -- the job ------------------------------------------------------------------------------------
class _Members(_Job):
    """Members of one in-process-recovering job on 127.0.0.1 (test_elastic's job, with
    ``python -m trainers.elastic inproc`` in place of torchrun agents)."""

    def __init__(self, out: Path, combiner: str = "average") -> None:
        super().__init__(out)
        self.combiner = combiner

    def start(self, name: str) -> None:
        cmd = [
            sys.executable, "-m", "trainers.elastic", "inproc", f"--store=127.0.0.1:{self.port}",
            "--job=recovery-test", "--nodes=1:3", str(REPO / "tests/trainers/_elastic_worker.py"),
            str(self.out),
        ]  # fmt: skip
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            MODELZOO_RECOVERY_LAST_CALL="5",  # the first round waits for the second member
            # fixed: the gate's holds would count as slow steps for the adaptive timeout
            MODELZOO_COLLECTIVE_TIMEOUT="3",  # a frozen member is given up after 3 s
            MODELZOO_PEER_TIMEOUT="1.5",  # heartbeat silence that counts as dead
            ELASTIC_TEST_COMBINER=self.combiner,
        )
        self.agents[name] = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=open(self.out / f"agent_{name}.log", "w"),  # noqa: SIM115
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def newcomer_waiting(self) -> bool:
        """Whether a process waits for the group's next round (trainers.recovery's keys)."""
        gen = int(self.store.add("recovery-test/gen", 0))
        return self.store.check([f"recovery-test/round/{gen + 1}/arrived"])

    def pid_of(self, name: str) -> int:
        return self.agents[name].pid  # the launcher exec()s the script: the same process

    def records(self, kind: str) -> list[dict]:
        return [
            r
            for p in (self.out / "elastic" / "ledger").glob("*.jsonl")
            for r in _records(p)
            if r["kind"] == kind
        ]

    def cleanup(self) -> None:
        for member in self.agents.values():  # a frozen member takes SIGKILL as well
            if member.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(member.pid, signal.SIGCONT)
        super().cleanup()


@slow_fixture(scope="module")
def inproc_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("inproc")
    job = _Members(out)
    result: dict = {"out": out}
    try:
        job.gate(6)
        job.start("a")
        job.start("b")
        job.wait_for("step 6 at world size 2", lambda: job.reached(6, world_size=2))
        job.start("c")  # a newcomer: admitted at the commit of step 8
        job.wait_for("c to ask for admission", job.newcomer_waiting)
        job.gate(10)
        job.wait_for("step 10 at world size 3", lambda: job.reached(10, world_size=3))
        # Kill rank 0 (the run log's writer; a or b: whichever registered first) between
        # steps: the survivors fail in the next step's all-reduce.
        procs = [json.loads(p.read_text()) for p in (out / "procs").glob("*.json")]
        rank0 = next(p["pid"] for p in procs if p["rank"] == 0)
        victim = next(n for n in job.agents if job.pid_of(n) == rank0)
        job.killed = victim  # test_elastic's _Job: a failure after this is not reported
        os.kill(rank0, signal.SIGKILL)
        job.agents[victim].wait()
        result["killed"] = victim
        job.gate(24)
        job.wait_for("step 24 at world size 2", lambda: job.reached(24, world_size=2))
        left = [n for n in job.agents if n != victim]
        # freeze the member that is rank 0 now, the run log's writer: when it is back it is
        # not rank 0 any more and must leave the log to the one that took it over
        starts = sorted(job.records("start"), key=lambda r: r["time"])
        writer = next(r["pid"] for r in reversed(starts) if r["rank"] == 0)
        frozen = next(n for n in left if job.pid_of(n) == writer)
        survivor = next(n for n in left if n != frozen)
        os.kill(job.pid_of(frozen), signal.SIGSTOP)  # cut off: no heartbeat, no collective
        job.gate(32)
        job.wait_for("step 32 at world size 1", lambda: job.reached(32, world_size=1))
        os.kill(job.pid_of(frozen), signal.SIGCONT)  # back: it rejoins as a newcomer
        job.gate(10**6)
        for name in left:
            job.agents[name].wait(timeout=240)
        result["returncodes"] = {n: job.agents[n].returncode for n in left}
        result["logs"] = job.logs()
        result["ledger"] = job.ledger()
        result["recoveries"] = job.records("recovery")
        result["finals"] = [json.loads(p.read_text()) for p in (out / "procs").glob("*.final")]
        result["frozen"], result["survivor"] = frozen, survivor
    finally:
        job.cleanup()
    return result


@pytest.mark.dist
def test_members_finish_after_a_join_a_death_and_a_freeze(inproc_job):
    # one writer at a time: every line of the run log is one whole record
    for line in (inproc_job["out"] / "run.jsonl").read_text().splitlines():
        json.loads(line)
    assert inproc_job["returncodes"] == {n: 0 for n in inproc_job["returncodes"]}, inproc_job[
        "logs"
    ]
    records = _records(inproc_job["out"] / "run.jsonl")
    assert records[0]["kind"] == "header" and records[-1]["kind"] == "end"
    changes = [r for r in records if r["kind"] == "membership"]
    assert [(c["old_world_size"], c["new_world_size"], c["reason"]) for c in changes] == [
        (2, 3, "newcomer"),
        (3, 2, "failure"),
        (2, 1, "failure"),
        (1, 2, "newcomer"),
    ], inproc_job["logs"]
    assert all(c["in_process"] for c in changes)
    assert changes[0]["restored_step"] == 8  # the commit where the newcomer waited
    assert changes[1]["restored_step"] == 8  # the last commit before the death (step 9-10)
    assert records[-1]["steps"] == max(r["step"] for r in records if r["kind"] == "step")
    # No member restarted: every survivor's recoveries are in its ledger.
    assert len(inproc_job["recoveries"]) >= 5


@pytest.mark.dist
def test_each_sample_is_committed_exactly_once_per_epoch(inproc_job):
    check_ledger(inproc_job["out"], inproc_job["ledger"])
    assert {r["world_size"] for r in inproc_job["ledger"]} == {1, 2, 3}


@pytest.mark.dist
def test_the_lr_ramps_as_documented_across_in_process_changes(inproc_job):
    records = _records(inproc_job["out"] / "run.jsonl")
    lr, k = worker.LR, worker.RAMP_STEPS
    marks = [i for i, r in enumerate(records) if r["kind"] == "membership"]
    for n, i in enumerate(marks):
        change = records[i]
        ramp = change["lr_ramp"]
        end = marks[n + 1] if n + 1 < len(marks) else len(records)
        steps = [r for r in records[i:end] if r["kind"] == "step"][:k]
        f0, f1 = ramp["from_factor"], ramp["to_factor"]
        assert f1 == change["new_world_size"] / 2  # the job started with 2 members
        want = [f0 + (f1 - f0) * min(1, (j + 1) / k) for j in range(len(steps))]
        assert [s["step"] for s in steps] == list(
            range(change["step"] + 1, change["step"] + 1 + len(steps))
        )
        assert [s["lr"] for s in steps] == pytest.approx([lr * f for f in want], rel=1e-12)
        if n:  # from the factor of the step before, wherever the earlier ramp was
            before = records[marks[n - 1]]["lr_ramp"]
            earlier = LRRamp(before["start_step"], before["from_factor"], before["to_factor"],
                             before["steps"])  # fmt: skip
            assert f0 == earlier.factor(change["step"] - 1)
        else:
            assert f0 == 1.0


@pytest.mark.dist
def test_the_members_end_with_equal_weights(inproc_job):
    finals = inproc_job["finals"]
    assert len(finals) == 2, finals  # the survivor and the one that rejoined
    assert len({f["params_sha256"] for f in finals}) == 1
    assert sorted(f["rank"] for f in finals) == [0, 1]
    assert {f["step"] for f in finals} == {max(r["step"] for r in inproc_job["ledger"])}


@pytest.mark.dist
def test_the_rejoined_member_received_the_state(inproc_job):
    # The thawed member held an older commit than the survivor: it was sent the newer one.
    rejoin = [
        r for r in inproc_job["recoveries"]
        if r["reason"] == "failure" and r["phases"]["transfer"] > 0
    ]  # fmt: skip
    assert rejoin, inproc_job["recoveries"]


@pytest.mark.dist
def test_held_out_accuracy_is_close_to_an_uninterrupted_run(inproc_job):
    from tests.trainers import test_elastic

    test_elastic.test_final_accuracy_is_close_to_an_uninterrupted_run({"out": inproc_job["out"]})


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("combiner", ["fp16", "powersgd"])
def test_ddp_hook_modes_recover_in_process(tmp_path, combiner):
    """DDP with PyTorch's communication hooks is wrapped again on the new group: 3 members,
    the last rank killed between steps, the two left finish with equal weights and every
    sample once."""
    out = tmp_path / combiner
    out.mkdir()
    job = _Members(out, combiner)
    try:
        job.gate(6)
        for name in "abc":
            job.start(name)
        job.wait_for("step 6 at world size 3", lambda: job.reached(6, world_size=3))
        procs = [json.loads(p.read_text()) for p in (out / "procs").glob("*.json")]
        last = next(p["pid"] for p in procs if p["rank"] == 2)
        victim = next(n for n in job.agents if job.pid_of(n) == last)
        job.killed = victim
        os.kill(last, signal.SIGKILL)
        job.gate(10**6)
        left = [n for n in job.agents if n != victim]
        for name in left:
            job.agents[name].wait(timeout=240)
        assert [job.agents[n].returncode for n in left] == [0, 0], job.logs()
        check_ledger(out, job.ledger())
        finals = [json.loads(p.read_text()) for p in (out / "procs").glob("*.final")]
        assert len(finals) == 2 and len({f["params_sha256"] for f in finals}) == 1
        records = _records(out / "run.jsonl")
        (change,) = [r for r in records if r["kind"] == "membership"]
        assert (change["old_world_size"], change["new_world_size"]) == (3, 2)
    finally:
        job.cleanup()
