"""SGP, AD-PSGD (+ H-ADPSGD) and Pipe-SGD against the oracles of specs/decentralized.md.

Oracles: the mixing matrices of the one-peer exponential graph (their product over log2 n
rounds is 11^T / n, so every rank holds the exact mean computed here from all ranks' start
values); conservation of sum x and sum w; SGP on 2 ranks = model averaging every step
(LocalSGD, H = 1); pair averaging preserving the mean update; a single-process SGD loop on
identical data; H-ADPSGD on one node = DDP; a single-process delayed-SGD simulation for
Pipe-SGD and the closed-form recurrence w_{t+1} = w_t - eta a w_{t-1} on a quadratic; for
resuming, the same run without interruption; the real digits for accuracy.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.trainers._launch import run_ranks
from tests.trainers._trainer_toys import ToyDataset, lr_fn, make_mlp
from trainers import DistEnv
from trainers.comm import create_combiner
from trainers.comm.adpsgd import random_matching
from trainers.comm.sgp import exponential_peers
from trainers.data import ShardedSampler

N, BATCH, EPOCHS, SEED = 48, 3, 2, 5  # as in _decentral_worker.py
pytestmark = pytest.mark.dist


def _run(tmp_path_factory, world: int):
    out = tmp_path_factory.mktemp(f"decentral{world}")
    run_ranks("tests.trainers._decentral_worker", [str(out)], world=world, timeout=600)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _run(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _run(tmp_path_factory, 4)


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
    return _run(tmp_path_factory, 8)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# -- the graph and the matching ----------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 12])
def test_exponential_graph_is_one_peer_and_a_permutation(n):
    hops = int(torch.tensor(float(n - 1)).log2().floor()) + 1
    for step in range(2 * hops):
        sends = [exponential_peers(i, n, step)[0] for i in range(n)]
        recvs = [exponential_peers(i, n, step)[1] for i in range(n)]
        assert sorted(sends) == list(range(n))  # every rank receives exactly one message
        assert all(sends[recvs[i]] == i for i in range(n))  # i hears from whom sends to i
        assert all(s != i for i, s in enumerate(sends))
        assert sends[0] == 2 ** (step % hops) % n


@pytest.mark.parametrize("n", [2, 4, 5, 8])
def test_matching_is_shared_and_perfect(n):
    for step in range(5):
        partner = random_matching(n, 3, step)
        assert partner == random_matching(n, 3, step)  # the same on every rank
        assert all(partner[partner[i]] == i for i in range(n))
        assert sum(partner[i] == i for i in range(n)) == n % 2  # one sits out when n is odd
    assert len({tuple(random_matching(n, 3, s)) for s in range(20)}) > 1 or n == 2


# -- SGP -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", ["two", "four", "eight"])
@pytest.mark.slow
def test_sgp_gives_the_exact_average_after_log2_n_rounds(world, request):
    ranks = request.getfixturevalue(world)
    n = len(ranks)
    mean = torch.stack([r["gossip"]["start"].double() for r in ranks]).mean(0)
    for r in ranks:
        torch.testing.assert_close(r["gossip"]["x"][-1].double(), mean, rtol=0, atol=1e-6)
        for total in r["gossip"]["sum_x"]:  # sum_i x_i conserved round by round
            torch.testing.assert_close(total, mean * n, rtol=0, atol=1e-5)
        assert r["gossip"]["sum_w"] == [float(n)] * len(r["gossip"]["sum_w"])
    if n > 2:  # one round is not enough: the average needs all log2 n rounds
        first = [r["gossip"]["x"][0].double() for r in ranks]
        assert max(float((x - mean).abs().max()) for x in first) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("world", ["two", "four", "eight"])
def test_overlapping_sgp_conserves_mass_and_synchronizes_to_the_mean(world, request):
    """OSGP (messages 2 steps late): sum x and sum w = n include the messages in flight,
    the push-sum weight departs from 1, and synchronize() gives the exact mean."""
    ranks = request.getfixturevalue(world)
    n = len(ranks)
    mean = torch.stack([r["gossip_overlap"]["start"].double() for r in ranks]).mean(0)
    for r in ranks:
        g = r["gossip_overlap"]
        for total, w in zip(g["sum_x"], g["sum_w"], strict=True):
            torch.testing.assert_close(total, mean * n, rtol=0, atol=1e-5)
            assert w == pytest.approx(n, abs=1e-6)
        torch.testing.assert_close(g["synchronized"].double(), mean, rtol=0, atol=1e-6)
        assert g["weight_after_sync"] == 1.0


def test_sgp_on_two_ranks_is_averaging_every_step(two):
    for r in two:
        assert torch.equal(r["sgp"], r["localsgd_h1"])


# -- AD-PSGD -------------------------------------------------------------------------------------
def test_adpsgd_rounds_move_the_mean_by_the_mean_gradient(four):
    """Pair averaging keeps the mean: mean(x_{t+1}) = mean(x_t) - lr_t mean(g_t) (plain SGD)."""
    steps = len(four[0]["adpsgd_sync"]["params"])
    assert steps == 8
    before = torch.stack([flat(make_mlp(seed=0))] * 4).double()
    for t in range(steps):
        after = torch.stack([r["adpsgd_sync"]["params"][t] for r in four]).double()
        grads = torch.stack([r["adpsgd_sync"]["grads"][t] for r in four]).double()
        lr = four[0]["adpsgd_sync"]["lrs"][t]
        torch.testing.assert_close(
            after.mean(0), before.mean(0) - lr * grads.mean(0), rtol=0, atol=1e-6
        )
        before = after
    assert not torch.equal(before[0], before[1])  # the replicas differ (it is not DDP)


def single_process_sgd(steps: int = 6) -> torch.Tensor:
    model = make_mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = ToyDataset(N)
    for t in range(steps):
        x, y = data.x[t * 6 : (t + 1) * 6], data.y[t * 6 : (t + 1) * 6]
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return flat(model)


@pytest.mark.parametrize("key", ["identical_adpsgd", "identical_h_adpsgd"])
def test_adpsgd_on_identical_data_is_single_process_sgd(four, key):
    reference = single_process_sgd()
    for r in four:
        assert torch.equal(r[key], reference)


def test_adpsgd_consensus_shrinks_at_lr_zero(four):
    d = four[0]["consensus"]
    assert d[0] > 1.0
    assert all(b <= a * (1 + 1e-9) for a, b in zip(d, d[1:], strict=False))
    assert d[-1] < 1e-3 * d[0]


def test_h_adpsgd_on_one_node_is_ddp(four):
    for r in four:
        torch.testing.assert_close(r["h_adpsgd_one_node"], r["average"], rtol=0, atol=1e-6)


def test_h_adpsgd_keeps_each_nodes_replicas_equal(four):
    steps = four[0]["h_adpsgd_two_nodes"]
    for t in range(len(steps)):
        assert torch.equal(four[0]["h_adpsgd_two_nodes"][t], four[1]["h_adpsgd_two_nodes"][t])
        assert torch.equal(four[2]["h_adpsgd_two_nodes"][t], four[3]["h_adpsgd_two_nodes"][t])
    assert not torch.equal(four[0]["h_adpsgd_two_nodes"][-1], four[2]["h_adpsgd_two_nodes"][-1])


def test_async_adpsgd_exchanges_and_synchronizes(four):
    for r in four:
        assert torch.equal(r["async_after_sync"], four[0]["async_after_sync"])
        assert r["async_exchanges"] >= 1


def test_async_adpsgd_keeps_the_sum_of_the_models_exactly(four):
    """lr 0, exchanges running concurrently with the steps: every exchange moves two models to
    their average, so sum_i x_i never changes (float64, dyadic values: exactly), while the
    models do move toward each other. A rule where only one end moves, or where the active
    end overwrites what its main thread applied meanwhile, changes the sum."""
    runs = [r["async_mass"] for r in four]
    assert torch.equal(runs[0]["sum_end"], runs[0]["sum_start"])
    assert all(torch.equal(r["sum_start"], runs[0]["sum_start"]) for r in runs)
    assert sum(r["exchanges"] for r in runs) >= 4  # both ends count an exchange
    moved = [not torch.equal(r["end"], r["start"]) for r in runs]
    assert all(moved), moved
    mean = runs[0]["sum_start"] / 4
    spread = lambda key: sum(float(((r[key] - mean) ** 2).sum()) for r in runs)  # noqa: E731
    assert spread("end") < spread("start")


def test_async_adpsgd_fast_ranks_do_not_wait_for_a_slow_peer(four):
    """Rank 1 sleeps 0.25 s after each of 12 steps. Asynchronously the other ranks' 12 steps
    take a fraction of rank 1's time (its thread still answers exchanges); in synchronous
    rounds, the control, every rank is paced by the slow one."""

    def span(times):
        return times[-1] - times[0]

    slow_async = span(four[1]["pace"]["async"])
    assert slow_async > 11 * 0.25 * 0.9
    for rank in (0, 2, 3):
        assert span(four[rank]["pace"]["async"]) < 0.4 * slow_async, rank
    slow_sync = span(four[1]["pace"]["sync"])
    for rank in (0, 2, 3):
        assert span(four[rank]["pace"]["sync"]) > 0.6 * slow_sync, rank


# -- Pipe-SGD ------------------------------------------------------------------------------------
def test_pipesgd_is_delayed_sgd(four):
    """A single process fed the 4 ranks' batches: step t applies mean_i g_i(w_{t-1})."""
    data = ToyDataset(N)
    model = make_mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr_fn(0), momentum=0.9, weight_decay=1e-3)
    params = list(model.parameters())
    shards = [
        [list(ShardedSampler(N, batch_size=BATCH, world_size=4, rank=r, seed=SEED, epoch=e,
                             with_epoch=False)) for r in range(4)]
        for e in range(EPOCHS)
    ]  # fmt: skip
    batches = [step for epoch in shards for step in zip(*epoch, strict=True)]
    previous, got = None, four[0]["pipesgd"]["params"]
    assert len(got) == len(batches) == 8
    for t, per_rank in enumerate(batches):
        grads = [
            torch.autograd.grad(F.cross_entropy(model(data.x[idx]), data.y[idx]), params)
            for idx in per_rank
        ]
        mean = [torch.stack(gs).mean(0) for gs in zip(*grads, strict=True)]
        if previous is not None:
            for p, g in zip(params, previous, strict=True):
                p.grad = g
            for group in opt.param_groups:
                group["lr"] = lr_fn(t)
            opt.step()
        previous = mean
        torch.testing.assert_close(got[t], flat(model), rtol=0, atol=1e-5)
    for r in four:  # every replica applies the same average
        assert all(torch.equal(a, b) for a, b in zip(r["pipesgd"]["params"], got, strict=True))


def quadratic(combiner_name: str, eta_a: float, steps: int = 80) -> list[float]:
    """f(w) = a w^2 / 2 with a = 2, trained by the combiner in a world of one."""
    a = 2.0
    w = nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    holder = nn.Module()
    holder.w = w
    opt = torch.optim.SGD([w], lr=eta_a / a)
    combiner = create_combiner(combiner_name)
    combiner.prepare(holder, opt, DistEnv())
    out = [float(w.detach())]
    for _ in range(steps):
        (0.5 * a * w**2).sum().backward()
        combiner.reduce_gradients(None)
        combiner.step(opt, None)
        opt.zero_grad()
        out.append(float(w.detach()))
    return out


def test_pipesgd_diverges_where_delayed_gradient_descent_is_unstable():
    """eta a = 1.5: plain GD converges (|1 - eta a| < 1), delayed GD diverges (needs < 1)."""
    delayed, plain = quadratic("pipesgd", 1.5), quadratic("average", 1.5)
    assert abs(plain[-1]) < 1e-6
    assert abs(delayed[-1]) > 1e4  # |roots of z^2 - z + 1.5| = sqrt(1.5) > 1
    ws = [1.0, 1.0]  # step 0 applies nothing: w_1 = w_0
    for _ in range(79):
        ws.append(ws[-1] - 1.5 * ws[-2])
    assert delayed == pytest.approx(ws, rel=1e-12)
    stable = quadratic("pipesgd", 0.5)
    assert abs(stable[-1]) < 1e-3


# -- every mode ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mode", ["sgp", "sgp-overlap2", "adpsgd", "h-adpsgd", "pipesgd", "pipesgd-fp16"]
)
def test_resumes_bit_for_bit(four, mode):
    for r in four:
        straight, resumed = r["resume"][mode][:2]
        assert torch.equal(straight, resumed), mode


@pytest.mark.parametrize(
    ("mode", "name", "options"),
    [
        ("sgp", "sgp", {}),
        ("sgp-overlap2", "sgp", {"overlap": 2}),
        ("adpsgd", "adpsgd", {}),
        ("h-adpsgd", "adpsgd", {"node_size": 2}),
    ],
)
def test_a_membership_change_starts_from_the_exact_average(four, mode, name, options):
    """A 4-rank checkpoint resumed by a world of one (what an elastic restart with another
    world size does): the model is the mean of the 4 replicas the ranks held; for SGP with
    overlap, push-sum's sum x / sum w over every rank's numerator and its messages in
    flight, whose weights must add up to n."""
    path = four[0]["resume"][mode][3]
    replicas = torch.stack([r["resume"][mode][2] for r in four]).double()
    trainer = _trainer_of_one(name, options)
    trainer.resume(path)
    got = flat(trainer.model).double()
    if mode == "sgp-overlap2":  # w != 1 and messages in flight: sum x / sum w from the file
        state = torch.load(path, weights_only=False)
        x = w = 0
        for rank in state["ranks"]:
            c = rank["combiner"]
            x = x + torch.cat([t.reshape(-1) for t in c["tensors"]]).double() * c["weight"]
            w = w + c["weight"]
            for _, msg in c["pending"]:
                x = x + msg[:-1].double()
                w = w + float(msg[-1])
        assert w == pytest.approx(4.0, abs=1e-6)
        expected = (x / w)[: got.numel()]
    else:
        expected = replicas.mean(0)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    if mode in ("sgp", "adpsgd"):
        assert float((replicas[0] - replicas[1]).abs().max()) > 1e-4  # the replicas differed


def test_pipesgd_membership_change_applies_the_gradient_in_flight(four):
    path = four[0]["resume"]["pipesgd"][3]
    trainer = _trainer_of_one("pipesgd", {})
    trainer.resume(path)
    state = torch.load(path, weights_only=False)
    assert torch.equal(flat(trainer.model), four[0]["resume"]["pipesgd"][2])
    assert torch.equal(trainer.combiner.ready, state["ranks"][0]["combiner"]["pending"])


def _trainer_of_one(mode, options):
    from trainers import RunLogger, Trainer, TrainerConfig

    model = make_mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr_fn(0), momentum=0.9, weight_decay=1e-3)
    return Trainer(
        model, opt,
        TrainerConfig(epochs=2, batch_size=BATCH, seed=SEED, log_interval=0, progress=False),
        env=DistEnv(), logger=RunLogger(None, enabled=False), lr_schedule=lr_fn,
        combiner=create_combiner(mode, seed=SEED, **options),
        train_step=lambda m, b: (F.cross_entropy(m(b[0]), b[1]), {}),
    )  # fmt: skip


@pytest.mark.parametrize(
    "mode",
    ["sgp", "sgp-overlap1", "adpsgd", "adpsgd-async", "h-adpsgd", "pipesgd", "pipesgd-qsgd"],
)
def test_digits_within_two_points_of_averaging(four, mode):
    """The real digits, 4 ranks: every mode within 2 points of synchronous averaging."""
    acc = four[0]["digits"]
    assert acc["average"] > 0.93
    assert acc[mode] >= acc["average"] - 0.02, acc


@pytest.mark.parametrize("mode", ["sgp", "adpsgd", "pipesgd"])
def test_fp16_loss_scaling_is_refused_with_what_to_do(mode):
    model = make_mlp(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    combiner = create_combiner(mode)
    combiner.prepare(model, opt, DistEnv())
    with pytest.raises(ValueError, match=f"combiner '{mode}' .*train in bfloat16 or float32"):
        combiner.reduce_gradients(torch.amp.GradScaler("cpu"))


@pytest.mark.gpu
def test_sgp_mixing_on_nccl(tmp_path):
    """The same mixing oracles over NCCL on 2 GPUs (skipped without them)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    run_ranks("tests.trainers._decentral_worker", [str(tmp_path), "cuda"], world=2, timeout=600)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", map_location="cpu", weights_only=False)
             for r in range(2)]  # fmt: skip
    mean = torch.stack([r["gossip"]["start"].double() for r in ranks]).mean(0)
    for r in ranks:
        torch.testing.assert_close(r["gossip"]["x"][-1].double(), mean, rtol=0, atol=1e-6)
        torch.testing.assert_close(
            r["gossip_overlap"]["synchronized"].double(), mean, rtol=0, atol=1e-6
        )
