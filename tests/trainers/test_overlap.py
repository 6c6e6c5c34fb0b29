"""Communication overlapped with the backward (``trainers.comm.overlap``): Adasum gradient
mode and bucketed error feedback.

Oracles: the plain path (the same buckets reduced after the backward) bit for bit, on 2 gloo
processes through the Trainer with accumulation, a branch only one rank runs and a parameter
no rank uses; bucketed fp16 error feedback against the whole-vector path (an elementwise
compressor does not care about buckets); bucketed top-k error feedback against the rule
recomputed here from both ranks' recorded inputs; the hooks' launch times against the
backward's own progress (a reduction that starts before the backward has returned); the
bucket rule recomputed by hand.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from tests._tiers import slow_fixture
from tests.trainers._launch import run_ranks
from trainers.comm.overlap import BackwardBuckets, backward_order_buckets


def _chain(n: int = 4, width: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes 0.3 s (the layers below it wait)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.3)
        return grad


def test_buckets_are_consecutive_capped_and_of_one_kind():
    ps = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(5, dtype=torch.float64)]
    ps.append(torch.zeros(1))
    # 40 + 40 bytes fit 100; 120 opens a bucket of its own; a dtype change cuts too
    assert backward_order_buckets(ps, 100) == [[0, 1], [2], [3], [4]]
    assert backward_order_buckets(ps, 1000) == [[0, 1, 2], [3], [4]]
    assert backward_order_buckets(ps, 1) == [[0], [1], [2], [3], [4]]


def test_buckets_launch_in_order_during_the_backward():
    net = _chain()
    params = [p for p in net.parameters()][::-1]
    log: list[tuple[int, bool, str]] = []
    backward_done = threading.Event()

    def reduce(b, grads):
        log.append((b, backward_done.is_set(), threading.current_thread().name))
        for g in grads:
            g.mul_(2)

    buckets = BackwardBuckets(params, 32 * 33 * 4, reduce)  # one layer per bucket
    assert [len(b) for b in buckets.buckets] == [2, 2, 2, 2]
    x = torch.randn(8, 32)

    def backward():  # the last layer's gradients, 0.3 s, then the others'
        net.zero_grad(set_to_none=True)
        net[3](_SlowBackward.apply(net[:3](x))).square().sum().backward()

    backward()  # not armed: only the order is recorded
    assert log == [] and buckets.recording
    assert buckets.observed_order() == list(range(8))  # the reverse guess was right
    plain = [p.grad.clone() for p in params]
    buckets.rebuild(buckets.observed_order())
    buckets.armed = True

    # a slow first reduction: the backward goes on meanwhile, the launches stay in order
    def slow_reduce(b, grads):
        reduce(b, grads)
        if b == 0:
            time.sleep(0.3)

    buckets.reduce = slow_reduce
    backward()
    backward_done.set()
    buckets.finish()
    assert [b for b, _, _ in log] == [0, 1, 2, 3]
    assert all(name == "modelzoo-overlap" for _, _, name in log)
    assert buckets.last_launched_early == 4  # every bucket launched by a hook
    assert not log[0][1]  # the first reduction began while the backward was still running
    for p, want in zip(params, plain, strict=True):
        torch.testing.assert_close(p.grad, 2 * want, rtol=0, atol=0)
    buckets.remove()


def test_finish_reduces_what_the_hooks_did_not_and_reraises_worker_errors():
    net = _chain(2)
    params = [p for p in net.parameters()][::-1]
    seen: list[int] = []

    def reduce(b, grads):
        seen.append(b)
        if b == 1 and len(seen) > 2:
            raise RuntimeError("collective failed")

    buckets = BackwardBuckets(params, 32 * 33 * 4, reduce)
    buckets.rebuild(range(4))
    buckets.armed = True
    # only the last layer takes part: bucket 0 is launched by its hooks, bucket 1 by finish
    net.zero_grad(set_to_none=True)
    net[1](torch.randn(4, 32)).sum().backward()
    assert params[2].grad is None
    buckets.finish()
    assert seen == [0, 1] and buckets.last_launched_early == 1
    assert torch.equal(params[2].grad, torch.zeros_like(params[2]))  # zeros, reduced
    net.zero_grad(set_to_none=True)
    net(torch.randn(4, 32)).sum().backward()
    with pytest.raises(RuntimeError, match="collective failed"):
        buckets.finish()
    buckets.remove()
    with pytest.raises(ValueError, match="permutation"):
        buckets.rebuild([0, 0, 1, 2])


def test_a_second_backward_in_one_step_is_an_error_not_a_half_reduced_bucket():
    net = _chain(2)
    params = [p for p in net.parameters()][::-1]
    buckets = BackwardBuckets(params, 32 * 33 * 4, lambda b, grads: None)
    buckets.rebuild(range(4))
    buckets.armed = True
    loss = net(torch.randn(4, 32)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second gradient in one step"):
        loss.backward()
    buckets.remove()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_buckets_wait_for_their_gradients_on_the_device():
    """The CUDA path: each hook records an event that the worker's stream waits for."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)]).cuda()
    params = [p for p in net.parameters()][::-1]
    buckets = BackwardBuckets(params, 512 * 513 * 4, lambda b, grads: [g.mul_(2) for g in grads])
    buckets.rebuild(range(len(params)))
    x = torch.randn(256, 512, device="cuda")
    net(x).square().sum().backward()
    want = [2 * p.grad.clone() for p in params]
    net.zero_grad(set_to_none=True)
    buckets.armed = True
    net(x).square().sum().backward()
    buckets.finish()
    torch.cuda.synchronize()
    assert buckets.last_launched_early == 4
    for p, w in zip(params, want, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=0, atol=0)
    buckets.remove()


@slow_fixture(scope="module")
def adasum2(tmp_path_factory):
    out = tmp_path_factory.mktemp("overlap")
    run_ranks("tests.trainers._overlap_worker", [str(out)], world=2, timeout=300)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.dist
def test_overlapped_adasum_equals_the_plain_path_bit_for_bit(adasum2):
    for r in adasum2:
        for a, b in zip(r["overlap"], r["plain"], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(r["overlap"], adasum2[0]["overlap"], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(r["resumed"], r["overlap"], strict=True):  # the order is checkpointed
            assert torch.equal(a, b)
        assert min(r["resumed_early"]) >= 1  # so the hooks are armed from the first step
        # named_parameters order: `unused` first; no rank used it: SGD never touched it
        assert torch.equal(r["overlap"][0], torch.ones(5))
        # the first step records the order; from the second the hooks launch buckets
        assert r["early"][0] == 0 and min(r["early"][1:]) >= 1 and r["plain_early"] == [0] * 6
    # rank 0's order for everyone: the branch only rank 1 runs comes last, with `unused`
    assert adasum2[0]["buckets"] == adasum2[1]["buckets"]
    assert adasum2[0]["buckets"][0][:2] == ["head.bias", "head.weight"]
    assert adasum2[0]["buckets"][-1][-2:] == ["side.weight", "unused"]


@slow_fixture(scope="module")
def ef2(tmp_path_factory):
    out = tmp_path_factory.mktemp("overlap_ef")
    run_ranks("tests.trainers._overlap_worker", [str(out), "ef"], world=2, timeout=300)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.dist
def test_overlapped_error_feedback_equals_the_plain_path_and_fp16_the_whole_vector(ef2):
    for r in ef2:
        for a, b in zip(r["overlap"]["params"], r["plain"]["params"], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(r["overlap"]["params"], ef2[0]["overlap"]["params"], strict=True):
            assert torch.equal(a, b)
        assert r["overlap"]["early"][0] == 0 and min(r["overlap"]["early"][1:]) >= 1
        assert r["plain"]["early"] == [0] * 6
        # fp16 is elementwise: cutting the vector into buckets changes nothing
        for a, b in zip(r["fp16_buckets"]["params"], r["fp16_whole"]["params"], strict=True):
            assert torch.equal(a, b)
    assert ef2[0]["overlap"]["buckets"] == ef2[1]["overlap"]["buckets"]


@pytest.mark.dist
def test_bucketed_error_feedback_resumes_bit_for_bit_with_its_bucket_order(ef2):
    for r in ef2:
        for a, b in zip(r["resumed"]["params"], r["overlap"]["params"], strict=True):
            assert torch.equal(a, b)
        assert min(r["resumed"]["early"]) >= 1  # armed from the first step after resuming


@pytest.mark.dist
def test_bucketed_top_k_error_feedback_is_the_rule_per_bucket(ef2):
    """Per step and bucket: x = g + e on each rank, c = its top 10 % by magnitude, every rank
    applies mean(c), and the next step's residual of the bucket is x - c."""
    logs = [{(t, b): (g, e, m) for t, b, g, e, m in r["overlap"]["log"]} for r in ef2]
    assert logs[0].keys() == logs[1].keys() and len(logs[0]) >= 6 * 2
    for key in logs[0]:
        cs = []
        for log in logs:
            g, e, _ = log[key]
            x = g.double() + e.double()
            k = min(x.numel(), max(1, round(x.numel() * 0.1)))
            c = torch.zeros_like(x)
            top = x.abs().topk(k).indices
            c[top] = x[top]
            cs.append((x, c))
        mean = (cs[0][1] + cs[1][1]) / 2
        for rank, log in enumerate(logs):
            torch.testing.assert_close(log[key][2].double(), mean, rtol=1e-6, atol=1e-7)
            after = log.get((key[0] + 1, key[1]))
            if after is not None and key[0] >= 1:  # same layout from the second step on
                x, c = cs[rank]
                torch.testing.assert_close(after[1].double(), x - c, rtol=1e-6, atol=1e-7)
