"""Start ``world`` gloo worker processes on 127.0.0.1 and wait for all of them.

Shared by the multi-process tests: each worker is ``python -m <module> <args...>`` with the
torchrun-style environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...), one thread each. A
worker that fails or outlives ``timeout`` fails the test with every rank's output; on a
timeout that output ends with each rank's Python stacks (``faulthandler`` on SIGABRT), so a
hang names the line every rank waits in.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    module: str, args: list[str], *, world: int = 2, timeout: float = 300, port: int | None = None
) -> list[str]:
    """Run the ranks to completion; returns their combined stdout/stderr, rank by rank."""
    port = free_port() if port is None else port
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONFAULTHANDLER="1",  # SIGABRT on a timeout prints every thread's stack
            PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", module, *args],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{module} {args}: not finished after {timeout} s\n"
                               + _stacks(procs)) from None  # fmt: skip
    for rank, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"{module} rank {rank} failed:\n{text}"
    return outputs


def _stacks(procs: list[subprocess.Popen]) -> str:
    """Abort every rank still running and return each rank's output with its stacks."""
    for q in procs:
        if q.poll() is None:
            q.send_signal(signal.SIGABRT)
    texts = []
    for rank, q in enumerate(procs):
        try:
            text = q.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            q.kill()
            text = q.communicate()[0]
        texts.append(f"----- rank {rank} (exit {q.returncode}) -----\n{text}")
    return "\n".join(texts)
