"""Run a torchrun job across the nodes of a lab, with an optional partition, and count bytes.

One torchrun agent per node namespace, each with its own interface and address:

* c10d rendezvous on node 0's address (``is_host=1`` there, ``0`` elsewhere: c10d's own
  host detection compares host names, which every namespace shares), or, for an elastic job
  whose node 0 may leave, on the lab's control host (the switch namespace's bridge address,
  198.18.0.1), which stays up for the whole job;
* ``--local-addr`` = the node's address (otherwise rank 0 advertises ``localhost``) and
  ``GLOO_SOCKET_IFNAME=eth0`` (otherwise gloo resolves the host name to 127.0.0.1);
* ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: every rendezvous round publishes a fresh worker
  store address instead of reusing the first round's (docs/elastic.md).

The bytes each node sent and received are its interface counters before and after the job
(measured on the cable, headers and retransmissions included, not computed). A partition
pulls one node's cable at the switch at a chosen time or training step and plugs it back
after a chosen duration. Every job is bounded by a timeout and everything it started is
stopped when it ends, however it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .lab import Lab, LabError, _kill_in, format_rate

__all__ = [
    "CONTROL_ADDRESS",
    "JobResult",
    "Partition",
    "flag_value",
    "run_job",
    "start_ranks",
    "wait_ranks",
]

CONTROL_ADDRESS = "198.18.0.1"  # the bridge's address in the switch namespace: the store host
RDZV_PORT = 29400
#: c10d settings for a job whose membership may change: a death is seen in seconds
ELASTIC_RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


@dataclasses.dataclass(frozen=True)
class Partition:
    """Pull ``node``'s cable at ``at_step`` (a training step seen in the run log or the
    elastic ledger) or ``at_time`` seconds after the job started; plug it back ``duration``
    seconds later (``None``: at the end of the job)."""

    node: int
    at_step: int | None = None
    at_time: float | None = None
    duration: float | None = None

    def __post_init__(self) -> None:
        if (self.at_step is None) == (self.at_time is None):
            raise ValueError("a partition needs exactly one of a step and a time")
        if self.at_step is not None and self.at_step < 0:
            raise ValueError(f"partition step {self.at_step}: must be >= 0")
        if self.at_time is not None and self.at_time < 0:
            raise ValueError(f"partition time {self.at_time}: must be >= 0 seconds")
        if self.duration is not None and self.duration <= 0:
            raise ValueError(f"partition duration {self.duration}: must be > 0 seconds")


@dataclasses.dataclass
class JobResult:
    """What a lab job did: per-node exit codes and bytes on the cable, times, partition."""

    nodes: int
    caps: list[str | None]
    exit_codes: list[int | None]
    wall_seconds: float
    tx_bytes: list[int]
    rx_bytes: list[int]
    timed_out: bool = False
    partition: dict | None = None
    logs: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(code == 0 for code in self.exit_codes)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def table(self) -> str:
        lines = [f"{'node':>4}  {'cap':>8}  {'exit':>4}  {'sent MB':>10}  {'received MB':>11}"]
        for node in range(self.nodes):
            lines.append(
                f"{node:>4}  {self.caps[node] or 'none':>8}  {str(self.exit_codes[node]):>4}  "
                f"{self.tx_bytes[node] / 1e6:>10.2f}  {self.rx_bytes[node] / 1e6:>11.2f}"
            )
        return "\n".join(lines)


def flag_value(command: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(command):
        if arg == flag and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def last_step(command: Sequence[str], cwd: Path) -> int | None:
    """The latest training step the job has recorded: its elastic ledger when it has one,
    else the ``step`` records of its run log (every ``--log-interval`` steps)."""
    from ..elastic_drill import ledger_steps

    elastic_dir = flag_value(command, "--elastic-dir")
    if elastic_dir is not None:
        steps = ledger_steps(cwd / elastic_dir)
        return max((r["step"] for r in steps), default=None)
    run_log = flag_value(command, "--run-log")
    if run_log is None:
        return None
    path = cwd / run_log
    best = None
    with contextlib.suppress(OSError):
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line)
                if record.get("kind") == "step" and "step" in record:
                    best = max(best or 0, int(record["step"]))
    return best


def torchrun_argv(
    lab: Lab,
    node: int,
    command: Sequence[str],
    *,
    nproc_per_node: int,
    min_nodes: int | None,
    rdzv_on_control: bool,
    max_restarts: int,
    rdzv_id: str,
    python: str,
    extra_rdzv_conf: str | None,
) -> list[str]:
    elastic = min_nodes is not None and min_nodes < lab.nodes
    nnodes = f"{min_nodes}:{lab.nodes}" if elastic else str(lab.nodes)
    host = CONTROL_ADDRESS if rdzv_on_control else lab.address(0)
    conf = [f"is_host={0 if rdzv_on_control or node != 0 else 1}"]
    if elastic:
        conf.append(ELASTIC_RDZV_CONF)
    if extra_rdzv_conf:
        conf.append(extra_rdzv_conf)
    return [
        python, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=c10d",
        f"--rdzv-endpoint={host}:{RDZV_PORT}", f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf={','.join(conf)}", f"--local-addr={lab.address(node)}",
        f"--max-restarts={max_restarts}", "--monitor-interval=0.5", *command,
    ]  # fmt: skip


def run_job(
    lab: Lab,
    command: Sequence[str],
    *,
    nproc_per_node: int = 1,
    min_nodes: int | None = None,
    threads: int = 1,
    timeout: float = 3600.0,
    partition: Partition | None = None,
    max_restarts: int = 3,
    rdzv_on_control: bool | None = None,
    extra_rdzv_conf: str | None = None,
    log_dir: Path | None = None,
    cwd: Path | None = None,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
    log: Callable[[str], None] = print,
    share_store: bool = False,
    launcher: str = "torchrun",
) -> JobResult:
    """Start ``command`` (a script and its flags) on every node of the running ``lab`` under
    torchrun and wait for it (module docstring). Returns per-node exit codes and bytes.

    ``min_nodes`` below ``lab.nodes`` makes the job elastic (``--nnodes=MIN:N``, rendezvous on
    the control host). Each agent's output goes to ``log_dir/node<i>.log`` (a temporary
    folder when ``None``, named in the result). ``share_store=True`` leaves torchrun's
    default (one worker store for every rendezvous round; unsafe, see docs/elastic.md): only
    to reproduce that failure. ``launcher="inproc"``: each node runs ``python -m
    trainers.elastic inproc`` (members that recover in process, :mod:`trainers.recovery`)
    instead of a torchrun agent; the job's store is on the control host. The partition record carries the cut's and the reconnection's
    wall-clock times (``cut_at_time``, ``up_at_time``) besides the seconds into the job.
    """
    if not lab.is_up:
        raise LabError("the lab is not up: use it as a context manager or call up() first")
    if not command:
        raise ValueError("no command: give the training script and its flags")
    if partition is not None:
        lab._check_node(partition.node)
    cwd = Path.cwd() if cwd is None else Path(cwd)
    if launcher not in ("torchrun", "inproc"):
        raise ValueError(f"launcher {launcher!r}: torchrun or inproc")
    if launcher == "inproc":
        rdzv_on_control = True  # the members' store must outlive any node
    if rdzv_on_control is None:
        rdzv_on_control = (min_nodes is not None and min_nodes < lab.nodes) or (
            partition is not None and partition.node == 0
        )
    log_dir = Path(
        log_dir if log_dir is not None else tempfile.mkdtemp(prefix=f"netlab_{lab.name}_")
    )
    log_dir.mkdir(parents=True, exist_ok=True)
    base = dict(os.environ if env is None else env)
    base.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                PYTHONUNBUFFERED="1")  # fmt: skip
    if share_store:
        base.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    else:
        base["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    _import_from_here(base)

    procs: list[subprocess.Popen] = []
    outs = []
    store = None
    rdzv_id = f"netlab-{lab.name}"
    before = lab.all_counters()
    start = time.monotonic()
    partition_record: dict | None = None
    timed_out = False
    try:
        if rdzv_on_control:
            lab.enable_control_host(CONTROL_ADDRESS)
            store = lab.popen_switch(
                [python, "-m", "trainers.elastic", "store", "--host", CONTROL_ADDRESS,
                 "--port", str(RDZV_PORT)],
                env=base, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            _wait_for_port(lab, CONTROL_ADDRESS, RDZV_PORT, timeout=30)
        for node in range(lab.nodes):
            argv = torchrun_argv(
                lab, node, command, nproc_per_node=nproc_per_node, min_nodes=min_nodes,
                rdzv_on_control=rdzv_on_control, max_restarts=max_restarts, rdzv_id=rdzv_id,
                python=python, extra_rdzv_conf=extra_rdzv_conf,
            ) if launcher == "torchrun" else [
                python, "-m", "trainers.elastic", "inproc",
                f"--store={CONTROL_ADDRESS}:{RDZV_PORT}", f"--job={rdzv_id}",
                f"--nodes={min_nodes or lab.nodes}:{lab.nodes}",
                f"--nproc-per-node={nproc_per_node}", *command,
            ]  # fmt: skip
            out = open(log_dir / f"node{node}.log", "w", encoding="utf-8")  # noqa: SIM115
            outs.append(out)
            procs.append(lab.popen(node, argv, env=lab.node_env(node, base), cwd=cwd, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
        log(f"[netlab] {lab.nodes} nodes started ({nproc_per_node} process(es) each); "
            f"agent output in {log_dir}")  # fmt: skip
        cut_at = restore_at = None
        deadline = start + timeout
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                timed_out = True
                log(f"[netlab] timed out after {timeout:.0f} s; stopping every node")
                break
            if partition is not None and cut_at is None:
                step = last_step(command, cwd) if partition.at_step is not None else None
                if (partition.at_time is not None and now - start >= partition.at_time) or (
                    step is not None and step >= partition.at_step
                ):
                    lab.set_link(partition.node, up=False)
                    cut_at, cut_time = now, time.time()
                    partition_record = {"node": partition.node, "cut_at_s": now - start,
                                        "cut_at_step": last_step(command, cwd),
                                        "cut_at_time": cut_time}  # fmt: skip
                    log(f"[netlab] node {partition.node}'s link down at {now - start:.1f} s "
                        f"(step {partition_record['cut_at_step']})")  # fmt: skip
            if (cut_at is not None and restore_at is None and partition.duration is not None
                    and now - cut_at >= partition.duration):  # fmt: skip
                lab.set_link(partition.node, up=True)
                restore_at, up_time = now, time.time()
                partition_record.update(up_at_s=now - start, up_at_step=last_step(command, cwd),
                                        up_at_time=up_time)  # fmt: skip
                log(f"[netlab] node {partition.node}'s link up at {now - start:.1f} s")
            time.sleep(0.1)
    finally:
        if (
            partition is not None
            and partition_record is not None
            and "up_at_s" not in partition_record
        ):
            with contextlib.suppress(LabError):
                lab.set_link(partition.node, up=True)
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, 15)
        _kill_in([lab.namespace(n) for n in range(lab.nodes)], grace=3.0)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        if store is not None:
            store.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                store.wait(timeout=5)
            if store.poll() is None:
                store.kill()
        for out in outs:
            out.close()
    after = lab.all_counters()
    wall = time.monotonic() - start
    return JobResult(
        nodes=lab.nodes,
        caps=[None if c is None else format_rate(c) for c in lab.caps.values()],
        exit_codes=[p.returncode for p in procs],
        wall_seconds=wall,
        tx_bytes=[(a - b).tx_bytes for a, b in zip(after, before, strict=True)],
        rx_bytes=[(a - b).rx_bytes for a, b in zip(after, before, strict=True)],
        timed_out=timed_out,
        partition=partition_record,
        logs=[str(log_dir / f"node{n}.log") for n in range(lab.nodes)],
    )


def _import_from_here(env: dict[str, str]) -> None:
    """Put this checkout first on ``env``'s ``PYTHONPATH``, so that processes started in the
    lab's namespaces import the same ``trainers`` (and scripts' ``modelzoo``) as the caller."""
    repo = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")


def _wait_for_port(lab: Lab, host: str, port: int, timeout: float) -> None:
    """Wait until ``host:port`` accepts connections from node 0's namespace."""
    probe = (
        "import socket,sys,time\n"
        "end=time.time()+float(sys.argv[3])\n"
        "while True:\n"
        "    try:\n"
        "        socket.create_connection((sys.argv[1],int(sys.argv[2])),timeout=1).close();break\n"
        "    except OSError:\n"
        "        if time.time()>end: sys.exit(1)\n"
        "        time.sleep(0.1)\n"
    )
    done = lab.run(0, [sys.executable, "-c", probe, host, str(port), str(timeout)],
                   timeout=timeout + 10, check=False)  # fmt: skip
    if done.returncode != 0:
        raise LabError(f"the rendezvous store on {host}:{port} did not come up in {timeout:.0f} s")


def start_ranks(
    lab: Lab,
    argv: Sequence[str],
    *,
    nproc_per_node: int = 1,
    port: int = 29500,
    threads: int = 1,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    **popen_kwargs,
) -> list[subprocess.Popen]:
    """Start ``argv`` (e.g. ``[python, "-m", "pkg.worker", ...]``) as ranks across the lab
    without torchrun (about 2.5 s instead of 6-40 s per job): ``nproc_per_node`` ranks on
    each node, rank ``node * nproc_per_node + local``, torchrun's variables set, the default
    process group's store on node 0's address. The caller waits for the processes."""
    base = dict(os.environ if env is None else env)
    _import_from_here(base)
    world = lab.nodes * nproc_per_node
    procs = []
    for node in range(lab.nodes):
        for local in range(nproc_per_node):
            rank_env = lab.node_env(node, base)
            rank_env.update(
                RANK=str(node * nproc_per_node + local), LOCAL_RANK=str(local),
                WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(nproc_per_node),
                GROUP_RANK=str(node), MASTER_ADDR=lab.address(0), MASTER_PORT=str(port),
                OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
            )  # fmt: skip
            procs.append(lab.popen(node, list(argv), env=rank_env, cwd=cwd, **popen_kwargs))
    return procs


def wait_ranks(procs: Sequence[subprocess.Popen], timeout: float) -> bool:
    """Wait for ranks started by :func:`start_ranks`; stop them all once one fails (its peers
    would wait for it until gloo's timeout) or ``timeout`` seconds pass. ``False``: the time
    ran out."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline or any(p.returncode for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            return time.monotonic() <= deadline
        time.sleep(0.2)
    return True
