"""``TrainerConfig.compile`` / ``--compile``: when the trainer compiles, and that a compiled
run trains what the hand-written eager loop trains (to rounding: inductor fuses, so the last
bits move) with the module's own parameters and checkpoint keys. The toy model is a plain
``nn.Sequential``: the case ``nn.Module.compile`` (in place) would silently leave eager in
torch 2.13, since every frame of it is torch's own."""

from __future__ import annotations

import pytest
import torch

from tests.trainers._trainer_toys import ToyDataset, make_mlp, params, plain_loop
from tests.trainers.test_trainer import make_trainer
from trainers import TrainerConfig, load_checkpoint
from trainers.cli import add_run_args, trainer_config
from trainers.cli_parser import ArgumentParser
from trainers.errors import UsageError
from trainers.trainer import resolve_compile


@pytest.mark.parametrize(
    ("setting", "device", "split", "want"),
    [
        ("auto", "cpu", None, False),
        ("auto", "cuda", None, True),
        ("auto", "cuda:1", None, True),
        ("auto", "cuda", "tensor", False),
        ("auto", "cuda", "pipeline", False),
        ("on", "cpu", None, True),
        ("off", "cuda", None, False),
        ("off", "cuda", "pipeline", False),
    ],
)
def test_when_the_trainer_compiles(setting, device, split, want):
    got = resolve_compile(setting, device, tensor_parallel=split == "tensor",
                          pipeline=split == "pipeline")  # fmt: skip
    assert got is want


@pytest.mark.parametrize(("split", "flag"), [("tensor", "--tensor-parallel"),
                                             ("pipeline", "--pipeline-parallel")])  # fmt: skip
def test_compile_on_a_split_model_is_refused_naming_the_flags(split, flag):
    with pytest.raises(UsageError, match=f"--compile on with {flag}.*--compile off"):
        resolve_compile("on", "cpu", tensor_parallel=split == "tensor",
                        pipeline=split == "pipeline")  # fmt: skip


def test_an_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="compile must be one of auto, on, off, got 'yes'"):
        TrainerConfig(compile="yes")
    with pytest.raises(ValueError, match="got 'yes'"):
        resolve_compile("yes", "cpu")


def test_the_flag_reaches_the_config_and_its_default_is_the_scripts():
    for default, argv, want in [("auto", [], "auto"), ("off", [], "off"),
                                ("auto", ["--compile", "on"], "on")]:  # fmt: skip
        p = ArgumentParser(prog="x")
        add_run_args(p.add_argument_group("t"), p.add_argument_group("l"),
                     compile_default=default, log_interval=10)  # fmt: skip
        args = p.parse_args(argv)
        args.inject_straggler = None  # add_distributed_args' flag, not added here
        assert trainer_config(args).compile == want
    p = ArgumentParser(prog="x")
    add_run_args(p.add_argument_group("t"), p.add_argument_group("l"))
    with pytest.raises(SystemExit) as exc:
        p.parse_args(["--compile", "maybe"])
    assert exc.value.code == 2


def test_eager_on_cpu_by_default():
    trainer = make_trainer(make_mlp(), TrainerConfig(epochs=1, batch_size=8, log_interval=0))
    assert trainer.compiled is False
    assert trainer.forward_model is trainer.model


def test_a_compiled_run_trains_what_the_eager_loop_trains(tmp_path):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    data = ToyDataset(40)  # 5 steps of 8 per epoch, 2 epochs
    cfg = TrainerConfig(epochs=2, batch_size=8, seed=7, log_interval=0, compile="on",
                        save_dir=str(tmp_path))  # fmt: skip
    trainer = make_trainer(make_mlp(), cfg)
    assert trainer.compiled is True
    trainer.fit(data, data)
    # dynamo captured the model's forward (a trainer that did not compile captures nothing)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    reference = plain_loop(make_mlp(), data, batch=8, steps=10, seed=7)
    assert trainer.global_step == 10
    for got, want in zip(params(trainer.model), params(reference), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the bare module stays what train_step's compiled wrapper trains: its own keys (no
    # "_orig_mod." prefix), and the checkpoint loads into an eager model
    assert list(trainer.model.state_dict()) == list(make_mlp().state_dict())
    fresh = make_mlp(seed=1)
    state = load_checkpoint(tmp_path / "latest.pt")
    fresh.load_state_dict(state["model"])
    for got, want in zip(params(fresh), params(trainer.model), strict=True):
        assert torch.equal(got, want)
    torch._dynamo.reset()
