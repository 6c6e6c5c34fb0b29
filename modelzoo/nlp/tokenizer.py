"""BERT's WordPiece tokenizer on the ``tokenizers`` library, with character offsets.

The pipeline is BERT's: clean the text (drop control characters, map whitespace to spaces),
isolate CJK characters, lowercase and strip accents (uncased vocabularies), split on
whitespace and punctuation, then greedy longest-match WordPiece with ``##`` continuations
(words over 100 characters become ``[UNK]``). Offsets are character spans of the *original*
text, which is what SQuAD needs to map answers between text and tokens.

Vocabularies: BERT's ``vocab.txt`` (one token a line; the id is the line number) or
GluonNLP's JSON ``.vocab`` (``idx_to_token`` plus the names of its special tokens; its token
order differs from Google's, and GluonNLP checkpoints use that order).

Example:
    >>> tok = get_tokenizer("minilm_l6_h384")  # doctest: +SKIP
    >>> enc = tok.encode("Fine-tuning BERT")  # doctest: +SKIP
    >>> enc.tokens, enc.offsets  # doctest: +SKIP
    (['fine', '-', 'tuning', 'bert'], [(0, 4), (4, 5), (5, 11), (12, 16)])
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

__all__ = ["BertTokenizer", "Encoding", "get_tokenizer", "read_vocab", "tokenizer_from_vocab"]

if TYPE_CHECKING:
    from ..weights import VocabFile

_SPECIALS = {"unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "pad": "[PAD]", "mask": "[MASK]"}
_GLUON_KEYS = {
    "unk": "unknown_token",
    "cls": "cls_token",
    "sep": "sep_token",
    "pad": "padding_token",
    "mask": "mask_token",
}


@dataclass(frozen=True)
class Encoding:
    """Tokens of one text: ids, WordPiece strings and ``(start, end)`` character offsets."""

    ids: list[int]
    tokens: list[str]
    offsets: list[tuple[int, int]]

    def __len__(self) -> int:
        return len(self.ids)


def read_vocab(path: str | Path, file_format: str = "txt") -> tuple[dict[str, int], dict[str, str]]:
    """Reads a vocabulary: token -> id, and the special tokens by role.

    Args:
        path: The file.
        file_format: ``"txt"`` (BERT ``vocab.txt``) or ``"gluonnlp"`` (JSON ``.vocab``).

    Raises:
        ValueError: An unreadable file, a duplicate token, or a special token missing.
    """
    path = Path(path)
    if file_format == "txt":
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not a readable UTF-8 vocab.txt ({exc})") from exc
        tokens = [line.rstrip("\r") for line in lines]
        while tokens and not tokens[-1]:
            tokens.pop()
        specials = dict(_SPECIALS)
    elif file_format == "gluonnlp":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            tokens = list(data["idx_to_token"])
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{path}: not a GluonNLP vocabulary (JSON with 'idx_to_token'): {exc}"
            ) from exc
        specials = {role: data.get(key) or _SPECIALS[role] for role, key in _GLUON_KEYS.items()}
    else:
        raise ValueError(f"{path}: unknown vocabulary format {file_format!r}; use txt or gluonnlp")
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if token in vocab:
            raise ValueError(f"{path}: token {token!r} appears twice (ids {vocab[token]}, {index})")
        vocab[token] = index
    return vocab, specials


class BertTokenizer:
    """Uncased (or cased) BERT WordPiece tokenization with character offsets.

    Args:
        vocab: Token -> id.
        lowercase: Lowercase and strip accents first (uncased models).
        specials: Special tokens by role (``unk``, ``cls``, ``sep``, ``pad``, ``mask``).
    """

    def __init__(
        self,
        vocab: Mapping[str, int],
        *,
        lowercase: bool = True,
        specials: Mapping[str, str] | None = None,
    ) -> None:
        from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

        self.vocab = dict(vocab)
        self.lowercase = lowercase
        self.specials = dict(_SPECIALS if specials is None else specials)
        missing = [t for t in self.specials.values() if t not in self.vocab]
        if missing:
            raise ValueError(f"BertTokenizer: the vocabulary lacks the special tokens {missing}")
        self._ids_to_tokens = {i: t for t, i in self.vocab.items()}
        model = models.WordPiece(
            self.vocab, unk_token=self.specials["unk"], max_input_chars_per_word=100
        )
        self._tok = Tokenizer(model)
        self._tok.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
        )
        self._tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()

    @classmethod
    def from_file(
        cls, path: str | Path, *, file_format: str = "txt", lowercase: bool = True
    ) -> BertTokenizer:
        """From a ``vocab.txt`` (or a GluonNLP ``.vocab`` with ``file_format="gluonnlp"``)."""
        vocab, specials = read_vocab(path, file_format)
        return cls(vocab, lowercase=lowercase, specials=specials)

    @classmethod
    def from_dir(cls, path: str | Path) -> BertTokenizer:
        """From a checkpoint directory: ``vocab.txt`` and, if present,
        ``tokenizer_config.json`` (Hugging Face's ``do_lower_case``; :meth:`save`'s special
        tokens)."""
        path = Path(path)
        config: dict = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        vocab, specials = read_vocab(path / "vocab.txt")
        specials.update(config.get("modelzoo_specials", {}))
        return cls(vocab, lowercase=bool(config.get("do_lower_case", True)), specials=specials)

    def save(self, directory: str | Path) -> None:
        """Writes ``vocab.txt`` (ids in order) and ``tokenizer_config.json`` for
        :meth:`from_dir`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tokens = [self._ids_to_tokens[i] for i in range(len(self.vocab))]
        (directory / "vocab.txt").write_text("\n".join(tokens) + "\n", encoding="utf-8")
        config = {"do_lower_case": self.lowercase, "modelzoo_specials": self.specials}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    # -- ids of the special tokens ------------------------------------------------------------
    @property
    def cls_id(self) -> int:
        return self.vocab[self.specials["cls"]]

    @property
    def sep_id(self) -> int:
        return self.vocab[self.specials["sep"]]

    @property
    def pad_id(self) -> int:
        return self.vocab[self.specials["pad"]]

    @property
    def mask_id(self) -> int:
        return self.vocab[self.specials["mask"]]

    @property
    def unk_id(self) -> int:
        return self.vocab[self.specials["unk"]]

    def __len__(self) -> int:
        return len(self.vocab)

    # -- encoding -----------------------------------------------------------------------------
    def encode(self, text: str) -> Encoding:
        """WordPiece tokens of ``text`` (no special tokens) with character offsets."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return Encoding(list(enc.ids), list(enc.tokens), [tuple(o) for o in enc.offsets])

    def encode_batch(self, texts: Sequence[str]) -> list[Encoding]:
        """:meth:`encode` over many texts (parallel in the Rust library)."""
        out = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [Encoding(list(e.ids), list(e.tokens), [tuple(o) for o in e.offsets]) for e in out]

    def encode_pair(
        self, first: str, second: str | None = None, *, max_length: int | None = None
    ) -> tuple[list[int], list[int]]:
        """``[CLS] first [SEP] (second [SEP])`` ids and segment ids; with ``max_length`` the
        longer text is trimmed first (BERT's ``_truncate_seq_pair``)."""
        a = self.encode(first).ids
        b = self.encode(second).ids if second is not None else []
        if max_length is not None:
            budget = max_length - (3 if second is not None else 2)
            if budget < 0:
                raise ValueError(f"max_length {max_length} leaves no room for the special tokens")
            while len(a) + len(b) > budget:
                if len(a) >= len(b):
                    a.pop()
                else:
                    b.pop()
        ids = [self.cls_id, *a, self.sep_id]
        types = [0] * len(ids)
        if second is not None:
            ids += [*b, self.sep_id]
            types += [1] * (len(b) + 1)
        return ids, types

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self._ids_to_tokens[int(i)] for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        """Joins WordPieces back into words (``##`` glued, special tokens dropped)."""
        special = set(self.specials.values())
        words: list[str] = []
        for token in self.convert_ids_to_tokens(ids):
            if token in special:
                continue
            if token.startswith("##") and words:
                words[-1] += token[2:]
            else:
                words.append(token)
        return " ".join(words)


def get_tokenizer(name: str, tag: str | bool = True, *, progress: bool = True) -> BertTokenizer:
    """The tokenizer published with model ``name``'s weights (``tag`` as in ``get_model``).

    Raises:
        ValueError: The model has no published vocabulary.
    """
    from ..registry import get_weights

    weights = get_weights(name, tag)
    if weights.vocab is None:
        raise ValueError(f"{name}: its weights have no published vocabulary")
    return tokenizer_from_vocab(weights.vocab, progress=progress)


def tokenizer_from_vocab(vocab: VocabFile, *, progress: bool = True) -> BertTokenizer:
    """The tokenizer of a :class:`~modelzoo.weights.VocabFile`, fetched and verified."""
    from .. import store

    path = store.fetch(
        vocab.url,
        file_name=vocab.file_name,
        hash_prefix=vocab.hash_prefix,
        hash_algo=vocab.hash_algo,
        archive_member=vocab.archive_member,
        progress=progress,
    )
    return BertTokenizer.from_file(path, file_format=vocab.file_format, lowercase=vocab.lowercase)
