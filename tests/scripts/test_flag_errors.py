"""One error path for every script (docs/flags.md): a mistake in the command is one or two
lines naming a flag, exit status 2, no traceback and no run log; ``--help`` is short,
``--help-all`` complete, ``--print-config`` stops after the checks.

The property test draws flag values and combinations for each script's parser and checks
(``--print-config`` stops a run right after them) and asserts the run would start (exit 0)
or stops with exit status 2 and a message that names a flag -- never an exception.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

import modelzoo
from trainers.cli import run_main

from ._scripts import captured_parser, load_script

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SCRIPTS = ("train_imagenet", "finetune_squad", "pretrain_bert", "train_gnn", "train_linear",
           "prepare_bert_data")  # fmt: skip
MODULES = {name: load_script(name, "flag_errors") for name in SCRIPTS}


def _run(name: str, argv: list[str]) -> tuple[int, str, str]:
    """``run_main(main, argv)`` of a script: exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = run_main(MODULES[name].main, argv)
        except SystemExit as exc:  # argparse's own exits (usage errors)
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def _assert_one_error(code: int, err: str) -> str:
    """Exit status 2 and one or two lines (beside notes), the first naming a flag."""
    lines = [line for line in err.splitlines() if line and not line.startswith("note:")]
    assert code == 2, err
    assert "Traceback" not in err
    assert 1 <= len(lines) <= 2, err
    assert "error: " in lines[0] and re.search(r"--[a-z]", lines[0]), lines[0]
    return lines[0]


# ---- the property ---------------------------------------------------------------------------
# Numbers mostly in range, often at or past an edge, sometimes not numbers at all.
INTS = st.one_of(st.sampled_from(["1", "2", "3", "8"]), st.sampled_from(["0", "-1", "2.5", "1e9"]))
FLOATS = st.one_of(
    st.sampled_from(["0.5", "0.1", "1e-3", "0.9", "2"]),
    st.sampled_from(["0", "1", "-1", "-0.1", "1e9", "nan", "inf", "-inf"]),
)
GARBAGE = st.sampled_from(["abc", "", "1,2", "x1"])
SHARED = ("--lr", "--wd", "--momentum", "--beta1", "--beta2", "--epsilon", "--batch-size",
          "--max-steps", "--seed", "--log-interval", "--num-workers", "--accumulate",
          "--max-grad-norm", "--local-steps", "--dropout", "--skip-nonfinite",
          "--model-ema-decay", "--num-epochs", "--epochs", "--warmup-epochs", "--const-epochs",
          "--lr-decay", "--lr-decay-power", "--micro-batches", "--pipeline-parallel",
          "--tensor-parallel")  # fmt: skip
NUMERIC = {
    "train_imagenet": ("--label-smoothing", "--input-size", "--crop-ratio", "--mixup-alpha",
                       "--mixup-off-epoch", "--dropblock-prob", "--target-top1", "--hflip",
                       "--temperature", "--save-frequency"),
    "finetune_squad": ("--max-seq-length", "--doc-stride", "--max-query-length",
                       "--warmup-ratio", "--test-batch-size", "--n-best-size"),
    "pretrain_bert": ("--num-layers", "--hidden-size", "--num-heads", "--phase1-steps",
                      "--phase1-batch-size", "--phase1-lr", "--phase1-warmup-ratio",
                      "--const-ratio", "--decay-power", "--eval-batch-size",
                      "--max-position-embeddings", "--phase1-max-seq-length"),
    "train_gnn": ("--hidden", "--num-layers", "--heads", "--early-stop", "--eval-interval"),
    "train_linear": ("--history-size", "--iterations", "--test-fraction", "--s-steps",
                     "--sa-batches", "--sa-decay", "--latency-ms", "--round-batches"),
    "prepare_bert_data": ("--max-seq-length", "--max-predictions-per-seq", "--masked-lm-prob",
                          "--short-seq-prob", "--random-next-prob", "--dupe-factor",
                          "--window-docs", "--instances-per-shard", "--random-seed"),
}  # fmt: skip
CHOICES = {
    "train_imagenet": {
        "--model": ["resnest14", "resnest50", "resnet14", "gcn", "bert_12_768_12"],
        "--optimizer": ["nag", "lamb", "adamw", "lamb2"],
        "--grad-combine": ["average", "localsgd", "adasum", "avg"],
        "--lr-mode": ["cosine", "step", "poly", "warmup_const_poly", "cos"],
        "--lr-decay-epoch": ["30,60", "x", "10,", ""],
        "--rgb-std": ["1,1,1", "0,1,1", "1,2", "a,b,c"],
        "--dtype": ["float32", "bfloat16", "float64"],
        "--data-dir": ["/nonexistent/imagenet"],
    },
    "finetune_squad": {
        "--bert-model": ["minilm_l6_h384", "bert_12_768_12", "bert", "gcn"],
        "--optimizer": ["adamw", "lans", "bertadam", "adam_w"],
    },
    "pretrain_bert": {
        "--phases": ["1", "2", "1,2", "3", "x"],
        "--bert-model": ["bert_12_768_12", "resnest14", "bert_x"],
        "--lr-schedule": ["warmup_const_poly", "nvidia_poly_warmup", "cosine"],
    },
    "train_gnn": {
        "--model": ["gcn", "gat", "graphsage_mean", "gcm", "resnest14"],
        "--dataset": ["karate", "sbm", "sbm_graphs", "cora2", "npz"],
        "--fanouts": ["", "25,10", "0,3", "-1", "a,b"],
    },
    "train_linear": {
        "--solver": ["lbfgs", "sgd", "casgd", "newton"],
        "--grad-combine": ["allreduce", "average", "symsgd"],
        "--loss": ["logistic", "multinomial", "hinge", "l1"],
    },
    "prepare_bert_data": {"--bert-model": ["minilm_l6_h384", "minilm"]},
}
BASE = {"prepare_bert_data": ["--output-dir", "unused", "--stdlib-corpus", "unused"]}


def _parser(name: str):
    return captured_parser(MODULES[name])


def _values(name: str) -> dict[str, st.SearchStrategy[str]]:
    """Each drawn flag of a script and its values (numbers by the flag's type)."""
    actions = _parser(name)._option_string_actions
    out = {flag: st.sampled_from(values) for flag, values in CHOICES[name].items()}
    for flag in (*SHARED, *NUMERIC[name]):
        if flag in actions:
            numbers = INTS if actions[flag].type is int else FLOATS
            out[flag] = st.one_of(numbers, numbers, numbers, GARBAGE)
    return out


@st.composite
def command(draw: st.DrawFn, name: str, values: dict[str, st.SearchStrategy[str]]) -> list[str]:
    flags = draw(st.lists(st.sampled_from(sorted(values)), max_size=4, unique=True))
    argv = list(BASE.get(name, []))
    for flag in flags:
        argv += [flag, draw(values[flag])]
    return argv


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.usefixtures("isolated_home")
def test_drawn_flags_start_the_run_or_name_a_flag(name, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # nothing a run could write lands in the checkout

    @settings(max_examples=100, deadline=2000, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
    @given(argv=command(name, _values(name)))
    def check(argv: list[str]) -> None:
        code, out, err = _run(name, [*argv, "--print-config"])
        if code == 0:
            assert out.startswith("# ") and "(--print-config)" in out, out[:200]
            assert "Traceback" not in err
        else:
            _assert_one_error(code, err)

    # The first refusal of a --model of another modality builds every registered model once
    # on the meta device to learn the modalities (cached for the process): warm the cache so
    # that the deadline times the runs, not that one-time cost.
    for modality in ("image", "text", "graph", "tabular"):
        modelzoo.list_models(modality=modality)
    check()
    assert list(tmp_path.glob("*.jsonl")) == []


# ---- the examples of issue 42 ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--batch-size", "0"], "--batch-size 0: must be >= 1"),
        (["--lr", "-1"], "--lr -1: must be >= 0"),
        (["--num-epochs", "0"], "--num-epochs 0: must be >= 1"),
        (["--model", "resnet14"], "--model resnet14: Unknown model"),
        (["--data-dir", "missing"], "--data-dir missing does not exist"),
        (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
        (["--warmup-epochs", "3", "--num-epochs", "2"], "--warmup-epochs 3 is longer than"),
    ],
)
@pytest.mark.usefixtures("isolated_home")
def test_imagenet_mistakes_are_one_line_and_leave_no_log(argv, names, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = _run("train_imagenet", [*argv, "--save-dir", "out", "--no-progress"])
    assert names in _assert_one_error(code, err)
    assert "usage:" not in err and out == ""
    assert not (tmp_path / "out").exists()


def _images(root: Path, per_class: int) -> Path:
    from PIL import Image

    for c, cls in enumerate(("cat", "dog")):
        folder = root / "train" / cls
        folder.mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (36, 36), (40 * c, 10 * i, 0)).save(folder / f"{i}.png")
    return root


@pytest.mark.usefixtures("isolated_home")
def test_imagenet_batch_norm_and_too_few_images_stop_before_a_log(tmp_path):
    """--batch-size 1 with BatchNorm is refused by name; an error found after the run log was
    started (fewer images than one batch) removes that log."""
    data = _images(tmp_path / "data", per_class=3)
    base = ["--data-dir", str(data), "--model", "resnest14", "--input-size", "32", "-j", "0",
            "--no-progress"]  # fmt: skip
    code, _, err = _run("train_imagenet", [*base, "--batch-size", "1", "--save-dir",
                                           str(tmp_path / "a")])  # fmt: skip
    assert "--batch-size 1: resnest14 has BatchNorm layers" in _assert_one_error(code, err)
    code, _, err = _run("train_imagenet", [*base, "--batch-size", "8", "--save-dir",
                                           str(tmp_path / "b" / "c")])  # fmt: skip
    assert "fewer than one global batch" in err and code == 2
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.usefixtures("isolated_home")
def test_the_default_warmup_is_shortened_to_fit_and_says_so():
    code, out, err = _run("train_imagenet", ["--num-epochs", "1", "--print-config"])
    assert code == 0
    assert err.count("\n") == 1 and "default --warmup-epochs 2 does not fit --num-epochs 1" in err
    assert re.search(r"--warmup-epochs\s+0\.5\n", out)
    code, _, err = _run("train_imagenet", ["--num-epochs", "1", "--warmup-epochs", "2"])
    assert "--warmup-epochs 2 is longer than --num-epochs 1" in _assert_one_error(code, err)


def test_gnn_refuses_batch_size_0_even_full_graph():
    code, _, err = _run("train_gnn", ["--batch-size", "0"])
    assert "--batch-size 0" in _assert_one_error(code, err)


# ---- help and --print-config ----------------------------------------------------------------
@pytest.mark.parametrize("name", SCRIPTS)
def test_help_is_short_and_help_all_lists_every_flag(name):
    code, short, _ = _run(name, ["--help"])
    assert code == 0 and len(short.splitlines()) < 150, len(short.splitlines())
    assert "--help-all" in short
    assert "also: " in short or name == "prepare_bert_data"  # its few flags are all shown
    code, full, _ = _run(name, ["--help-all"])
    assert code == 0
    assert len(full.splitlines()) > len(short.splitlines()) or name == "prepare_bert_data"
    parser_flags = set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", full))
    assert parser_flags >= set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", short))
    assert "(default: None)" not in full


@pytest.mark.usefixtures("isolated_home")
def test_defaults_that_depend_on_other_flags_are_shown_and_resolved():
    _, text, _ = _run("finetune_squad", ["--help"])
    text = " ".join(text.split())
    assert "minilm_l6_h384 with the built-in set, bert_12_768_12 with SQuAD's files" in text
    code, out, err = _run("finetune_squad", ["--dataset", "squad1.1", "--print-config"])
    assert code == 0 and re.search(r"--bert-model\s+bert_12_768_12\n", out)
    assert "note: --bert-model bert_12_768_12, the default with SQuAD's files" in err
    code, out, _ = _run("finetune_squad", ["--print-config"])
    assert code == 0 and re.search(r"--bert-model\s+minilm_l6_h384\n", out)


@pytest.mark.usefixtures("isolated_home")
def test_no_namespace_dump_and_print_config_is_grouped(tmp_path):
    code, out, err = _run("train_imagenet", ["--print-config"])
    assert code == 0 and "Namespace(" not in out + err
    assert "\nmodel:\n" in out and re.search(r"--model\s+resnest14\n", out)
    assert not any(Path(tmp_path).iterdir())  # nothing written, not even the digits


def test_debug_shows_the_traceback_of_an_expected_error():
    code, _, err = _run("train_gnn", ["--model", "gcm", "--debug"])
    assert code == 2 and "Traceback" in err and "UsageError" in err
    assert ": error: --model gcm: Unknown model 'gcm'" in err.strip().splitlines()[-1]


@pytest.mark.parametrize("flag", ["--train-file", "--predict-file"])
def test_squad_missing_data_file_is_refused_before_any_work(flag, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing = str(tmp_path / "nope" / "train-v1.1.json")
    only = ["--only-predict", "--model-parameters", __file__] if flag == "--predict-file" else []
    code, _, err = _run("finetune_squad", [flag, missing, *only, "--run-log", "run.jsonl"])
    line = _assert_one_error(code, err)
    assert flag in line and missing in line
    assert not (tmp_path / "run.jsonl").exists()


def test_imagenet_refuses_a_model_that_is_no_image_classifier():
    """The choices it offers are every registered image classifier (its family's modality),
    the ResNeSts and the ResNet v1b/v1d alike."""
    code, _, err = _run("train_imagenet", ["--model", "gcn"])
    line = _assert_one_error(code, err)
    assert "--model gcn is not an image classifier; choose one of " in line
    offered = set(line.split("choose one of ", 1)[1].strip().split(", "))
    expected = {n for n in modelzoo.list_models() if n.startswith(("resnest", "resnet"))}
    assert offered == expected and "resnet50_v1d" in offered


@pytest.mark.parametrize(
    ("script", "flag", "modality", "what"),
    [
        ("finetune_squad", "--bert-model", "text", "is not a BERT"),
        ("pretrain_bert", "--bert-model", "text", "is not a BERT"),
        ("train_gnn", "--model", "graph", "is not a graph model"),
    ],
)
def test_a_model_of_another_modality_is_refused_with_the_right_choices(
    script, flag, modality, what
):
    code, _, err = _run(script, [flag, "resnest14"])
    line = _assert_one_error(code, err)
    assert f"{flag} resnest14 {what}; choose one of " in line
    offered = line.split("choose one of ", 1)[1]
    if modality == "text":  # every BERT of the zoo, MiniLM included
        assert all(n in offered for n in ("bert_12_768_12", "bert_24_1024_16", "minilm_l6_h384"))
    else:  # the graph families
        assert offered.strip() == "gat, gcn, gin, graphsage"
