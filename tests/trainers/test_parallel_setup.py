"""The model-parallel flags behind ``ParallelSetup`` (trainers/parallel_setup.py).

The meshes and pipelines themselves are checked across processes in test_tensor_parallel.py
and test_pipeline_parallel.py; here: what the flags resolve to, the checks that need no
process group, and that parsing flags does not import ``torch.distributed.pipelining``.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainers import DistEnv
from trainers.cli import ArgumentParser, add_distributed_args
from trainers.comm import combiner_class
from trainers.parallel_setup import (
    ParallelSetup,
    add_tensor_parallel_args,
    apply_model_parallel,
    parallel_config,
    tensor_parallel_mesh,
)

ROOT = Path(__file__).resolve().parents[2]


def _parser(**kwargs) -> ArgumentParser:
    parser = ArgumentParser(prog="t")
    parser.add_argument("--batch-size", type=int, default=8)
    add_distributed_args(parser)
    add_tensor_parallel_args(parser, **kwargs)
    return parser


def test_parsed_flags_become_a_frozen_setup():
    args = _parser().parse_args(["--tensor-parallel", "2", "--pipeline-parallel", "2",
                                 "--micro-batches", "4", "--pipeline-schedule", "gpipe",
                                 "--pipeline-boundaries", "0,3,5"])  # fmt: skip
    setup = parallel_config(args)
    assert setup == ParallelSetup(tensor_parallel=2, pipeline_parallel=2, micro_batches=4,
                                  schedule="gpipe", boundaries=(0, 3, 5))  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        setup.tensor_parallel = 4  # type: ignore[misc]
    # the defaults, and a script without the tensor-parallel flag (train_imagenet.py)
    assert parallel_config(_parser().parse_args([])) == ParallelSetup()
    assert parallel_config(_parser(tensor=False).parse_args([])) == ParallelSetup()
    assert parallel_config(argparse.Namespace()) == ParallelSetup()
    flags = argparse.Namespace(elastic_dir="/x", model_ema=True, grad_combine="adasum")
    assert parallel_config(flags) == ParallelSetup(elastic=True, model_ema=True,
                                                   grad_combine="adasum")  # fmt: skip


def test_a_degree_below_one_is_refused_naming_the_flag():
    with pytest.raises(SystemExit, match="--pipeline-parallel must be >= 1, got 0"):
        parallel_config(argparse.Namespace(pipeline_parallel=0))


def test_one_process_per_model_changes_nothing():
    model, env = torch.nn.Linear(2, 2), DistEnv()
    for setup in (ParallelSetup(), parallel_config(_parser().parse_args([]))):
        assert apply_model_parallel(setup, env, model) == (model, env)
    assert apply_model_parallel(_parser().parse_args([]), env, model) == (model, env)


@pytest.mark.parametrize(
    ("setup", "world", "message"),
    [
        (ParallelSetup(pipeline_parallel=2, micro_batches=3), 2,
         "the batch size 8 does not split into --micro-batches 3"),
        (ParallelSetup(pipeline_parallel=2, elastic=True), 2, "--elastic-dir do not combine"),
        (ParallelSetup(tensor_parallel=2, pipeline_parallel=2), 2,
         "--tensor-parallel x --pipeline-parallel 4 needs a world size divisible by 4"),
        (ParallelSetup(pipeline_parallel=2), 2, "LinearModel has no pipeline inputs"),
    ],
)  # fmt: skip
def test_splits_that_cannot_run_are_clear_errors(setup, world, message):
    class LinearModel(torch.nn.Linear):
        pass

    with pytest.raises(SystemExit, match=message):
        apply_model_parallel(setup, DistEnv(rank=0, world_size=world), LinearModel(2, 2),
                             batch_size=8)  # fmt: skip


def test_the_combiner_class_says_whether_it_runs_on_a_split_model(monkeypatch):
    env = DistEnv(rank=0, world_size=2)
    with pytest.raises(SystemExit, match=r"runs with --grad-combine average \(got 'ef'\)"):
        tensor_parallel_mesh(ParallelSetup(tensor_parallel=2, grad_combine="ef"), env)
    monkeypatch.setattr(combiner_class("adasum"), "supports_tensor_parallel", True)
    with pytest.raises(SystemExit, match=r"--grad-combine average / adasum \(got 'ef'\)"):
        tensor_parallel_mesh(ParallelSetup(tensor_parallel=2, grad_combine="ef"), env)


def test_the_cli_names_are_these():
    from trainers import cli, parallel_setup

    for name in parallel_setup.__all__:
        assert getattr(cli, name) is getattr(parallel_setup, name), name


def test_parsing_the_flags_imports_no_pipelining():
    """``--help`` and every script's start stay quick: trainers.parallel (DTensor, pipelining)
    is imported only by a run that splits its model."""
    code = ("import sys, trainers.cli; assert 'trainers.parallel' not in sys.modules; "
            "assert 'torch.distributed.pipelining' not in sys.modules")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
