"""The one latency-bandwidth model (trainers.comm.cost) and each mode's cost formula.

Oracles: the alpha-beta costs of Thakur, Rabenseifner and Gropp (IJHPCA 2005) worked by hand
for given sizes, and the method table of ``scripts/scaling_whatif.py``'s docstring (the
fast/straggler step times of each mode), evaluated by hand.
"""

from __future__ import annotations

import math

import pytest

from trainers.comm import combiner_class, create_combiner, list_combiners
from trainers.comm.cost import (
    allgather_time,
    alpha_beta,
    bytes_per_s,
    message_time,
    ring_allreduce_time,
)
from trainers.comm.sparse import CostModel
from trainers.parallel import plan


def test_the_collectives_by_hand():
    # 1 Gbit/s = 1.25e8 B/s; 100 MB over 4 ranks: 2 * 3/4 * 0.8 s + 6 * 100 us
    assert bytes_per_s(1.0) == 1.25e8
    assert ring_allreduce_time(1e8, 4, 1.0, 1e-4) == pytest.approx(1.2 + 6e-4, rel=1e-12)
    assert ring_allreduce_time(1e8, 1, 1.0, 1e-4) == 0.0
    # all-gather of 10 MB from each of 8 ranks at 10 Gbit/s: 7 * 8 ms + 7 * 5 us
    assert allgather_time(1e7, 8, 10.0, 5e-6) == pytest.approx(7 * 8e-3 + 7 * 5e-6, rel=1e-12)
    assert message_time(1e8, 10.0, 1e-5) == pytest.approx(0.08 + 1e-5, rel=1e-12)
    assert alpha_beta(3, 3e6, latency_s=1e-3, rate=1e9) == pytest.approx(6e-3, rel=1e-12)


def test_planner_whatif_and_sparse_choice_share_it():
    """The planner's names are the shared functions, and the sparse all-reduce's network
    term is alpha_beta (its merge and scan terms come on top)."""
    assert plan.allreduce_time is ring_allreduce_time and plan.p2p_time is message_time
    cost = CostModel(latency=2e-3, bandwidth=5e8, merge=1e-8, scan=2e-9)
    wire = alpha_beta(5, 4e6, latency_s=2e-3, rate=5e8)
    assert cost.time(5, 4e6) == wire
    assert cost.time(5, 4e6, 100, 1000) == pytest.approx(wire + 100e-8 + 1000 * 2e-9, rel=1e-12)


# (mode, options) -> (T_m at S = 1e8 B, n = 8, 10 Gbit/s, a = 1e-5 s; step times at
# T_c = 0.1 s, s = 2, o = 0)
ONE = 0.08 + 1e-5  # one model to one peer
RING = 2 * 7 / 8 * 0.08 + 14 * 1e-5
CASES = {
    ("average", ()): (RING, (0.2 + RING, 0.2 + RING)),
    ("pipesgd", ()): (RING, (max(0.2, RING),) * 2),
    ("sgp", (("overlap", 0),)): (ONE, (0.2 + ONE,) * 2),
    ("sgp", (("overlap", 2),)): (ONE, (max(0.2, ONE / 2),) * 2),
    ("adpsgd", (("asynchronous", False),)): (ONE, (0.2 + ONE,) * 2),
    ("adpsgd", (("asynchronous", True),)): (2 * ONE, (0.1, 0.2)),
    ("coded", ()): (14 * ONE, (0.1 + 14 * ONE, 0.2 + 14 * ONE)),
    ("localsgd", (("period", 4),)): (RING / 4, (0.2 + RING / 4,) * 2),
    ("slowmo", (("period", 3),)): (RING / 3, (0.2 + RING / 3,) * 2),
    ("local-adaalter", (("period", 8),)): (
        (2 * 7 / 8 * 0.16 + 14 * 1e-5) / 8,  # models and accumulators: 2 S a ring
        (0.2 + (2 * 7 / 8 * 0.16 + 14 * 1e-5) / 8,) * 2,
    ),
}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0] + "".join(f"-{k}={v}" for k, v in c[1]))
def test_each_modes_formula_is_its_table_row(case):
    mode, options = case
    combiner = create_combiner(mode, **dict(options))
    comm, steps = CASES[case]
    assert combiner.comm_time(1e8, 8, 10.0, 1e-5) == pytest.approx(comm, rel=1e-12)
    assert combiner.step_time(0.1, comm, straggler=2.0) == pytest.approx(steps, rel=1e-12)


def test_average_hides_up_to_its_overlap():
    combiner = create_combiner("average")
    assert combiner.step_time(0.1, 0.08, overlap=0.5) == pytest.approx((0.13, 0.13))
    assert combiner.step_time(0.1, 0.03, overlap=0.5) == pytest.approx((0.1, 0.1))


@pytest.mark.parametrize("mode", list_combiners())
def test_every_registered_mode_answers_a_cost(mode):
    """The contract: a finite, non-negative T_m that grows with the bytes; with no
    communication and no straggler a step is its computation; a straggler never makes the
    fast ranks' step longer than its own."""
    combiner = combiner_class(mode)()
    small = combiner.comm_time(1e6, 4, 1.0, 1e-4)
    big = combiner.comm_time(1e8, 4, 1.0, 1e-4)
    assert math.isfinite(big) and 0 <= small < big
    assert combiner.step_time(0.1, 0.0) == pytest.approx((0.1, 0.1))
    fast, slow = combiner.step_time(0.1, big, straggler=3.0)
    assert 0 < fast <= slow


def test_variants_without_a_formula_say_so():
    with pytest.raises(ValueError, match="H-ADPSGD"):
        create_combiner("adpsgd", hierarchical=True).comm_time(1e8, 8, 10.0, 1e-5)
    with pytest.raises(ValueError, match="one-level tree"):
        create_combiner("coded", branching=2, stragglers=1).comm_time(1e8, 7, 10.0, 1e-5)
