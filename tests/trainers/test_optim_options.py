"""The optimizer options as dataclass fields (trainers/optim/options.py) and the flags made from
them (trainers.cli.add_optimizer_args / optimizer_config).

Oracles: the ``configs.optimizer`` that published run logs recorded for their commands (their
headers, logs/<recipe>/seed0.jsonl), and, for the option flags no published command uses, the
flags, configs and error messages of the hand-written flags these fields replaced
(trainers/cli.py at commit 5a42fa6, quoted below as that code produced them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.scripts._scripts import load_script
from trainers.cli import ArgumentParser, add_optimizer_args, optimizer_config
from trainers.config import OptimizerConfig, configs_record
from trainers.optim import list_optimizers, optimizer_accepts, option_fields

ROOT = Path(__file__).resolve().parents[2]

# Published logs whose commands choose lamb, lans, adamw, nag, sgd and adam, from the four
# training scripts.
PUBLISHED = (
    "bert_pretrain_small_lamb_b256_lr0.0025",
    "bert_pretrain_lans_b256",
    "digits_lans_b128",
    "squad_minilm_tp2",
    "bert_pretrain_small_adamw_b32",
    "digits_resnest14_adasum_2proc",
    "digits_resnest14_8proc_step",
    "karate_gcn",
)
_SCRIPTS: dict[str, object] = {}


def _header(recipe: str) -> dict:
    with open(ROOT / "logs" / recipe / "seed0.jsonl", encoding="utf-8") as f:
        return json.loads(f.readline())


def _parse_published(command: list[str]) -> argparse.Namespace:
    name = Path(command[0]).stem
    if name not in _SCRIPTS:
        _SCRIPTS[name] = load_script(name, tag="optim_options")
    return _SCRIPTS[name].parse_args(command[1:])


def _recorded(record: dict) -> OptimizerConfig:
    return OptimizerConfig(**{**record, "betas": tuple(record["betas"])})


@pytest.mark.parametrize("recipe", PUBLISHED)
def test_published_commands_resolve_to_their_recorded_optimizer_config(recipe):
    header = _header(recipe)
    recorded = header["configs"]["optimizer"]
    config = optimizer_config(_parse_published(header["command"]))
    assert config == _recorded(recorded)
    # and the run log would record it the same way, key for key
    assert json.loads(json.dumps(configs_record(optimizer=config)))["optimizer"] == recorded


def test_option_flags_added_to_a_published_command_change_only_the_options():
    header = _header("digits_lans_b128")
    command = [*header["command"], "--no-adapt-no-wd", "--max-grad-norm", "0",
               "--trust-clamp", ",1", "--optimizer-variant", "mxnet"]  # fmt: skip
    config = optimizer_config(_parse_published(command))
    want = {"max_grad_norm": None, "trust_clamp": (None, 1.0), "adapt_no_wd": False,
            "variant": "mxnet"}  # fmt: skip
    assert config == OptimizerConfig(**{**_recorded(header["configs"]["optimizer"]).__dict__,
                                        "options": want})  # fmt: skip


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="t")
    add_optimizer_args(parser)
    return parser


def _parse(command: str, parser: ArgumentParser | None = None) -> argparse.Namespace:
    return (parser or _parser()).parse_args(command.split())


# What the hand-written flags gave (trainers/cli.py at 5a42fa6), ``--lr 0.5`` added to each.
OPTIONS = [
    ("--optimizer lamb", {}),
    ("--optimizer lamb --max-grad-norm 0", {"max_grad_norm": None}),
    ("--optimizer lamb --max-grad-norm 2.5", {"max_grad_norm": 2.5}),
    ("--optimizer lans --max-grad-norm -1", {"max_grad_norm": None}),
    ("--optimizer lamb --trust-clamp 0.01,10 --weight-norm-clamp ,1",
     {"trust_clamp": (0.01, 10.0), "weight_norm_clamp": (None, 1.0)}),
    ("--optimizer lans --no-bias-correction", {"bias_correction": False}),
    ("--optimizer lamb --always-adapt --use-nvlamb", {"always_adapt": True, "use_nvlamb": True}),
    ("--optimizer lamb --adapt-no-wd", {"adapt_no_wd": True}),
    ("--optimizer lans --no-adapt-no-wd", {"adapt_no_wd": False}),
    ("--optimizer lamb --optimizer-variant deepspeed", {"variant": "deepspeed"}),
    ("--optimizer LANS --optimizer-variant mxnet-sequential", {"variant": "mxnet-sequential"}),
    ("--optimizer lamb --max-grad-norm 1 --trust-clamp 0,1 --weight-norm-clamp 0.1,10 "
     "--no-bias-correction --always-adapt --no-adapt-no-wd --use-nvlamb --optimizer-variant apex",
     {"max_grad_norm": 1.0, "trust_clamp": (0.0, 1.0), "weight_norm_clamp": (0.1, 10.0),
      "bias_correction": False, "always_adapt": True, "use_nvlamb": True, "adapt_no_wd": False,
      "variant": "apex"}),
]  # fmt: skip


@pytest.mark.parametrize(("command", "options"), OPTIONS)
def test_option_flags_give_the_options_the_hand_written_flags_gave(command, options):
    config = optimizer_config(_parse(f"{command} --lr 0.5"))
    assert config.options == options
    assert (config.lr, config.weight_decay, config.eps, config.no_wd) == (0.5, 1e-4, None, False)


def test_common_flags_are_unchanged():
    args = _parse(
        "--optimizer LANS --epsilon 1e-8 --beta1 0.8 --beta2 0.99 --wd 0.02 --no-wd "
        "--lr 0.1 --momentum 0.5"
    )
    assert optimizer_config(args) == OptimizerConfig(
        name="lans", lr=0.1, weight_decay=0.02, momentum=0.5, no_wd=True, betas=(0.8, 0.99),
        eps=1e-8, options={},
    )  # fmt: skip


_TAKE = "drop it or pick an optimizer that takes it"
REFUSED = [
    ("--optimizer adamw --max-grad-norm 1", f"--max-grad-norm is not an option of --optimizer adamw; {_TAKE} (lamb, lans)"),
    ("--optimizer adamw --max-grad-norm 0", f"--max-grad-norm is not an option of --optimizer adamw; {_TAKE} (lamb, lans)"),
    ("--optimizer sgd --trust-clamp 1,2", f"--trust-clamp is not an option of --optimizer sgd; {_TAKE} (lamb, lans)"),
    ("--optimizer nag --no-bias-correction", f"--no-bias-correction is not an option of --optimizer nag; {_TAKE} (lamb, lans)"),
    ("--optimizer lans --always-adapt", f"--always-adapt is not an option of --optimizer lans; {_TAKE} (lamb)"),
    ("--optimizer lans --use-nvlamb", f"--use-nvlamb is not an option of --optimizer lans; {_TAKE} (lamb)"),
    ("--optimizer adam --adapt-no-wd", f"--adapt-no-wd is not an option of --optimizer adam; {_TAKE} (lamb, lans)"),
    ("--optimizer adam --no-adapt-no-wd", f"--no-adapt-no-wd is not an option of --optimizer adam; {_TAKE} (lamb, lans)"),
    ("--optimizer bertadam --optimizer-variant apex", f"--optimizer-variant is not an option of --optimizer bertadam; {_TAKE} (lamb, lans)"),
    ("--optimizer adamw --use-nvlamb --always-adapt", f"--always-adapt is not an option of --optimizer adamw; {_TAKE} (lamb)"),
]  # fmt: skip


@pytest.mark.parametrize(("command", "message"), REFUSED)
def test_a_flag_the_optimizer_does_not_take_is_the_same_error(command, message):
    with pytest.raises(ValueError) as info:
        optimizer_config(_parse(f"{command} --lr 0.5"))
    assert str(info.value) == message


def test_the_checked_command_line_says_it_in_one_line(capsys):
    parser = _parser()
    args = _parse("--optimizer adam --no-adapt-no-wd --lr 0.5", parser)
    with pytest.raises(SystemExit) as info:
        parser.check(args)
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "t: error: --no-adapt-no-wd is not an option of --optimizer adam; drop it or pick an "
        "optimizer that takes it (lamb, lans)\nt: see --help for the flags\n"
    )


# The option flags as the hand-written code declared them: (flags, dest, default, metavar,
# nargs, const, help).
FLAGS = [
    (["--max-grad-norm"], "max_grad_norm", None, None, None, None, "lamb/lans: clip the global gradient norm inside the optimizer (default 1.0; 0 turns it off)"),
    (["--trust-clamp"], "trust_clamp", None, "LOW,HIGH", None, None, "lamb/lans: clamp the trust ratio (DeepSpeed: 0.01,10)"),
    (["--weight-norm-clamp"], "weight_norm_clamp", None, "LOW,HIGH", None, None, "lamb/lans: clamp ||w|| in the trust ratio (MXNet's lower_bound,upper_bound)"),
    (["--no-bias-correction"], "no_bias_correction", False, None, 0, True, "lamb/lans: no Adam bias correction"),
    (["--always-adapt"], "always_adapt", False, None, 0, True, "lamb: apply the trust ratio where the weight decay is 0 too"),
    (["--adapt-no-wd", "--no-adapt-no-wd"], "adapt_no_wd", None, None, 0, None, "lamb/lans: apply the trust ratio to the --no-wd parameters too (unset: the optimizer's default, lamb off, lans on; --no-adapt-no-wd turns it off for lans)"),
    (["--use-nvlamb"], "use_nvlamb", False, None, 0, True, "lamb: apex's use_nvlamb, the trust ratio on every tensor (= --always-adapt --adapt-no-wd)"),
    (["--optimizer-variant"], "optimizer_variant", None, "NAME", None, None, "lamb: apex (default) or deepspeed (DeepSpeed FusedLamb); lans: gluonnlp (default, the authors' FusedLANS), mxnet or mxnet-sequential"),
]  # fmt: skip


def test_the_option_flags_are_declared_as_before():
    parser = _parser()
    group = next(g for g in parser._action_groups if g.title == "optimizer")
    actions = group._group_actions[8:]  # after --optimizer ... --epsilon
    got = [(a.option_strings, a.dest, a.default, a.metavar, a.nargs, a.const, a.help)
           for a in actions]  # fmt: skip
    assert got == FLAGS
    assert [a.type for a in actions][0] is float  # ArgumentParser.check: finite floats
    assert isinstance(actions[5], argparse.BooleanOptionalAction)


def test_clamp_values_parse_and_refuse_as_before(capsys):
    parser = _parser()
    assert parser.parse_args(["--trust-clamp", "0.01,"]).trust_clamp == (0.01, None)
    with pytest.raises(SystemExit):
        parser.parse_args(["--trust-clamp", "1"])
    assert "expected LOW,HIGH (e.g. 0.01,10), got '1'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--weight-norm-clamp", "a,b"])
    assert "expected two numbers LOW,HIGH, got 'a,b'" in capsys.readouterr().err


def test_each_fields_optimizers_are_the_ones_whose_builder_takes_it():
    """The takers in the metadata and the optimizers' signatures (what ``create_optimizer``
    passes an option to) say the same."""
    for field in option_fields():
        assert set(field.takers) <= set(list_optimizers()), field.name
        for name in list_optimizers():
            assert optimizer_accepts(name, field.name) == (name in field.takers), (field, name)


def test_the_options_reach_the_optimizer():
    import torch

    from trainers.cli import build_optimizer

    args = _parse(
        "--optimizer lamb --lr 0.5 --max-grad-norm 0 --trust-clamp 0,2 --use-nvlamb "
        "--optimizer-variant deepspeed"
    )
    group = build_optimizer(args, torch.nn.Linear(2, 2)).param_groups[0]
    assert (group["max_grad_norm"], group["trust_clamp"], group["variant"]) == (
        None, (0.0, 2.0), "deepspeed",
    )  # fmt: skip
    assert group["always_adapt"] and group["adapt_no_wd"]  # use_nvlamb
