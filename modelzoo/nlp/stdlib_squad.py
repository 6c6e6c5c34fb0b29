"""A small SQuAD-format set made offline from real text: Python's standard-library docstrings.

Each paragraph describes a few functions of one module, one entry each, in the form
``name(parameters): <first paragraph of its docstring>`` (the parameter names come from
``inspect.signature``). Questions are generated from those sentences, and every answer is an
exact span of the paragraph:

* ``What does NAME return?``: the phrase after "Return"/"Returns" in NAME's first sentence.
* ``Which function returns PHRASE?``: the function name.
* ``What are the parameters of NAME?``: the parameter list (for functions without a
  "Return" sentence).

Modules are split between train and dev by name, so the dev questions are about functions
the model never saw. The text depends on the Python version (docstrings change), so the
set is rebuilt, deterministically, by the interpreter that runs it.

Example:
    >>> train = stdlib_squad("train")
    >>> train["data"][0]["paragraphs"][0]["qas"][0]["question"]  # doctest: +SKIP
    'What does b64decode return?'
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
import warnings
from typing import Any

__all__ = ["MODULES", "stdlib_squad"]

#: Modules whose functions make the paragraphs (light, importable everywhere, no GUI).
MODULES = (
    "base64", "binascii", "bisect", "builtins", "calendar", "cmath", "codecs", "colorsys",
    "copy", "csv", "difflib", "email.utils", "fnmatch", "functools", "gc", "glob", "gzip",
    "hashlib", "heapq", "hmac", "html", "inspect", "ipaddress", "json", "keyword",
    "linecache", "locale", "math", "mimetypes", "operator", "os.path", "pickle", "platform",
    "pprint", "quopri", "random", "re", "secrets", "shlex", "shutil", "site", "stat",
    "statistics", "string", "struct", "sys", "tempfile", "textwrap", "time", "tokenize",
    "traceback", "unicodedata", "urllib.parse", "uuid", "warnings", "zlib",
)  # fmt: skip
_PER_PARAGRAPH = 4
_RETURN = re.compile(r"^(Returns?) (.+?)\.?$")
_DEV_FRACTION = 0.25


def _first_sentence(text: str) -> str:
    match = re.search(r"\.(\s|$)", text)
    return text[: match.start() + 1] if match else text


def _entries(module_name: str) -> list[tuple[str, str, str]]:
    """``(name, parameters, first docstring paragraph)`` of the module's public functions."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(module_name)
    out = []
    for name in sorted(vars(module)):
        obj = getattr(module, name)
        if name.startswith("_") or inspect.isclass(obj) or not callable(obj):
            continue
        if module_name != "builtins" and getattr(obj, "__module__", None) not in (
            module.__name__,
            module_name,
            None,
        ):
            continue
        doc = inspect.getdoc(obj)
        if not doc:
            continue
        paragraph = " ".join(doc.split("\n\n")[0].split())
        if not paragraph or len(paragraph) > 400 or paragraph.startswith(name + "("):
            continue  # signature-only first lines say nothing
        try:
            signature = inspect.signature(obj)
        except (TypeError, ValueError):
            continue
        params = ", ".join(
            p.name if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) else
            ("*" if p.kind == p.VAR_POSITIONAL else "**") + p.name
            for p in signature.parameters.values()
        )  # fmt: skip
        out.append((name, params, paragraph))
    return out


def _is_dev(module_name: str) -> bool:
    digest = hashlib.sha256(module_name.encode()).digest()
    return digest[0] < 256 * _DEV_FRACTION


def _paragraph(module_name: str, group: list[tuple[str, str, str]], pid: str) -> dict[str, Any]:
    context = ""
    qas: list[dict[str, Any]] = []
    spans = []
    for name, params, text in group:
        if context:
            context += " "
        start = len(context)
        entry = f"{name}({params}): {text}"
        context += entry
        spans.append((name, params, text, start))

    def qa(kind: str, name: str, question: str, answer: str, at: int) -> None:
        assert context[at : at + len(answer)] == answer
        qas.append(
            {
                "id": f"{pid}-{name}-{kind}",
                "question": question,
                "answers": [{"text": answer, "answer_start": at}],
            }
        )

    for name, params, text, start in spans:
        match = _RETURN.match(_first_sentence(text))
        phrase = match[2].strip() if match else ""
        text_at = start + len(name) + len(params) + 4  # after "name(params): "
        phrase_at = text_at + len(match[1]) + 1 if match else -1
        if phrase and context[phrase_at : phrase_at + len(phrase)] == phrase:
            qa("returns", name, f"What does {name} return?", phrase, phrase_at)
            qa("which", name, f"Which function returns {phrase}?", name, start)
        elif params:  # the parameter question only where there is no return question
            qa("params", name, f"What are the parameters of {name}?", params, start + len(name) + 1)
    return {"context": context, "qas": qas}


def stdlib_squad(split: str = "train", *, per_paragraph: int = _PER_PARAGRAPH) -> dict[str, Any]:
    """The ``"train"`` or ``"dev"`` split as parsed SQuAD v1.1 JSON.

    Args:
        split: ``"train"`` or ``"dev"`` (disjoint modules).
        per_paragraph: Functions described in each paragraph. With 1, every question is
            about the only function in its paragraph (an easier, shorter set).
    """
    if split not in ("train", "dev"):
        raise ValueError(f"split must be 'train' or 'dev', got {split!r}")
    if per_paragraph < 1:
        raise ValueError(f"per_paragraph must be >= 1, got {per_paragraph}")
    articles = []
    for module_name in MODULES:
        if _is_dev(module_name) != (split == "dev"):
            continue
        try:
            entries = _entries(module_name)
        except ImportError:
            continue
        paragraphs = []
        for start in range(0, len(entries), per_paragraph):
            group = entries[start : start + per_paragraph]
            paragraph = _paragraph(module_name, group, f"{module_name}-{start // per_paragraph}")
            if paragraph["qas"]:
                paragraphs.append(paragraph)
        if paragraphs:
            articles.append({"title": module_name, "paragraphs": paragraphs})
    return {"version": "1.1", "data": articles}
