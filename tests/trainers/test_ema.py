"""trainers.ema: the EMA of the weights (``--model-ema``).

Oracles: ``torch.optim.swa_utils.AveragedModel`` with ``get_ema_multi_avg_fn`` (PyTorch's
EMA) updated in lock-step on a real optimizer run; a float64 numpy recurrence of timm's
warmup decay; the uninterrupted run (against a resumed one); an evaluation of the
AveragedModel's weights written out here (against the logged ``ema_`` metrics).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from tests.trainers._trainer_toys import DIM, ToyDataset, eval_step, lr_fn, train_step
from trainers import DistEnv, ModelEMA, RunLogger, Trainer, TrainerConfig, create_combiner
from trainers.ema import EMAConfig, ema_decay

ENV = DistEnv()  # a world of one


def _bn_mlp(seed: int = 0) -> nn.Module:
    """Float buffers (BatchNorm statistics), an integer buffer and dropout."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(DIM, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3)
    )


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9, weight_decay=1e-3)


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_equals_pytorch_averaged_model_in_lock_step():
    model = _bn_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    decay = 0.9
    ema = ModelEMA(model, decay=decay)
    oracle = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
    data = ToyDataset(64, seed=3)
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        idx = torch.randint(0, 64, (16,), generator=g)
        loss = F.cross_entropy(model(data.x[idx]), data.y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
        ema.update()
        oracle.update_parameters(model)
    mine = ema.state_dict_for_export()
    theirs = oracle.module.state_dict()
    assert list(mine) == list(model.state_dict())
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point():
            assert torch.equal(mine[name], theirs[name]), name
            assert not torch.equal(mine[name], tensor), name  # it is an average, not a copy
        else:  # num_batches_tracked: copied (AveragedModel rounds its average down instead)
            assert torch.equal(mine[name], tensor) and int(tensor) == 30


def test_warmup_decay_follows_the_numpy_recurrence_of_timm():
    torch.manual_seed(1)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ema = ModelEMA(model, decay=0.9, warmup=True)
    seen, expected = [], None
    for t in range(1, 41):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ema.update()
        w = model.weight.detach().double().numpy().copy()
        # timm ModelEmaV3.get_decay(step=t): 0 at t=1, then min(decay, 1 - t ** (-2/3))
        d = 0.0 if t == 1 else min(0.9, 1.0 - float(t) ** (-2.0 / 3.0))
        expected = w if expected is None else d * expected + (1.0 - d) * w
        seen.append(d)
    np.testing.assert_allclose(ema.average["weight"].double().numpy(), expected, rtol=0, atol=1e-6)
    assert seen[1] == pytest.approx(1 - 2 ** (-2 / 3)) and seen[-1] == 0.9  # warmed up (t >= 32)
    assert [ema_decay(t, 0.9, warmup=True) for t in range(1, 41)] == seen
    assert ema_decay(1, 0.9998) == 0.0 and ema_decay(2, 0.9998) == 0.9998


def test_swap_in_and_export_leave_the_model_bit_for_bit():
    model = _bn_mlp()
    ema = ModelEMA(model, decay=0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.train()
    model(torch.randn(8, DIM))  # BatchNorm statistics move
    ema.update()
    ema.update()  # a real average: the first update copies
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.swap_in() as inside:
        assert inside is model
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, ema.average[name])
        with torch.no_grad():
            model[0].weight.zero_()  # changed inside: must not reach the average
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    assert not torch.equal(ema.average["0.weight"], torch.zeros_like(model[0].weight))
    with pytest.raises(RuntimeError, match="inside"), ema.swap_in():
        raise RuntimeError("inside")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    fresh = _bn_mlp(seed=5)
    fresh.load_state_dict(ema.state_dict_for_export())
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, ema.average[name])


def test_tied_weights_are_one_average():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)
            self.b.weight = self.a.weight

    model = Tied()
    ema = ModelEMA(model, decay=0.5)
    assert sorted(ema.average) == ["a.bias", "a.weight", "b.bias"]
    with torch.no_grad():
        model.a.weight.fill_(2.0)
    ema.update()
    exported = ema.state_dict_for_export()
    assert exported["a.weight"] is exported["b.weight"]
    before = model.a.weight.detach().clone()
    with ema.swap_in():
        assert torch.equal(model.b.weight, ema.average["a.weight"])
    assert torch.equal(model.a.weight, before) and model.b.weight is model.a.weight


def _trainer(log, *, ema=None, seed=3, extra_hooks=(), **config):
    model = _bn_mlp()
    hooks = [*extra_hooks] + ([ema(model)] if ema is not None else [])
    return Trainer(
        model,
        _sgd(model),
        TrainerConfig(batch_size=8, seed=seed, log_interval=2, **config),
        env=ENV,
        logger=RunLogger(log, console=False),
        lr_schedule=lr_fn,
        train_step=train_step,
        eval_step=eval_step,
        hooks=hooks,
    )


def _numbers(records, kinds=("step", "epoch", "eval")):
    drop = {"samples_per_sec", "time_cost", "total_time"}
    return [{k: v for k, v in r.items() if k not in drop} for r in records if r["kind"] in kinds]


def test_evaluated_after_each_evaluation_and_equal_to_an_independent_evaluation(tmp_path):
    train, val = ToyDataset(48, noise=0.3), ToyDataset(20, seed=9)
    oracle: dict[str, AveragedModel] = {}

    class Oracle:  # PyTorch's EMA, updated after every optimizer step like ours
        def on_train_start(self, trainer):
            oracle["m"] = AveragedModel(
                trainer.model, multi_avg_fn=get_ema_multi_avg_fn(0.8), use_buffers=True
            )

        def on_step_end(self, trainer, step):
            oracle["m"].update_parameters(trainer.model)

    trainer = _trainer(
        tmp_path / "ema.jsonl",
        epochs=3,
        extra_hooks=[Oracle()],
        ema=lambda m: ModelEMA(m, decay=0.8, eval_dataset=val),
    )
    final = trainer.fit(train, eval_dataset=val)
    records = _records(tmp_path / "ema.jsonl")
    evals = [r for r in records if r["kind"] == "eval"]
    # each evaluation of the model is followed by the EMA's, at the same epoch and step
    assert [(r["epoch"], r["step"]) for r in evals] == [(e, 6 * (e + 1)) for e in range(3) for _ in "mm"]  # fmt: skip
    assert [sorted(r) for r in evals[1::2]] == [
        ["ema_loss", "ema_top1", "epoch", "kind", "step"]
    ] * 3
    assert sorted(evals[0]) == ["epoch", "kind", "loss", "step", "top1"]

    # the oracle: the AveragedModel's weights, evaluated by hand over the whole held-out set
    module = oracle["m"].module.eval()
    with torch.no_grad():
        logits = module(val.x)
    top1 = (logits.argmax(1) == val.y).double().mean().item()
    loss = F.cross_entropy(logits, val.y, reduction="sum").item() / len(val)
    last = evals[-1]
    assert last["ema_top1"] == top1
    assert last["ema_loss"] == pytest.approx(loss, rel=1e-6)
    assert last["ema_loss"] != evals[-2]["loss"]  # the EMA is another model than the last
    end = records[-1]
    assert end["kind"] == "end" and end["ema_top1"] == top1 and end["ema_loss"] == last["ema_loss"]
    assert final["ema_top1"] == top1 and final["top1"] == evals[-2]["top1"]

    # the EMA and its evaluations leave training alone: the same run without it
    plain = _trainer(tmp_path / "plain.jsonl", epochs=3)
    plain.fit(train, eval_dataset=val)
    assert _numbers(_records(tmp_path / "plain.jsonl")) == [
        r for r in _numbers(records) if not any(k.startswith("ema_") for k in r)
    ]
    for a, b in zip(plain.model.state_dict().values(), trainer.model.state_dict().values(), strict=True):  # fmt: skip
        assert torch.equal(a, b)


def test_resume_mid_run_continues_the_average_bit_for_bit(tmp_path):
    train, val = ToyDataset(48, noise=0.3), ToyDataset(20, seed=9)

    def run(log, **config):
        return _trainer(log, ema=lambda m: ModelEMA(m, decay=0.7, eval_dataset=val), **config)

    straight = run(tmp_path / "straight.jsonl", epochs=2)
    straight.fit(train, eval_dataset=val)
    first = run(tmp_path / "first.jsonl", epochs=2, max_steps=8)  # stops inside epoch 1
    first.fit(train, eval_dataset=val)
    first.save_checkpoint(tmp_path / "mid.pt")
    resumed = run(tmp_path / "resumed.jsonl", epochs=2)
    resumed.resume(tmp_path / "mid.pt")
    assert resumed.hooks[-1].updates == 8
    resumed.fit(train, eval_dataset=val)
    a, b = straight.hooks[-1], resumed.hooks[-1]
    assert a.updates == b.updates == 12
    for name in a.average:
        assert torch.equal(a.average[name], b.average[name]), name
    # the cut-short run ends by evaluating the model it has (and its EMA): records the
    # straight run does not have at step 8; the rest continues bit-for-bit
    cut = _numbers(_records(tmp_path / "first.jsonl"))
    stop_evals = [r for r in cut if r["kind"] == "eval" and r["step"] == 8]
    assert len(stop_evals) == 2 and "ema_top1" in stop_evals[1]
    joined = [r for r in cut if r not in stop_evals] + _numbers(
        _records(tmp_path / "resumed.jsonl")
    )
    assert joined == _numbers(_records(tmp_path / "straight.jsonl"))
    assert any("ema_top1" in r for r in joined)


def test_a_checkpoint_without_ema_starts_the_average_from_the_resumed_weights(tmp_path):
    train = ToyDataset(48)
    first = _trainer(None, epochs=1)
    first.fit(train)
    first.save_checkpoint(tmp_path / "plain.pt")
    resumed = _trainer(None, epochs=2, max_steps=7, ema=lambda m: ModelEMA(m, decay=0.9))
    resumed.resume(tmp_path / "plain.pt")  # step 6, no EMA state in it
    ema = resumed.hooks[-1]
    resumed.fit(train)
    assert ema.updates == 1  # one step after the resume: the average is that step's weights
    for name, tensor in resumed.model.state_dict().items():
        assert torch.equal(ema.average[name], tensor), name


def test_refuses_a_combiner_whose_replicas_drift_and_a_wrong_state():
    model = _bn_mlp()
    trainer = Trainer(
        model, _sgd(model), TrainerConfig(epochs=1, batch_size=8), env=ENV,
        logger=RunLogger(None, enabled=False), train_step=train_step,
        combiner=create_combiner("localsgd"), hooks=[ModelEMA(model)],
    )  # fmt: skip
    with pytest.raises(ValueError, match="--grad-combine localsgd keeps different replicas"):
        trainer.fit(ToyDataset(16))
    with pytest.raises(ValueError, match="not a ModelEMA state"):
        ModelEMA(model).load_state_dict({"best": 1})
    with pytest.raises(ValueError, match="does not fit this model"):
        ModelEMA(model).load_state_dict(ModelEMA(nn.Linear(2, 2)).state_dict())
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        EMAConfig(decay=1.0)


def test_flags_build_the_hook():
    from trainers.cli import ArgumentParser, add_ema_args, build_ema, ema_config, run_configs

    p = ArgumentParser()
    add_ema_args(p)
    assert build_ema(p.parse_args([]), nn.Linear(2, 2)) is None
    assert "ema" not in run_configs(p.parse_args([]))
    args = p.parse_args(["--model-ema", "--model-ema-decay", "0.99", "--model-ema-warmup"])
    assert ema_config(args) == EMAConfig(decay=0.99, warmup=True)
    hook = build_ema(args, nn.Linear(2, 2))
    assert isinstance(hook, ModelEMA) and (hook.decay, hook.config.warmup) == (0.99, True)
    assert run_configs(args)["ema"] == EMAConfig(decay=0.99, warmup=True)
    assert p.parse_args([]).model_ema_decay == 0.9998  # timm's default
    with pytest.raises(SystemExit):
        p.parse_args(["--model-ema-decay", "1.5"])


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_average_the_synchronized_weights_and_evaluate_rank_zeros(tmp_path):
    from tests.trainers._launch import run_ranks

    run_ranks("tests.trainers._ema_worker", [str(tmp_path)], timeout=180)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    for name, tensor in r0["oracle"].items():
        if tensor.is_floating_point():
            assert torch.equal(r0["ema"][name], tensor), name  # PyTorch's EMA, rank 0
        assert torch.equal(r1["ema"][name], r0["ema"][name]), name  # every rank evaluated it
    # DDP: the weights agree on both ranks, the BatchNorm statistics do not
    assert torch.equal(r0["oracle"]["0.weight"], r1["oracle"]["0.weight"])
    assert not torch.equal(r0["oracle"]["1.running_mean"], r1["oracle"]["1.running_mean"])
    # the logged EMA evaluation (each rank half of the held-out set) is rank 0's average's
    module = _bn_mlp()
    module.load_state_dict(r0["oracle"])
    val = ToyDataset(21, seed=9)
    with torch.no_grad():
        logits = module.eval()(val.x)
    last = [r for r in _records(tmp_path / "run.jsonl") if r["kind"] == "eval"][-1]
    assert last["ema_top1"] == (logits.argmax(1) == val.y).double().mean().item()
    loss = F.cross_entropy(logits, val.y, reduction="sum").item() / len(val)
    assert last["ema_loss"] == pytest.approx(loss, rel=1e-6)
    assert r0["final"] == {"ema_top1": last["ema_top1"], "ema_loss": last["ema_loss"]}
