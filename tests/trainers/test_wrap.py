"""``combiner.wrap(optimizer, model)``: any registered mode in a plain PyTorch loop.

Oracles: torch's own ``DistributedDataParallel`` + SGD in the same loop (the reference for
``average``: bit for bit, 2 gloo ranks), scikit-learn's real digits (held-out top-1 of every
mode above 0.9, where one class scores 0.10), and the replicas themselves (local SGD's
differ after training and are equal inside ``evaluating()``). Single-process parts:
PyTorch's LR schedulers attach to the wrapper, state dicts round-trip, misuse is refused.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests._tiers import slow_fixture
from trainers.comm import DistributedOptimizer, create_combiner


@slow_fixture(scope="module")
def ranks(tmp_path_factory):
    from tests.trainers._launch import run_ranks

    out = tmp_path_factory.mktemp("wrap")
    run_ranks("tests.trainers._wrap_worker", [str(out)], timeout=600)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.dist
def test_average_in_a_plain_loop_is_torchs_ddp_bit_for_bit(ranks):
    for res in ranks:
        for ours, ref in zip(res["average"]["trained"], res["ddp"]["trained"], strict=True):
            assert torch.equal(ours, ref)
        assert res["average"]["accuracy"] == res["ddp"]["accuracy"]


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["average", "localsgd", "ef-topk"])
def test_three_modes_learn_the_digits_in_a_plain_loop(ranks, mode):
    assert ranks[0][mode]["accuracy"] >= 0.9, {m: r["accuracy"] for m, r in ranks[0].items()}
    assert ranks[0][mode]["accuracy"] == ranks[1][mode]["accuracy"]  # one evaluated model
    for a, b in zip(ranks[0][mode]["evaluated"], ranks[1][mode]["evaluated"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.dist
def test_local_sgd_replicas_drift_and_are_averaged_for_evaluation(ranks):
    trained = [r["localsgd"]["trained"] for r in ranks]
    assert any(not torch.equal(a, b) for a, b in zip(*trained, strict=True))
    mean = [(a + b) / 2 for a, b in zip(*trained, strict=True)]
    for got, want in zip(ranks[0]["localsgd"]["evaluated"], mean, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _wrapped(mode="localsgd", **options):
    model = nn.Linear(3, 2)
    combiner = create_combiner(mode, seed=0, **options)
    return model, combiner.wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)


def test_a_scheduler_drives_the_wrapped_optimizers_lr():
    torch.manual_seed(0)
    model, opt = _wrapped()
    assert isinstance(opt, torch.optim.Optimizer) and isinstance(opt, DistributedOptimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    plain_model = nn.Linear(3, 2)
    plain_model.load_state_dict(model.state_dict())
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9)
    plain_sched = torch.optim.lr_scheduler.LambdaLR(plain, lambda s: 0.5**s)
    for _ in range(3):  # a world of one: the wrapped step is the plain one
        x = torch.randn(4, 3)
        for m, o, s in ((opt.model, opt, sched), (plain_model, plain, plain_sched)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
            s.step()
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    for a, b in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_state_dict_round_trips_and_misuse_is_refused():
    model, opt = _wrapped()
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    assert set(saved) == {"optimizer", "combiner"}
    other_model, other = _wrapped()
    other.load_state_dict(saved)
    assert (
        other.optimizer.state_dict()["state"].keys() == opt.optimizer.state_dict()["state"].keys()
    )
    with pytest.raises(ValueError, match="keys 'optimizer', 'combiner'"):
        other.load_state_dict(saved["optimizer"])
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(TypeError, match="already wrapped"):
        create_combiner("average").wrap(opt, model)
    with pytest.raises(ValueError, match="already prepared"):
        opt.combiner.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model)
    with pytest.raises(ValueError, match="added after wrapping"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
