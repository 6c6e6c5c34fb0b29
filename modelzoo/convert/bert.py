"""Hugging Face and GluonNLP BERT checkpoints -> :mod:`modelzoo.nlp.bert` state dicts.

Both sources are first renamed to one canonical, unfused naming (our module names with
separate ``attn.q`` / ``attn.k`` / ``attn.v``), then fitted to the target model: query, key
and value are concatenated into our fused ``attn.qkv``, and the backbone is prefixed with
``bert.`` when the model has a task head.

Fitting rules (:func:`fit_bert_state`):

* The encoder (embeddings and every layer) must be complete and of the model's shapes.
* Optional parts (pooler, masked-LM and next-sentence heads, span classifier, sequence
  classifier) present in the checkpoint are loaded when the model has them and dropped
  when it does not (a pretraining checkpoint fine-tuned for QA); parts the model has but the
  checkpoint lacks keep the model's fresh initialization (the QA head of a fine-tune).
* Anything else is an error that lists every missing, unexpected or mis-shaped name.

GluonNLP v0.10 names (``Block.save_parameters``, structural): ``word_embed.0.weight``,
``token_type_embed.0.weight``, ``encoder.position_weight``, ``encoder.layer_norm.{gamma,beta}``,
``encoder.transformer_cells.{i}.attention_cell.proj_{query,key,value}.{weight,bias}``,
``encoder.transformer_cells.{i}.proj.*``, ``...{i}.layer_norm.*``, ``...{i}.ffn.ffn_1.*``,
``...{i}.ffn.ffn_2.*``, ``...{i}.ffn.layer_norm.*``, ``pooler.*``, ``classifier.*`` (next
sentence), ``decoder.0.*`` / ``decoder.2.*`` / ``decoder.3.bias`` (masked LM, ``decoder.3.weight``
tied to the word embedding); a fine-tuned ``BertForQA`` adds the ``bert.`` prefix and
``span_classifier.*``. Hugging Face names are ``transformers``' ``BertFor*`` names (with the
old ``LayerNorm.gamma``/``beta`` spelling accepted).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = [
    "BertCheckpointError",
    "convert_gluonnlp_bert",
    "convert_hf_bert",
    "fit_bert_state",
    "gluonnlp_to_canonical",
    "hf_to_canonical",
    "load_bert_checkpoint",
    "read_bert_checkpoint",
    "save_hf_directory",
    "to_hf_state_dict",
]

_TIED = "<tied decoder weight>"
_DROP = "<buffer>"
_OPTIONAL = ("pooler.", "mlm.", "nsp.", "span_classifier.", "classifier.")
_HEADS = ("mlm.", "nsp.", "span_classifier.", "classifier.")
_NORM = {"weight": "weight", "bias": "bias", "gamma": "weight", "beta": "bias"}
_QKV = {"query": "q", "key": "k", "value": "v"}

_B = r"^(?:bert\.)?"
_HF_RULES: list[tuple[re.Pattern[str], Any]] = [
    (re.compile(_B + r"embeddings\.word_embeddings\.weight$"), "embeddings.word.weight"),
    (re.compile(_B + r"embeddings\.position_embeddings\.weight$"), "embeddings.position.weight"),
    (
        re.compile(_B + r"embeddings\.token_type_embeddings\.weight$"),
        "embeddings.token_type.weight",
    ),
    (
        re.compile(_B + r"embeddings\.LayerNorm\.(weight|bias|gamma|beta)$"),
        lambda m: f"embeddings.norm.{_NORM[m[1]]}",
    ),
    (re.compile(_B + r"embeddings\.(position_ids|token_type_ids)$"), _DROP),
    (
        re.compile(
            _B + r"encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.(weight|bias)$"
        ),
        lambda m: f"layers.{m[1]}.attn.{_QKV[m[2]]}.{m[3]}",
    ),
    (
        re.compile(_B + r"encoder\.layer\.(\d+)\.attention\.output\.dense\.(weight|bias)$"),
        lambda m: f"layers.{m[1]}.attn.proj.{m[2]}",
    ),
    (
        re.compile(_B + r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.(\w+)$"),
        lambda m: f"layers.{m[1]}.attn_norm.{_NORM.get(m[2], m[2])}",
    ),
    (
        re.compile(_B + r"encoder\.layer\.(\d+)\.intermediate\.dense\.(weight|bias)$"),
        lambda m: f"layers.{m[1]}.fc1.{m[2]}",
    ),
    (
        re.compile(_B + r"encoder\.layer\.(\d+)\.output\.dense\.(weight|bias)$"),
        lambda m: f"layers.{m[1]}.fc2.{m[2]}",
    ),
    (
        re.compile(_B + r"encoder\.layer\.(\d+)\.output\.LayerNorm\.(\w+)$"),
        lambda m: f"layers.{m[1]}.ffn_norm.{_NORM.get(m[2], m[2])}",
    ),
    (re.compile(_B + r"pooler\.dense\.(weight|bias)$"), lambda m: f"pooler.{m[1]}"),
    (
        re.compile(r"^cls\.predictions\.transform\.dense\.(weight|bias)$"),
        lambda m: f"mlm.dense.{m[1]}",
    ),
    (
        re.compile(r"^cls\.predictions\.transform\.LayerNorm\.(\w+)$"),
        lambda m: f"mlm.norm.{_NORM.get(m[1], m[1])}",
    ),
    (re.compile(r"^cls\.predictions\.(?:decoder\.)?bias$"), "mlm.bias"),
    (re.compile(r"^cls\.predictions\.decoder\.weight$"), _TIED),
    (re.compile(r"^cls\.seq_relationship\.(weight|bias)$"), lambda m: f"nsp.{m[1]}"),
    (re.compile(r"^qa_outputs\.(weight|bias)$"), lambda m: f"span_classifier.{m[1]}"),
    (re.compile(r"^classifier\.(weight|bias)$"), lambda m: f"classifier.{m[1]}"),
]

_C = _B + r"encoder\.transformer_cells\.(\d+)\."
_GLUON_RULES: list[tuple[re.Pattern[str], Any]] = [
    (re.compile(_B + r"word_embed\.0\.weight$"), "embeddings.word.weight"),
    (re.compile(_B + r"encoder\.position_weight$"), "embeddings.position.weight"),
    (re.compile(_B + r"token_type_embed\.0\.weight$"), "embeddings.token_type.weight"),
    (
        re.compile(_B + r"encoder\.layer_norm\.(gamma|beta)$"),
        lambda m: f"embeddings.norm.{_NORM[m[1]]}",
    ),
    (
        re.compile(_C + r"attention_cell\.proj_(query|key|value)\.(weight|bias)$"),
        lambda m: f"layers.{m[1]}.attn.{_QKV[m[2]]}.{m[3]}",
    ),
    (re.compile(_C + r"proj\.(weight|bias)$"), lambda m: f"layers.{m[1]}.attn.proj.{m[2]}"),
    (
        re.compile(_C + r"layer_norm\.(gamma|beta)$"),
        lambda m: f"layers.{m[1]}.attn_norm.{_NORM[m[2]]}",
    ),
    (re.compile(_C + r"ffn\.ffn_1\.(weight|bias)$"), lambda m: f"layers.{m[1]}.fc1.{m[2]}"),
    (re.compile(_C + r"ffn\.ffn_2\.(weight|bias)$"), lambda m: f"layers.{m[1]}.fc2.{m[2]}"),
    (
        re.compile(_C + r"ffn\.layer_norm\.(gamma|beta)$"),
        lambda m: f"layers.{m[1]}.ffn_norm.{_NORM[m[2]]}",
    ),
    (re.compile(_B + r"pooler\.(weight|bias)$"), lambda m: f"pooler.{m[1]}"),
    (re.compile(_B + r"classifier\.(weight|bias)$"), lambda m: f"nsp.{m[1]}"),
    (re.compile(_B + r"decoder\.0\.(weight|bias)$"), lambda m: f"mlm.dense.{m[1]}"),
    (re.compile(_B + r"decoder\.2\.(gamma|beta)$"), lambda m: f"mlm.norm.{_NORM[m[1]]}"),
    (re.compile(_B + r"decoder\.3\.bias$"), "mlm.bias"),
    (re.compile(_B + r"decoder\.3\.weight$"), _TIED),
    (re.compile(r"^span_classifier\.(weight|bias)$"), lambda m: f"span_classifier.{m[1]}"),
    (re.compile(r"^classifier\.\d+\.(weight|bias)$"), lambda m: f"classifier.{m[1]}"),
]


class BertCheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message lists every offending name."""


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.from_numpy(np.ascontiguousarray(value))


def _rename(
    state: Mapping[str, Any], rules: list[tuple[re.Pattern[str], Any]], source: str
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """Canonical name -> tensor, canonical -> original name, and the unknown names."""
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    unknown: list[str] = []
    tied: list[tuple[str, torch.Tensor]] = []
    for name, value in state.items():
        for pattern, target in rules:
            match = pattern.match(name)
            if match is None:
                continue
            canonical = target(match) if callable(target) else target
            tensor = _as_tensor(value)
            if canonical == _DROP:
                break
            if canonical == _TIED:
                tied.append((name, tensor))
                break
            if canonical in out:
                if not torch.equal(out[canonical], tensor):
                    raise BertCheckpointError(
                        f"{source} checkpoint: {origin[canonical]!r} and {name!r} both map to "
                        f"{canonical!r} but differ"
                    )
                break
            out[canonical] = tensor
            origin[canonical] = name
            break
        else:
            unknown.append(name)
    word = out.get("embeddings.word.weight")
    for name, tensor in tied:
        if word is None or word.shape != tensor.shape or not torch.equal(word, tensor):
            raise BertCheckpointError(
                f"{source} checkpoint: the masked-LM output weight {name!r} is not tied to the "
                "word embedding; this BERT ties them, so it cannot hold this checkpoint"
            )
    return out, origin, unknown


def hf_to_canonical(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """Renames a Hugging Face BERT state dict; returns (canonical, origins, unknown names)."""
    return _rename(state, _HF_RULES, "Hugging Face")


def gluonnlp_to_canonical(
    params: Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """Renames GluonNLP v0.10 BERT parameters; returns (canonical, origins, unknown names)."""
    return _rename(params, _GLUON_RULES, "GluonNLP")


def _fuse_qkv(
    canonical: dict[str, torch.Tensor], origin: dict[str, str]
) -> tuple[dict[str, torch.Tensor], list[str], set[str]]:
    """Concatenates ``attn.{q,k,v}`` into ``attn.qkv``; returns the state, the missing parts
    and the fused names left incomplete by them."""
    out = {k: v for k, v in canonical.items() if not re.search(r"\.attn\.[qkv]\.", k)}
    missing: list[str] = []
    incomplete: set[str] = set()
    layers = sorted({int(k.split(".")[1]) for k in canonical if re.search(r"\.attn\.[qkv]\.", k)})
    for i in layers:
        for kind in ("weight", "bias"):
            parts = [f"layers.{i}.attn.{p}.{kind}" for p in "qkv"]
            absent = [p for p in parts if p not in canonical]
            if absent:
                missing.extend(absent)
                incomplete.add(f"layers.{i}.attn.qkv.{kind}")
                continue
            out[f"layers.{i}.attn.qkv.{kind}"] = torch.cat([canonical[p] for p in parts], 0)
            origin[f"layers.{i}.attn.qkv.{kind}"] = ", ".join(origin[p] for p in parts)
    return out, missing, incomplete


def _short(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}]"


def fit_bert_state(
    canonical: dict[str, torch.Tensor],
    origin: dict[str, str],
    unknown: list[str],
    model: nn.Module,
    source: str,
) -> dict[str, torch.Tensor]:
    """A state dict that ``model.load_state_dict(..., strict=True)`` accepts (rules above).

    Raises:
        BertCheckpointError: Missing encoder names, unexpected names or shape mismatches,
            all listed.
    """
    target = model.state_dict()
    prefix = "bert." if hasattr(model, "bert") else ""
    fused, missing_parts, incomplete = _fuse_qkv(canonical, origin)

    def model_name(name: str) -> str:
        return name if name.startswith(_HEADS) else prefix + name

    out: dict[str, torch.Tensor] = {}
    unexpected = list(unknown)
    mismatched: list[str] = []
    for name, tensor in fused.items():
        key = model_name(name)
        if key not in target:
            if name.startswith(_OPTIONAL):
                continue  # a head this model does not have
            unexpected.append(origin.get(name, name))
            continue
        if tuple(tensor.shape) != tuple(target[key].shape):
            mismatched.append(
                f"{origin.get(name, name)} {tuple(tensor.shape)} -> {key} {tuple(target[key].shape)}"
            )
            continue
        out[key] = tensor.to(target[key].dtype)
    missing = list(missing_parts)
    for key, fresh in target.items():
        if key in out:
            continue
        bare = key[len(prefix) :] if prefix and key.startswith(prefix) else key
        if bare.startswith(_OPTIONAL) or key.startswith(_HEADS):
            out[key] = fresh  # not in the checkpoint: keeps the model's initialization
        elif bare not in incomplete:
            missing.append(key)
    if missing or unexpected or mismatched:
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} names {_short(missing)}")
        if unexpected:
            problems.append(f"unexpected {len(unexpected)} names {_short(unexpected)}")
        if mismatched:
            problems.append(f"{len(mismatched)} shape mismatches {_short(mismatched, 6)}")
        layers = getattr(getattr(model, "config", None), "num_layers", "?")
        raise BertCheckpointError(
            f"{source} checkpoint does not fit {type(model).__name__} ({layers} layers): "
            + "; ".join(problems)
            + ". Is it a checkpoint of another size? Build the model from its config "
            "(modelzoo.nlp.bert.bert_from_checkpoint reads config.json)."
        )
    return out


def convert_hf_bert(state: Mapping[str, Any], model: nn.Module) -> dict[str, torch.Tensor]:
    """A Hugging Face BERT state dict fitted to ``model`` (``Weights.convert`` signature)."""
    return fit_bert_state(*hf_to_canonical(state), model, "Hugging Face")


def convert_gluonnlp_bert(params: Mapping[str, Any], model: nn.Module) -> dict[str, torch.Tensor]:
    """GluonNLP v0.10 BERT parameters fitted to ``model`` (``Weights.convert`` signature)."""
    return fit_bert_state(*gluonnlp_to_canonical(params), model, "GluonNLP")


def read_bert_checkpoint(path: str | Path) -> tuple[dict[str, Any], str]:
    """Reads a BERT checkpoint without executing code from it.

    Args:
        path: A Hugging Face directory (``model.safetensors`` preferred, else
            ``pytorch_model.bin``), a ``.safetensors`` file, a ``.bin``/``.pt``/``.pth`` torch
            state dict (``weights_only=True``), or a GluonNLP ``.params`` file.

    Returns:
        ``(state, kind)`` with kind ``"hf"`` or ``"gluonnlp"``.
    """
    from .load import read_state_dict

    path = Path(path).expanduser()
    if path.is_dir():
        for name, fmt in (("model.safetensors", "safetensors"), ("pytorch_model.bin", "pth")):
            if (path / name).is_file():
                return read_state_dict(path / name, fmt), "hf"
        raise FileNotFoundError(
            f"{path}: no model.safetensors or pytorch_model.bin in this directory "
            "(a Hugging Face BERT checkpoint has one of them next to config.json)"
        )
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint file or directory")
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return read_state_dict(path, "safetensors"), "hf"
    if suffix in (".bin", ".pt", ".pth"):
        return read_state_dict(path, "pth"), "hf"
    if suffix == ".params":
        return read_state_dict(path, "params"), "gluonnlp"
    raise ValueError(
        f"{path}: unknown checkpoint type {suffix!r}; expected .safetensors, .bin/.pt/.pth "
        "(Hugging Face) or .params (GluonNLP)"
    )


def load_bert_checkpoint(model: nn.Module, path: str | Path) -> nn.Module:
    """Loads a Hugging Face or GluonNLP checkpoint into ``model`` (see the fitting rules).

    A state dict already under ``model``'s own names (exactly its keys) loads as it is.
    """
    state, kind = read_bert_checkpoint(path)
    if set(state) == set(model.state_dict()):
        model.load_state_dict({k: _as_tensor(v) for k, v in state.items()}, strict=True)
        return model
    convert = convert_hf_bert if kind == "hf" else convert_gluonnlp_bert
    try:
        fitted = convert(state, model)
    except BertCheckpointError as exc:
        raise BertCheckpointError(f"{path}: {exc}") from None
    model.load_state_dict(fitted, strict=True)
    return model


# ---------------------------------------------------------------------------------------------
# Writing: our models -> a Hugging Face directory (the one writer every script uses)
# ---------------------------------------------------------------------------------------------
_HF_LAYER = {
    "attn.proj": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm",
    "fc1": "intermediate.dense",
    "fc2": "output.dense",
    "ffn_norm": "output.LayerNorm",
}
_HF_TOP = {
    "embeddings.word": "bert.embeddings.word_embeddings",
    "embeddings.position": "bert.embeddings.position_embeddings",
    "embeddings.token_type": "bert.embeddings.token_type_embeddings",
    "embeddings.norm": "bert.embeddings.LayerNorm",
    "pooler": "bert.pooler.dense",
    "mlm.dense": "cls.predictions.transform.dense",
    "mlm.norm": "cls.predictions.transform.LayerNorm",
    "nsp": "cls.seq_relationship",
    "span_classifier": "qa_outputs",
    "classifier": "classifier",
}
_HF_ARCHITECTURES = {
    "BertForPretraining": "BertForPreTraining",
    "BertForQuestionAnswering": "BertForQuestionAnswering",
    "BertForSequenceClassification": "BertForSequenceClassification",
    "BertModel": "BertModel",
}


def to_hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A :mod:`modelzoo.nlp.bert` model's state dict under ``transformers``' ``BertFor*``
    names (query/key/value split; the masked-LM decoder weight is the word embedding, tied,
    so it is not stored). :func:`load_bert_checkpoint` reads it back."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        bare = name.removeprefix("bert.")
        stem, _, kind = bare.rpartition(".")
        if bare == "mlm.bias":
            out["cls.predictions.bias"] = tensor
            continue
        match = re.match(r"layers\.(\d+)\.(.+)$", stem)
        if match:
            layer, part = match[1], match[2]
            prefix = f"bert.encoder.layer.{layer}."
            if part == "attn.qkv":
                for piece, chunk in zip(("query", "key", "value"), tensor.chunk(3, 0), strict=True):
                    out[f"{prefix}attention.self.{piece}.{kind}"] = chunk.clone()
                continue
            if part in _HF_LAYER:
                out[f"{prefix}{_HF_LAYER[part]}.{kind}"] = tensor
                continue
        elif stem in _HF_TOP:
            out[f"{_HF_TOP[stem]}.{kind}"] = tensor
            continue
        raise ValueError(f"to_hf_state_dict: no Hugging Face name for {name!r}")
    return out


def save_hf_directory(
    model: nn.Module, tokenizer: Any, directory: str | Path, *, replace: bool = True
) -> Path:
    """Write a Hugging Face BERT directory: ``config.json`` (with ``architectures``),
    ``model.safetensors`` (:func:`to_hf_state_dict`), ``vocab.txt`` and
    ``tokenizer_config.json``.

    ``transformers``' ``BertFor*.from_pretrained``, :func:`load_bert_checkpoint`,
    :func:`~modelzoo.nlp.bert.bert_from_checkpoint` and ``finetune_squad.py
    --pretrained-bert-parameters / --model-parameters`` read it. Everything is written under
    a temporary name first. ``replace=True``: the directory is renamed into place (an old one
    is removed); ``replace=False``: each file is renamed into the existing directory, whose
    other files stay (``finetune_squad.py``'s output directory also holds predictions).
    """
    import json
    import os
    import shutil
    import tempfile

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.partial-"))
    try:
        save_file(
            to_hf_state_dict(model), str(tmp / "model.safetensors"), metadata={"format": "pt"}
        )
        architecture = _HF_ARCHITECTURES.get(type(model).__name__)
        config = model.config.to_hf()  # type: ignore[union-attr]
        if architecture is not None:
            config = {"architectures": [architecture], **config}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        tokenizer.save(tmp)
        if replace or not directory.exists():
            if directory.exists():
                shutil.rmtree(directory)
            os.replace(tmp, directory)
        else:
            for item in tmp.iterdir():
                os.replace(item, directory / item.name)
            tmp.rmdir()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory
