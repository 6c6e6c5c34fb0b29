"""The built-in pretraining corpus: the docstrings of Python's standard library."""

from __future__ import annotations

import ast
import hashlib
import os
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from ...fileio import atomic_write_text

__all__ = [
    "corpus_vocabulary",
    "stdlib_documents",
    "write_stdlib_corpus",
]


# ---------------------------------------------------------------------------------------------
# The stdlib corpus
# ---------------------------------------------------------------------------------------------

_SKIP_DIRS = frozenset(
    {"test", "tests", "idlelib", "tkinter", "turtledemo", "site-packages", "dist-packages",
     "lib2to3", "ensurepip", "pydoc_data", "__pycache__", "config-3"}
)  # fmt: skip
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_DEV_FRACTION = 0.1


def _module_files(root: Path) -> list[tuple[str, Path]]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(("config-", "."))
        )
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            module = path.relative_to(root).with_suffix("").as_posix().replace("/", ".")
            module = module.removesuffix(".__init__")
            if any(part.startswith("_") and part != "__main__" for part in module.split(".")):
                continue  # private modules
            files.append((module, path))
    return files


def _sentences(docstring: str) -> list[str]:
    """Prose sentences of a docstring: code, doctests and indented blocks are dropped."""
    out = []
    for paragraph in docstring.split("\n\n"):
        lines = paragraph.strip("\n").split("\n")
        if any(
            line.lstrip().startswith((">>>", "...", "$ ", "%")) or line[:1].isspace()
            for line in lines
        ):
            continue
        text = " ".join(" ".join(lines).split())
        for sentence in _SENTENCE_END.split(text):
            words = sentence.split()
            letters = sum(c.isalpha() for c in sentence)
            if len(words) >= 3 and letters >= 0.6 * len(sentence):
                out.append(sentence)
    return out


def _is_dev(module: str) -> bool:
    return hashlib.sha256(module.encode()).digest()[0] < 256 * _DEV_FRACTION


def stdlib_documents(
    split: str = "train", *, root: str | os.PathLike[str] | None = None
) -> Iterator[list[str]]:
    """Documents (lists of sentences) of the standard library's docstrings, one per module.

    Args:
        split: ``"train"``, ``"dev"`` (about 10 % of the modules, by a hash of the name)
            or ``"all"``.
        root: The standard library's directory (default: the running interpreter's).
    """
    if split not in ("train", "dev", "all"):
        raise ValueError(f"split must be 'train', 'dev' or 'all', got {split!r}")
    root = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    for module, path in _module_files(root):
        if split != "all" and _is_dev(module) != (split == "dev"):
            continue
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError):
            continue  # e.g. a file for another Python version
        document: list[str] = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if not isinstance(node, ast.Module) and node.name.startswith("_"):
                    continue
                doc = ast.get_docstring(node)
                if doc:
                    document.extend(_sentences(doc))
        if len(document) >= 2:
            yield document


def write_stdlib_corpus(
    path: str | os.PathLike[str],
    split: str = "train",
    *,
    root: str | os.PathLike[str] | None = None,
) -> dict[str, int]:
    """Writes :func:`stdlib_documents` as a corpus file (one sentence per line, a blank line
    between documents), atomically; returns ``{"documents", "sentences", "bytes"}``."""
    path = Path(path)
    documents = sentences = 0

    def write(f: IO[str]) -> None:
        nonlocal documents, sentences
        for document in stdlib_documents(split, root=root):
            if documents:
                f.write("\n")
            f.write("\n".join(document) + "\n")
            documents += 1
            sentences += len(document)

    atomic_write_text(path, write)
    return {"documents": documents, "sentences": sentences, "bytes": path.stat().st_size}


def corpus_vocabulary(tokenizer: Any) -> Any:
    """``tokenizer`` restricted to the tokens that the built-in training corpus uses, plus the
    special tokens, in their original order (``pretrain_bert.py --corpus-vocab``; a
    :class:`~modelzoo.nlp.tokenizer.BertTokenizer` in, one out). WordPiece's greedy longest
    match only ever picks a token it used before, so the training text is cut into the same
    tokens; held-out words whose pieces are missing fall back to shorter pieces or
    ``[UNK]``."""
    from ..tokenizer import BertTokenizer

    used = {tokenizer.vocab[token] for token in tokenizer.specials.values()}
    for document in stdlib_documents("train"):
        for encoding in tokenizer.encode_batch(document):
            used.update(encoding.ids)
    tokens = tokenizer.convert_ids_to_tokens(sorted(used))
    return BertTokenizer(
        {token: i for i, token in enumerate(tokens)},
        lowercase=tokenizer.lowercase,
        specials=tokenizer.specials,
    )
