"""Elastic recovery time: from a worker's death to the first training step after it.

``--recovery inproc`` (the default) starts ``--nodes`` members with ``python -m
trainers.elastic inproc`` on 127.0.0.1 (a store this process hosts), lets them train an MLP
with a ``trainers.elastic.ElasticState`` (commit every 5 steps), SIGKILLs the last rank and
reads the survivors' ``recovery`` ledger records (``trainers.recovery``):

* detect: the kill -> the survivors' collective fails;
* agree: the new membership agreed in the store (the dead heartbeat must go stale);
* process group + DDP: the new gloo group and ``DistributedDataParallel`` on it;
* hand over state: the latest commit sent where missing, and loaded;
* first step: -> the first optimizer step of the new group is done.

``--recovery restart`` starts torchrun agents instead (one worker each, c10d rendezvous,
``--nnodes=2:N``), SIGKILLs the last rank's worker and agent (a node dying) and reads the
survivors' timestamps:

* detect + rendezvous: the kill -> the new worker processes start (the agents notice the
  failure, stop the survivors, run a new rendezvous round, spawn);
* import + init: process start -> the process group is up (Python, torch, gloo);
* build: -> model, optimizer and ``DistributedDataParallel`` built (DDP's first use imports
  ``torch._dynamo``: seconds);
* restore: -> ``state.pt`` loaded (every rank reads it), the data re-split;
* first step: -> the first optimizer step of the new world is done.

``--params-millions`` sizes the model (25 is about ResNet-50: a 200 MB state with momentum).
There is no peer to run side by side: Horovod's elastic mode does not build against current
torch (see DESIGN.md), so this prints the breakdown and ``recovery_seconds=<median total>``
(``restart_seconds=`` for the restart path) last.

    python benchmarks/bench_elastic.py [--recovery inproc] [--nodes 3] [--repeats 5] \
        [--params-millions 0.1]
"""

from __future__ import annotations

import time

_PROCESS_START = time.time()  # before the imports: the worker's "process start"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from _report import check_rounds, machine_line, spread  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from trainers import DistEnv, RunLogger, Trainer, TrainerConfig  # noqa: E402
from trainers.elastic import ElasticState  # noqa: E402

RDZV_CONF = "last_call_timeout=1,is_host=false,keep_alive_interval=1,keep_alive_max_attempt=5"


# -- the worker -----------------------------------------------------------------------------
def worker(out: Path, params_millions: float) -> None:
    with DistEnv.from_env(device="cpu") as env:
        pg_ready = time.time()
        hidden = max(16, int((params_millions * 1e6) ** 0.5))  # the h x h layer dominates
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        model.append(nn.Linear(hidden, 10))
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(4096, 64, generator=g), torch.randint(0, 10, (4096,)))

        def train_step(m, batch):
            x, y = batch
            time.sleep(0.05)  # a paced step, so the kill lands mid-run
            return nn.functional.cross_entropy(m(x), y), {}

        trainer = Trainer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
            TrainerConfig(epochs=1000, max_steps=400, batch_size=8, log_interval=0, progress=False),
            env=env,
            logger=RunLogger(None, enabled=False),
            train_step=train_step,
        )
        ElasticState(trainer, out / "elastic", checkpoint_steps=5, ramp_steps=5)
        info = {"pid": os.getpid(), "rank": env.rank, "world_size": env.world_size}
        info.update(process_start=_PROCESS_START, pg_ready=pg_ready, agent_pid=os.getppid())
        (out / "procs").mkdir(exist_ok=True)
        (out / "procs" / f"{os.getpid()}.json").write_text(json.dumps(info))
        trainer.fit(data)


# -- the driver -------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(paths) -> list[dict]:
    records = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return records


def _launch(out: Path, cmd: list[str], copies: int, name: str) -> list[subprocess.Popen]:
    """``copies`` processes of ``cmd`` (1 thread each, this checkout first on the path),
    each in its own session, output in ``out/<name><i>.log``."""
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    procs = []
    for i in range(copies):
        log = open(out / f"{name}{i}.log", "w")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
    return procs


def _waiter(out: Path, timeout: float):
    def wait(what, predicate):
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waiting for {what}; see {out}")
            time.sleep(0.05)

    return wait


def one_restart(nodes: int, params_millions: float, timeout: float = 300) -> dict[str, float]:
    out = Path(tempfile.mkdtemp(prefix="bench_elastic_"))
    port = _free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes=2:{nodes}",
        "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=bench", "--max-restarts=3", "--monitor-interval=0.1",
        f"--rdzv-conf={RDZV_CONF}", __file__, "--worker", str(out),
        "--params-millions", str(params_millions),
    ]  # fmt: skip
    agents = _launch(out, cmd, nodes, "agent")
    ledger = out / "elastic" / "ledger"
    wait = _waiter(out, timeout)

    def steps():
        return [r for r in _read(ledger.glob("*.jsonl")) if r["kind"] == "step"]

    try:
        wait("steps at full size", lambda: any(r["world_size"] == nodes for r in steps()))
        wait("a few more steps", lambda: len(steps()) >= 12 * nodes)
        procs = _read((out / "procs").glob("*.json"))
        victim = max(procs, key=lambda p: p["rank"])
        kill = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        os.killpg(victim["agent_pid"], signal.SIGKILL)
        wait("the first step after the restart", lambda: any(r["time"] > kill for r in steps()))
        new = [p for p in _read((out / "procs").glob("*.json")) if p["process_start"] > kill]
        starts = [r for r in _read(ledger.glob("*.jsonl")) if r["kind"] == "start"]
        restart = [r for r in starts if r["time"] > kill]
        restored = max(r["time"] for r in restart)
        load = max(r["load_seconds"] for r in restart)
        first = min(r["time"] for r in steps() if r["time"] > kill)
        return {
            "detect + rendezvous": max(p["process_start"] for p in new) - kill,
            "import + init": max(p["pg_ready"] - p["process_start"] for p in new),
            "build": restored - load - max(p["pg_ready"] for p in new),
            "restore": load,
            "first step": first - restored,
            "total": first - kill,
        }
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        for proc in _read((out / "procs").glob("*.json")) if (out / "procs").is_dir() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc["pid"], signal.SIGKILL)
        del store
        shutil.rmtree(out, ignore_errors=True)


def one_recovery(nodes: int, params_millions: float, timeout: float = 300) -> dict[str, float]:
    """The same job and kill under in-process recovery (``python -m trainers.elastic
    inproc``): the survivors keep their processes; phases from their ledger records."""
    out = Path(tempfile.mkdtemp(prefix="bench_elastic_inproc_"))
    port = _free_port()
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    cmd = [
        sys.executable, "-m", "trainers.elastic", "inproc", f"--store=127.0.0.1:{port}",
        "--job=bench", f"--nodes=2:{nodes}", __file__, "--worker", str(out),
        "--params-millions", str(params_millions),
    ]  # fmt: skip
    members = _launch(out, cmd, nodes, "member")
    ledger = out / "elastic" / "ledger"
    wait = _waiter(out, timeout)

    def records(kind):
        return [r for r in _read(ledger.glob("*.jsonl")) if r["kind"] == kind]

    try:
        wait("steps at full size", lambda: any(r["world_size"] == nodes for r in records("step")))
        wait("a few more steps", lambda: len(records("step")) >= 12 * nodes)
        procs = _read((out / "procs").glob("*.json"))
        victim = max(procs, key=lambda p: p["rank"])
        kill = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        wait("the first step after", lambda: any(r["time"] > kill for r in records("step")))
        wait("the survivors' recovery records", lambda: len(records("recovery")) >= nodes - 1)
        recovered = [r for r in records("recovery") if r["time"] > kill]
        first = min(r["time"] for r in records("step") if r["time"] > kill)
        phases = [r["phases"] for r in recovered]
        return {
            "detect": max(r["failed_at"] for r in recovered) - kill,
            "agree": max(p["agree"] for p in phases),
            "process group + DDP": max(p["process_group"] + p["rewrap"] for p in phases),
            "hand over state": max(p["transfer"] + p["restore"] for p in phases),
            "first step": first - max(r["time"] for r in recovered),
            "total": first - kill,
        }
    finally:
        for member in members:
            if member.poll() is None:
                os.killpg(member.pid, signal.SIGKILL)
                member.wait()
        del store
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--nodes", type=int, default=3, help="agents at the start (>= 3)")
    parser.add_argument("--repeats", type=int, default=5, help="restarts timed (>= 5)")
    parser.add_argument("--params-millions", type=float, default=0.1, help="model size")
    parser.add_argument(
        "--recovery",
        choices=["restart", "inproc"],
        default="inproc",
        help="inproc: the survivors re-form the group in their processes (trainers.recovery, "
        "the default); restart: torchrun restarts every worker from state.pt",
    )
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.params_millions)
        return
    check_rounds(args.repeats)
    if args.nodes < 3:
        parser.error("--nodes must be >= 3 (the job keeps at least 2 after one dies)")
    how = (
        f"rdzv-conf {RDZV_CONF}"
        if args.recovery == "restart"
        else "in-process recovery, heartbeat timeout "
        f"{os.environ.get('MODELZOO_PEER_TIMEOUT') or '1 (default)'} s"
    )
    print(f"{args.nodes} members -> {args.nodes - 1}, model {args.params_millions}M params, "
          f"{how}, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(machine_line())
    one = one_restart if args.recovery == "restart" else one_recovery
    runs = [one(args.nodes, args.params_millions) for _ in range(args.repeats)]
    for phase in runs[0]:
        values = [r[phase] for r in runs]
        print(f"{phase:>20}: {spread(values)}  ({', '.join(f'{v:.2f}' for v in values)})")
    name = "restart_seconds" if args.recovery == "restart" else "recovery_seconds"
    print(f"{name}={statistics.median(r['total'] for r in runs):.2f}")


if __name__ == "__main__":
    main()
