"""``--grad-combine coded`` (CodedReduce, fractional repetition on a tree) on gloo processes.

Oracles: the mean of the step's distinct data parts computed here from every rank's recorded
local gradient (float64) for a straggler at every position of a 7-rank, 2-level tree; the
ranks that share data computing bit-identical gradients; the root not waiting for a slow
child; a rank slowed 2x at every step skipping the steps decided without it while the model
stays bit for bit that of the run without it; a rank starting late computing its first step; the same skipping by an inner node of a
two-level tree;
with no tolerance (s = 0) the whole run equal to
DDP's averaging.
"""

from __future__ import annotations

import pytest
import torch

from tests._tiers import slow_fixture
from tests.trainers._coded_worker import DELAY, STEPS
from tests.trainers._launch import run_ranks
from trainers import create_combiner
from trainers.comm.coded import CodedTree

pytestmark = pytest.mark.dist


def _launch(tmp_path_factory, world: int, branching: int, stragglers: int, *more) -> list[dict]:
    out = tmp_path_factory.mktemp(f"coded{world}")
    run_ranks("tests.trainers._coded_worker", [str(out), str(branching), str(stragglers), *more],
              world=world, timeout=300)  # fmt: skip
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)]


@slow_fixture(scope="module")
def tree7(tmp_path_factory):
    return _launch(tmp_path_factory, 7, 2, 1)


@slow_fixture(scope="module")
def tree3_exact(tmp_path_factory):
    return _launch(tmp_path_factory, 3, 2, 0)


@slow_fixture(scope="module")
def persistent3(tmp_path_factory):
    return _launch(tmp_path_factory, 3, 2, 1, "persistent")


def test_the_tree_and_its_data_parts():
    tree = CodedTree(7, 2, 1)
    assert tree.groups[0] == [[1, 2]] and tree.groups[1] == [[3, 4]] and tree.groups[2] == [[5, 6]]
    # 1 and 2 share data, and so do their subtrees position by position: 3, 4, 5, 6
    assert tree.part_of == [0, 1, 1, 2, 2, 2, 2] and tree.parts == 3
    assert CodedTree(5, 4, 1).part_of == [0, 1, 1, 2, 2]
    assert CodedTree(3, 2, 0).part_of == [0, 1, 2]
    # what the scripts size their lr schedule by, before the world exists: P, not n
    assert create_combiner("coded", stragglers=1, branching=2).data_parts(7) == 3
    assert (
        create_combiner("coded").data_parts(5) == 3 and create_combiner("coded").data_parts(3) == 2
    )
    assert create_combiner("coded", stragglers=0).data_parts(3) == 3
    assert create_combiner("average").data_parts(3) == 3
    with pytest.raises(ValueError, match="rank 1 has 1 children.*e.g. 3, 7, 15"):
        CodedTree(4, 2, 1)
    with pytest.raises(ValueError, match="not a multiple of stragglers"):
        CodedTree(4, 3, 1)
    with pytest.raises(ValueError, match="stragglers must be >= 0"):
        create_combiner("coded", stragglers=-1)


def test_every_step_applies_the_mean_of_the_distinct_parts(tree7):
    parts = [r["part"] for r in tree7]
    assert {p for p, _ in parts} == {0, 1, 2} and {n for _, n in parts} == {3}
    for t in range(STEPS):
        first = {}
        for rank, r in enumerate(tree7):
            part = r["part"][0]
            if r["local"][t] is None:  # skipped: the step was decided before it got there
                continue
            if part in first:  # the premise of fractional repetition: equal bit for bit
                assert torch.equal(r["local"][t], tree7[first[part]]["local"][t]), (t, rank)
            else:
                first[part] = rank
        assert sorted(first) == [0, 1, 2], (t, first)  # every part computed by someone
        mean = sum(tree7[rank]["local"][t] for rank in first.values()) / 3
        for r in tree7:
            torch.testing.assert_close(r["applied"][t], mean, rtol=0, atol=1e-12)


def test_a_slow_child_is_not_waited_for(tree7):
    root = tree7[0]
    assert [s for s in root["slow"] if s is not None] == [1, 3, 6]
    # a child (1) or grandchild (3, 6) slowed by DELAY: the group-mate's equal message is
    # used at once, at the root and at the slow grandchild's parent
    assert max(root["waited"]) < DELAY / 2, root["waited"]
    assert max(tree7[2]["waited"]) < DELAY / 2, tree7[2]["waited"]
    # and the run ends with the same model everywhere
    for r in tree7[1:]:
        for a, b in zip(r["params"], root["params"], strict=True):
            assert torch.equal(a, b)


def test_a_persistent_straggler_catches_up_by_skipping_decided_steps(persistent3):
    root, fast, slow = persistent3
    # rank 2 is twice as slow at every step: it finds about every other step already decided
    # by the root (which took part 1 from rank 1) and skips it; the others never skip
    assert root["skipped"] == 0 and fast["skipped"] == 0
    assert 3 <= slow["skipped"] <= 9, slow["skipped"]
    assert sum(t is None for t in slow["local"]) == slow["skipped"]
    # the straggler changes who computes, not what is applied: bit for bit the same model
    # on every rank as the same run without it
    for r in persistent3:
        for a, b in zip(r["params"], root["reference"], strict=True):
            assert torch.equal(a, b)


@slow_fixture(scope="module")
def persistent7(tmp_path_factory):
    return _launch(tmp_path_factory, 7, 2, 1, "persistent")


def test_a_persistent_inner_straggler_skips_in_a_two_level_tree(persistent7):
    # rank 1 (parent of 3 and 4) three times as slow at every step: it skips decided steps while
    # still draining its children's messages, nobody else skips, and every rank ends with
    # the model of the run without it; rank 2 (an inner node too) starting late computes
    # its first step
    assert persistent7[1]["skipped"] >= 1
    assert [r["skipped"] for i, r in enumerate(persistent7) if i != 1] == [0] * 6
    assert persistent7[2]["late_local"][0] is not None
    for r in persistent7:
        for a, b in zip(r["params"], persistent7[0]["reference"], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(r["late_params"], r["reference"], strict=True):
            assert torch.equal(a, b)


def test_a_rank_starting_late_computes_its_first_step_then_catches_up(persistent3):
    # step 0 was decided before rank 2 started; skipping it, rank 2 would not know the metric
    # names that every step's metric reduction sums, and the collective would mismatch (the
    # suite hung so under load). It computes step 0, and the run ends as without the delay.
    assert persistent3[2]["late_local"][0] is not None
    for r in persistent3:
        for a, b in zip(r["late_params"], r["reference"], strict=True):
            assert torch.equal(a, b)


def test_without_tolerance_it_is_the_all_reduce_average(tree3_exact):
    for r in tree3_exact:
        assert r["part"][1] == 3
        for a, b in zip(r["params"], r["ddp"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
