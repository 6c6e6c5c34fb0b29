"""Every published run log in logs/ reproduces (a prefix) and states what it claims.

The oracle is the published log itself: ``scripts/reproduce.py`` reruns the command in its
header for the first logged steps and compares every shared number.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOGS = sorted((ROOT / "logs").glob("*.jsonl"))
# What each published run claims in docs/: (metric, minimum) of its last eval record.
CLAIMS = {
    "digits_resnest14.jsonl": ("top1", 0.95),
    "digits_resnest14_2proc.jsonl": ("top1", 0.93),
    "digits_resnest14_adasum_2proc.jsonl": ("top1", 0.94),
    "elastic_digits_resnest14.jsonl": ("top1", 0.94),
    "digits_nag_b16.jsonl": ("top1", 0.95),
    "digits_lamb_b128.jsonl": ("top1", 0.955),
    "digits_lans_b128.jsonl": ("top1", 0.955),
    "squad_minilm.jsonl": ("f1", 28.0),
    "squad_minilm_3ep.jsonl": ("f1", 43.0),
    # docs/gnn.md: test accuracy at the best-validation epoch (in the end record).
    "karate_gcn.jsonl": ("best_test_acc", 0.95),
    "karate_gat.jsonl": ("best_test_acc", 0.95),
    "karate_graphsage_mean.jsonl": ("best_test_acc", 0.90),
    "sbm_gcn.jsonl": ("best_test_acc", 0.96),
    "sbm_graphsage_mean.jsonl": ("best_test_acc", 0.95),
    "sbm_gat.jsonl": ("best_test_acc", 0.95),
    "sbm_gin.jsonl": ("best_test_acc", 0.99),
    "bert_pretrain_adam_b16.jsonl": ("mlm_accuracy", 0.07),
    "bert_pretrain_lans_b256.jsonl": ("mlm_accuracy", 0.05),
    "bert_pretrain_lans_b128.jsonl": ("mlm_accuracy", 0.06),
    # docs/communication.md: the communication-efficient modes on the 2-process digits recipe.
    "digits_comm_fp16_2proc.jsonl": ("top1", 0.96),
    "digits_comm_powersgd_2proc.jsonl": ("top1", 0.93),
    "digits_comm_ef_topk_2proc.jsonl": ("top1", 0.95),
    "digits_comm_ef_qsgd_2proc.jsonl": ("top1", 0.94),
    "digits_comm_cser_2proc.jsonl": ("top1", 0.95),
    "digits_comm_localsgd_2proc.jsonl": ("top1", 0.93),
    "digits_comm_slowmo_2proc.jsonl": ("top1", 0.95),
    "digits_comm_local_adaalter_2proc.jsonl": ("top1", 0.945),
}
# ... and how many times less than dense averaging each sent over its logged steps
# (docs/communication.md): sum(grad_bytes x steps) / sum(bytes_sent x steps).
COMPRESSION_CLAIMS = {
    "digits_comm_fp16_2proc.jsonl": 2.0,
    "digits_comm_powersgd_2proc.jsonl": 15.0,
    "digits_comm_ef_topk_2proc.jsonl": 49.9,
    "digits_comm_ef_qsgd_2proc.jsonl": 3.9,
    "digits_comm_cser_2proc.jsonl": 5.5,
    "digits_comm_localsgd_2proc.jsonl": 6.1,
    "digits_comm_slowmo_2proc.jsonl": 2.6,
    "digits_comm_local_adaalter_2proc.jsonl": 3.2,
}
# Large-batch evidence (issue: LAMB/LANS): each run uses a global batch at least 8x its
# SGD baseline's and reaches the baseline's held-out top-1 within the same number of epochs.
LARGE_BATCH = {
    "digits_lamb_b128.jsonl": "digits_nag_b16.jsonl",
    "digits_lans_b128.jsonl": "digits_nag_b16.jsonl",
}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def test_the_main_logs_are_published():
    names = {p.name for p in LOGS}
    assert {"digits_resnest14.jsonl", "digits_resnest14_2proc.jsonl"} <= names


@pytest.mark.parametrize("path", LOGS, ids=[p.stem for p in LOGS])
def test_log_is_complete(path):
    records = _records(path)
    assert records[0]["kind"] == "header" and records[-1]["kind"] == "end"
    assert records[0]["command"][0].startswith("scripts/")
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals, "a published log needs its held-out evaluation"
    if path.name in CLAIMS:
        metric, minimum = CLAIMS[path.name]
        # The end record states the run's result (GNNs: the best-validation epoch's test
        # accuracy); otherwise the last evaluation is the result.
        value = records[-1].get(metric, evals[-1].get(metric))
        assert value is not None and value >= minimum, (path.name, metric, value, minimum)


@pytest.mark.parametrize("name", sorted(COMPRESSION_CLAIMS))
def test_communication_run_sent_less(name):
    records = _records(ROOT / "logs" / name)
    assert records[0]["world_size"] >= 2
    steps = [r for r in records if r["kind"] == "step"]
    sent = dense = 0.0
    for before, r in zip([{"step": 0}, *steps[:-1]], steps, strict=True):
        sent += r["bytes_sent"] * (r["step"] - before["step"])
        dense += r["grad_bytes"] * (r["step"] - before["step"])
    assert dense / sent >= COMPRESSION_CLAIMS[name], (name, dense / sent)


def test_every_published_log_states_a_claim():
    assert {p.name for p in LOGS} <= set(CLAIMS), "add the new log's claim to CLAIMS"


def _global_batch(header: dict) -> int:
    config = header["config"]
    return config["batch_size"] * config.get("accumulate", 1) * header["world_size"]


@pytest.mark.parametrize("name", sorted(LARGE_BATCH))
def test_large_batch_run_matches_its_baseline(name):
    run, base = _records(ROOT / "logs" / name), _records(ROOT / "logs" / LARGE_BATCH[name])
    assert run[0]["config"]["optimizer"] in {"lamb", "lans"}
    assert base[0]["config"]["optimizer"] in {"sgd", "nag"}
    assert _global_batch(run[0]) >= 8 * _global_batch(base[0])
    assert run[0]["config"]["num_epochs"] == base[0]["config"]["num_epochs"]
    run_evals = [r for r in run if r["kind"] == "eval"]
    base_evals = [r for r in base if r["kind"] == "eval"]
    assert run_evals[-1]["epoch"] == base_evals[-1]["epoch"]
    assert run_evals[-1]["top1"] >= base_evals[-1]["top1"]


# The default run reruns one log per script and mode family (about 4 minutes on 2 cores);
# MODELZOO_REPRODUCE_ALL=1 reruns every published log (about 15 minutes).
REPRODUCED_BY_DEFAULT = {
    "digits_resnest14.jsonl",  # train_imagenet.py, one process
    "digits_lamb_b128.jsonl",  # LAMB with accumulation
    "digits_comm_ef_topk_2proc.jsonl",  # torchrun, 2 processes, compression + error feedback
    "karate_gcn.jsonl",  # train_gnn.py, full graph
    "sbm_graphsage_mean.jsonl",  # train_gnn.py, neighbour-sampled mini-batches
    "sbm_gin.jsonl",  # graph classification, the thread count taken from the header
    "squad_minilm_3ep.jsonl",  # finetune_squad.py
    "bert_pretrain_adam_b16.jsonl",  # pretrain_bert.py (builds its stdlib data first)
}
REPRODUCE_ALL = os.environ.get("MODELZOO_REPRODUCE_ALL") == "1"


def test_the_default_reproduction_set_is_published():
    assert {p.name for p in LOGS} >= REPRODUCED_BY_DEFAULT


@pytest.mark.slow
@pytest.mark.parametrize("path", LOGS, ids=[p.stem for p in LOGS])
def test_log_reproduces_its_first_steps(path, tmp_path):
    if path.name not in REPRODUCED_BY_DEFAULT and not REPRODUCE_ALL:
        pytest.skip("rerun with MODELZOO_REPRODUCE_ALL=1 (every published log, ~15 min)")
    steps = [r["step"] for r in _records(path) if r["kind"] == "step"]
    prefix = steps[1] if len(steps) > 1 else steps[0]
    env = {**os.environ, "MODELZOO_HOME": str(tmp_path / "home")}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "reproduce.py"), str(path), "--max-steps", str(prefix)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
