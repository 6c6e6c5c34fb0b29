"""Local AdaAlter and Adasum against numpy transcriptions of their authors' code (float64).

The runs (``_faithful_worker.py``: a float64 linear softmax classifier through the Trainer on
4 and on 2 gloo ranks) record each rank's batches, learning rates and parameters after every
optimizer step; the transcriptions here replay the recorded batches with N workers simulated
in one process and are compared step by step. The transcriptions are written from reading:

* xcgoner/AISTATS2020-AdaAlter-GluonNLP at 9c673ed5a7ec1c02eb5383f7403bf7f73a067a9e:
  ``src/gluonnlp/optimizer/local_adaalter.py`` (``LocalAdaAlter.update``, dense branch),
  ``scripts/language_model/distributed_hvd_local_sgd.py`` (``DistributedHierLocalHVDTrainer``)
  and the switch from the synchronous phase in
  ``scripts/language_model/large_word_language_model_local_hvd.py`` (``train``);
* horovod/horovod at 2626dc87a3a8eb8fb7d2216198ce45bce0f9e65a: ``horovod/torch/optimizer.py``
  (``_DistributedAdasumOptimizer``: step the local optimizer, delta, Adasum, start + delta)
  and ``horovod/common/ops/adasum/adasum.h`` (``FusedAllreduce``: vector halving, distance
  doubling; ``FusedPairwiseReduceWithComm``: the rule and its ``sqrt(DBL_MIN)`` guard);
  the local optimizer Horovod wraps is ``torch.optim.SGD`` (pytorch ``torch/optim/sgd.py``:
  ``d_p = g + wd p``; ``buf = d_p`` at the first step, else ``momentum buf + d_p``;
  ``p -= lr buf``).

Tolerance: 1e-12 absolute on parameters of order 1 after 12-24 steps. Both sides compute in
float64; they differ only by rounding (numpy's gradient vs autograd's, the order of the
Adasum dot-product partial sums, gloo's reduction order), about 1e-16 per operation.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

from tests._tiers import slow_fixture
from tests.trainers._faithful_worker import WEIGHT_DECAY
from tests.trainers._launch import free_port, run_ranks

pytestmark = pytest.mark.dist
ATOL = 1e-12  # float64 on both sides: rounding only (see the module docstring)
FAR = 1e-6  # a variant that is not the reference differs by far more than rounding


@slow_fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("faithful")
    run_ranks("tests.trainers._faithful_worker", [str(out), str(free_port())], world=4)
    load = lambda w, r: torch.load(out / f"w{w}_r{r}.pt", weights_only=True)  # noqa: E731
    return {w: [load(w, r) for r in range(w)] for w in (4, 2)}


# ================================================================================================
# the model: a linear softmax classifier, its cross-entropy gradient in numpy
# ================================================================================================
def np64(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy().astype(np.float64)


def grad(params: list[np.ndarray], x: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """d/d(W, b) of mean cross-entropy of softmax(x W^T + b) (``F.cross_entropy``)."""
    w, b = params
    logits = x @ w.T + b
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    dlogits = z / z.sum(axis=1, keepdims=True)
    dlogits[np.arange(len(y)), y] -= 1.0
    dlogits /= len(y)
    return [dlogits.T @ x, dlogits.sum(axis=0)]


def batches(per_rank: list[dict], t: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np64(r["x"][t]), r["y"][t].numpy()) for r in per_rank]


def max_diff(got: list[list[torch.Tensor]], want: list[list[np.ndarray]]) -> float:
    return max(
        float(np.abs(np64(g) - w).max())
        for got_t, want_t in zip(got, want, strict=True)
        for g, w in zip(got_t, want_t, strict=True)
    )


# ================================================================================================
# (a) Local AdaAlter: the authors' optimizer and trainer
# ================================================================================================
def authors_local_adaalter(
    per_rank: list[dict], *, eps: float, period: int, warmup_steps: int
) -> list[list[list[np.ndarray]]]:
    """xcgoner/AISTATS2020-AdaAlter-GluonNLP, N workers in one process; per step, per worker,
    the parameters after the step.

    ``large_word_language_model_local_hvd.py``: the trainer starts with
    ``local_sgd_interval = 0`` and ``_full_sync = True``; at ``step_num == warmup_steps + 1``
    it sets the interval to H, ``_full_sync = False`` and ``init_states()`` (the local
    accumulator ``cache_history = history.copy()``). ``DistributedHierLocalHVDTrainer.step``:
    interval 0: ``allreduce_(grad, average=True)``, then the update; interval > 1: the update,
    and every H-th call ``allreduce_params`` (average) and ``allreduce_states`` (average
    ``cache_history``, ``history[:] = cache_history``). ``LocalAdaAlter.update`` (dense)::

        div = grad / sqrt(history + eps)
        weight += (div + weight * wd) * -lr
        full sync: history += grad^2;   else: cache_history += grad^2
    """
    n, steps = len(per_rank), len(per_rank[0]["x"])
    w = [[np64(p) for p in per_rank[0]["start"]] for _ in range(n)]
    history = [[np.zeros_like(p) for p in w[0]] for _ in range(n)]
    cache = None
    interval, counter, full_sync = 0, 0, True
    out = []
    for t in range(steps):
        step_num = t + 1
        if step_num == warmup_steps + 1:
            interval, full_sync = period, False
            cache = [[h.copy() for h in hs] for hs in history]
        grads = [grad(w[i], x, y) for i, (x, y) in enumerate(batches(per_rank, t))]
        if interval == 0:  # allreduce_(grad, average=True)
            mean = [sum(gs[k] for gs in grads) / n for k in range(len(grads[0]))]
            grads = [[g.copy() for g in mean] for _ in range(n)]
        for i in range(n):
            for k, lr in enumerate(per_rank[i]["lrs"][t]):
                g = grads[i][k]
                div = g / np.sqrt(history[i][k] + eps)
                w[i][k] = w[i][k] + (div + w[i][k] * WEIGHT_DECAY) * -lr
                if full_sync:
                    history[i][k] += np.square(g)
                else:
                    cache[i][k] += np.square(g)
        if interval > 1:
            counter += 1
            if counter == interval:
                counter = 0
                for k in range(len(w[0])):
                    avg = sum(w[i][k] for i in range(n)) / n
                    acc = sum(cache[i][k] for i in range(n)) / n
                    for i in range(n):
                        w[i][k] = avg.copy()
                        cache[i][k] = acc.copy()
                        history[i][k] = acc.copy()
        out.append([[p.copy() for p in wi] for wi in w])
    return out


def adaalter_diff(per_rank: list[dict], **authors) -> float:
    want = authors_local_adaalter(per_rank, period=4, **authors)
    return max(max_diff(r["params"], [step[i] for step in want]) for i, r in enumerate(per_rank))


@pytest.mark.parametrize(
    "run, authors",
    [
        ("default", {"eps": 1.0, "warmup_steps": 1}),
        ("warmup3_eps0.01", {"eps": 0.01, "warmup_steps": 3}),
        ("no_warmup", {"eps": 0.01, "warmup_steps": 0}),
    ],
)
def test_local_adaalter_is_the_authors_trainer(ranks, run, authors):
    """xcgoner/AISTATS2020-AdaAlter-GluonNLP (9c673ed): local_adaalter.py,
    distributed_hvd_local_sgd.py, large_word_language_model_local_hvd.py. 2 ranks, 24 steps,
    weight decay 0.05, H = 4: synchronous steps, then local steps and synchronisations after
    steps 5, 9, ... (default) or 7, 11, ... (3 synchronous steps). ``no_warmup`` is the
    authors' rule with the interval set from the first step (their script would fail there:
    its ``init_states`` runs before any optimizer state exists)."""
    per_rank = [r["adaalter"][run] for r in ranks[2]]
    assert len(per_rank[0]["x"]) == 24
    assert adaalter_diff(per_rank, **authors) < ATOL
    # the replicas agree during the synchronous phase and right after each synchronisation
    warmup = authors["warmup_steps"]
    for step, (a, b) in enumerate(zip(*(r["params"] for r in per_rank), strict=True), start=1):
        synced = step <= warmup or (step - warmup) % 4 == 0
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)) == synced, step


@pytest.mark.parametrize("run", ["per_step", "in_gradient", "no_warmup"])
def test_local_adaalter_variants_are_not_the_authors(ranks, run):
    """Each earlier rule of this library (sqrt(D + s eps^2); weight decay in the gradient and
    the accumulator; no synchronous phase) alone moves the run away from the authors'."""
    per_rank = [r["adaalter"][run] for r in ranks[2]]
    assert adaalter_diff(per_rank, eps=0.01, warmup_steps=3) > FAR


# ================================================================================================
# (b) Adasum: Horovod's DistributedOptimizer(op=Adasum) with torch.optim.SGD inside
# ================================================================================================
SQRT_DBL_MIN = math.sqrt(sys.float_info.min)  # adasum.h: static double sqrt_double_min


def horovod_fused_adasum(
    buffers: list[np.ndarray], tensor_counts: list[int], eps: float = SQRT_DBL_MIN
) -> list[np.ndarray]:
    """``Adasum::FusedAllreduce`` (adasum.h, start_level 1) over ``len(buffers)`` ranks: every
    rank's fused buffer (tensors back to back, ``tensor_counts`` elements each) afterwards."""
    size = len(buffers)
    assert size & (size - 1) == 0, "Horovod's Adasum needs a power of two"
    grad_buf = [b.copy() for b in buffers]
    offset = [0] * size  # where each rank's grad_buffer pointer is
    my_count = [len(buffers[0])] * size
    counts = [list(tensor_counts) for _ in range(size)]
    nghr_vecs: list[list[list[int]]] = [[] for _ in range(size)]
    level = 1
    while level < size:  # vector halving, distance doubling
        kept = []
        for rank in range(size):
            first_half = my_count[rank] >> 1
            second_half = my_count[rank] - first_half
            tc, nv = counts[rank], [0] * len(tensor_counts)
            my_so_far = nghr_so_far = 0
            if rank & level:
                mine, nghr = second_half, first_half
                for i in range(len(tc)):
                    if nghr_so_far <= nghr:
                        if nghr_so_far + tc[i] <= nghr:
                            nv[i], tc[i] = tc[i], 0
                        else:
                            nv[i], tc[i] = nghr - nghr_so_far, tc[i] - (nghr - nghr_so_far)
                    nghr_so_far += nv[i]
                    my_so_far += tc[i]
                start = offset[rank] + nghr  # grad_buffer = &grad_buffer[nghrCount]
            else:
                mine, nghr = first_half, second_half
                for i in range(len(tc)):
                    if my_so_far <= mine:
                        if my_so_far + tc[i] > mine:
                            nv[i], tc[i] = tc[i] - (mine - my_so_far), mine - my_so_far
                    else:
                        nv[i], tc[i] = tc[i], 0
                    nghr_so_far += nv[i]
                    my_so_far += tc[i]
                start = offset[rank]
            nghr_vecs[rank].append(nv)
            kept.append((start, mine))
        # PointToPointSendRecv: each rank receives the neighbour's copy of the half it keeps
        recv = [grad_buf[rank ^ level][s : s + m].copy() for rank, (s, m) in enumerate(kept)]
        # FusedPairwiseReduceWithComm: per tensor dot, |left|^2, |right|^2 summed over the
        # reduction communicator (the 2 * level ranks of this rank's block)
        parts = []
        for rank, (s, m) in enumerate(kept):
            a, b, lo = grad_buf[rank][s : s + m], recv[rank], 0
            left = (rank & level) == 0
            nd = np.zeros((len(tensor_counts), 3))
            for i, c in enumerate(counts[rank]):
                ai, bi = a[lo : lo + c], b[lo : lo + c]
                an, bn = float(ai @ ai), float(bi @ bi)
                nd[i] = (float(ai @ bi), an, bn) if left else (float(ai @ bi), bn, an)
                lo += c
            parts.append(nd)
        for rank, (s, m) in enumerate(kept):
            block = range(rank & ~(2 * level - 1), (rank & ~(2 * level - 1)) + 2 * level)
            nd = sum(parts[r] for r in block)
            left = (rank & level) == 0
            a, b, lo = grad_buf[rank][s : s + m], recv[rank], 0
            for i, c in enumerate(counts[rank]):
                dot = nd[i, 0]
                anormsq, bnormsq = (nd[i, 1], nd[i, 2]) if left else (nd[i, 2], nd[i, 1])
                acoeff = 1.0 - dot / anormsq * 0.5 if anormsq >= eps else 1.0
                bcoeff = 1.0 - dot / bnormsq * 0.5 if bnormsq >= eps else 1.0
                a[lo : lo + c] = acoeff * a[lo : lo + c] + bcoeff * b[lo : lo + c]
                lo += c
            offset[rank], my_count[rank] = s, m
        level <<= 1
    level = size >> 1
    while level > 0:  # distance halving: gather the halves back
        snapshot = [(offset[r], my_count[r], grad_buf[r].copy()) for r in range(size)]
        for rank in range(size):
            nv = nghr_vecs[rank].pop()
            nghr = sum(nv)
            counts[rank] = [c + v for c, v in zip(counts[rank], nv, strict=True)]
            n_off, n_count, n_buf = snapshot[rank ^ level]
            assert n_count == nghr
            grad_buf[rank][n_off : n_off + n_count] = n_buf[n_off : n_off + n_count]
            if rank & level:
                offset[rank] -= nghr
            my_count[rank] += nghr
        level >>= 1
    return grad_buf


def horovod_adasum_sgd(
    per_rank: list[dict], *, momentum: float, weight_decay: float
) -> list[list[np.ndarray]]:
    """``_DistributedAdasumOptimizer`` around ``torch.optim.SGD`` on every rank: per step the
    common parameters after ``start + Adasum(step(start) - start)``."""
    n, steps = len(per_rank), len(per_rank[0]["x"])
    w = [np64(p) for p in per_rank[0]["start"]]
    bufs: list[list[np.ndarray | None]] = [[None] * len(w) for _ in range(n)]
    out = []
    for t in range(steps):
        deltas = []
        for i, (x, y) in enumerate(batches(per_rank, t)):
            g = grad(w, x, y)
            delta = []
            for k, lr in enumerate(per_rank[i]["lrs"][t]):
                d_p = g[k] + weight_decay * w[k] if weight_decay else g[k]
                if momentum:
                    prev = bufs[i][k]
                    bufs[i][k] = d_p.copy() if prev is None else momentum * prev + d_p
                    d_p = bufs[i][k]
                new = w[k] + -lr * d_p
                delta.append(new - w[k])  # p.data.sub_(start)
            deltas.append(np.concatenate([d.reshape(-1) for d in delta]))
        counts = [p.size for p in w]
        combined = horovod_fused_adasum(deltas, counts)
        assert all(np.array_equal(combined[0], c) for c in combined[1:])
        lo, new_w = 0, []
        for p in w:  # start.data.add_(delta); p.data.copy_(start)
            new_w.append(p + combined[0][lo : lo + p.size].reshape(p.shape))
            lo += p.size
        w = new_w
        out.append([p.copy() for p in w])
    return out


def adasum_diff(per_rank: list[dict], **optimizer) -> float:
    want = horovod_adasum_sgd(per_rank, **optimizer)
    return max(max_diff(r["params"], want) for r in per_rank)


def test_the_fused_tree_transcription_is_the_pairwise_tree():
    """The literal adasum.h transcription against the binary tree of the per-tensor rule."""
    rng = np.random.default_rng(0)
    counts = [7, 1, 12, 3]

    def rule(a, b):
        dot = a @ b
        return (1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b

    for size in (2, 4, 8):
        xs = [rng.normal(size=sum(counts)) + rng.normal() for _ in range(size)]
        got = horovod_fused_adasum(xs, counts)
        lo = 0
        for c in counts:
            level = [x[lo : lo + c] for x in xs]
            while len(level) > 1:
                level = [rule(level[i], level[i + 1]) for i in range(0, len(level), 2)]
            for g in got:
                np.testing.assert_allclose(g[lo : lo + c], level[0], rtol=1e-13, atol=1e-14)
            lo += c


@pytest.mark.parametrize("world", [2, 4])
def test_adasum_default_is_horovods_delta_optimizer(ranks, world):
    """horovod/torch/optimizer.py (_DistributedAdasumOptimizer) and
    horovod/common/ops/adasum/adasum.h (FusedAllreduce, FusedPairwiseReduceWithComm) at
    2626dc8, around torch.optim.SGD (momentum 0.9, weight decay 0.05): 12 steps on 4 ranks,
    24 on 2. The bias group's lr is scaled by 1e-4, so its updates' squared norms (~1e-12)
    lie below the old 1e-8 guard and above Horovod's sqrt(DBL_MIN)."""
    per_rank = [r["adasum"]["default"] for r in ranks[world]]
    assert len(per_rank[0]["x"]) == {2: 24, 4: 12}[world]
    assert adasum_diff(per_rank, momentum=0.9, weight_decay=WEIGHT_DECAY) < ATOL
    bias_step = np.abs(np64(per_rank[0]["params"][0][1]) - np64(per_rank[0]["start"][1]))
    assert 0 < float(bias_step @ bias_step) < 1e-8  # the premise of the guard check


@pytest.mark.parametrize("world", [2, 4])
def test_adasum_gradient_mode_is_not_horovods_with_momentum(ranks, world):
    per_rank = [r["adasum"]["gradient"] for r in ranks[world]]
    assert adasum_diff(per_rank, momentum=0.9, weight_decay=WEIGHT_DECAY) > FAR


def test_adasum_auto_and_the_old_guard_are_not_horovods(ranks):
    """``auto`` is gradient mode for SGD; eps = 1e-8 sums the bias updates instead."""
    auto, gradient = ([r["adasum"][name] for r in ranks[2]] for name in ("auto", "gradient"))
    for a, b in zip(auto[0]["params"], gradient[0]["params"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    old_guard = [r["adasum"]["eps_1e-8"] for r in ranks[2]]
    want = horovod_adasum_sgd(old_guard, momentum=0.9, weight_decay=WEIGHT_DECAY)
    first = old_guard[0]["params"][0]  # step 1: the weight's |update|^2 is above 1e-8
    assert max_diff([[first[0]]], [[want[0][0]]]) < ATOL
    assert max_diff([[first[1]]], [[want[0][1]]]) > 1e-8  # the bias updates: summed
    assert adasum_diff(old_guard, momentum=0.9, weight_decay=WEIGHT_DECAY) > FAR


@pytest.mark.parametrize("weight_decay", [0.0, WEIGHT_DECAY])
def test_gradient_and_delta_mode_agree_only_for_plain_sgd(ranks, weight_decay):
    """SGD without momentum: the update is -lr g (+ -lr wd w), and Adasum is scale-equivariant
    but not additive, so the modes agree without weight decay and differ with it."""
    delta, gradient = (
        [r["adasum"][f"sgd_wd{weight_decay}_{mode}"] for r in ranks[2]]
        for mode in ("delta", "gradient")
    )
    assert adasum_diff(delta, momentum=0.0, weight_decay=weight_decay) < ATOL
    want = [[np64(p) for p in step] for step in delta[0]["params"]]
    diff = max_diff(gradient[0]["params"], want)
    if weight_decay:
        assert diff > FAR
    else:
        assert diff < ATOL
