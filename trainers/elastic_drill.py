"""A fault drill for an elastic job: start it on N nodes, kill one mid-run, add one later.

This is how ``logs/elastic_*`` are made, and how a user checks that their own elastic job
survives a node's death before a real one dies. On one machine it:

1. hosts the c10d rendezvous store (:func:`trainers.elastic.serve_store`) on a free port;
2. starts ``--nodes`` torchrun agents (``--nnodes=2:N``, one worker each, each in its own
   process group) running the training command with a fresh ``--elastic-dir``;
3. when the job's sample ledger shows step ``--kill-at-step``, SIGKILLs one agent and every
   process under it (agent and worker: a node dying without a word);
4. when the survivors have resumed and reached ``--join-at-step``, starts one more agent (a
   node joining; the agents restart the workers at the larger size);
5. waits for the job to finish and checks that its run log ends with an ``end`` record.

The ledger is copied next to the run log (``<run-log without .jsonl>.ledger/``) so that
:func:`trainers.elastic.committed_samples` can be checked on the published run.

The steps at which the changes *take effect* are whatever the job's commits make them: the
survivors resume from the last durable checkpoint before the kill, and the world grows at
the first commit the new node sees. Timing on a loaded machine moves them by a few steps;
the run log's ``membership`` records say where they happened.

``--netlab`` runs the job on the lab network instead (:mod:`trainers.netlab`: one network
namespace per node, capped links, the rendezvous store on the lab's control host) and
rehearses network faults instead of a kill: ``--partition NODE:STEP:SECONDS`` pulls a node's
cable at a training step and plugs it back after SECONDS, ``--slow-node NODE:RATE`` caps one
node's link (e.g. 10x below ``--bandwidth``). The drill then checks the ledger (every sample
of every epoch committed exactly once) and reports the detection time (the cut to the first
rank that gave up, :class:`trainers.dist.PeerWatchdog`), the outage (the cut to the first
step of the survivors' new worker group), the rejoin time (the link's return to the first
step at full size) and the median step time per world size. The lab is removed however the
drill ends.

Example (the published elastic digits recipe)::

    python -m trainers.elastic_drill --nodes 3 --kill-at-step 30 --join-at-step 70 -- \\
        scripts/train_imagenet.py -j 0 --no-progress --batch-size 32 --elastic-checkpoint-steps 4 \\
        --elastic-ramp-steps 5 --run-log runs/elastic.jsonl

    # node 2's link down at step 20 for 20 s; 3 nodes at 1 Gbit/s
    python -m trainers.elastic_drill --netlab --nodes 3 --bandwidth 1gbit --partition 2:20:20 -- \
        scripts/train_imagenet.py -j 0 --no-progress --batch-size 32 --elastic-checkpoint-steps 4 \
        --max-steps 80 --run-log runs/cut.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .cli import split_command
from .elastic import LEDGER_DIR, committed_samples, serve_store

__all__ = [
    "DrillError",
    "DrillUsage",
    "ledger_steps",
    "main",
    "parse_partition",
    "parse_slow_node",
    "run_drill",
    "run_netlab_drill",
]

#: short keep-alive and last-call so that a death is seen in seconds on one machine
RDZV_CONF = "last_call_timeout=2,is_host=false,keep_alive_interval=1,keep_alive_max_attempt=10"


class DrillError(RuntimeError):
    """The drill could not run or the job did not finish."""


class DrillUsage(DrillError):
    """A flag's value is wrong (one line naming it; exit 2)."""


def _flag_value(command: Sequence[str], flag: str) -> str | None:
    from .netlab.job import flag_value  # the lab's runner reads the same flags

    return flag_value(command, flag)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from ``/proc``; torchrun starts each worker in a
    session of its own, so killing the agent's process group does not reach it)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent, its process group and every process under it (its workers)."""
    doomed = _descendants(agent.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(agent.pid, signal.SIGKILL)
    for pid in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    agent.wait()


def _check_command(command: Sequence[str]) -> Path:
    """The command's ``--run-log`` (new); a :class:`DrillUsage` naming the flag otherwise."""
    if not command or not command[0].endswith(".py"):
        raise DrillUsage("give the training command after --, e.g. -- scripts/train_imagenet.py")
    if _flag_value(command, "--elastic-dir") is not None:
        raise DrillUsage("leave --elastic-dir out of the command: the drill makes a fresh one")
    run_log = _flag_value(command, "--run-log")
    if run_log is None:
        raise DrillUsage("the command must name --run-log: the drill checks its end record")
    if Path(run_log).exists():
        raise DrillUsage(f"{run_log}: exists; the drill writes a new run log (remove it first)")
    return Path(run_log)


def _publish_ledger(result: dict, elastic_dir: Path, run_log_path: Path, lines: list[str]) -> None:
    """Copy the job's ledger beside its run log (``<run log>.ledger/``) and note where, with
    the run log's membership records, in ``result``."""
    ledger_copy = run_log_path.with_suffix(".ledger")
    shutil.rmtree(ledger_copy, ignore_errors=True)
    shutil.copytree(elastic_dir / LEDGER_DIR, ledger_copy)
    result["ledger"] = str(ledger_copy)
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise DrillError(
                f"{run_log_path}: line {number} is not one JSON record (two writers?)"
            ) from None
    result["membership"] = [r for r in records if r.get("kind") == "membership"]


def ledger_steps(elastic_dir: Path) -> list[dict]:
    """Every ``step`` record in the job's ledger so far (a torn last line is skipped)."""
    records = []
    for path in sorted((elastic_dir / LEDGER_DIR).glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                if record.get("kind") == "step":
                    records.append(record)
    return records


def run_drill(
    command: Sequence[str],
    *,
    nodes: int = 3,
    kill_at_step: int,
    join_at_step: int | None,
    kill_node: int = 0,
    threads: int = 1,
    timeout: float = 3600.0,
    rdzv_conf: str = RDZV_CONF,
    python: str = sys.executable,
    work_dir: Path | None = None,
    log=print,
    recovery: str = "restart",
) -> dict:
    """Run the drill (module docstring); returns what happened (times, steps, exit codes).

    ``recovery="inproc"``: the nodes are members of a job that recovers in process
    (``python -m trainers.elastic inproc``, :mod:`trainers.recovery`) instead of torchrun
    agents that restart their workers.

    ``command`` is the training script and its flags; it must name ``--run-log`` and must
    not name ``--elastic-dir`` (the drill gives each run a fresh one).
    """
    if nodes < 3:
        raise DrillUsage(f"--nodes {nodes}: need at least 3 (the job keeps 2 after one dies)")
    if recovery not in ("restart", "inproc"):
        raise DrillUsage(f"--recovery {recovery!r}: restart or inproc")
    if not 0 <= kill_node < nodes:
        raise DrillUsage(f"--kill-node {kill_node}: must be in [0, {nodes - 1}]")
    if join_at_step is not None and join_at_step <= kill_at_step:
        raise DrillUsage(
            f"--join-at-step {join_at_step} must come after --kill-at-step {kill_at_step}"
        )
    run_log_path = _check_command(command)
    run_log = str(run_log_path)

    work = Path(tempfile.mkdtemp(prefix="elastic_drill_", dir=work_dir))
    elastic_dir = work / "elastic"
    port = _free_port()
    store = serve_store("127.0.0.1", port)
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    worker = [*command, "--elastic-dir", str(elastic_dir)]
    agents: list[subprocess.Popen] = []
    agent_logs = []

    def start_agent() -> None:
        i = len(agents)
        cmd = [
            python, "-m", "torch.distributed.run", f"--nnodes=2:{nodes}", "--nproc-per-node=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=drill",
            "--max-restarts=5", "--monitor-interval=0.5", f"--rdzv-conf={rdzv_conf}", *worker,
        ] if recovery == "restart" else [
            python, "-m", "trainers.elastic", "inproc", f"--store=127.0.0.1:{port}",
            "--job=drill", f"--nodes=2:{nodes}", *worker,
        ]  # fmt: skip
        out = open(work / f"agent{i}.log", "w")  # noqa: SIM115 (closed below)
        agent_logs.append(out)
        agents.append(
            subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )  # fmt: skip
        )
        log(f"[drill] agent {i} started (pid {agents[-1].pid})")

    deadline = time.monotonic() + timeout

    def wait_for(what: str, predicate) -> None:
        while not predicate():
            if time.monotonic() > deadline:
                raise DrillError(f"timed out after {timeout:.0f} s waiting for {what}; see {work}")
            if all(a.poll() is not None for a in agents):
                raise DrillError(f"every agent exited while waiting for {what}; see {work}")
            time.sleep(0.2)

    result: dict = {"nodes": nodes, "kill_at_step": kill_at_step, "join_at_step": join_at_step}
    try:
        for _ in range(nodes):
            start_agent()
        wait_for(
            f"step {kill_at_step} at {nodes} workers",
            lambda: any(
                r["step"] >= kill_at_step and r["world_size"] == nodes
                for r in ledger_steps(elastic_dir)
            ),
        )
        victim = agents[kill_node]
        kill_time = time.time()
        _kill_node(victim)
        result["killed_at"] = max(r["step"] for r in ledger_steps(elastic_dir))
        log(f"[drill] killed agent {kill_node} and its worker at step {result['killed_at']}")
        if join_at_step is not None:
            wait_for(
                f"step {join_at_step} after the kill",
                lambda: any(
                    r["step"] >= join_at_step and r["time"] > kill_time
                    for r in ledger_steps(elastic_dir)
                ),
            )
            result["joined_at"] = max(r["step"] for r in ledger_steps(elastic_dir))
            start_agent()
            log(f"[drill] a new node joins at step {result['joined_at']}")
        live = [a for i, a in enumerate(agents) if i != kill_node]
        while any(a.poll() is None for a in live):
            if time.monotonic() > deadline:
                raise DrillError(f"timed out after {timeout:.0f} s waiting for the job; see {work}")
            time.sleep(0.5)
        result["exit_codes"] = [a.returncode for a in live]
        if any(code != 0 for code in result["exit_codes"]):
            raise DrillError(f"agents exited with {result['exit_codes']}; see {work}")
        lines = (
            run_log_path.read_text(encoding="utf-8").splitlines() if run_log_path.is_file() else []
        )
        if not lines or json.loads(lines[-1]).get("kind") != "end":
            raise DrillError(f"{run_log}: the job finished without an end record; see {work}")
        _publish_ledger(result, elastic_dir, run_log_path, lines)
    except BaseException:
        # no partial run log survives a failed drill (a log is a publication)
        run_log_path.unlink(missing_ok=True)
        raise
    finally:
        for agent in agents:
            if agent.poll() is None:
                _kill_node(agent)
        for out in agent_logs:
            out.close()
        del store
        if "ledger" in result:
            shutil.rmtree(work, ignore_errors=True)
    return result


# -- the drill on the lab network -----------------------------------------------------------------
_GAVE_UP = re.compile(r"^\[DistEnv\] rank (\d+): (.*) at (\d+\.\d+)\s*$")


def parse_partition(text: str) -> tuple[int, int, float]:
    """``"NODE:STEP:SECONDS"`` (``--partition``) -> ``(node, step, seconds)``."""
    parts = text.split(":")
    try:
        node, step, seconds = int(parts[0]), int(parts[1]), float(parts[2])
        if len(parts) != 3:
            raise ValueError
    except (ValueError, IndexError):
        raise DrillUsage(
            f"--partition {text!r}: give NODE:STEP:SECONDS, e.g. 2:20:20 (node 2's link down "
            "at training step 20, up again 20 s later)"
        ) from None
    if node < 0 or step < 0 or not seconds > 0:
        raise DrillUsage(f"--partition {text!r}: node and step >= 0, seconds > 0")
    return node, step, seconds


def parse_slow_node(text: str) -> tuple[int, str]:
    """``"NODE:RATE"`` (``--slow-node``) -> ``(node, rate)``, the rate checked."""
    from .netlab import parse_rate

    node, _, rate = text.partition(":")
    try:
        parse_rate(rate)
        return int(node), rate
    except ValueError:
        raise DrillUsage(f"--slow-node {text!r}: give NODE:RATE, e.g. 2:100mbit") from None


def run_netlab_drill(
    command: Sequence[str],
    *,
    nodes: int = 3,
    min_nodes: int | None = None,
    bandwidth: str | None = "1gbit",
    partition: tuple[int, int, float] | None = None,
    slow_node: tuple[int, str] | None = None,
    threads: int = 1,
    timeout: float = 1800.0,
    max_restarts: int = 5,
    share_store: bool = False,
    store_on: str = "control",
    env: dict[str, str] | None = None,
    work_dir: Path | None = None,
    name: str | None = None,
    log=print,
    recovery: str = "restart",
) -> dict:
    """The drill on the lab network (module docstring); returns what happened.

    ``recovery="inproc"``: the nodes run members that recover in process (``python -m
    trainers.elastic inproc``) instead of torchrun agents; detection is then read from the
    survivors' ``recovery`` ledger records.

    ``partition`` is ``(node, step, seconds)``, ``slow_node`` is ``(node, rate)``.
    ``share_store=True`` launches torchrun with its default shared worker store (and lets
    the workers start anyway): only to reproduce that failure mode. ``store_on`` is where the
    rendezvous store runs: ``"control"`` (the lab's control host, which no partition cuts off:
    the project's launch) or ``"node0"`` (node 0's agent hosts it, torchrun's ``is_host``, as
    when a cluster's store runs on a training node). ``env``: the agents' environment
    (default: this process's).
    """
    from .netlab import Lab, LabError, Partition, missing_requirements, parse_rate, run_job

    min_nodes = nodes - 1 if min_nodes is None else min_nodes
    if nodes < 2:
        raise DrillUsage(f"--nodes {nodes}: a lab has at least 2 nodes")
    if partition is not None and nodes < 3:
        raise DrillUsage(f"--nodes {nodes}: a partition drill needs 3 (2 go on without one)")
    if not 1 <= min_nodes <= nodes:
        raise DrillUsage(f"--min-nodes {min_nodes}: must be in [1, {nodes}]")
    if store_on not in ("control", "node0"):
        raise DrillUsage(f"--store-on {store_on}: give control or node0")
    if recovery not in ("restart", "inproc"):
        raise DrillUsage(f"--recovery {recovery!r}: restart or inproc")
    if recovery == "inproc" and (store_on != "control" or share_store):
        raise DrillUsage("--recovery inproc: the store is on the control host, never shared")
    if partition is not None and not 0 <= partition[0] < nodes:
        raise DrillUsage(f"--partition: node {partition[0]} is not in [0, {nodes - 1}]")
    if slow_node is not None and not 0 <= slow_node[0] < nodes:
        raise DrillUsage(f"--slow-node: node {slow_node[0]} is not in [0, {nodes - 1}]")
    if bandwidth is not None:
        try:
            parse_rate(bandwidth)
        except ValueError as e:
            raise DrillUsage(f"--bandwidth: {e}") from None
    run_log_path = _check_command(command)
    why = missing_requirements()
    if why:
        raise DrillUsage(f"--netlab: {why}")

    work = Path(tempfile.mkdtemp(prefix="netlab_drill_", dir=work_dir))
    elastic_dir = work / "elastic"
    name = name or f"drill{os.getpid() % 100000}"
    cut = None
    if partition is not None:
        cut = Partition(node=partition[0], at_step=partition[1], duration=partition[2])
    agent_env = dict(os.environ if env is None else env)
    if share_store:
        agent_env["MODELZOO_ALLOW_SHARED_STORE"] = "1"
    result: dict = {"nodes": nodes, "min_nodes": min_nodes, "bandwidth": bandwidth,
                    "partition": partition, "slow_node": slow_node, "share_store": share_store,
                    "store_on": store_on, "work": str(work)}  # fmt: skip
    try:
        slow = {slow_node[0]: slow_node[1]} if slow_node is not None else None
        try:
            with Lab(nodes, bandwidth=bandwidth, slow=slow, name=name) as lab:
                job = run_job(
                    lab, [*command, "--elastic-dir", str(elastic_dir)], min_nodes=min_nodes,
                    threads=threads, timeout=timeout, partition=cut, max_restarts=max_restarts,
                    log_dir=work / "agents", env=agent_env, log=log, share_store=share_store,
                    rdzv_on_control=store_on == "control",
                    launcher="inproc" if recovery == "inproc" else "torchrun",
                )  # fmt: skip
        except LabError as e:
            raise DrillError(f"--netlab: {e}") from None
        result.update(exit_codes=job.exit_codes, wall_seconds=job.wall_seconds,
                      timed_out=job.timed_out, cut=job.partition,
                      tx_bytes=job.tx_bytes, rx_bytes=job.rx_bytes)  # fmt: skip
        result.update(_timeline(elastic_dir, work / "agents", nodes, job.partition))
        if job.timed_out:
            raise DrillError(f"timed out after {timeout:.0f} s; see {work}")
        if partition is not None and job.partition is None:
            raise DrillError(f"the job ended before step {partition[1]}: no cut; see {work}")
        if not job.ok:
            raise DrillError(f"agents exited with {job.exit_codes}; see {work}")
        lines = (
            run_log_path.read_text(encoding="utf-8").splitlines() if run_log_path.is_file() else []
        )
        if not lines or json.loads(lines[-1]).get("kind") != "end":
            raise DrillError(f"{run_log_path}: the job finished without an end record; see {work}")
        result["samples"] = ledger = _check_ledger(elastic_dir)
        if ledger["duplicates"]:
            raise DrillError(
                f"the ledger has {ledger['duplicates']} samples used twice; see {work}"
            )
        if partition is not None and result.get("rejoin_seconds") is None:
            up = (job.partition or {}).get("up_at_time")
            last = max((r["time"] for r in ledger_steps(elastic_dir)), default=0.0)
            if up is not None and last > up:
                raise DrillError(
                    f"node {partition[0]} never trained again after the cut; see {work}"
                )
            result["note"] = "the job ended before the link returned: no rejoin to see"
        _publish_ledger(result, elastic_dir, run_log_path, lines)
    except BaseException:
        run_log_path.unlink(missing_ok=True)  # no partial run log survives a failed drill
        raise
    shutil.rmtree(work, ignore_errors=True)
    return result


def _ledger_starts(elastic_dir: Path) -> list[dict]:
    """The ``start`` records of rank 0 (one per worker group) in the job's ledger."""
    records = []
    for path in sorted((elastic_dir / LEDGER_DIR).glob("*.rank0.jsonl")):
        with contextlib.suppress(json.JSONDecodeError, IndexError):
            record = json.loads(path.read_text(encoding="utf-8").splitlines()[0])
            if record.get("kind") == "start":
                records.append(record)
    return records


def _check_ledger(elastic_dir: Path) -> dict:
    """Per epoch: committed samples, distinct ones, duplicates (must be 0)."""
    epochs = committed_samples(elastic_dir)
    rows = {e: {"committed": len(ids), "distinct": len(set(ids))} for e, ids in epochs.items()}
    return {
        "epochs": rows,
        "duplicates": sum(r["committed"] - r["distinct"] for r in rows.values()),
    }


def _ledger_records(elastic_dir: Path, kind: str) -> list[dict]:
    ledger = elastic_dir / LEDGER_DIR
    if not ledger.is_dir():
        return []
    out = []
    for path in sorted(ledger.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                if record.get("kind") == kind:
                    out.append(record)
    return out


def _timeline(elastic_dir: Path, agent_logs: Path, nodes: int, cut: dict | None) -> dict:
    """Detection, outage, rejoin and step times from the ledger, the watchdog's lines and the
    cut's wall-clock times (``None`` where the drill did not get that far)."""
    steps = ledger_steps(elastic_dir) if (elastic_dir / LEDGER_DIR).is_dir() else []
    rank0 = sorted((r for r in steps if r["rank"] == 0), key=lambda r: r["time"])
    step_times: dict[int, list[float]] = {}
    for a, b in zip(rank0, rank0[1:], strict=False):
        if a["run"] == b["run"] and b["step"] == a["step"] + 1:
            step_times.setdefault(b["world_size"], []).append(b["time"] - a["time"])
    by_rank: dict[int, list[float]] = {}  # at full size: a slow node's ranks show there
    for rank in {r["rank"] for r in steps}:
        mine = sorted((r for r in steps if r["rank"] == rank and r["world_size"] == nodes),
                      key=lambda r: r["time"])  # fmt: skip
        for a, b in zip(mine, mine[1:], strict=False):
            if a["run"] == b["run"] and b["step"] == a["step"] + 1:
                by_rank.setdefault(rank, []).append(b["time"] - a["time"])
    out: dict = {
        "median_step_seconds": {w: statistics.median(v) for w, v in sorted(step_times.items())},
        "median_step_seconds_by_rank": {
            r: statistics.median(v) for r, v in sorted(by_rank.items())
        },
        "steps_recorded": len(rank0),
    }
    gave_up = []
    for path in sorted(agent_logs.glob("node*.log")):
        node = int(path.stem[4:])
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            match = _GAVE_UP.match(line.strip())
            if match:
                gave_up.append({"node": node, "rank": int(match.group(1)),
                                "reason": match.group(2), "time": float(match.group(3))})  # fmt: skip
    # In-process recovery: each survivor's recovery record says when its collective failed.
    for record in _ledger_records(elastic_dir, "recovery"):
        if record["reason"] != "failure":  # a newcomer admitted at a commit
            continue
        gave_up.append({"node": record.get("node"), "rank": record["rank"], "reason": record["reason"],
                        "time": float(record["failed_at"])})  # fmt: skip
    out["gave_up"] = gave_up
    if not cut or "cut_at_time" not in cut:
        return out
    t_cut, t_up = cut["cut_at_time"], cut.get("up_at_time")
    after = [g["time"] - t_cut for g in gave_up if g["time"] >= t_cut]
    survivors = [
        g["time"] - t_cut for g in gave_up if g["time"] >= t_cut and g["node"] != cut["node"]
    ]
    out["detection_seconds"] = min(after) if after else None
    out["survivors_detection_seconds"] = max(survivors) if survivors else None
    starts = [r["time"] for r in _ledger_starts(elastic_dir) if r["time"] > t_cut]
    out["restart_seconds"] = min(starts) - t_cut if starts else None
    resumed = [r["time"] for r in rank0 if r["time"] > t_cut and r["world_size"] < nodes]
    out["outage_seconds"] = min(resumed) - t_cut if resumed else None
    if t_up is not None:
        back = [r["time"] for r in rank0 if r["time"] > t_up and r["world_size"] == nodes]
        out["rejoin_seconds"] = min(back) - t_up if back else None
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv, command = split_command(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="python -m trainers.elastic_drill",
        description="Run an elastic job on N local nodes, kill one mid-run, add one later; "
        "or (--netlab) on the lab network with a partition or a slow link.",
        epilog="the training command follows --, e.g. -- scripts/train_imagenet.py --run-log x.jsonl",
    )
    p.add_argument("--nodes", type=int, default=3, help="agents at the start (>= 3)")
    p.add_argument("--kill-at-step", type=int, default=None, help="kill a node at this step")
    p.add_argument("--join-at-step", type=int, default=None, help="add a node at this step")
    p.add_argument("--kill-node", type=int, default=0, help="which agent dies (start order)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per worker")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole drill")
    p.add_argument("--rdzv-conf", default=RDZV_CONF, help="torchrun --rdzv-conf")
    p.add_argument("--recovery", choices=("restart", "inproc"), default="restart",
                   help="restart: torchrun agents restart every worker from state.pt (default); "
                   "inproc: the survivors re-form the group in their processes "
                   "(python -m trainers.elastic inproc)")  # fmt: skip
    lab = p.add_argument_group("--netlab: the lab network (trainers.netlab; needs root)")
    lab.add_argument("--netlab", action="store_true", help="run the nodes on the lab network")
    lab.add_argument("--bandwidth", default="1gbit", help="every node's link cap (none: uncapped)")
    lab.add_argument("--min-nodes", type=int, default=None, help="torchrun MIN (default N-1)")
    lab.add_argument(
        "--partition",
        default=None,
        metavar="NODE:STEP:SECONDS",
        help="pull NODE's cable at training step STEP, plug it back SECONDS later",
    )
    lab.add_argument("--slow-node", default=None, metavar="NODE:RATE",
                     help="cap NODE's link at RATE (e.g. 2:100mbit)")  # fmt: skip
    lab.add_argument("--share-store", action="store_true",
                     help="torchrun's default shared worker store (reproduces its failure)")  # fmt: skip
    lab.add_argument("--store-on", choices=("control", "node0"), default="control",
                     help="the rendezvous store on the lab's control host (default) or hosted "
                     "by node 0's agent (a partition of node 0 then isolates it)")  # fmt: skip
    args = p.parse_args(argv)
    try:
        if args.netlab:
            if args.kill_at_step is not None or args.join_at_step is not None:
                raise DrillUsage(
                    "--kill-at-step/--join-at-step: not with --netlab (use --partition)"
                )
            if args.partition is None and args.slow_node is None:
                raise DrillUsage("--netlab: give --partition NODE:STEP:SECONDS or --slow-node")
            result = run_netlab_drill(
                command, nodes=args.nodes, min_nodes=args.min_nodes,
                bandwidth=None if args.bandwidth == "none" else args.bandwidth,
                partition=parse_partition(args.partition) if args.partition else None,
                slow_node=parse_slow_node(args.slow_node) if args.slow_node else None,
                threads=args.threads, timeout=args.timeout, share_store=args.share_store,
                store_on=args.store_on, recovery=args.recovery,
            )  # fmt: skip
            print(_netlab_summary(result))
            return 0
        if args.store_on != "control":
            raise DrillUsage("--store-on: only with --netlab")
        for flag in ("partition", "slow_node", "share_store"):
            if getattr(args, flag):
                raise DrillUsage(f"--{flag.replace('_', '-')}: only with --netlab")
        if args.kill_at_step is None:
            raise DrillUsage("--kill-at-step: required (or --netlab with --partition)")
        result = run_drill(
            command, nodes=args.nodes, kill_at_step=args.kill_at_step,
            join_at_step=args.join_at_step, kill_node=args.kill_node, threads=args.threads,
            timeout=args.timeout, rdzv_conf=args.rdzv_conf, recovery=args.recovery,
        )  # fmt: skip
    except DrillUsage as e:
        print(f"elastic_drill: error: {e}", file=sys.stderr)
        return 2
    except DrillError as e:
        print(f"elastic_drill: error: {e}", file=sys.stderr)
        return 1
    changes = ", ".join(
        f"step {m.get('step')}: {m.get('old_world_size')} -> {m.get('new_world_size')}"
        for m in result["membership"]
    )
    print(f"[drill] done; membership changes: {changes or 'none'}; ledger in {result['ledger']}")
    return 0


def _netlab_summary(result: dict) -> str:
    def secs(key: str) -> str:
        value = result.get(key)
        return "-" if value is None else f"{value:.1f} s"

    changes = ", ".join(
        f"step {m.get('step')}: {m.get('old_world_size')} -> {m.get('new_world_size')}"
        for m in result["membership"]
    )
    steps = ", ".join(f"{w} nodes {t:.3f} s" for w, t in result["median_step_seconds"].items())
    epochs = result["samples"]["epochs"]
    note = f" ({result['note']})" if result.get("note") else ""
    return (
        f"[drill] done; detection {secs('detection_seconds')} (survivors "
        f"{secs('survivors_detection_seconds')}), new worker group {secs('restart_seconds')}, "
        f"first step without the node {secs('outage_seconds')}, rejoin "
        f"{secs('rejoin_seconds')}{note}; median step {steps or '-'}; membership changes: "
        f"{changes or 'none'}; {len(epochs)} epochs, every committed sample once; "
        f"ledger in {result['ledger']}"
    )


if __name__ == "__main__":
    sys.exit(main())
