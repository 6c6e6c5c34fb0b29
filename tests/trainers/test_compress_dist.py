"""Two gloo processes: every communication-efficient mode against its reference.

Oracles: the hand-written synchronous momentum SGD of ``_trainer_toys.plain_loop`` (for CSER
with an identity compressor and H = 1, error feedback with the identity, local SGD with H = 1);
periodic averaging, SlowMo and Local AdaAlter written from their update rules with plain
``dist.all_reduce`` in ``_comm_worker.py``; PyTorch's own PowerSGD hook registered on DDP by
hand; and the decoded vectors of every rank for QSGD's all-reduce.
"""

from __future__ import annotations

import pytest
import torch

from tests._tiers import slow_fixture
from tests.trainers._launch import run_ranks
from tests.trainers._trainer_toys import ToyDataset, make_mlp, plain_loop

pytestmark = pytest.mark.dist
N, GLOBAL_BATCH, STEPS, SEED = 48, 8, 12, 5  # as in _comm_worker.py
ATOL = 1e-5  # reduction order across two processes (as test_trainer_dist.py)


@slow_fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("comm")
    run_ranks("tests.trainers._comm_worker", [str(out)], timeout=300)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.fixture(scope="module")
def synchronous_sgd():
    model = plain_loop(make_mlp(seed=0), ToyDataset(N), batch=GLOBAL_BATCH, steps=STEPS, seed=SEED)
    return [p.detach().clone() for p in model.parameters()]


def assert_same(a, b, atol=ATOL):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


@pytest.mark.parametrize(
    "mode",
    ["cser", "cser-pl", "cser-update", "localsgd", "slowmo", "local-adaalter", "adasum-delta"],
)
def test_resuming_on_two_ranks_is_bit_exact(ranks, mode):
    """Each rank gets its own residuals, local model and optimizer moments back."""
    for r in ranks:
        straight, resumed = r["resume"][mode]
        for a, b in zip(straight, resumed, strict=True):
            assert torch.equal(a, b), mode


@pytest.mark.parametrize(
    "mode", ["cser_identity_h1", "cser_whole_blocks", "ef_identity", "localsgd_h1"]
)
def test_identity_compression_or_period_one_is_synchronous_momentum_sgd(
    ranks, synchronous_sgd, mode
):
    for r in ranks:
        assert_same(r[mode], synchronous_sgd)


def test_cser_replicas_are_equal_right_after_each_exact_reset(ranks):
    per_rank = [r["cser_topk"] for r in ranks]
    steps = len(per_rank[0]["params"])
    assert steps == STEPS
    differed = 0
    for t in range(steps):
        p0, p1 = (r["params"][t] for r in per_rank)
        if (t + 1) % 3 == 0:  # a reset step
            assert all(torch.equal(a, b) for a, b in zip(p0, p1, strict=True)), t
            assert all(not r["residuals"][t].any() for r in per_rank)
        else:
            differed += not all(torch.equal(a, b) for a, b in zip(p0, p1, strict=True))
        # x_i - e_i (the synchronised part) is the same on both ranks at every step.
        flat = [torch.cat([p.reshape(-1) for p in r["params"][t]]) for r in per_rank]
        synced = [f - r["residuals"][t] for f, r in zip(flat, per_rank, strict=True)]
        torch.testing.assert_close(synced[0], synced[1], rtol=0, atol=1e-6)
    assert differed >= 4  # between resets the local models drift apart
    assert torch.equal(per_rank[0]["synced"], per_rank[1]["synced"])
    assert per_rank[0]["eval"] == per_rank[1]["eval"]


def test_error_feedback_keeps_replicas_identical(ranks):
    for p0, p1 in zip(ranks[0]["ef_topk"], ranks[1]["ef_topk"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(p0, p1, strict=True))


def test_local_sgd_averages_like_the_reference(ranks):
    for r in ranks:
        assert_same(r["localsgd_h2"], r["ref_periodic_h2"])
    assert_same(ranks[0]["localsgd_h2"], ranks[1]["localsgd_h2"], atol=0)  # just averaged


def test_slowmo_with_b0_and_slow_lr_1_is_periodic_averaging(ranks):
    for r in ranks:
        assert_same(r["slowmo_b0"], r["ref_periodic_h2"])
        assert_same(r["slowmo_b0"], r["localsgd_h2"])


def test_slowmo_follows_the_outer_momentum_rule(ranks):
    for r in ranks:
        assert_same(r["slowmo"], r["ref_slowmo"])
    pairs = zip(ranks[0]["slowmo"], ranks[0]["slowmo_b0"], strict=True)
    far = max(float((a - b).abs().max()) for a, b in pairs)
    assert far > 1e-3  # the outer momentum changes the trajectory


def test_local_adaalter_matches_the_reference(ranks):
    for r in ranks:
        assert_same(r["adaalter"], r["ref_adaalter"])


def test_powersgd_is_pytorchs_hook(ranks):
    for r in ranks:
        assert_same(r["powersgd"], r["ref_powersgd"], atol=1e-6)


def test_qsgd_allreduce_is_the_mean_of_the_decoded_vectors(ranks):
    for r in ranks:
        q = r["qsgd"]
        torch.testing.assert_close(q["mean"], (q["owns"][0] + q["owns"][1]) / 2)
        assert q["sent"] == 1000 + 10 * 4  # int8 levels + one norm per bucket of 100
    assert torch.equal(ranks[0]["qsgd"]["mean"], ranks[1]["qsgd"]["mean"])


def test_topk_pairs_are_summed_exactly_by_every_sparse_algorithm(ranks):
    """Two workers' values are added in one operation, so every algorithm gives the bits of
    the decoded vectors' sum; the report names the algorithm and its bytes."""
    for r in ranks:
        for algorithm, t in r["topk"].items():
            assert torch.equal(t["mean"], (t["owns"][0] + t["owns"][1]) / 2), algorithm
            if algorithm != "auto":
                assert t["report"]["collective"] == algorithm
            assert t["report"]["wire_bytes"] > 0
    allgather = ranks[0]["topk"]["allgather"]["report"]
    assert allgather["wire_bytes"] == 8 * 50  # 50 pairs to 1 peer (k is known: no lengths)
    dense = ranks[0]["topk"]["dense"]["report"]
    assert dense["wire_bytes"] == 1000 * 4  # ring all-reduce at 2 workers: the buffer once


# Held-out top-1 of a 64-64-10 MLP on scikit-learn's digits after 6 epochs on 2 ranks (plain
# SGD averaging reaches ~0.96 with this recipe; see test_adasum.py); one class for every image
# scores 0.10. Every mode whose published recipe claims to learn is here. DEF is not: it is a
# published negative result (docs/communication.md; on this MLP too it ends near 0.4).
DIGITS_ACCURACY = 0.9
# modes that learn more slowly at this budget (measured: 0.897 and 0.842 on an AMD EPYC)
SLOWER = {"ef-importance": 0.85, "ef-randblock": 0.8}


@pytest.mark.parametrize(
    "mode",
    [
        "ef-topk",
        "ef-qsgd",
        "cser",
        "cser-pl",
        "cser-update",
        "powersgd",
        "localsgd",
        "slowmo",
        "local-adaalter",
        "fp16",
        "ef-importance",
        "ef-randblock",
    ],
)
def test_every_mode_learns_the_digits(ranks, mode):
    assert ranks[0]["digits"][mode] == ranks[1]["digits"][mode]
    assert ranks[0]["digits"][mode] >= SLOWER.get(mode, DIGITS_ACCURACY), ranks[0]["digits"]
