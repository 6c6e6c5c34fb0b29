"""One flag vocabulary for every training script (docs/flags.md).

Oracles: the training commands GluonCV and GluonNLP publish with their model zoos (quoted
below as written there), and the argparse behaviour the scripts must not have (prefix
matching).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from ._scripts import captured_parser

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("train_imagenet", "finetune_squad", "pretrain_bert", "train_gnn", "prepare_bert_data")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_flags_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _parser(name: str):
    """The script's parser, captured as its parse_args starts parsing."""
    return captured_parser(_script(name))


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_flag_is_dashed(name):
    parser = _parser(name)
    flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    assert flags
    assert [f for f in flags if "_" in f] == []


@pytest.mark.parametrize("name", SCRIPTS)
def test_no_abbreviations(name):
    parser = _parser(name)
    assert parser.allow_abbrev is False


def test_underscore_spellings_are_the_dashed_flags():
    squad = _script("finetune_squad")
    a = squad.parse_args(["--max_seq_length", "200", "--doc_stride=64", "--lr", "1e-4"])
    b = squad.parse_args(["--max-seq-length", "200", "--doc-stride=64", "--lr", "1e-4"])
    assert (a.max_seq_length, a.doc_stride) == (b.max_seq_length, b.doc_stride) == (200, 64)


def test_mode_hybrid_is_not_a_model_and_prints_a_note(capsys):
    args = _script("train_imagenet").parse_args(["--mode", "hybrid"])
    assert args.model == "resnest14"  # the digits default, untouched
    assert "--mode is an MXNet option" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _script("train_imagenet").parse_args(["--mod", "resnest50"])  # no prefix matching


# GluonCV's model zoo, classification/imagenet: ResNet50_v1b (as published).
GLUONCV_RESNET50_V1B = (
    "--rec-train /media/ramdisk/rec/train.rec --rec-train-idx /media/ramdisk/rec/train.idx "
    "--rec-val /media/ramdisk/rec/val.rec --rec-val-idx /media/ramdisk/rec/val.idx "
    "--model resnet50_v1b --mode hybrid --lr 0.4 --lr-mode cosine --num-epochs 120 "
    "--batch-size 128 --num-gpus 8 -j 60 --warmup-epochs 5 --dtype float16 --use-rec "
    "--last-gamma --no-wd --label-smoothing"
)
# GluonCV's classification README (ResNet50_v2).
GLUONCV_RESNET50_V2 = (
    "--batch-size 64 --num-gpus 4 -j 32 --mode hybrid --num-epochs 120 --lr 0.1 --momentum 0.9 "
    "--wd 0.0001 --lr-decay 0.1 --lr-decay-epoch 30,60,90 --model resnet50_v2"
)


@pytest.mark.parametrize("command", [GLUONCV_RESNET50_V1B, GLUONCV_RESNET50_V2])
def test_gluoncv_imagenet_commands_parse_as_written(command, capsys):
    args = _script("train_imagenet").parse_args(command.split())
    notes = capsys.readouterr().err
    assert "--num-gpus is an MXNet option" in notes and "torchrun --nproc-per-node" in notes
    if "--label-smoothing" in command:
        assert args.label_smoothing == pytest.approx(0.1)  # GluonCV's switch: eta 0.1
        assert args.use_rec and args.dtype == "float16" and args.last_gamma and args.no_wd
        assert (args.batch_size, args.num_workers, args.num_epochs) == (128, 60, 120)
    else:
        assert args.lr_decay_epoch == "30,60,90" and args.lr_mode == "cosine"
    assert args.lr in (0.4, 0.1)


def test_label_smoothing_takes_a_value_too():
    args = _script("train_imagenet").parse_args(["--label-smoothing", "0.2"])
    assert args.label_smoothing == pytest.approx(0.2)


# GluonNLP's BERT SQuAD fine-tuning commands (scripts/bert, "BERT for SQuAD"), as published.
GLUONNLP_SQUAD = [
    "--train_file ./squad1.1/train-v1.1.json --predict_file ./squad1.1/dev-v1.1.json "
    "--optimizer adam --gpu",
    "--train_file ./squad1.1/train-v1.1.json --predict_file ./squad1.1/dev-v1.1.json "
    "--optimizer bertadam --accumulate 2 --batch_size 6 --gpu",
]


@pytest.mark.parametrize("command", GLUONNLP_SQUAD)
def test_gluonnlp_squad_commands_parse_as_written(command, capsys):
    args = _script("finetune_squad").parse_args(command.split())
    assert "--gpu is an MXNet option" in capsys.readouterr().err
    assert args.train_file == "./squad1.1/train-v1.1.json"
    assert args.predict_file == "./squad1.1/dev-v1.1.json"
    assert args.optimizer in ("adam", "bertadam")
    if args.optimizer == "bertadam":
        assert (args.accumulate, args.batch_size) == (2, 6)
    from trainers.optim import list_optimizers

    assert args.optimizer in list_optimizers()


def test_gluonnlp_bert_dataset_is_accepted_with_a_note(capsys):
    squad = _script("finetune_squad")
    squad.parse_args(["--bert_dataset", "book_corpus_wiki_en_uncased", "--gpu", "0"])
    err = capsys.readouterr().err
    assert "--bert-dataset is an MXNet option" in err and "--gpu is an MXNet option" in err


def test_one_meaning_per_name():
    """--eval-interval counts epochs; pretraining (no epochs) names its steps flag apart."""
    gnn = _script("train_gnn").parse_args(["--eval-interval", "3"])
    assert gnn.eval_interval == 3
    pre = _script("pretrain_bert")
    assert pre.parse_args(["--eval-interval-steps", "16"]).eval_interval_steps == 16
    with pytest.raises(SystemExit):
        pre.parse_args(["--eval_interval", "16"])
    # --resume: a path, or alone the latest checkpoint of the run's directory.
    img = _script("train_imagenet")
    assert img.parse_args(["--resume", "x.pt"]).resume == "x.pt"
    assert img.parse_args(["--resume"]).resume == "auto"
    assert pre.parse_args(["--resume"]).resume == "auto"
    with pytest.raises(SystemExit):
        pre.parse_args(["--resume", "x.pt"])


def test_the_flags_table_names_every_shared_flag():
    text = (ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    table = set(re.findall(r"`(--[a-z0-9-]+)", text))
    shared: dict[str, int] = {}
    for name in ("train_imagenet", "finetune_squad", "pretrain_bert", "train_gnn"):
        parser = _parser(name)
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and action.help != "==SUPPRESS==":
                    shared[flag] = shared.get(flag, 0) + 1
    from trainers.cli import combiner_flags

    documented_elsewhere = set(combiner_flags()) | {"--grad-combine", "--help"}
    documented_elsewhere |= {"--no-" + f[2:] for f in combiner_flags()}  # bool: --x / --no-x
    from trainers.optim import option_fields  # generated in docs/optimizers.md

    documented_elsewhere |= {flag for field in option_fields() for flag in field.flags}
    missing = sorted(
        f for f, n in shared.items() if n > 1 and f not in table and f not in documented_elsewhere
    )
    assert missing == [], f"docs/flags.md lacks {missing}"


def test_pretraining_phases_get_their_own_elastic_directory(tmp_path):
    pre = _script("pretrain_bert")
    args = pre.parse_args(["--elastic-dir", str(tmp_path / "job"), "--grad-combine", "adasum"])
    first, second = pre._phase_elastic(args, 1), pre._phase_elastic(args, 2)
    assert (first.dir, second.dir) == (str(tmp_path / "job" / "phase1"), str(tmp_path / "job" / "phase2"))  # fmt: skip
    assert first.lr_scaling == "none"  # auto with Adasum: no scaling
    assert pre._phase_elastic(pre.parse_args([]), 1) is None
