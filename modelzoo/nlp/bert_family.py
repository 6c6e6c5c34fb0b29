"""BERT's answers to the model-family protocol (:mod:`modelzoo.family`).

Export (example token batches, dynamic batch and sequence dimensions, the NamedTuple outputs
as plain tuples), pipeline parallelism (the embeddings, each Transformer layer and the task
head as a chain of blocks; the attention mask travels with the hidden states), tensor
parallelism (Megatron's plan for each :class:`~modelzoo.nlp.bert.BertLayer`, read by
:func:`trainers.parallel.parallelize`) and the planner's profiling model (the span-QA head
``scripts/finetune_squad.py`` trains, with ``BertConfig`` overrides).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..family import Modality, ModelFamily, register_family, register_modality
from .bert import (
    BertConfig,
    BertForPretraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertLayer,
    BertModel,
    PretrainingOutput,
    SpanLogits,
    _attention_mask,
)

__all__ = ["BertFamily", "TextModality"]


class TextModality(Modality):
    """Text: WordPiece tokenization (:class:`~modelzoo.nlp.tokenizer.BertTokenizer`) of the
    published vocabulary or of an artifact's ``vocab.txt``; an artifact is a Hugging Face
    BERT directory, rebuilt from its own ``config.json``."""

    name = "text"
    needs_tokenizer = True
    registered_model = False

    def tokenizer(self, *, owner: str, vocab: Any = None, directory: Any = None,
                  progress: bool = True) -> Any:  # fmt: skip
        from .tokenizer import BertTokenizer, tokenizer_from_vocab

        if directory is not None:
            return BertTokenizer.from_dir(directory)
        if vocab is None:
            raise ValueError(f"{owner}: text weights need their vocab=VocabFile(...)")
        return tokenizer_from_vocab(vocab, progress=progress)

    def save_model(self, model: nn.Module, tokenizer: Any, directory: Any) -> bool:
        from ..convert.bert import save_hf_directory

        save_hf_directory(model, tokenizer, directory, replace=False)  # its files into it
        return True

    def load_model(self, directory: Any, model_kwargs: dict[str, Any],
                   overrides: dict[str, Any]) -> nn.Module:  # fmt: skip
        from .bert import bert_from_checkpoint

        head = overrides.pop("head", model_kwargs.get("head"))
        if overrides:
            raise ValueError(
                f"{directory}: a BERT artifact takes no builder options but head; "
                f"got {sorted(overrides)}"
            )
        return bert_from_checkpoint(directory, head=head)


register_modality(TextModality())


# ---- pipeline blocks -------------------------------------------------------------------------


class _BertEmbed(nn.Module):
    """Embeddings; the attention mask (and the masked positions, pretraining) travel on."""

    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *extra: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        return self.embeddings(input_ids, token_type_ids), attention_mask, *extra


class _BertBlock(nn.Module):
    def __init__(self, layer: nn.Module, bert: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.__dict__["bert"] = bert  # not a submodule: its gradient_checkpointing switch

    def forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor, *extra: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        mask = _attention_mask(attention_mask)
        recompute = getattr(self.bert, "gradient_checkpointing", False) and self.training
        if recompute and torch.is_grad_enabled():
            x = checkpoint(self.layer, x, mask, use_reentrant=False)
        else:
            x = self.layer(x, mask)
        return x, attention_mask, *extra


class _BertSpanHead(nn.Module):
    """``(B, T, 2)``: start and end logits stacked (``SpanLogits`` is ``unbind(-1)`` of it)."""

    def __init__(self, classifier: nn.Module) -> None:
        super().__init__()
        self.span_classifier = classifier

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.span_classifier(x)


class _BertPretrainingHead(nn.Module):
    """Pooler, next-sentence head and the masked-LM head, whose decoder is the word embedding
    matrix: the same parameter as the first block's (tied across the first and last stage).
    Output: ``(mlm_logits (B, M, vocab), nsp_logits (B, 2))``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.pooler, self.mlm, self.nsp = model.bert.pooler, model.mlm, model.nsp
        self.word = model.bert.embeddings.word

    def forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor, masked_positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = torch.tanh(self.pooler(x[:, 0]))
        index = masked_positions[..., None].expand(-1, -1, x.shape[-1])
        h = torch.gather(x, 1, index)  # (B, M, C)
        return self.mlm(h, self.word.weight), self.nsp(pooled)


class _BertClassHead(nn.Module):
    def __init__(self, pooler: nn.Module, drop: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.pooler, self.drop, self.classifier = pooler, drop, classifier

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.drop(torch.tanh(self.pooler(x[:, 0]))))


# ---- export -----------------------------------------------------------------------------------


class _BertTuple(nn.Module):
    """A BERT whose NamedTuple output becomes a plain tuple without its None fields:
    ``torch.export.save`` cannot serialize an unregistered NamedTuple, and a file that needs
    modelzoo's classes to load is no deployment file."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        out = self.model(input_ids, token_type_ids, attention_mask)
        return tuple(t for t in out if t is not None)


class BertFamily(ModelFamily):
    """The zoo's BERTs: the encoder and its span-QA, pretraining and classification heads."""

    name = "BERT"
    model_classes = (
        BertModel,
        BertForQuestionAnswering,
        BertForSequenceClassification,
        BertForPretraining,
    )
    modality = "text"
    classifiers = (BertForSequenceClassification,)
    #: Megatron's layout of every :class:`BertLayer` (Hugging Face's ``base_model_tp_plan``):
    #: the fused query/key/value projection and the first feed-forward linear column-parallel,
    #: the attention output and the second feed-forward linear row-parallel.
    tp_plan = {"attn.qkv": "colwise", "attn.proj": "rowwise", "fc1": "colwise", "fc2": "rowwise"}
    #: The attention module of a layer: its ``qkv`` is fused ``[q; k; v]`` over ``num_heads``
    #: heads of ``head_dim``, which tensor parallelism regroups rank-major and divides.
    tp_attention = "attn"

    # ---- export ----

    def example_inputs(
        self,
        model: nn.Module,
        *,
        batch_size: int,
        generator: torch.Generator,
        seq_len: int = 16,
        **sizes: Any,
    ) -> tuple[Any, ...]:
        config = model.config
        if seq_len > config.max_position_embeddings:
            raise ValueError(
                f"example_inputs: seq_len {seq_len} is longer than the model's "
                f"max_position_embeddings {config.max_position_embeddings}"
            )
        ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=generator)
        types = torch.zeros(batch_size, seq_len, dtype=torch.long)
        if config.type_vocab_size > 1:
            types[:, seq_len // 2 :] = 1
        mask = torch.ones(batch_size, seq_len, dtype=torch.long)
        mask[-1, seq_len - seq_len // 4 :] = 0  # (B, T), padding at the end of the last row
        return ids, types, mask

    def inputs_like(self, model: nn.Module, inputs: tuple[Any, ...]) -> dict[str, Any]:
        batch, length = inputs[0].shape
        longer = length + 3 <= model.config.max_position_embeddings
        return {"batch_size": batch + 1, "seq_len": length + 3 if longer else max(length - 1, 1)}

    def dynamic_shapes(self, model: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        from torch.export import Dim

        batch = Dim("batch", min=1)
        seq = Dim("seq", min=1, max=model.config.max_position_embeddings)
        return tuple(None if t is None else {0: batch, 1: seq} for t in inputs)

    def export_view(self, model: nn.Module, inputs: tuple[Any, ...]) -> nn.Module | None:
        return _BertTuple(model) if len(inputs) <= 3 else None

    # ---- pipeline parallelism ----

    def pipeline_blocks(self, model: nn.Module) -> list[nn.Module]:
        """BERT span QA (``BertForQuestionAnswering``): inputs ``(input_ids,
        token_type_ids, attention_mask)``, output ``(B, T, 2)`` start/end logits. Sequence
        classification: output ``(B, classes)``. Pretraining (``BertForPretraining``): inputs
        ``(input_ids, token_type_ids, attention_mask, masked_positions)``, output
        ``(mlm_logits, nsp_logits)``; its masked-LM decoder is the word embedding matrix, so
        the first and the last block share that parameter."""
        if isinstance(model, BertModel):
            return super().pipeline_blocks(model)  # no task head to end the chain
        bert = model.bert
        blocks: list[nn.Module] = [_BertEmbed(bert.embeddings)]
        blocks += [_BertBlock(layer, bert) for layer in bert.layers]
        if isinstance(model, BertForQuestionAnswering):
            blocks.append(_BertSpanHead(model.span_classifier))
        elif isinstance(model, BertForPretraining):
            blocks.append(_BertPretrainingHead(model))
        else:
            blocks.append(_BertClassHead(bert.pooler, model.drop, model.classifier))
        return blocks

    def pipeline_block_names(self, model: nn.Module, count: int) -> list[str]:
        return ["embeddings", *[f"layer{i}" for i in range(count - 2)], "head"]

    def pipeline_output(self, model: nn.Module) -> Callable[[Any], Any]:
        if isinstance(model, BertForQuestionAnswering):
            return lambda out: SpanLogits(*out.unbind(-1))
        if isinstance(model, BertForPretraining):
            return lambda out: PretrainingOutput(*out)
        return lambda out: out

    def profile_inputs(
        self,
        model: nn.Module,
        batch: int,
        *,
        seq_len: int | None,
        image_size: int | None,
        generator: torch.Generator,
        owner: str,
    ) -> tuple[torch.Tensor, ...]:
        if seq_len is None:
            raise ValueError(f"{owner}: a BERT needs the sequence length (--seq-len)")
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (batch, seq_len), generator=generator)
        types = torch.randint(
            0, model.config.type_vocab_size, (batch, seq_len), generator=generator
        )
        return ids, types, torch.ones(batch, seq_len, dtype=torch.long)

    # ---- tensor parallelism ----

    def tensor_parallel_layers(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if isinstance(m, BertLayer)]

    def is_tensor_parallel_layer(self, module: nn.Module) -> bool:
        return isinstance(module, BertLayer)

    def unsplit_copy(self, model: nn.Module) -> nn.Module:
        if isinstance(model, BertModel):
            return BertModel(model.config, add_pooler=model.pooler is not None)
        if isinstance(model, BertForSequenceClassification):
            return BertForSequenceClassification(model.config, model.num_classes)
        return type(model)(model.config)

    # ---- planner ----

    def build_for_planning(self, builder: Callable[..., nn.Module], overrides: dict[str, Any],
                           name: str) -> nn.Module:  # fmt: skip
        """The span-QA model ``scripts/finetune_squad.py`` trains, with ``overrides``
        replacing fields of its ``BertConfig``."""
        net = builder(head="qa")
        if overrides:
            try:
                config = dataclasses.replace(net.config, **overrides)
            except TypeError as exc:
                fields = ", ".join(f.name for f in dataclasses.fields(BertConfig))
                raise ValueError(
                    f"model config overrides: {exc}; BertConfig has {fields}"
                ) from None
            net = BertForQuestionAnswering(config)
        return net


register_family(BertFamily())
