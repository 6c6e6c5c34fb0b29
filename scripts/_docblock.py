"""The generated blocks of the docs: ``<!-- name -->`` ... ``<!-- /name -->`` in a Markdown file,
rewritten from their source (``make_comm_docs.py``, ``make_optim_docs.py``) or checked
(``--check``: exit 1 when stale, as ``tests/test_docs.py`` runs them)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


def sync_block(
    doc: Path, name: str, render: Callable[[], str], *, script: str, description: str,
    argv: Sequence[str] | None = None,
) -> int:  # fmt: skip
    """The command line of a block generator: rewrite block ``name`` of ``doc`` with
    ``render()`` (which returns the block with its markers), or with ``--check`` exit 1 when
    the file's block differs; 2 when the file has no such block."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="fail if the block is stale")
    args = parser.parse_args(argv)
    block = re.compile(rf"<!-- {re.escape(name)} -->\n.*?<!-- /{re.escape(name)} -->", re.S)
    text = doc.read_text(encoding="utf-8")
    if not block.search(text):
        print(f"{doc} has no <!-- {name} --> ... <!-- /{name} --> block", file=sys.stderr)
        return 2
    new = block.sub(lambda _: render(), text)
    if args.check:
        if new != text:
            print(f"{doc} is stale: run python scripts/{script}", file=sys.stderr)
            return 1
        return 0
    if new != text:
        doc.write_text(new, encoding="utf-8")
        print(f"wrote {doc}")
    return 0
