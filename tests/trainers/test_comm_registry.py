"""The combiner registry, the options dataclasses and the flags generated from them."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing

import pytest
import torch

from tests.trainers._trainer_toys import ToyDataset, lr_fn, make_mlp, train_step
from trainers import DistEnv, RunLogger, Trainer, TrainerConfig, make_header
from trainers.cli import (
    _scalar,
    add_distributed_args,
    add_optimizer_args,
    add_schedule_args,
    build_combiner,
    combiner_config,
    combiner_flags,
    run_configs,
)
from trainers.comm import (
    GradCombiner,
    base,
    combiner_class,
    create_combiner,
    list_combiners,
    option,
    register_combiner,
)
from trainers.config import CombinerConfig

# The published modes; a new one is added by registering a class (the list here is the
# reference the registry is checked against, so a mode cannot disappear unnoticed).
MODES = {
    "average", "adasum", "ef", "cser", "cser-pl", "cser-update", "powersgd", "fp16", "bf16",
    "localsgd", "slowmo", "local-adaalter",
}  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_optimizer_args(parser)
    add_schedule_args(parser)
    add_distributed_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def test_every_published_mode_is_registered():
    assert set(list_combiners()) >= MODES
    assert list_combiners()[0] == "average"


@pytest.mark.parametrize("mode", list_combiners())
def test_options_are_frozen_dataclasses_that_own_their_defaults(mode):
    cls = combiner_class(mode)
    assert cls.name == mode and cls.summary
    opts = cls.Options()
    assert dataclasses.is_dataclass(opts) and cls.Options.__dataclass_params__.frozen
    for f in dataclasses.fields(opts):
        assert f.metadata.get("help"), f"{mode}.{f.name} has no help text"
    # The CLI with no flags gives exactly the dataclass defaults.
    args = _parser().parse_args(["--grad-combine", mode, "--lr", "0.1"])
    assert combiner_config(args) == CombinerConfig(mode, cls.Options())
    combiner = build_combiner(args)
    assert type(combiner) is cls and combiner.options == cls.Options()


@pytest.mark.parametrize("mode", list_combiners())
def test_every_option_has_a_flag_that_sets_it(mode):
    cls = combiner_class(mode)
    flags = {f.name: flag for flag, entry in combiner_flags().items() for m, f in entry.takers if m == mode}  # fmt: skip
    hints = typing.get_type_hints(cls.Options)
    for f in dataclasses.fields(cls.Options):
        flag = flags[f.name]
        kind = _scalar(hints[f.name])
        entry = combiner_flags()[flag]
        if entry.choices:
            argv, want = [flag, entry.choices[-1]], entry.choices[-1]
        elif kind is bool:
            argv, want = [flag], True
        elif kind is float:
            argv, want = [flag, "0.25"], 0.25
        else:
            argv, want = [flag, "3"], 3
        if f.name in ("levels", "bucket_size"):  # options of the qsgd compressor
            argv += ["--compressor", "qsgd"]
        if flag == "--importance-eps":  # an option of the importance compressor
            argv += ["--compressor", "importance"]
        args = _parser().parse_args(["--grad-combine", mode, "--lr", "0.1", *argv])
        got = getattr(combiner_config(args).options, f.name)
        assert got == want, (mode, flag)


def test_a_flag_shared_by_modes_keeps_each_modes_default():
    entry = combiner_flags()["--local-steps"]
    assert {m: f.default for m, f in entry.takers} == {
        "localsgd": 8, "slowmo": 3, "local-adaalter": 8,
    }  # fmt: skip
    args = _parser().parse_args(["--grad-combine", "slowmo", "--lr", "0.1"])
    assert combiner_config(args).options.period == 3


def test_option_errors_name_the_option_and_the_cli_adds_the_flag():
    with pytest.raises(ValueError, match="^period must be >= 1"):
        combiner_class("localsgd").Options(period=0)
    args = _parser().parse_args(["--grad-combine", "localsgd", "--local-steps", "0", "--lr", "1"])
    with pytest.raises(ValueError, match="period must be >= 1.*--local-steps sets period"):
        combiner_config(args)


def test_registry_rejects_duplicates_and_bad_options_and_suggests_names():
    with pytest.raises(ValueError, match="already registered"):
        register_combiner("ef")(type("Again", (GradCombiner,), {}))
    with pytest.raises(TypeError, match="frozen dataclass"):

        @dataclasses.dataclass
        class Mutable:
            x: int = 1

        register_combiner("mutable-options", Mutable)
    with pytest.raises(ValueError, match="did you mean localsgd"):
        combiner_class("localsdg")
    with pytest.raises(ValueError, match="unknown combiner"):
        CombinerConfig("nonsense")
    with pytest.raises(TypeError, match="takes LocalSGDOptions"):
        CombinerConfig("localsgd", combiner_class("slowmo").Options())


@dataclasses.dataclass(frozen=True)
class _HalfOptions:
    scale: float = option(0.5, "factor applied to every gradient", flag="--half-scale")


@pytest.fixture
def half_mode():
    """A mode defined in this test file only: one class, registered, then removed."""

    @register_combiner("test-half", _HalfOptions)
    class HalfCombiner(GradCombiner):
        summary = "gradients scaled by a factor (a test mode)"

        def reduce_gradients(self, scaler):
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.options.scale)

    yield HalfCombiner
    del base._COMBINERS["test-half"]


def test_a_new_mode_is_one_class(half_mode):
    """Registering the class is all it takes: --grad-combine, its flag, the Trainer."""
    parser = _parser()
    args = parser.parse_args(["--grad-combine", "test-half", "--half-scale", "0.0", "--lr", "1"])
    combiner = build_combiner(args)
    assert isinstance(combiner, half_mode) and combiner.options.scale == 0.0
    with pytest.raises(ValueError, match="--half-scale only applies with --grad-combine test-half"):
        combiner_config(parser.parse_args(["--half-scale", "0.1", "--lr", "1"]))
    # Scale 0: the optimizer (no momentum, no weight decay) never moves the weights.
    model = make_mlp(seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TrainerConfig(epochs=1, batch_size=8, log_interval=0),
        env=DistEnv(),
        logger=RunLogger(None, enabled=False),
        train_step=train_step,
        combiner=combiner,
    )
    trainer.fit(ToyDataset(32))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# Further option sets resumed like the registered modes: (mode, options, optimizer momentum).
RESUME_VARIANTS = {
    # momentum before compression keeps m and the last lr (a changing schedule: lr_fn)
    "ef-momentum": ("ef", {"compressor": "randblock", "ratio": 0.25, "momentum": 0.9}, 0.0),
}


@pytest.mark.parametrize("mode", [*list_combiners(), *RESUME_VARIANTS])
def test_resume_on_one_rank_is_bit_exact_for_every_mode(mode, tmp_path):
    """Train 2 epochs straight, or 1 + save + resume in a new process state + 1: the same."""
    options: dict = {}
    optimizer = "sgd" if mode == "local-adaalter" else "nag"
    momentum = 0.0 if mode == "local-adaalter" else 0.9
    if mode in RESUME_VARIANTS:
        mode, options, momentum = RESUME_VARIANTS[mode]
        optimizer = "sgd"

    def run(epochs: int, resume: str | None = None) -> Trainer:
        model = make_mlp(seed=0)
        opt = torch.optim.SGD(
            model.parameters(), lr=0.05, momentum=momentum, nesterov=optimizer == "nag"
        )
        trainer = Trainer(
            model,
            opt,
            TrainerConfig(epochs=epochs, batch_size=8, seed=3, log_interval=0, save_dir=None),
            env=DistEnv(),
            logger=RunLogger(None, enabled=False),
            lr_schedule=lr_fn,
            train_step=train_step,
            combiner=create_combiner(mode, seed=3, **options),
        )
        if resume:
            trainer.resume(resume)
        trainer.fit(ToyDataset(40, noise=0.1))
        return trainer

    straight = run(2)
    first = run(1)
    path = tmp_path / "one.pt"
    first.save_checkpoint(path)
    resumed = run(2, resume=str(path))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), mode


def test_headers_record_the_typed_configs():
    args = _parser().parse_args(
        ["--grad-combine", "cser-update", "--cser-period", "4", "--lr", "0.1", "--optimizer", "lamb",
         "--max-grad-norm", "0"]
    )  # fmt: skip
    header = make_header(["scripts/x.py"], 0, 1, args, configs=run_configs(args))
    configs = json.loads(json.dumps(header["configs"]))
    assert configs["combiner"]["mode"] == "cser-update"
    assert configs["combiner"]["options"]["period"] == 4
    assert configs["combiner"]["options"]["compressor"] == "topk"
    assert configs["optimizer"]["name"] == "lamb"
    assert configs["optimizer"]["options"] == {"max_grad_norm": None}
    assert configs["schedule"]["mode"] == "cosine"
