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

Example (the published elastic digits recipe)::

    python -m trainers.elastic_drill --nodes 3 --kill-at-step 30 --join-at-step 70 -- \\
        scripts/train_imagenet.py -j 0 --no-progress --batch-size 32 --elastic-checkpoint-steps 4 \\
        --elastic-ramp-steps 5 --run-log runs/elastic.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from .cli import split_command
from .elastic import LEDGER_DIR, serve_store

__all__ = ["DrillError", "ledger_steps", "main", "run_drill"]

#: short keep-alive and last-call so that a death is seen in seconds on one machine
RDZV_CONF = "last_call_timeout=2,is_host=false,keep_alive_interval=1,keep_alive_max_attempt=10"


class DrillError(RuntimeError):
    """The drill could not run or the job did not finish."""


def _flag_value(command: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(command):
        if arg == flag and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


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
) -> dict:
    """Run the drill (module docstring); returns what happened (times, steps, exit codes).

    ``command`` is the training script and its flags; it must name ``--run-log`` and must
    not name ``--elastic-dir`` (the drill gives each run a fresh one).
    """
    if nodes < 3:
        raise DrillError(f"--nodes {nodes}: need at least 3 (the job keeps 2 after one dies)")
    if not 0 <= kill_node < nodes:
        raise DrillError(f"--kill-node {kill_node}: must be in [0, {nodes - 1}]")
    if join_at_step is not None and join_at_step <= kill_at_step:
        raise DrillError(
            f"--join-at-step {join_at_step} must come after --kill-at-step {kill_at_step}"
        )
    if not command or not command[0].endswith(".py"):
        raise DrillError("give the training command after --, e.g. -- scripts/train_imagenet.py")
    if _flag_value(command, "--elastic-dir") is not None:
        raise DrillError("leave --elastic-dir out of the command: the drill makes a fresh one")
    run_log = _flag_value(command, "--run-log")
    if run_log is None:
        raise DrillError("the command must name --run-log: the drill checks its end record")
    run_log_path = Path(run_log)
    if run_log_path.exists():
        raise DrillError(f"{run_log}: exists; the drill writes a new run log (remove it first)")

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
        ledger_copy = run_log_path.with_suffix(".ledger")
        shutil.rmtree(ledger_copy, ignore_errors=True)
        shutil.copytree(elastic_dir / LEDGER_DIR, ledger_copy)
        result["ledger"] = str(ledger_copy)
        result["membership"] = [r for r in map(json.loads, lines) if r.get("kind") == "membership"]
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


def main(argv: Sequence[str] | None = None) -> int:
    argv, command = split_command(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="python -m trainers.elastic_drill",
        description="Run an elastic job on N local nodes, kill one mid-run, add one later.",
        epilog="the training command follows --, e.g. -- scripts/train_imagenet.py --run-log x.jsonl",
    )
    p.add_argument("--nodes", type=int, default=3, help="agents at the start (>= 3)")
    p.add_argument("--kill-at-step", type=int, required=True, help="kill a node at this step")
    p.add_argument("--join-at-step", type=int, default=None, help="add a node at this step")
    p.add_argument("--kill-node", type=int, default=0, help="which agent dies (start order)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per worker")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole drill")
    p.add_argument("--rdzv-conf", default=RDZV_CONF, help="torchrun --rdzv-conf")
    args = p.parse_args(argv)
    try:
        result = run_drill(
            command, nodes=args.nodes, kill_at_step=args.kill_at_step,
            join_at_step=args.join_at_step, kill_node=args.kill_node, threads=args.threads,
            timeout=args.timeout, rdzv_conf=args.rdzv_conf,
        )  # fmt: skip
    except DrillError as e:
        print(f"elastic_drill: error: {e}", file=sys.stderr)
        return 1
    changes = ", ".join(
        f"step {m.get('step')}: {m.get('old_world_size')} -> {m.get('new_world_size')}"
        for m in result["membership"]
    )
    print(f"[drill] done; membership changes: {changes or 'none'}; ledger in {result['ledger']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
