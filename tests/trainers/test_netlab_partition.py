"""Network partitions: what makes one survivable, then one short drill on the lab network.

* The launch guard (``trainers.dist.check_launch``): torchrun's shared worker store is
  refused where a restart could read a dead group's addresses; the project's launcher is not.
* The peer watchdog (``trainers.dist.PeerWatchdog``): its rule on a fake clock, then real
  TCPStores: a silent peer or a store that stops answering makes a rank give up, a finished
  rank makes the others stand down.
* A finished job whose workers torchrun restarts (a node joined as it ended) exits cleanly.
* The drill (trainers.netlab, needs root): a node's cable is pulled mid-epoch and plugged
  back; the survivors give up within the watchdog's timeout (not at the 30-minute collective
  timeout), go on without it, the node rejoins, the job ends cleanly, and every sample of
  every epoch is committed exactly once.

Oracles: the kernel's link state (the cut is real: a black hole), the watchdog's own lines
in the agents' output (when each rank gave up, against the cut's wall-clock time), the
sample ledger against the dataset (``drop_last=False``: each of the NUM_SAMPLES indices once
per epoch, whatever the world sizes along the way), and torchrun itself for the launch guard.

The drill's job is tests/trainers/_elastic_worker.py (the toy MLP of test_elastic.py, paced
by its gate file so that the scenario does not depend on the machine's load): 3 nodes at
1 Gbit/s, torchrun --nnodes=2:3, the rendezvous store on the lab's control host.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch.distributed as dist

import trainers.dist as dist_module
from tests.trainers import _elastic_worker as worker
from trainers.dist import PEER_LOST_EXIT_CODE
from trainers.elastic import _finished_during_this_launch, committed_samples
from trainers.elastic_drill import _GAVE_UP, _ledger_records, _ledger_starts, ledger_steps
from trainers.netlab import Lab, missing_requirements, run_job

WHY = missing_requirements()

NODES, CUT_NODE, PEER_TIMEOUT = 3, 2, 3.0


def _wait(what: str, predicate, deadline: float, job: threading.Thread) -> None:
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        assert job.is_alive(), f"the job ended while waiting for {what}"
        time.sleep(0.1)


def _steps(out: Path) -> list[dict]:
    return ledger_steps(out / "elastic") if (out / "elastic").is_dir() else []


def _cut_drill(tmp_path: Path, env: dict, name: str, launcher: str) -> tuple[Path, object, float]:
    """The scenario of both drills: 3 lab nodes run the gated worker; at step 4 node
    CUT_NODE's cable is pulled; the survivors may go on to step 10; once they train without
    it the cable is plugged back and the job runs to its end. Returns the job's folder, its
    run_job result and the cut's wall-clock time."""
    out = tmp_path / "job"
    out.mkdir()
    gate = out / "gate"
    gate.write_text("4")  # no worker starts step 5 until the test says so
    result: dict = {}
    deadline = time.monotonic() + 110
    command = (
        ["-m", "tests.trainers._elastic_worker", str(out)]
        if launcher == "torchrun"
        else [str(Path(worker.__file__).resolve()), str(out)]  # inproc runs a script file
    )
    with Lab(NODES, bandwidth="1gbit", name=f"{name}{os.getpid() % 100000}") as lab:

        def job() -> None:
            result["job"] = run_job(
                lab, command, min_nodes=NODES - 1, timeout=105, log_dir=tmp_path / "agents",
                env=env, log=lambda _: None, max_restarts=3, launcher=launcher,
            )  # fmt: skip

        thread = threading.Thread(target=job, daemon=True)
        thread.start()
        _wait("step 4 on 3 nodes",
              lambda: any(r["step"] == 4 and r["world_size"] == NODES for r in _steps(out)),
              deadline, thread)  # fmt: skip
        time.sleep(0.5)  # everyone waits at the gate, heartbeats going
        lab.set_link(CUT_NODE, up=False)
        cut_at = time.time()
        gate.write_text("10")  # the survivors may go on (from the commit at step 4) to 10
        _wait("a step on 2 nodes after the cut",
              lambda: any(r["world_size"] == NODES - 1 and r["time"] > cut_at
                          for r in _steps(out)),
              deadline, thread)  # fmt: skip
        lab.set_link(CUT_NODE, up=True)
        up_at = time.time()
        # in process, the node is admitted at the survivors' next commit: let them reach it
        if launcher == "inproc":
            gate.unlink()
        _wait("the node back: a step on 3 nodes after the link returned",
              lambda: any(r["world_size"] == NODES and r["time"] > up_at for r in _steps(out)),
              deadline, thread)  # fmt: skip
        gate.unlink(missing_ok=True)  # run to the end
        thread.join(max(1.0, deadline - time.monotonic()))
        assert not thread.is_alive(), "the job did not finish in time"
    return out, result["job"], cut_at


def _check_every_sample_once(out: Path) -> None:
    epochs = committed_samples(out / "elastic")
    assert sorted(epochs) == list(range(worker.EPOCHS))
    for epoch, ids in epochs.items():
        assert Counter(ids) == Counter(range(worker.NUM_SAMPLES)), f"epoch {epoch}"
    sizes = [r["world_size"] for r in sorted(_steps(out), key=lambda r: r["time"])]
    assert sizes[0] == NODES and NODES - 1 in sizes and sizes[-1] == NODES


@pytest.mark.slow
@pytest.mark.netlab
@pytest.mark.skipif(WHY is not None, reason=f"netlab: {WHY}")
def test_a_cut_node_is_dropped_in_seconds_and_rejoins_with_every_sample_once(tmp_path):
    env = dict(os.environ, MODELZOO_PEER_TIMEOUT=str(PEER_TIMEOUT))
    out, job_result, cut_at = _cut_drill(tmp_path, env, "tp", "torchrun")
    assert job_result.ok, (job_result.exit_codes, job_result.logs)

    # The cut node and at least one survivor gave up by the watchdog within its timeout of
    # the cut (plus its poll and a loaded machine's slack), not at a collective timeout; a
    # survivor may instead see its peer's exit through gloo (connection closed) at once.
    gave_up = {}
    for node, path in enumerate(job_result.logs):
        for line in Path(path).read_text(errors="replace").splitlines():
            match = _GAVE_UP.match(line.strip())
            if match and float(match.group(3)) > cut_at:
                gave_up.setdefault(node, float(match.group(3)) - cut_at)
    assert CUT_NODE in gave_up and set(gave_up) - {CUT_NODE}, gave_up
    assert all(PEER_TIMEOUT - 0.5 <= t <= PEER_TIMEOUT + 4 for t in gave_up.values()), gave_up
    exits = " ".join(Path(p).read_text(errors="replace") for p in job_result.logs)
    assert f"exitcode: {PEER_LOST_EXIT_CODE}" in exits
    restarted = [r["time"] - cut_at for r in _ledger_starts(out / "elastic") if r["time"] > cut_at]
    assert restarted and min(restarted) < PEER_TIMEOUT + 45, restarted  # seconds, not 30 min

    # Every sample of every epoch committed exactly once (drop_last=False: all of them).
    _check_every_sample_once(out)


@pytest.mark.slow
@pytest.mark.netlab
@pytest.mark.skipif(WHY is not None, reason=f"netlab: {WHY}")
def test_in_process_recovery_goes_on_without_a_cut_node_and_takes_it_back(tmp_path):
    """The same cut with members that recover in process (python -m trainers.elastic inproc):
    the survivors' collective times out (3 s, fixed here: the gate's holds would count as
    slow steps), they re-form without the node in their running processes and go on; when
    the link returns the node's own collective fails, it asks to come back and is admitted
    at the next commit with the survivors' newer state."""
    timeout = 3.0
    env = dict(os.environ, MODELZOO_COLLECTIVE_TIMEOUT=str(timeout), MODELZOO_PEER_TIMEOUT="1.5",
               MODELZOO_RECOVERY_LAST_CALL="10")  # fmt: skip
    out, job_result, cut_at = _cut_drill(tmp_path, env, "ti", "inproc")
    assert job_result.ok, (job_result.exit_codes, job_result.logs)
    recoveries = [r for r in _ledger_records(out / "elastic", "recovery")]
    survivors = [r for r in recoveries if r["node"] != CUT_NODE and r["failed_at"] > cut_at]
    assert survivors, recoveries
    # each survivor noticed at its collective's timeout (or at once, from a peer that had)
    assert all(r["failed_at"] - cut_at <= timeout + 4 for r in survivors), survivors
    first_without = min(r["time"] for r in _steps(out) if r["world_size"] == NODES - 1)
    assert first_without - cut_at <= timeout + 10  # seconds, not a restart's tens
    cut_node = [r for r in recoveries if r["node"] == CUT_NODE]
    assert cut_node and all(r["phases"]["transfer"] > 0 for r in cut_node[-1:]), recoveries
    # no process restarted: one ledger start per generation, the members' ids unchanged
    assert {r["member"] for r in recoveries} <= {1, 2, 3}
    _check_every_sample_once(out)


# -- launch safety and the peer watchdog ---------------------------------------------------------
SHARED = {"TORCHELASTIC_USE_AGENT_STORE": "True"}


@pytest.mark.parametrize(
    ("environ", "elastic", "refused"),
    [
        ({**SHARED, "TORCHELASTIC_MAX_RESTARTS": "3"}, False, True),
        ({**SHARED, "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RESTART_COUNT": "1"}, False,
         True),
        ({**SHARED, "TORCHELASTIC_MAX_RESTARTS": "0"}, True, True),  # nodes may join or leave
        ({**SHARED, "TORCHELASTIC_MAX_RESTARTS": "0"}, False, False),  # one generation only
        ({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_MAX_RESTARTS": "3"}, True, False),
        ({**SHARED, "TORCHELASTIC_MAX_RESTARTS": "3", "MODELZOO_ALLOW_SHARED_STORE": "1"}, True,
         False),
        ({}, True, False),  # not under torchrun
    ],
)  # fmt: skip
def test_a_restartable_launch_on_a_shared_store_is_refused(environ, elastic, refused):
    if refused:
        with pytest.raises(dist_module.UnsafeLaunchError) as err:
            dist_module.check_launch(environ, elastic=elastic)
        message = str(err.value)
        assert "\n" not in message and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in message
        assert "python -m trainers.elastic torchrun" in message
    else:
        dist_module.check_launch(environ, elastic=elastic)


def test_peer_timeout_defaults_to_on_for_elastic_jobs_under_torchrun_only():
    torchrun = {"TORCHELASTIC_RUN_ID": "job"}
    assert dist_module.peer_timeout({}, elastic=True) == 0
    assert dist_module.peer_timeout(torchrun, elastic=True) == 5.0
    assert dist_module.peer_timeout(torchrun) == 0  # a fixed-size job waits a short cut out
    assert dist_module.peer_timeout({**torchrun, "MODELZOO_PEER_TIMEOUT": "0"}, elastic=True) == 0
    assert dist_module.peer_timeout({"MODELZOO_PEER_TIMEOUT": "2.5"}) == 2.5
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(ValueError, match="MODELZOO_PEER_TIMEOUT"):
            dist_module.peer_timeout({"MODELZOO_PEER_TIMEOUT": bad})


def test_watchdog_rule_blames_a_peer_only_across_its_own_reads():
    dog = dist_module.PeerWatchdog(object(), rank=1, world_size=3, timeout=5.0)
    assert dog.observe([1, 1, 1], now=0.0) is None
    assert dog.observe([2, 9, 2], now=4.9) is None  # rank 1's own counter is not judged
    assert dog.observe([3, 9, 2], now=9.8) is None  # rank 2 last moved at 4.9: 4.9 s
    reason = dog.observe([4, 9, 2], now=9.9)
    assert reason is not None and reason.startswith("rank 2's heartbeat has not moved for 5.0 s")
    # A reader starved for longer than the timeout does not blame peers that did move.
    starved = dist_module.PeerWatchdog(object(), rank=0, world_size=2, timeout=5.0)
    assert starved.observe([1, 1], now=0.0) is None
    assert starved.observe([1, 40], now=60.0) is None
    # A store round trip in flight for the timeout is silence too.
    starved._in_flight_since = 100.0
    assert starved.stalled(104.9) is None
    assert starved.stalled(105.0).startswith("the job's store has not answered for 5.0 s")


def _store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _wait_until(predicate, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.mark.slow
def test_watchdog_fires_on_a_silent_peer_and_stands_down_when_the_job_ends():
    server = _store()
    fired: list[str] = []
    a = dist_module.PeerWatchdog(server.clone(), 0, 2, timeout=0.5, on_silence=fired.append)
    b = dist_module.PeerWatchdog(server.clone(), 1, 2, timeout=0.5, on_silence=fired.append)
    a.start(), b.start()
    time.sleep(1.0)  # two timeouts with both beating: nobody fires
    assert fired == []
    b.stop(finished=False)  # rank 1 goes silent (what a cut looks like from rank 0)
    assert _wait_until(lambda: fired, 2.0), "rank 0 never gave up on its silent peer"
    assert fired == ["rank 0: rank 1's heartbeat has not moved for 0.5 s (network partition "
                     "or a frozen node)"]  # fmt: skip

    # A finished rank tells the others to stand down: its silence is then no fault.
    server = _store()
    fired.clear()
    a = dist_module.PeerWatchdog(server.clone(), 0, 2, timeout=0.5, on_silence=fired.append)
    b = dist_module.PeerWatchdog(server.clone(), 1, 2, timeout=0.5, on_silence=fired.append)
    a.start(), b.start()
    time.sleep(0.3)
    b.stop(finished=True)
    time.sleep(1.5)
    assert fired == [] and a._stop.is_set()


def test_watchdog_fires_when_the_store_stops_answering():
    class Blackhole:  # a request to a host behind a pulled cable: it never returns
        def __init__(self):
            self.release = threading.Event()

        def add(self, key, value):
            self.release.wait(10)
            return 1

    store = Blackhole()
    fired: list[str] = []
    dog = dist_module.PeerWatchdog(store, 0, 2, timeout=0.4, on_silence=fired.append).start()
    try:
        assert _wait_until(lambda: fired, 2.0)
        assert fired[0].startswith("rank 0: the job's store has not answered for 0.4 s")
    finally:
        store.release.set()
        dog.stop(finished=False)


@pytest.mark.dist
@pytest.mark.slow
def test_torchrun_sharing_its_store_is_refused_and_the_project_launcher_is_not(tmp_path):
    """Real torchrun agents: with torchrun's default (one shared store for every round) a
    restartable job stops at once with the one-line fix; ``python -m trainers.elastic
    torchrun`` runs the same job, and its clean end does not trip the peer watchdog."""
    repo = Path(__file__).resolve().parents[2]
    script = tmp_path / "worker.py"
    script.write_text(
        "import trainers.dist as d\n"
        "with d.DistEnv.from_env(device='cpu') as env:\n"
        "    assert d._WATCHDOGS and env.world_size == 2\n"
        "    env.barrier()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    env["MODELZOO_PEER_TIMEOUT"] = "2"  # on for this fixed-size job: its clean end must not fire
    args = ["--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1",
            str(script)]  # fmt: skip
    plain = subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], env=env,
                           capture_output=True, text=True, timeout=180, cwd=tmp_path)  # fmt: skip
    assert plain.returncode != 0
    assert dist_module.SHARED_STORE_MESSAGE in plain.stdout + plain.stderr
    ours = subprocess.run([sys.executable, "-m", "trainers.elastic", "torchrun", *args], env=env,
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)  # fmt: skip
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert "[DistEnv]" not in ours.stdout + ours.stderr


def test_a_finished_job_restarted_by_its_own_torchrun_exits_cleanly(monkeypatch):
    """torchrun restarts the workers when a node joins, even in the job's last seconds; the
    restarted workers find state.pt finished. Finished after their agent (the parent process)
    started: the same launch, nothing to do. Before: a relaunch on a finished directory."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert _finished_during_this_launch(time.time())
    assert not _finished_during_this_launch(1.0)  # finished before this launch: refused
    assert not _finished_during_this_launch(None)  # a state.pt from before finished_at
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert not _finished_during_this_launch(time.time())  # not under torchrun
