"""Every registered communication mode trains a few steps across 4 lab nodes (issue 38).

The worker (_netlab_comm_worker.py) trains a small MLP on the digits with every mode of
``trainers.comm.list_combiners()`` once across a 4-node lab (1 Gbit links, one rank per node
on its own interface) and once as 4 processes on loopback. Oracles: the loopback run (the
network changes time, never arithmetic: the same final parameters bit for bit), the first
step's loss (a trained model ends well below it; an untrained or diverged one does not), and
the kernel's counters of each node's interface (at least the bytes the combiner says it sent:
the wire also carries headers, barriers and handshakes).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.trainers import _netlab_comm_worker as worker
from tests.trainers._launch import REPO, _stacks, free_port, run_ranks
from trainers.comm import list_combiners
from trainers.netlab import Lab, list_labs, missing_requirements, start_ranks

WHY = missing_requirements()
pytestmark = [
    pytest.mark.netlab,
    pytest.mark.dist,
    pytest.mark.slow,
    pytest.mark.skipif(WHY is not None, reason=f"netlab: {WHY}"),
]

NODES = 4
MODULE = "tests.trainers._netlab_comm_worker"
TIMEOUT = 300
# Runs whose final parameters depend on timing, so a different network may change them.
TIMING_DEPENDENT = {
    # AD-PSGD (asynchronous by default, as the paper): a communication thread averages with a
    # peer while the main thread computes, and the step applies whatever the thread finished
    # by then; which exchanges land before which step is decided by timing (is_deterministic
    # is False). Its synchronous rounds (adpsgd-sync) are deterministic.
    "adpsgd",
}
# Not exempt although is_deterministic() is False: CodedReduce with stragglers >= 1 lets
# timing decide which group member's gradient the root takes and which members skip a step
# (so the recorded losses differ), but the members of a group compute the same gradient bit
# for bit, so the applied model does not depend on timing (trainers/comm/coded.py).
LAST = 10  # the loss of the last LAST steps ...
MARGIN = 0.5  # ... must average below MARGIN x the first step's loss (chance: ln 10 = 2.30)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], list[dict], list[int]]:
    """(lab ranks' results, loopback ranks' results, bytes each lab node sent in all)."""
    out = tmp_path_factory.mktemp("lab")
    loop = tmp_path_factory.mktemp("loop")
    name = f"comm{os.getpid() % 10**8}"  # unique on this machine, <= 12 characters
    with Lab(NODES, bandwidth="1gbit", name=name) as lab:
        before = lab.all_counters()
        procs = start_ranks(lab, [sys.executable, "-m", MODULE, str(out)], port=free_port(),
                            cwd=REPO, env=dict(os.environ, PYTHONFAULTHANDLER="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        deadline = time.monotonic() + TIMEOUT
        try:
            outputs = [p.communicate(timeout=deadline - time.monotonic())[0] for p in procs]
        except subprocess.TimeoutExpired:
            pytest.fail(f"the lab run is not finished after {TIMEOUT} s\n{_stacks(procs)}")
        for rank, (p, text) in enumerate(zip(procs, outputs, strict=True)):
            assert p.returncode == 0, f"lab rank {rank} failed:\n{text}"
        sent = [(a - b).tx_bytes for a, b in zip(lab.all_counters(), before, strict=True)]
    assert name not in list_labs(), f"lab {name} was not removed"
    run_ranks(MODULE, [str(loop)], world=NODES, timeout=TIMEOUT)
    lab_ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(NODES)]
    loop_ranks = [torch.load(loop / f"rank{r}.pt", weights_only=True) for r in range(NODES)]
    return lab_ranks, loop_ranks, sent


RUNS = list(worker.runs())


def test_every_registered_mode_ran(runs):
    lab, loop, _ = runs
    for name, ranks in (("lab", lab), ("loopback", loop)):
        for rank, results in enumerate(ranks):
            modes = {r["mode"] for r in results.values()}
            missing = [m for m in list_combiners() if m not in modes]
            assert not missing, f"{name} rank {rank}: modes {missing} were not trained"
    unknown = TIMING_DEPENDENT - set(RUNS)
    assert not unknown, f"TIMING_DEPENDENT names runs the worker does not make: {unknown}"


@pytest.mark.parametrize("run", RUNS)
def test_the_mode_trains_across_the_lab_as_on_loopback(runs, run):
    lab, loop, _ = runs
    mode = lab[0][run]["mode"]
    for rank in range(NODES):
        a, b = lab[rank][run], loop[rank][run]
        assert a["steps"] == b["steps"] == worker.STEPS, (run, rank, a["steps"], b["steps"])
        # (b) it trains, on every rank, across the lab and on loopback
        for where, r in (("lab", a), ("loopback", b)):
            steps = dict(r["losses"])
            assert 0 in steps, f"{run}: {where} rank {rank} did not compute the first step"
            late = [loss for step, loss in steps.items() if step >= worker.STEPS - LAST]
            assert late, f"{run}: {where} rank {rank} computed none of the last {LAST} steps"
            mean = sum(late) / len(late)
            assert math.isfinite(mean) and mean < MARGIN * steps[0], (
                f"{run} ({mode}) did not train on {where} rank {rank}: the last {LAST} steps' "
                f"loss {mean:.3f} is not below {MARGIN} x the first step's {steps[0]:.3f}"
            )
        # (a) the network changes time, not arithmetic
        if run in TIMING_DEPENDENT:
            assert not a["deterministic"], f"{run}: exempt, but the mode says it repeats"
        else:
            for i, (p, q) in enumerate(zip(a["params"], b["params"], strict=True)):
                assert torch.equal(p, q), (
                    f"{run} ({mode}): rank {rank}'s parameter {i} after the lab run differs from "
                    f"loopback's (max |diff| {(p - q).abs().max():.3g})"
                )
            if a["deterministic"]:
                assert a["losses"] == b["losses"], f"{run}: rank {rank}'s losses differ"
        # (c) measured on the node's cable vs what the combiner reports sending
        measured, reported = a["measured_bytes"], a["reported_bytes"]
        assert measured is not None, f"{run}: lab rank {rank} found no lab interface"
        if reported is not None:
            assert reported > 0, f"{run} ({mode}): lab rank {rank} reports sending nothing"
            assert measured >= reported, (
                f"{run} ({mode}): lab rank {rank} reports sending {reported} bytes, but its "
                f"interface sent {measured}"
            )


def test_the_nodes_sent_at_least_what_the_combiners_report(runs):
    lab, _, sent = runs
    for rank in range(NODES):
        results = lab[rank].values()
        reported = sum(r["reported_bytes"] or 0 for r in results)
        windows = sum(r["measured_bytes"] for r in results)
        # the worker read the same counter (from inside the node): its windows lie in the run
        assert reported <= windows <= sent[rank], (rank, reported, windows, sent[rank])
