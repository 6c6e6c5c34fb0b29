"""CSER and CSER-PL against transcriptions of their authors' trainers, on 2 and 3 gloo ranks.

The references are ``xcgoner/NeurIPS2020_CSER`` (commit 74a7af0d054db30228ae5a7813edcb49a615712e):

* ``gluon-cv/gluoncv/trainer/ersgd2_trainer_v2.py`` (``ERSGD2TrainerV2``, the trainer
  ``gluon-cv/scripts/classification/cifar/exp_CSER.sh`` runs): ``step`` = the local update, then
  ``_allreduce_params``; ``pre_test`` / ``post_test`` around evaluation;
* ``gluon-cv/gluoncv/trainer/partial_local_sgd_trainer_v1.py`` (``PartialLocalSGDTrainerV1``,
  CSER-PL, run by ``exp_CSERPL.sh``).

They are transcribed below in numpy (float64), the workers simulated in one process. The one
substitution: the authors draw from Python's global ``random`` (seeded alike on every worker);
the transcription draws from ``random.Random(derive_seed(seed, step, salt))``, the stream ours
uses, so that the blocks can be compared. The local optimizer is PyTorch's SGD with Nesterov
momentum (transcribed too); the gradients come from autograd on the same batches.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest
import torch

from tests._tiers import slow_fixture
from tests.trainers._cser_worker import (
    CASES,
    EVAL_AFTER,
    LR,
    MOMENTUM,
    SEED,
    STEPS,
    WD,
    loss_fn,
    make_net,
)
from tests.trainers._launch import run_ranks
from trainers import DistEnv
from trainers.comm import CSERCombiner, CSERPLCombiner
from trainers.comm.cser import _SALT, random_block
from trainers.data import derive_seed

WORLDS = (2, 3)
OPTIONS = {name: (mode, options) for name, mode, options in CASES}


def _averaged_block(xs: list[list[np.ndarray]], i: int, rng: random.Random, input_ratio: float,
                    output_ratio: float) -> int:  # fmt: skip
    """The body of the authors' per-parameter loop once ``uniform <= layer_ratio`` passed:
    the block ``x[b1:e1, b2:e2]`` (or ``x[b1:e1]``) all-reduced with ``average=True``."""
    x = xs[0][i]
    input_size = x.shape[0]
    k1 = max(1, round(input_size * input_ratio))
    b1 = rng.choice(range(math.ceil(input_size / k1))) * k1
    e1 = min(b1 + k1, input_size)
    if len(x.shape) > 1:
        output_size = x.shape[1]
        k2 = max(1, round(output_size * output_ratio))
        b2 = rng.choice(range(math.ceil(output_size / k2))) * k2
        e2 = min(b2 + k2, output_size)
        mean = sum(w[i][b1:e1, b2:e2] for w in xs) / len(xs)
        for w in xs:
            w[i][b1:e1, b2:e2] = mean
    else:
        mean = sum(w[i][b1:e1] for w in xs) / len(xs)
        for w in xs:
            w[i][b1:e1] = mean
    return mean.size


class AuthorsCSER:
    """``ERSGD2TrainerV2._allreduce_params``: ``_local_sgd_counter`` counts the steps; the
    ``local_sgd_interval``-th uses the second ratios and resets the counter."""

    def __init__(self, ratio_1: tuple[float, float, float], ratio_2: tuple[float, float, float],
                 local_sgd_interval: int) -> None:  # fmt: skip
        self.ratio_1, self.ratio_2 = ratio_1, ratio_2
        self.local_sgd_interval = local_sgd_interval
        self.local_sgd_counter = 0
        self.comm_counter = 0  # elements (the authors count x_sync.size * 2)

    def after_update(self, xs: list[list[np.ndarray]], rng: random.Random) -> None:
        self.local_sgd_counter += 1
        if self.local_sgd_counter == self.local_sgd_interval:
            self.local_sgd_counter = 0
            input_ratio, output_ratio, layer_ratio = self.ratio_2
        else:
            input_ratio, output_ratio, layer_ratio = self.ratio_1
        for i in range(len(xs[0])):
            if rng.uniform(0, 1) <= layer_ratio:
                self.comm_counter += _averaged_block(xs, i, rng, input_ratio, output_ratio)


class AuthorsCSERPL:
    """``PartialLocalSGDTrainerV1.step``: the block averaging only every
    ``local_sgd_interval`` steps."""

    def __init__(self, ratio: tuple[float, float, float], local_sgd_interval: int) -> None:
        self.ratio = ratio
        self.local_sgd_interval = local_sgd_interval
        self.local_sgd_counter = 0
        self.comm_counter = 0

    def after_update(self, xs: list[list[np.ndarray]], rng: random.Random) -> None:
        self.local_sgd_counter += 1
        if self.local_sgd_counter == self.local_sgd_interval:
            self.local_sgd_counter = 0
            input_ratio, output_ratio, layer_ratio = self.ratio
            for i in range(len(xs[0])):
                if rng.uniform(0, 1) <= layer_ratio:
                    self.comm_counter += _averaged_block(xs, i, rng, input_ratio, output_ratio)


def _authors(name: str):
    mode, options = OPTIONS[name]
    if mode == "cser":
        o = CSERCombiner(**options).options
        return AuthorsCSER(
            (o.rows, o.cols, o.layers), (o.reset_rows, o.reset_cols, o.reset_layers), o.period
        )
    o = CSERPLCombiner(**options).options
    return AuthorsCSERPL((o.rows, o.cols, o.layers), o.period)


def transcribe(name: str, world: int) -> dict:
    """The workers' parameters after every step, at the evaluations (``pre_test``: the
    average) and at the end, by the transcribed trainer."""
    trainer = _authors(name)
    net = make_net()
    start = [p.detach().numpy().copy().reshape(p.shape or (1,)) for p in net.parameters()]
    xs = [[x.copy() for x in start] for _ in range(world)]  # hvd.broadcast_parameters
    bufs: list[list[np.ndarray | None]] = [[None] * len(start) for _ in range(world)]
    steps, evals = [], []
    for step in range(1, STEPS + 1):
        for r in range(world):  # the local update: torch.optim.SGD(nesterov=True), transcribed
            with torch.no_grad():
                for p, x in zip(net.parameters(), xs[r], strict=True):
                    p.copy_(torch.from_numpy(x).reshape(p.shape))
            net.zero_grad()
            loss_fn(net, r, step).backward()
            for i, p in enumerate(net.parameters()):
                d = p.grad.numpy().reshape(xs[r][i].shape) + WD * xs[r][i]
                bufs[r][i] = d.copy() if bufs[r][i] is None else MOMENTUM * bufs[r][i] + d
                xs[r][i] = xs[r][i] - LR * (d + MOMENTUM * bufs[r][i])
        trainer.after_update(xs, random.Random(derive_seed(SEED, step, _SALT)))
        steps.append([[x.copy() for x in w] for w in xs])
        if step in EVAL_AFTER:  # pre_test: the average; post_test puts the local models back
            evals.append([sum(w[i] for w in xs) / world for i in range(len(start))])
    final = [sum(w[i] for w in xs) / world for i in range(len(start))]
    return {"steps": steps, "evals": evals, "final": final, "elements": trainer.comm_counter}


@slow_fixture(scope="module", params=WORLDS, ids=[f"{w}ranks" for w in WORLDS])
def ranks(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"cser{world}")
    run_ranks("tests.trainers._cser_worker", [str(out)], world=world, timeout=300)
    return world, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)]


def _close(ours: list[torch.Tensor], ref: list[np.ndarray]) -> None:
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a.numpy().reshape(b.shape), b, rtol=0, atol=1e-12)


pytestmark = pytest.mark.dist


@pytest.mark.parametrize("name", ["cser", "cser_default", "cser_pl"])
def test_every_step_equals_the_authors_trainer(ranks, name):
    """Each rank's model after every step is the transcription's worker model (1e-12), so
    the blocks, the averaging and the step counter agree; the replicas do differ between
    the averagings (it is not synchronous SGD)."""
    world, per_rank = ranks
    ref = transcribe(name, world)
    for r, res in enumerate(per_rank):
        for t in range(STEPS):
            _close(res[name]["steps"][t], ref["steps"][t][r])
    last = [res[name]["steps"][-1] for res in per_rank]
    assert any(not torch.equal(a, b) for a, b in zip(last[0], last[1], strict=True))


@pytest.mark.parametrize("name", ["cser", "cser_pl"])
def test_evaluation_uses_a_temporary_average(ranks, name):
    """``pre_test``/``post_test``: the evaluated model is the replicas' mean and training goes
    on from the local models (the steps after each evaluation match a transcription with no
    evaluation at all, above); at the end of ``fit`` the module keeps the mean."""
    world, per_rank = ranks
    ref = transcribe(name, world)
    for res in per_rank:
        assert len(res[name]["evals"]) == len(EVAL_AFTER)
        for ours, mean in zip(res[name]["evals"], ref["evals"], strict=True):
            _close(ours, mean)
        _close(res[name]["final"], ref["final"])


@pytest.mark.parametrize("name", ["cser", "cser_default", "cser_pl"])
def test_bytes_are_the_averaged_blocks(ranks, name):
    """float64 payload: the transcription's averaged elements, plus one whole model for each
    evaluation and for the end of ``fit``."""
    world, per_rank = ranks
    ref = transcribe(name, world)
    numel = sum(p.numel() for p in make_net().parameters())
    expected = 8 * (ref["elements"] + (len(EVAL_AFTER) + 1) * numel)
    assert all(res[name]["bytes"] == expected for res in per_rank)


@pytest.mark.parametrize("name", ["cser", "cser_pl", "cser_update"])
def test_the_ranks_evaluate_one_model(ranks, name):
    _, per_rank = ranks
    for k in range(len(EVAL_AFTER)):
        for a, b in zip(per_rank[0][name]["evals"][k], per_rank[1][name]["evals"][k], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("n", [1, 2, 5, 7, 16, 33, 100])
@pytest.mark.parametrize("ratio", [1 / 32, 1 / 16, 0.3, 0.5, 1.0])
def test_blocks_tile_the_dimension_and_are_drawn_uniformly(n, ratio):
    """Runs of ``max(1, round(n * ratio))`` that tile ``range(n)`` (the last may be shorter),
    each drawn with probability 1 / their count."""
    rng = random.Random(0)
    blocks = (random_block((n,), ratio, 1.0, rng)[0] for _ in range(4000))
    draws = Counter((s.start, s.stop) for s in blocks)
    k = max(1, round(n * ratio))
    runs = {(b, min(b + k, n)) for b in range(0, n, k)}
    assert set(draws) == runs
    covered = sorted(i for start, stop in runs for i in range(start, stop))
    assert covered == list(range(n))
    expected = 4000 / len(runs)
    assert all(abs(c - expected) < 5 * math.sqrt(expected) for c in draws.values())


def test_blocks_of_a_matrix_and_a_conv_weight():
    rng = random.Random(1)
    rows, cols = random_block((10, 6, 3, 3), 0.3, 0.5, rng)
    assert rows.stop - rows.start == 3 and rows.start % 3 == 0
    assert cols.stop - cols.start == 3 and cols.start in (0, 3)
    assert random_block((), 0.5, 0.5, rng) == (slice(0, 1),)  # a 0-d tensor: its one entry


def test_one_worker_is_plain_local_sgd():
    """No communication in a world of one: the plain optimizer loop, bit for bit."""
    net, plain = make_net(), make_net()
    make = lambda m: torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM, nesterov=True)  # noqa: E731
    opt, plain_opt = make(net), make(plain)
    combiner = CSERCombiner(period=2, rows=0.5)
    combiner.prepare(net, opt, DistEnv())
    for step in range(1, 6):
        for m, o in ((net, opt), (plain, plain_opt)):
            o.zero_grad()
            loss_fn(m, 0, step).backward()
        combiner.step(opt, None)
        plain_opt.step()
    for a, b in zip(net.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    assert combiner.counter.total_bytes == 0
