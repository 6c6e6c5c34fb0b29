"""The library halves of the training scripts, called without the scripts.

What ``train_imagenet.py``, ``finetune_squad.py``, ``train_linear.py`` and
``scaling_whatif.py`` hand to :mod:`modelzoo.vision.recipe`, :mod:`modelzoo.nlp.squad_recipe`,
:mod:`trainers.linear.recipes` and :mod:`trainers.comm.whatif_log`: each raises its own error
with the script's message (the scripts' own tests check that they print it and exit 2), and
the configs' defaults are the recipes' default tables.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from modelzoo.linear import DEFAULT_LOSS, loss_fits
from modelzoo.nlp.squad_recipe import (
    BUILTIN_DEFAULTS,
    SQUAD_DEFAULTS,
    SquadOptionError,
    SquadRecipe,
    resolve_squad_dataset,
    squad_defaults,
    untrained_f1_level,
)
from modelzoo.vision.recipe import (
    DIGITS_DEFAULTS,
    IMAGENET_DEFAULTS,
    ImageRecipe,
    RecipeOptionError,
    recipe_defaults,
    resume_path,
)
from trainers.comm.whatif_log import WhatIfLogError, read_workload
from trainers.linear.recipes import (
    LinearOptionError,
    elastic_identity,
    header_options,
    resolve_row_parallel,
)
from trainers.linear.rowparallel import DEFAULT_ROUND_BATCHES


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def test_the_configs_defaults_are_the_recipes_tables():
    image = _defaults(ImageRecipe)
    assert {k: v for k, v in IMAGENET_DEFAULTS.items() if k in image} == {
        k: image[k] for k in IMAGENET_DEFAULTS if k in image
    }
    squad = _defaults(SquadRecipe)
    assert {k: v for k, v in SQUAD_DEFAULTS.items() if k in squad} == {
        k: squad[k] for k in SQUAD_DEFAULTS if k in squad
    }
    # from_options keeps the recipe's fields and drops the rest (a script's other flags)
    recipe = ImageRecipe.from_options({"model": "resnest14", "lr": 0.1, "dataset": "digits"})
    assert (recipe.model, recipe.dataset) == ("resnest14", "digits")


def test_image_recipe_defaults_and_the_shortened_warmup():
    given = {key: None for key in DIGITS_DEFAULTS}
    dataset, values, note = recipe_defaults({**given, "data_dir": None, "const_epochs": 0})
    assert (dataset, values, note) == ("digits", DIGITS_DEFAULTS, None)
    dataset, values, note = recipe_defaults({**given, "num_epochs": 1, "const_epochs": 0})
    assert values["warmup_epochs"] == 0.5 and "warming up for 0.5 epochs" in note
    dataset, values, _ = recipe_defaults({**given, "use_rec": True, "warmup_epochs": 3})
    assert dataset == "recordio" and "warmup_epochs" not in values
    assert values["input_size"] == IMAGENET_DEFAULTS["input_size"]


def test_image_recipe_refuses_with_the_flags_names(tmp_path):
    with pytest.raises(RecipeOptionError, match="--rgb-std 1,0,1: a standard deviation of 0"):
        ImageRecipe(rgb_std="1,0,1").check_options()
    with pytest.raises(RecipeOptionError, match="--mixup does not run with --pipeline-parallel"):
        ImageRecipe(pipeline_parallel=2, mixup=True).check_options()
    with pytest.raises(RecipeOptionError, match="has no train/ folder"):
        ImageRecipe(dataset="folder", data_dir=tmp_path, model="resnest14").check_inputs()
    with pytest.raises(RecipeOptionError, match="is not an image classifier"):
        ImageRecipe(dataset="digits", model="bert_12_768_12").check_inputs()
    with pytest.raises(RecipeOptionError, match="pass --save-dir"):
        resume_path("auto", None)
    assert resume_path("auto", tmp_path) == tmp_path / "latest.pt"


def test_squad_dataset_defaults_and_checks(tmp_path):
    assert resolve_squad_dataset(None) == ("stdlib", "no data flags", False)
    assert resolve_squad_dataset(None, version_2=True) == ("squad2.0", "--version-2", True)
    assert resolve_squad_dataset(None, gluonnlp_flag="--gpu")[0] == "squad1.1"
    assert resolve_squad_dataset(None, train_file="t.json")[:2] == (
        "files",
        "--train-file/--predict-file",
    )
    with pytest.raises(SquadOptionError, match="contradict"):
        resolve_squad_dataset("squad1.1", version_2=True)
    values, note = squad_defaults("squad1.1", {"bert_model": None, "lr": 1e-3})
    assert values["bert_model"] == SQUAD_DEFAULTS["bert_model"] and "lr" not in values
    assert (
        note.startswith("note: --bert-model bert_12_768_12")
        and BUILTIN_DEFAULTS["bert_model"] in note
    )
    assert squad_defaults("stdlib", {"bert_model": None})[1] is None
    with pytest.raises(SquadOptionError, match=r"must be greater than --max-query-length"):
        SquadRecipe(max_seq_length=10, max_query_length=8).check_options()
    with pytest.raises(SquadOptionError, match="split by --tensor-parallel"):
        SquadRecipe(unpad=True).check_options(tensor_parallel=2)
    with pytest.raises(SquadOptionError, match="is not a BERT"):
        SquadRecipe(bert_model="resnest14").check_inputs()
    assert untrained_f1_level([{"kind": "eval", "step": 0, "f1": 7.5}])["value"] == 7.5
    with pytest.raises(SquadOptionError, match="--eval-at-start"):
        untrained_f1_level([{"kind": "header"}])


def test_linear_options_losses_and_header():
    assert resolve_row_parallel(None, solver="lbfgs") == (None, None)
    assert resolve_row_parallel("symsgd", solver="sgd") == (DEFAULT_ROUND_BATCHES["symsgd"], 16)
    assert resolve_row_parallel("allreduce", solver="sgd") == (1, None)
    with pytest.raises(LinearOptionError, match="--round-batches is a --grad-combine option"):
        resolve_row_parallel(None, solver="sgd", round_batches=2)
    with pytest.raises(LinearOptionError, match="needs a loss with one margin per example"):
        resolve_row_parallel("symsgd", solver="sgd", loss="multinomial")
    assert all(loss_fits(DEFAULT_LOSS[task], task) for task in DEFAULT_LOSS)
    assert not loss_fits("logistic", "regression") and not loss_fits("multinomial", "binary")
    options = {"elastic_dir": None, "elastic_checkpoint_steps": 5, "grad_combine": None,
               "round_batches": None, "wd": 0.1}  # fmt: skip
    assert header_options(options) == {"wd": 0.1}

    class Split:
        X_train = type("X", (), {"shape": (10, 3)})()
        num_classes = 2

    flags = {name: 0 for name in ("solver", "dataset", "data_file", "n_features", "zero_based",
             "test_fraction", "synthetic_samples", "synthetic_features", "nnz_per_row",
             "synthetic_task", "synthetic_columns", "data_seed", "wd", "lr", "precision",
             "batch_size", "seed", "num_epochs")}  # fmt: skip
    identity = elastic_identity({**flags, "solver": "sgd"}, Split(), "logistic")
    assert identity["train_rows"] == 10 and "num_epochs" not in identity


def test_whatif_log_errors_name_the_log(tmp_path):
    path = tmp_path / "run.jsonl"
    header = {"kind": "header", "command": ["scripts/train_imagenet.py"], "seed": 0,
              "world_size": 1, "config": {"batch_size": 8}}  # fmt: skip
    step = {"kind": "step", "step": 1, "samples_per_sec": 8.0}
    path.write_text(json.dumps(header) + "\n" + json.dumps(step) + "\n")

    def unnamed(name, config, script):
        assert (name, script) == (None, "train_imagenet.py")
        raise LookupError("names no model; pass --grad-bytes")

    with pytest.raises(WhatIfLogError, match=r"run\.jsonl names no model; pass --grad-bytes"):
        read_workload(path, model_grad_bytes=unnamed)
    assert read_workload(path, grad_bytes=4.0).compute_time == 1.0
    with pytest.raises(WhatIfLogError, match="no such run log"):
        read_workload(tmp_path / "missing.jsonl")
