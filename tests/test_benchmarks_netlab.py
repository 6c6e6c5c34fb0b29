"""The lab-network modes of benchmarks/bench_sparse.py and benchmarks/plan_check.py (issue 38).

Without a lab: the cost model and the planner's network come from the cap alone (the TCP
payload of a 1514-byte frame, 1448 bytes), the report's errors and "beats the all-gather"
verdicts are the arithmetic of the medians and the formula, and the benchmark's supports are
uniform over the vector with exactly the stated overlap. On a 2-node lab (marker ``netlab``,
skipped with the reason where namespaces cannot be made): both scripts run their ranks on the
nodes, the lab is removed, and each node's interface sent at least the bytes the sparse
algorithms report (the kernel's counters are the oracle: the wire adds headers and ACKs).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainers.comm.sparse import ALGORITHMS, CostModel, estimate_costs
from trainers.netlab import list_labs, missing_requirements

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
WHY = missing_requirements()


def _load(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"_netlab_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_lab_cost_model_is_the_caps_tcp_payload_and_the_default_latency():
    bench = _load("bench_sparse")
    cost = bench.lab_cost(100_000_000)
    assert cost.bandwidth == pytest.approx(100e6 / 8 * 1448 / 1514)
    assert (cost.latency, cost.merge, cost.scan, cost.swap) == (
        CostModel.latency, CostModel.merge, CostModel.scan, CostModel.swap,
    )  # fmt: skip
    assert bench.lab_cost(10**9, latency_us=250).latency == pytest.approx(250e-6)
    measured = bench.lab_cost(10**9, merge=5e-8, scan=6e-9, fill=2e-10, scatter=3e-9, swap=2.5)
    assert (measured.merge, measured.scan, measured.fill, measured.scatter, measured.swap) == (
        5e-8, 6e-9, 2e-10, 3e-9, 2.5,
    )  # fmt: skip


def test_the_planners_lab_network_is_the_caps_tcp_payload():
    check = _load("plan_check")
    net = check.lab_network(4, 10**9, 500.0)
    assert net.devices == 4 and len(net.levels) == 1
    assert net.levels[0].gbps == pytest.approx(1448 / 1514, rel=1e-5)
    assert net.levels[0].latency_s == pytest.approx(500e-6)


def test_the_supports_are_uniform_with_exactly_the_stated_overlap():
    bench = _load("bench_sparse")
    numel, k = 1 << 20, 10_000
    a = bench.supports(numel, k, 0.5, rank=0, setting=1)
    b = bench.supports(numel, k, 0.5, rank=1, setting=1)
    for idx in (a, b):
        assert idx.numel() == k and torch.equal(idx, torch.unique(idx))
        # every quarter of the vector holds about a quarter of the indices (split-allgather's
        # owners get equal shares): the smallest-k of a draw would put them all in the first
        quarters = torch.histc(idx.float(), bins=4, min=0, max=numel)
        assert ((quarters > 0.2 * k) & (quarters < 0.3 * k)).all(), quarters.tolist()
    shared = len(set(a.tolist()) & set(b.tolist()))
    expected_chance = (k / 2) ** 2 / numel  # the own draws may meet by chance
    assert k // 2 <= shared <= k // 2 + 10 * expected_chance + 10, shared


def _row(world: int, k: int, numel: int, union: int, med: dict[str, float]) -> dict:
    names = (*ALGORITHMS, "auto", "peer_allgather", "peer_dense")
    return {
        "world": world, "numel": numel, "density": k / numel, "k": k, "union": union,
        "netlab": "100mbit", "times": {n: [med.get(n, 1.0)] * 5 for n in names},
        "info": {"auto": {"algorithm": "allgather"}},
        "reported_bytes": [dict.fromkeys(names, 100)] * world,
        "wire_bytes": [dict.fromkeys(names, 110)] * world,
    }  # fmt: skip


def test_the_report_compares_the_medians_with_the_formula():
    bench = _load("bench_sparse")
    cost = bench.lab_cost(100_000_000)
    world, k, numel, union = 8, 40_000, 1 << 22, 60_000
    est = estimate_costs([k] * world, numel, 4, cost=cost, union=union, dense_output=True)
    # measured: the formula's times, except split-allgather (2x) and dense (0.5x)
    med = {n: est[n] for n in ALGORITHMS}
    med["split_allgather"] *= 2
    med["dense"] *= 0.5
    med["peer_allgather"] = med["allgather"]
    row = _row(world, k, numel, union, med)
    summary = bench.lab_report([row], cost)
    assert summary["max_rel_error"] == pytest.approx(1.0)  # dense predicted at 2x
    assert row["rel_error"]["split_allgather"] == pytest.approx(-0.5)
    assert row["rel_error"]["allgather"] == pytest.approx(0.0, abs=1e-12)
    assert row["measured_fastest"] == min(ALGORITHMS, key=lambda n: med[n])
    assert row["formula_pick"] == min(ALGORITHMS, key=lambda n: est[n])
    for a in ("recursive_doubling", "split_allgather"):
        verdict = row["beats_allgather"][a]
        assert verdict["formula"] == (est[a] < est["allgather"])
        assert verdict["measured"] == (med[a] < med["allgather"])
    # without a model given, each row is priced by the model its run calibrated
    own = dataclasses.replace(cost, latency=5e-4, swap=2.0, cpu_share=4.0, scatter=3e-9)
    again = _row(world, k, numel, union, med)
    again["cost_model"] = dataclasses.asdict(own)
    bench.lab_report([again])
    assert again["predicted_s"] == estimate_costs([k] * world, numel, 4, cost=own, union=union,
                                                  dense_output=True)  # fmt: skip
    assert again["predicted_s"] != row["predicted_s"]


@pytest.mark.slow
@pytest.mark.netlab
@pytest.mark.dist
@pytest.mark.skipif(WHY is not None, reason=f"netlab: {WHY}")
def test_bench_sparse_runs_its_ranks_on_two_lab_nodes(tmp_path):
    out = tmp_path / "sparse.json"
    done = subprocess.run(
        [sys.executable, str(BENCH / "bench_sparse.py"), "--netlab", "1gbit", "--worlds", "2",
         "--densities", "0.01,0.3", "--numel", "65536", "--rounds", "5", "--timeout", "200",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("max_rel_error=")
    assert not [n for n in list_labs() if n.startswith("sp")], "a lab was left behind"
    res = json.loads(out.read_text())
    assert res["netlab"] == "1gbit" and len(res["rows"]) == 2
    for row in res["rows"]:
        assert row["world"] == 2 and set(row["predicted_s"]) == set(ALGORITHMS)
        for name, ts in row["times"].items():
            assert len(ts) == 5 and all(t > 0 for t in ts), name
        for rank in range(2):
            for name in ALGORITHMS:
                reported = row["reported_bytes"][rank][name]
                wire = row["wire_bytes"][rank][name]
                assert wire is not None, f"rank {rank} found no lab interface"
                assert wire >= reported > 0, (name, rank, wire, reported)


@pytest.mark.slow
@pytest.mark.netlab
@pytest.mark.dist
@pytest.mark.skipif(WHY is not None, reason=f"netlab: {WHY}")
def test_plan_check_runs_its_ranks_on_two_lab_nodes(tmp_path):
    out = tmp_path / "plan.json"
    done = subprocess.run(
        [sys.executable, str(BENCH / "plan_check.py"), "--netlab", "1gbit", "--worlds", "2",
         "--layers", "2", "--hidden", "64", "--heads", "2", "--vocab", "1024", "--warmup", "1",
         "--timeout", "400", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("max_rel_error=")
    assert not [n for n in list_labs() if n.startswith("pc")], "a lab was left behind"
    res = json.loads(out.read_text())
    rows = res["worlds"]["2"]
    assert [(r["plan"]["tensor_parallel"], r["plan"]["pipeline_parallel"]) for r in rows] == [
        (1, 1),
        (2, 1),
        (1, 2),
    ]
    latency = f"{_load('plan_check').LAB_LATENCY_US * 1e-6:.6g}"  # the default, loopback's
    for row in rows:
        assert row["network"] == f"2:0.956407:{latency}"  # the cap's payload, not calibrated
        assert len(row["measured_s"]) == 5
        dp_bytes = row["plan"]["breakdown"]["stages"][0]["param_bytes"]
        if row["plan"]["data_parallel"] == 2:  # the ring all-reduce of the gradients
            assert min(row["wire_bytes_per_step"]) >= dp_bytes


def test_one_failed_rank_stops_the_others_and_a_timeout_stops_all():
    from trainers.netlab import wait_ranks  # what both benchmarks wait with

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = [subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]),
             subprocess.Popen(sleeper)]  # fmt: skip
    assert wait_ranks(procs, timeout=30) is True  # in time, but failed
    assert procs[0].returncode == 3 and procs[1].returncode is not None
    procs = [subprocess.Popen(sleeper) for _ in range(2)]
    assert wait_ranks(procs, timeout=1) is False
    assert all(p.returncode is not None for p in procs)
