"""The model a run log's header describes, rebuilt to count its gradient: ``G`` of the
scaling what-if (``scripts/scaling_whatif.py``, :mod:`trainers.comm.whatif_log`).

:func:`logged_model_grad_bytes` is 4 bytes per trainable parameter of the model a training
script trained: the zoo model the header names, with the classes and the head the script
puts on it (``pretrain_bert.py``: masked LM + next sentence, over the run's vocabulary;
``finetune_squad.py``: span prediction, or the size of the checkpoint it started from), or
the BERT that ``pretrain_bert.py``'s architecture flags build. The model families are
imported only when a model is counted.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

__all__ = ["SCRIPT_HEADS", "logged_model_grad_bytes"]

#: The head each training script puts on a BERT (its gradient is what a step all-reduces).
SCRIPT_HEADS = {"pretrain_bert.py": "pretraining", "finetune_squad.py": "qa"}


@functools.cache
def _zoo_grad_bytes(name: str, num_classes: int | None, head: str | None, vocab_size: int | None) -> float:  # fmt: skip
    from . import registry

    kwargs: dict[str, Any] = {} if num_classes is None else {"num_classes": num_classes}
    if head is not None:
        kwargs["head"] = head
    if vocab_size is not None:
        kwargs["vocab_size"] = vocab_size
    model = registry.get_model(name, **kwargs)
    return 4.0 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def _pretraining_vocab_size(config: dict[str, Any]) -> int:
    """The vocabulary ``pretrain_bert.py`` ran with (its sources in
    :func:`~modelzoo.nlp.pretraining.recipe.recipe_tokenizer`'s order)."""
    from .nlp.pretraining.recipe import BUILTIN_TOKENIZER, recipe_tokenizer
    from .nlp.tokenizer import get_tokenizer

    named = recipe_tokenizer(
        vocab_file=config.get("vocab_file"),
        data_dirs=[config.get("phase1_data"), config.get("phase2_data")],
        phase1_model=config.get("phase1_model"),
    )  # fmt: skip
    if named is not None:
        return len(named)
    # The run had a vocabulary this machine lacks: the built-in one would be the wrong size.
    if any(config.get(f"phase{n}_data") for n in (1, 2)):
        raise FileNotFoundError("the run's vocab.txt is not on this machine")
    if config.get("phase1_model") and not config.get("corpus_vocab"):
        raise FileNotFoundError("the phase-1 model's vocab.txt is not on this machine")
    if config.get("corpus_vocab"):  # --corpus-vocab: the tokens the built-in corpus uses
        return _corpus_vocab_size()
    return len(get_tokenizer(BUILTIN_TOKENIZER, progress=False))  # the built-in corpus's


@functools.cache
def _corpus_vocab_size() -> int:
    """``pretrain_bert.py --corpus-vocab``'s vocabulary size (tokenizes the built-in corpus
    once per process)."""
    from .nlp.pretraining.recipe import recipe_tokenizer

    return len(recipe_tokenizer(builtin=True, corpus_vocab=True, progress=False))


def logged_model_grad_bytes(name: str | None, config: dict[str, Any], script: str = "") -> float:
    """4 bytes per trainable parameter of the model a run trained: the zoo model ``name``
    (classes and head as the run had), or the BERT that ``pretrain_bert.py``'s flags build.

    Args:
        name: the header's ``model`` or ``bert_model`` (``None``: none named).
        config: the header's ``config`` (the run's flags).
        script: the file name of the script that wrote the log (``finetune_squad.py``, ...).

    Raises:
        LookupError: The log does not say which model (or its vocabulary is not here); the
            message says what to pass instead (``--grad-bytes``).
    """
    head = SCRIPT_HEADS.get(script)
    vocab_size = None
    source = config.get("pretrained_bert_parameters")
    if script == "finetune_squad.py" and source:  # the script's build_model, in its order
        folder = Path(source) if Path(source).is_dir() else Path(source).parent
        if (folder / "config.json").is_file():
            from .nlp.bert import BertConfig, build_bert

            model = build_bert(BertConfig.from_hf(folder / "config.json"), head="qa")
            return 4.0 * sum(p.numel() for p in model.parameters() if p.requires_grad)
        if not Path(source).exists():
            raise LookupError(
                f"fine-tuned the BERT in {source}, which is not on this machine (its size "
                "may not be --bert-model's); pass --grad-bytes"
            )
    if script == "pretrain_bert.py":
        try:
            vocab_size = _pretraining_vocab_size(config)
        except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: store's download errors
            raise LookupError(f"no vocabulary for its model ({e}); pass --grad-bytes") from None
        if not name:
            from .nlp.bert import BertConfig, build_bert

            bert = BertConfig(
                vocab_size=vocab_size,
                hidden_size=int(config["hidden_size"]),
                num_layers=int(config["num_layers"]),
                num_heads=int(config["num_heads"]),
                intermediate_size=int(config["intermediate_size"]),
                max_position_embeddings=int(config["max_position_embeddings"]),
            )
            model = build_bert(bert, head=head)
            return 4.0 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    if not name:
        raise LookupError("names no model; pass --grad-bytes")
    num_classes = None
    if config.get("dataset") == "digits":
        num_classes = 10
    elif config.get("num_classes"):
        num_classes = int(config["num_classes"])
    return _zoo_grad_bytes(name, num_classes, head, vocab_size)
