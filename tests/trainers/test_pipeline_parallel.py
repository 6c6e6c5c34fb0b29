"""Pipeline-parallel stages (``trainers.parallel.pipeline``) against the unsplit model.

``_pp_worker.py`` runs PyTorch's GPipe and 1F1B schedules over 4 micro-batches on 2 and 4
gloo ranks and, on every rank, the same float64 model whole over the same micro-batches
(accumulating the mean loss): BERT span QA and sequence classification, and ResNeSt-14 with
its BatchNorm statistics (2 ranks; the 4-rank run checks span QA).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests._tiers import slow_fixture
from tests.trainers._launch import run_ranks

pytest.importorskip("torch.distributed.pipelining")


@slow_fixture(scope="module", params=[2, 4], ids=["2stages", "4stages"])
def measured(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"pp{world}")
    run_ranks("tests.trainers._pp_worker", [str(out)], world=world, timeout=400)
    return world, torch.load(out / "result.pt", weights_only=False)


@slow_fixture(scope="module")
def measured_tp(tmp_path_factory):
    """4 ranks as 2 stages x 2-way tensor parallelism (1 replica)."""
    out = tmp_path_factory.mktemp("pp2tp2")
    run_ranks("tests.trainers._pp_worker", [str(out), "2"], world=4, timeout=400)
    return torch.load(out / "result.pt", weights_only=False)


def test_schedules_give_the_unsplit_gradients_losses_and_batchnorm_statistics(measured):
    world, ranks = measured
    cases = {key for res in ranks for key in res if key != "trainer"}
    expected = {("qa", "gpipe"), ("qa", "1f1b")}
    if world == 2:
        expected |= {("cls", "1f1b"), ("resnest", "gpipe"), ("resnest", "1f1b"), ("qa", "manual")}
    assert cases == expected
    for key in sorted(cases):
        covered = []
        for rank, res in enumerate(ranks):
            r = res[key]
            assert r["grad_scale"] > 1e-3, (key, rank)  # gradients reached every stage
            assert r["grad_err"] < 1e-12, (key, rank)
            assert r["stats_err"] < 1e-12, (key, rank)  # BatchNorm saw the real micro-batches
            assert r["n_losses"] == (4 if rank == world - 1 else 0), (key, rank)
            assert r["loss_err"] < 1e-12, (key, rank)
            covered.append(r["blocks"])
        # The stages tile the model's blocks in order.
        assert covered[0][0] == 0 and covered[-1][1] == ranks[0][key]["n_blocks"]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))
    if world == 2:
        assert [res[("qa", "manual")]["blocks"] for res in ranks] == [(0, 4), (4, 6)]


def test_trainer_dp_by_pp_equals_one_process_and_resumes_bit_for_bit(measured):
    """The shared Trainer with a PipelinedModel (2 stages x 1 replica on 2 ranks, x 2
    replicas on 4), LAMB and the trainer's whole-model gradient clip, against one process on
    the global batch: the same weights and optimizer state, an unsplit checkpoint, the same
    evaluation, and a resume that continues bit for bit."""
    world, ranks = measured
    check_trainer(ranks)


def test_trainer_pp_by_tp_equals_one_process_and_resumes_bit_for_bit(measured_tp):
    """Tensor parallelism inside the pipeline's stages (4 ranks: 2 stages x tp 2, rank =
    stage * 2 + tp index): the same checks against one process. Each rank holds sharded
    layers (its stage's), the checkpoint is the unsplit format, model and optimizer state."""
    for rank, res in enumerate(measured_tp):
        assert res["trainer"]["trainer_sharded"] > 0, rank  # the layers are split
    check_trainer(measured_tp)


def check_trainer(ranks):
    for rank, res in enumerate(ranks):
        r = res["trainer"]
        assert r["trainer_moved"] > 1e-3  # training moved the weights ...
        assert r["trainer_model_err"] < 1e-12, rank  # ... exactly as one process does
        assert r["trainer_model_keys"]
        assert r["trainer_opt_count"] > 20 and r["trainer_opt_err"] < 1e-12, rank
        assert r["trainer_resume_err"] == 0.0, rank
        assert r["trainer_final_err"] < 1e-12, rank
        mine, ref = r["trainer_eval"]
        assert set(mine) == set(ref) == {"span_loss"}
        assert mine["span_loss"] == pytest.approx(ref["span_loss"], rel=1e-12)


def brute_force(costs, stages):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        if best is None or worst < best:
            best = worst
    return best


@pytest.mark.parametrize("seed", range(20))
def test_balanced_boundaries_equal_brute_force(seed):
    from trainers.parallel.pipeline import balanced_boundaries

    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 9, (1,), generator=gen))
    stages = int(torch.randint(1, n + 1, (1,), generator=gen))
    costs = torch.randint(1, 50, (n,), generator=gen).tolist()
    bounds = balanced_boundaries(costs, stages)
    assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == stages + 1
    assert all(a < b for a, b in itertools.pairwise(bounds))
    worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
    assert worst == brute_force(costs, stages)


def test_unsupported_models_and_bad_boundaries_are_clear_errors():
    from modelzoo.nlp.bert import BertConfig, BertForPretraining, BertForQuestionAnswering
    from trainers.parallel.pipeline import (
        _tied_parameters,
        balanced_boundaries,
        build_pipeline,
        model_blocks,
    )

    config = BertConfig(vocab_size=20, hidden_size=8, num_layers=2, num_heads=2,
                        intermediate_size=8, max_position_embeddings=8)  # fmt: skip
    pretraining = BertForPretraining(config)
    blocks = model_blocks(pretraining)  # embed, 2 layers, the heads with the tied decoder
    assert len(blocks) == 4
    tied = _tied_parameters(blocks, [0, 2, 4])
    assert [(p is pretraining.bert.embeddings.word.weight, s) for p, s in tied] == [(True, [0, 1])]
    assert _tied_parameters(blocks, [0, 4]) == []  # one stage holds both uses
    with pytest.raises(TypeError, match="Linear is of no registered model family"):
        model_blocks(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="5 stages for 4 blocks"):
        balanced_boundaries([1, 1, 1, 1], 5)
    assert len(model_blocks(BertForQuestionAnswering(config))) == 4  # embed, 2 layers, head
    with pytest.raises(ValueError, match=r"pipeline boundaries \[0, 3, 3, 4\]"):
        build_pipeline(
            BertForQuestionAnswering(config), rank=0, num_stages=3, micro_batches=2,
            loss_fn=None, example_inputs=(), boundaries=[0, 3, 3, 4],
        )  # fmt: skip
    with pytest.raises(ValueError, match="schedule must be one of"):
        build_pipeline(
            BertForQuestionAnswering(config), rank=0, num_stages=1, micro_batches=2,
            loss_fn=None, example_inputs=(), schedule="interleaved",
        )  # fmt: skip
