"""``--grad-combine def`` (detached error feedback) and ``--compressor importance`` on two gloo
processes, float64.

Oracles: the invariant of the rule (x - mean(e) moves by exactly -lr mean(m) for any
compressor); error feedback on updates written from its rule with plain ``dist.all_reduce``
and ``torch.topk`` (coeff 0); the hand-written synchronous momentum SGD of
``_trainer_toys.plain_loop`` (identity compressor); a run without evaluations (evaluating at
x - mean(e) must not change training); the run without a checkpoint (resume). Importance
pruning: the index set recomputed with numpy from the drawn rank's values and parameters,
the mean of the workers' values there, plain top-k when all weights are equal, the dense mean
at ratio 1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._tiers import slow_fixture
from tests.trainers._launch import run_ranks
from tests.trainers._trainer_toys import ToyDataset, make_mlp, plain_loop
from trainers import create_combiner

pytestmark = pytest.mark.dist
N, GLOBAL_BATCH, STEPS, SEED = 48, 8, 12, 5  # as in _comm_worker.py


@slow_fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("def")
    run_ranks("tests.trainers._def_worker", [str(out)], timeout=300)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("name", ["randblock", "topk", "randblock_tensor", "topk_tensor"])
def test_the_average_model_steps_by_minus_lr_times_the_mean_momentum(ranks, name):
    per_rank = [r[name]["records"] for r in ranks]
    assert len(per_rank[0]) == STEPS
    x0 = torch.cat([p.detach().reshape(-1) for p in make_mlp(seed=0).double().parameters()])
    previous = x0  # x - mean(e) before the first step (e = 0)
    for t in range(STEPS):
        a, b = per_rank[0][t], per_rank[1][t]
        assert torch.equal(a["x"], b["x"]), "the shared model differs between ranks"
        assert not torch.equal(a["e"], torch.zeros_like(a["e"])), "nothing was left out"
        now = a["x"] - (a["e"] + b["e"]) / 2
        expected = previous - a["lr"] * (a["m"] + b["m"]) / 2
        torch.testing.assert_close(now, expected, rtol=0, atol=1e-12)
        previous = now


def test_per_tensor_blocks_follow_the_authors_reducer(ranks):
    """``--def-blocks tensor`` against a per-tensor transcription of the authors' DEF step
    with their random-block reducer (``_def_worker.reference_def_per_tensor``): the shared
    model x after every step."""
    for r in ranks:
        got = [rec["x"] for rec in r["randblock_tensor"]["records"]]
        assert len(got) == len(r["ref_tensor"]) == STEPS
        for t, (a, b) in enumerate(zip(got, r["ref_tensor"], strict=True)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=f"step {t + 1}")
    flat = ranks[0]["randblock"]["records"][-1]["x"]
    assert not torch.allclose(flat, ranks[0]["ref_tensor"][-1])  # the layouts differ


def test_per_tensor_blocks_send_ratio_of_each_tensor(ranks):
    """Each step every tensor sends max(1, round(0.1 n)) values (counted at 4 bytes each, the
    compressor's fp32 wire convention), not round(0.1 N) of the whole vector."""
    sizes = [p.numel() for p in make_mlp(seed=0).parameters()]
    per_tensor = 4 * sum(min(n, max(1, round(0.1 * n))) for n in sizes)
    assert per_tensor != 4 * round(0.1 * sum(sizes))  # the two layouts are told apart
    for r in ranks:
        sent = [rec["bytes"] for rec in r["randblock_tensor"]["records"]]
        steps = [b - a for a, b in zip([0, *sent], sent, strict=False)]
        assert steps == [per_tensor] * STEPS


def test_with_period_two_the_invariant_holds_at_each_communication(ranks):
    per_rank = [r["randblock_p2"]["records"] for r in ranks]
    x0 = torch.cat([p.detach().reshape(-1) for p in make_mlp(seed=0).double().parameters()])
    previous, moved = x0, torch.zeros_like(x0)
    for t in range(STEPS):
        a, b = per_rank[0][t], per_rank[1][t]
        moved = moved + a["lr"] * (a["m"] + b["m"]) / 2
        if (t + 1) % 2:
            continue
        now = a["x"] - (a["e"] + b["e"]) / 2
        torch.testing.assert_close(now, previous - moved, rtol=0, atol=1e-12)
        previous, moved = now, torch.zeros_like(x0)


def test_fit_leaves_the_average_model_on_every_rank(ranks):
    for name in ("randblock", "topk"):
        a, b = ranks[0][name], ranks[1][name]
        expected = a["x"] - (a["e"] + b["e"]) / 2
        for r in (a, b):
            got = torch.cat([p.reshape(-1) for p in r["final"]])
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)


def test_coeff_zero_is_error_feedback_on_updates(ranks):
    for r in ranks:
        torch.testing.assert_close(r["coeff0"], r["ref_coeff0"], rtol=0, atol=1e-12)


def test_the_identity_compressor_is_synchronous_momentum_sgd(ranks):
    model = plain_loop(make_mlp(seed=0), ToyDataset(N), batch=GLOBAL_BATCH, steps=STEPS, seed=SEED)
    for r in ranks:
        for got, ref in zip(r["identity"], model.parameters(), strict=True):
            torch.testing.assert_close(got, ref.detach(), rtol=0, atol=1e-5)


def test_evaluating_changes_nothing_in_training(ranks):
    for r in ranks:
        assert 0 <= r["eval"]["top1"] <= 1
        for a, b in zip(r["eval"]["with"], r["eval"]["without"], strict=True):
            assert torch.equal(a, b)


def test_resuming_is_bit_exact(ranks):
    for r in ranks:
        straight, resumed = r["resume"]
        for a, b in zip(straight, resumed, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("options", "message"),
    [({"coeff": -1}, "coeff"), ({"period": 0}, "period"), ({"blocks": "layer"}, "blocks")],
)
def test_bad_options_name_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        create_combiner("def", **options)


def _chooser() -> int:
    # the documented draw: one rank from the generator every rank seeds alike (seed 7 here)
    return int(torch.randint(2, (), generator=torch.Generator().manual_seed(7)))


def test_importance_pruning_sends_one_index_set_chosen_by_one_rank(ranks):
    c = _chooser()
    x = ranks[c]["importance"]["x"].numpy()
    w = ranks[c]["importance"]["w"].numpy()
    k = 20  # ratio 0.1 of 200
    expected = set(np.argsort(-(np.abs(x) / (np.abs(w) + 1e-6)))[:k].tolist())
    supports = [
        set(np.flatnonzero(r["importance"]["pruned"]["own"].numpy()).tolist()) for r in ranks
    ]
    assert supports[0] == supports[1] == expected
    mean = (ranks[0]["importance"]["x"] + ranks[1]["importance"]["x"]) / 2
    want = torch.zeros_like(mean)
    idx = torch.tensor(sorted(expected))
    want[idx] = mean[idx]
    for r in ranks:
        torch.testing.assert_close(r["importance"]["pruned"]["mean"], want, rtol=0, atol=1e-15)
        assert r["importance"]["pruned"]["sent"] == 8 * k


def test_importance_with_equal_weights_is_the_choosers_top_k(ranks):
    x = ranks[_chooser()]["importance"]["x"].numpy()
    expected = set(np.argsort(-np.abs(x))[:20].tolist())
    for r in ranks:
        got = set(np.flatnonzero(r["importance"]["equal_weights"]["own"].numpy()).tolist())
        assert got == expected


def test_importance_at_ratio_one_is_the_dense_mean(ranks):
    mean = (ranks[0]["importance"]["x"] + ranks[1]["importance"]["x"]) / 2
    for r in ranks:
        torch.testing.assert_close(r["importance"]["dense"]["mean"], mean, rtol=0, atol=1e-15)


def test_importance_needs_the_parameters():
    from trainers import DistEnv
    from trainers.comm import Importance, compressed_allreduce

    with pytest.raises(ValueError, match="weights="):
        compressed_allreduce(Importance(), torch.ones(4), DistEnv())
    with pytest.raises(ValueError, match="eps"):
        Importance(eps=0)


def test_a_checkpoint_holds_the_average_model(ranks):
    """The checkpoint after step 3 (rank 0 writes it): its model is x - mean(e) of step 3."""
    a, b = (r["randblock"]["records"][2] for r in ranks)
    average = a["x"] - (a["e"] + b["e"]) / 2
    saved = ranks[0]["randblock"]["checkpoint_model"]
    got = torch.cat([saved[k].reshape(-1) for k in ("0.weight", "0.bias", "2.weight", "2.bias")])
    torch.testing.assert_close(got, average, rtol=0, atol=1e-15)
    local = a["x"] - 0.3 * a["e"]  # rank 0's own model y_0 then: not what is saved
    assert not torch.allclose(got, local)
