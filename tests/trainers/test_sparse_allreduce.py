"""trainers.comm.sparse: the sparse allreduce against the dense sum, at 2 to 5 gloo processes.

Oracles: the ranks' vectors densified and summed in rank order (fp32) and in float64, which
every rank computes itself from the shared seeds (``_sparse_worker.py``); SparCML's byte
formulas for the dense switch.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests._tiers import slow_fixture
from tests.trainers._launch import run_ranks
from tests.trainers._sparse_worker import CASES
from trainers.comm.sparse import (
    ALGORITHMS,
    CostModel,
    choose_algorithm,
    dense_threshold,
    estimate_costs,
    estimate_features,
    fit_nonnegative,
    measure_compute,
    sparse_allreduce,
)

WORLDS = (2, 3, 4, 5)


@slow_fixture(scope="module", params=WORLDS, ids=[f"{w}ranks" for w in WORLDS])
def ranks(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"sparse{world}")
    run_ranks("tests.trainers._sparse_worker", [str(out)], world=world, timeout=300)
    return world, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)]


pytestmark = pytest.mark.dist


@pytest.mark.parametrize("case", CASES)
def test_every_algorithm_is_the_dense_sum_on_every_rank(ranks, case):
    world, results = ranks
    for kind in ("dyadic", "random", "rows"):
        ordered = results[0][case, kind, "ordered"]
        exact = results[0][case, kind, "exact"]
        for algorithm in ("auto", *ALGORITHMS):
            got = [r[case, kind, algorithm] for r in results]
            first = got[0]["sum"]
            for g in got[1:]:  # the same bits on every rank, and the same algorithm
                assert torch.equal(g["sum"], first), (case, kind, algorithm)
                assert g["algorithm"] == got[0]["algorithm"]
            if algorithm != "auto":
                assert got[0]["algorithm"] == algorithm
            assert first.shape == exact.shape
            if kind == "dyadic" or algorithm in ("allgather", "split_allgather") or world == 2:
                # exact sums, or the rank order of the dense reference: the same bits
                assert torch.equal(first, ordered), (case, kind, algorithm)
            else:  # tree or library order: within fp32's bound for N - 1 additions
                bound = (world - 1) * 2.0**-24 * results[0][case, kind, "abs"]
                assert bool(((first.double() - exact).abs() <= bound).all()), (case, algorithm)
            if algorithm == "auto":
                assert got[0]["algorithm"] in ALGORITHMS
            else:  # the dense output: the same sum and the same messages
                dense_out = results[0][case, kind, algorithm, "dense_output"]
                assert dense_out["dense"] and torch.equal(dense_out["sum"], first)
                assert dense_out["bytes"] == got[0]["bytes"]


@pytest.mark.parametrize("case", CASES)
def test_framed_recursive_doubling_is_the_same_sum_in_half_the_swaps(ranks, case):
    """With every worker's length known, each swap is one message padded to the bound on
    the partner's partial sum: the same merges, so the same bits, and log2 p swaps."""
    world, results = ranks
    p = 1 << (world.bit_length() - 1)
    for kind in ("dyadic", "random", "rows"):
        framed = results[0][case, kind, "rd_framed"]
        headed = results[0][case, kind, "recursive_doubling"]
        assert torch.equal(framed["sum"], headed["sum"]), (case, kind)
        swaps = p.bit_length() - 1
        folded = 1 if world > p else 0  # rank 0 receives the folded stream, then sends back
        assert framed["messages"] == swaps + folded


def test_the_dense_switch_happens_at_the_formulas_count(ranks):
    world, results = ranks
    if world != 2:
        pytest.skip("the formula's bytes are written for one swap (2 ranks)")
    threshold = dense_threshold(1000, 4)
    assert threshold == 500  # nnz (4 + 4) >= 1000 * 4
    for nnz in (249, 250, 499, 500):
        got = results[0]["switch", nnz]
        merged = 2 * nnz  # disjoint blocks
        assert got["dense"] == (merged >= threshold), nnz
        # one swap: the header, then the stream (dense from the start if nnz >= 500)
        sent = 8 + (1000 * 4 if nnz >= threshold else 8 * nnz)
        assert got["bytes"] == sent, nnz
        expected = torch.zeros(1000)
        expected[torch.arange(0, 2 * nnz) % 1000] += 1
        assert torch.equal(got["sum"], expected)


def test_allgather_sends_every_pair_to_every_other_worker(ranks):
    """Disjoint supports of k pairs: the all-gather sends the lengths and then (N - 1) k
    pairs per worker, growing with the world."""
    world, results = ranks
    got = results[0]["disjoint", "dyadic", "allgather"]["bytes"]
    k = 7
    assert got == 8 * (world - 1) + (world - 1) * 8 * k  # counts, then the padded pairs


def test_known_lengths_skip_their_exchange(ranks):
    world, results = ranks
    for algorithm in ("auto", "allgather"):
        exchanged = results[0]["disjoint", "random", algorithm]
        known = results[0]["counts", algorithm]
        assert torch.equal(known["sum"], exchanged["sum"])
    lengths = 8 * (world - 1)  # one int64 to each of N - 1 peers (ring all-gather)
    assert results[0]["counts", "allgather"]["bytes"] == (
        results[0]["disjoint", "random", "allgather"]["bytes"] - lengths
    )
    assert "this worker's = 7" in results[0]["counts", "error"]


def test_split_allgather_receives_from_one_peer_at_a_time(ranks):
    """Split-allgather's sparse reduce-scatter runs as N - 1 rounds of one receive and one
    send: in round s worker r receives from r - s and sends to r + s (mod N), so no worker is
    sent to by several peers at once (the incast that cost retransmissions on a capped link);
    the owned ranges then travel by a ring all-gather (no point-to-point batch)."""
    world, results = ranks
    for r, res in enumerate(results):
        batches = res["split_posted"]["batches"]
        assert len(batches) == world - 1, batches  # one exchange of N - 1 rounds
        for step, batch in enumerate(batches):
            s = step + 1
            assert batch == sorted([("irecv", (r - s) % world), ("isend", (r + s) % world)]), (
                r, step, batch,
            )  # fmt: skip
        assert torch.equal(res["split_posted"]["sum"], results[0]["split_posted"]["sum"])
    ordered = results[0]["overlapping", "random", "ordered"]
    assert torch.equal(results[0]["split_posted"]["sum"], ordered)


@pytest.mark.slow
def test_the_computation_constants_are_measured_in_this_process():
    """measure_compute times the module's own sums here: four finite constants >= 0, a
    sort's element dearer than a scatter's (the sort makes several passes over its input),
    and a model built from them keeps the network fields it is given."""
    got = measure_compute(numel=1 << 20, repeats=3)
    assert set(got) == {"merge", "scan", "fill", "scatter"}
    assert all(math.isfinite(v) and v >= 0 for v in got.values()), got
    assert got["merge"] > got["scatter"], got
    model = CostModel.measure_compute(numel=1 << 20, repeats=3, latency=2e-4, bandwidth=1e8,
                                      cpu_share=2.0)  # fmt: skip
    assert (model.latency, model.bandwidth, model.cpu_share) == (2e-4, 1e8, 2.0)
    assert model.merge > 0


def test_the_constants_fit_is_scipys_nonnegative_least_squares():
    """fit_nonnegative against scipy.optimize.nnls on the same relative-error system: exact
    recovery of non-negative constants, and the constrained answer where the unconstrained
    one has a negative term (a constant the times cannot support is 0)."""
    nnls = pytest.importorskip("scipy.optimize").nnls
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(12, 4, generator=gen, dtype=torch.float64) * torch.tensor([1e3, 1e6, 1e5, 1e4])
    truth = torch.tensor([2e-6, 3e-9, 0.0, 5e-8], dtype=torch.float64)
    exact = (a @ truth).tolist()
    assert fit_nonnegative(a.tolist(), exact) == pytest.approx(truth.tolist(), rel=1e-9, abs=1e-18)
    # times that a negative third constant would fit best
    noisy = (a @ torch.tensor([2e-6, 3e-9, -4e-8, 5e-8], dtype=torch.float64)).abs() + 1e-4
    weight = 1 / noisy
    ref, _ = nnls((a * weight[:, None]).numpy(), (noisy * weight).numpy())
    got = fit_nonnegative(a.tolist(), noisy.tolist())
    assert min(got) >= 0.0
    assert got == pytest.approx(ref.tolist(), rel=1e-6, abs=1e-15)


def test_one_process_returns_its_input():
    r = sparse_allreduce(torch.tensor([1, 3]), torch.tensor([2.0, -1.0]), 5, algorithm="dense")
    assert r.algorithm == "local" and r.bytes_sent == 0
    assert torch.equal(r.to_dense(), torch.tensor([0.0, 2.0, 0.0, -1.0, 0.0]))


@pytest.mark.parametrize(
    ("indices", "values", "numel", "match"),
    [
        (torch.tensor([3, 1]), torch.ones(2), 5, "sorted and unique"),
        (torch.tensor([1, 1]), torch.ones(2), 5, "sorted and unique"),
        (torch.tensor([1, 5]), torch.ones(2), 5, r"in \[0, 5\)"),
        (torch.tensor([1.0]), torch.ones(1), 5, "1-D integer"),
        (torch.tensor([1, 2]), torch.ones(3), 5, "one row per index"),
        (torch.tensor([1]), torch.ones(1, dtype=torch.int64), 5, "floating point"),
    ],
)
def test_bad_input_is_refused_with_the_reason(indices, values, numel, match):
    with pytest.raises(ValueError, match=match):
        sparse_allreduce(indices, values, numel)


def test_unknown_algorithm_names_the_choices():
    with pytest.raises(ValueError, match="choose one of auto, allgather"):
        sparse_allreduce(torch.tensor([1]), torch.ones(1), 5, algorithm="ring")


def test_the_choice_follows_the_cost_formulas():
    """On a latency-bound network recursive doubling's 2 log2 N messages win; on a
    bandwidth-bound one, overlapping supports (a sum of 1.2 M non-zeros from 8 x 1 M) favour
    split-allgather's 2 (N - 1) / N K volume over recursive doubling's partial sums and the
    all-gather's (N - 1) k; fully dense streams favour the dense all-reduce; a worker's sorted
    merges cost time (the default model's ``merge``)."""
    d = 10_000_000
    latency = CostModel(latency=1e-3, bandwidth=1e15, merge=0, scan=0, fill=0, scatter=0, swap=1)
    bandwidth = CostModel(latency=0, bandwidth=1e9, merge=0, scan=0, fill=0, scatter=0)
    assert choose_algorithm([10] * 8, d, 4, cost=latency) == "recursive_doubling"
    assert choose_algorithm([1_000_000] * 8, d, 4, cost=bandwidth, union=1_200_000) == (
        "split_allgather"
    )
    assert choose_algorithm([d] * 8, d, 4, cost=bandwidth) == "dense"
    costs = estimate_costs(
        [1000] * 4,
        d,
        4,
        cost=CostModel(latency=1.0, bandwidth=1e30, merge=0, scan=0, fill=0, scatter=0, swap=1),
    )
    assert min(costs, key=costs.get) == "recursive_doubling"  # 2 swaps vs 3 ring steps
    assert costs["allgather"] == pytest.approx(3.0)  # the lengths are known: one all-gather
    # a swap priced as 4 ring steps (the default, measured here): the all-gather wins
    slow_swaps = CostModel(latency=1.0, bandwidth=1e30, merge=0, scan=0, fill=0, scatter=0, swap=4)
    costs = estimate_costs([1000] * 4, d, 4, cost=slow_swaps)
    assert costs["recursive_doubling"] == pytest.approx(8.0)
    # recursive doubling merges 2 x 200 k and 2 x 400 k pairs by sorting (each element also
    # added once at its place), then 2 x 800 k (past an eighth of the vector) in a dense
    # scratch buffer: its d elements, each input element added and marked, the 1.6 M
    # non-zeros read back
    f = estimate_features([200_000] * 8, d, 4)
    merged = 2 * (200_000 + 400_000)
    assert f["recursive_doubling"][2:] == (merged, d, 0, merged + 2 * 1_600_000 + 1_600_000)
    # supports that overlap (a sum of 1 M non-zeros from 8 x 200 k): a shared part c with
    # 8 (200 k - c) + c = 1 M, so c = 600 k / 7; g workers' partial sum c + g (200 k - c);
    # every merge sorts (2 x 200 k, then 2 x 314 k, 2 x 543 k), and a dense output is filled
    # once with the 1 M non-zeros
    c = 600_000 / 7
    sizes = [200_000, c + 2 * (200_000 - c), c + 4 * (200_000 - c)]
    f = estimate_features([200_000] * 8, d, 4, union=1_000_000, dense_output=True)
    assert f["recursive_doubling"][2:] == pytest.approx(
        (2 * sum(sizes), 0, d, 2 * sum(sizes) + 1_000_000), rel=1e-12
    )
    # the computation is priced per element and multiplied by the workers sharing a core
    model = CostModel(latency=0, bandwidth=1e30, merge=1e-8, scan=2e-9, fill=3e-10,
                      scatter=4e-9, cpu_share=4)  # fmt: skip
    want = 4 * (2 * sum(sizes) * 1e-8 + d * 3e-10 + (2 * sum(sizes) + 1_000_000) * 4e-9)
    assert model.time(*f["recursive_doubling"]) == pytest.approx(want, rel=1e-9)
    # the split all-gather: two all-gathers of lengths, an exchange of N - 1 swaps and the
    # ring all-gather of the owned ranges
    assert f["split_allgather"][0] == 3 * 7 + 7 * CostModel.swap
    assert CostModel().time(*f["recursive_doubling"]) > CostModel().time(*f["allgather"])
    for bad in ({"bandwidth": 0}, {"latency": -1}, {"merge": -1e-9}, {"swap": 0},
                {"scatter": -1e-9}, {"cpu_share": 0}):  # fmt: skip
        with pytest.raises(ValueError, match="bandwidth > 0"):
            CostModel(**bad)
