"""Per-operator fingerprints of a computation: where two machines' numbers part ways.

When a run log re-created on another processor diverges (``scripts/cross_processor.py``),
the logged loss says *that* the numbers differ, not *which kernel* made them differ. An
:class:`OpRecorder` (a ``TorchDispatchMode``) records, for every ATen operator the code
calls, its name, its outputs' shapes and dtypes, a 64-bit BLAKE2b digest of the outputs'
bytes and the innermost line of this repository's code that called it. Two recordings of the
same code on two machines are compared by :func:`first_difference`: the first operator whose
outputs differ while every earlier output was identical is the kernel that computes
differently (its inputs were bit-identical, being earlier outputs, parameters or data);
whether later ones differ says nothing more.

Example:
    >>> with OpRecorder() as rec:
    ...     y = torch.nn.functional.gelu(torch.linspace(-3, 3, 7))
    >>> rec.records[-1].op
    'aten.gelu.default'

``scripts/cross_processor.py optrace`` records the first step of a published log's command
(with the log's pins) into ``logs/optrace/``; ``optrace-compare`` names the kernel.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["OpRecord", "OpRecorder", "first_difference", "load_trace", "run_script", "save_trace"]

_ROOT = str(Path(__file__).resolve().parents[1]) + os.sep
_HERE = str(Path(__file__).resolve())


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One operator call: ``op`` (``aten.addmm.default``), ``shapes`` of its tensor outputs
    (``"f32[8,384]"``), ``digest`` of their bytes (hex) and ``where`` (``file:line`` of the
    innermost frame of this repository's code, or ``""``)."""

    op: str
    shapes: str
    digest: str
    where: str


def _storage(t: torch.Tensor) -> int:
    if t.layout != torch.strided or t.device.type == "meta":
        return -1
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return -1


def _digest(tensors: Sequence[torch.Tensor], skip: set[int]) -> tuple[str, str]:
    """Shapes of ``tensors`` and a digest of their bytes (those in storages ``skip``, sparse
    and meta tensors: shape only)."""
    h = hashlib.blake2b(digest_size=8)
    shapes = []
    hashed = False
    for t in tensors:
        shapes.append(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}")
        if t.layout != torch.strided or t.device.type == "meta" or _storage(t) in skip:
            continue
        hashed = True
        data = t.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        data = data.contiguous().reshape(-1)
        if data.is_conj():
            data = data.resolve_conj()
        h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return ";".join(shapes), h.hexdigest() if hashed else ""


def _where() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_ROOT) and name != _HERE and "/.venv/" not in name:
            return f"{name[len(_ROOT) :]}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


# Operators whose outputs are uninitialized memory: recorded by shape only.
_UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "new_empty",
                            "new_empty_strided", "resize_", "set_"})  # fmt: skip


class OpRecorder(TorchDispatchMode):
    """Record every ATen operator call inside the ``with`` block (see the module docstring).

    Args:
        limit: keep at most this many records (later calls still run, unrecorded).
    """

    def __init__(self, limit: int = 2_000_000) -> None:
        super().__init__()
        self.limit = limit
        self.records: list[OpRecord] = []
        self.dropped = 0
        self._unwritten: set[int] = set()  # storages an empty() made and nothing wrote yet

    def _track(self, func: Any, args: Any, kwargs: Any, outputs: list[torch.Tensor]) -> None:
        """Keep :attr:`_unwritten` up to date: an ``empty*`` output's storage joins it; a
        tensor an operator writes (in place, ``out=``) or newly allocates leaves it; views of
        unwritten memory stay unwritten (their bytes are not recorded)."""
        if func.__name__.split(".")[0] in _UNINITIALIZED:
            self._unwritten.update(_storage(t) for t in outputs)
            return
        schema = func._schema
        written = [a.name for a in schema.arguments if a.alias_info is not None
                   and a.alias_info.is_write]  # fmt: skip
        if written:
            bound = dict(zip((a.name for a in schema.arguments), args, strict=False)) | kwargs
            for name in written:
                for t in tree_leaves(bound.get(name)):
                    if isinstance(t, torch.Tensor):
                        self._unwritten.discard(_storage(t))
        fresh = all(r.alias_info is None for r in schema.returns)
        if fresh:
            for t in outputs:
                self._unwritten.discard(_storage(t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if len(self.records) >= self.limit:
            self.dropped += 1
            return out
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if tensors and all(t.device.type == "meta" for t in tensors):
            return out  # shapes only, nothing computed (a model built on the meta device)
        self._track(func, args, kwargs or {}, tensors)
        shapes, digest = _digest(tensors, skip=self._unwritten)
        self.records.append(OpRecord(str(func), shapes, digest, _where()))
        return out


def save_trace(path: str | os.PathLike[str], records: Sequence[OpRecord], **meta: Any) -> Path:
    """Write ``records`` and ``meta`` (the machine, the command) as gzipped JSON."""
    from .checkpoint import atomic_write  # noqa: PLC0415 (checkpoint imports torch.save users)

    body = {"meta": meta, "records": [dataclasses.astuple(r) for r in records]}
    data = gzip.compress(json.dumps(body, separators=(",", ":")).encode(), mtime=0)
    return atomic_write(path, lambda f: f.write(data))


def load_trace(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[OpRecord]]:
    """``(meta, records)`` of a file :func:`save_trace` wrote."""
    body = json.loads(gzip.decompress(Path(path).read_bytes()))
    return body["meta"], [OpRecord(*r) for r in body["records"]]


#: Operators that allocate, rebind storage or mark profiler ranges: without a digest they
#: compute nothing, and how many run can depend on timing (a DataLoader's workers hand over
#: batches ahead of use, each rebuilt in the main process by ``empty`` + ``set_``).
BOOKKEEPING = ("aten.empty", "aten.new_empty", "aten.set_.", "profiler.")


def _computes(r: OpRecord) -> bool:
    return bool(r.digest) or not r.op.startswith(BOOKKEEPING)


def first_difference(a: Sequence[OpRecord], b: Sequence[OpRecord]) -> dict[str, Any] | None:
    """Where two recordings of the same code part ways, or None when every record matches.

    Bookkeeping records (:data:`BOOKKEEPING` with no digest) are left out of the comparison.
    Returns ``{"index", "index_b", "kind", "a", "b", "differing_after"}``: ``index`` and
    ``index_b`` are the record's positions in ``a`` and ``b``; ``kind`` is ``"values"``
    (the same operator on the same shapes gave different bytes: that kernel computes
    differently, its inputs being identical), ``"path"`` (another operator or shape: the code
    took another branch, e.g. another kernel selection visible at the ATen level) or
    ``"length"`` (one recording stops early); ``differing_after`` counts later records whose
    digests differ too.
    """
    ka = [(i, r) for i, r in enumerate(a) if _computes(r)]
    kb = [(i, r) for i, r in enumerate(b) if _computes(r)]
    for n, ((i, x), (j, y)) in enumerate(zip(ka, kb, strict=False)):
        if (x.op, x.shapes) != (y.op, y.shapes):
            kind = "path"
        elif x.digest != y.digest:
            kind = "values"
        else:
            continue
        later = sum(
            p.digest != q.digest for (_, p), (_, q) in zip(ka[n + 1 :], kb[n + 1 :], strict=False)
        )
        return {"index": i, "index_b": j, "kind": kind, "a": x, "b": y, "differing_after": later}
    if len(ka) != len(kb):
        n = min(len(ka), len(kb))
        i = ka[n][0] if n < len(ka) else len(a)
        j = kb[n][0] if n < len(kb) else len(b)
        return {"index": i, "index_b": j, "kind": "length", "a": a[i] if i < len(a) else None,
                "b": b[j] if j < len(b) else None, "differing_after": 0}  # fmt: skip
    return None


def run_script(script: str, argv: Sequence[str], recorder: OpRecorder) -> int:
    """Run ``script`` as ``__main__`` with ``argv`` under ``recorder``; its exit status."""
    saved = sys.argv
    sys.argv = [script, *argv]
    code: Any = 0
    try:
        with recorder:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = saved
    return code if isinstance(code, int) else (0 if code is None else 1)


def _script(meta: dict[str, Any]) -> str:
    """The traced script as the repository names it: ``scripts/pretrain_bert.py`` whether it ran
    from this checkout, another one or a commit exported to a temporary directory."""
    path = Path((meta.get("command") or [""])[0])
    parts = path.parts
    if "scripts" in parts:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("scripts") :])
    return path.name


def _describe(r: OpRecord | None) -> str:
    return "(none)" if r is None else f"{r.op} -> {r.shapes} at {r.where or '?'} [{r.digest}]"


def main(argv: Sequence[str] | None = None) -> int:
    """``record OUT -- SCRIPT ARGS...`` | ``compare A B`` (see the module docstring)."""
    import argparse  # noqa: PLC0415

    from .fingerprint import machine_fingerprint  # noqa: PLC0415

    p = argparse.ArgumentParser(
        prog="python -m trainers.optrace", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="run a script under an OpRecorder; save its trace")
    rec.add_argument("out", help="the trace file to write (.json.gz)")
    rec.add_argument("--limit", type=int, default=2_000_000, help="records kept at most")
    rec.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    cmp_ = sub.add_parser("compare", help="the first operator where two traces differ")
    cmp_.add_argument("a")
    cmp_.add_argument("b")
    args = p.parse_args(argv)
    if args.cmd == "record":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            p.error("record: give the script and its arguments after --")
        recorder = OpRecorder(args.limit)
        status = run_script(command[0], command[1:], recorder)
        if status != 0:
            print(f"optrace: {command[0]} exited with {status}; no trace written", file=sys.stderr)
            return status
        fp = machine_fingerprint()
        save_trace(args.out, recorder.records, command=command, fingerprint=fp,
                   dropped=recorder.dropped)  # fmt: skip
        print(f"optrace: {len(recorder.records)} operator calls -> {args.out}")
        return 0
    meta_a, a = load_trace(args.a)
    meta_b, b = load_trace(args.b)
    if _script(meta_a) != _script(meta_b):
        print(f"optrace: warning: the two traces ran different scripts ({_script(meta_a)}, "
              f"{_script(meta_b)})", file=sys.stderr)  # fmt: skip
    found = first_difference(a, b)
    if found is None:
        print(f"optrace: identical ({len(a)} operator calls)")
        return 0
    at = (
        found["index"]
        if found["index"] == found["index_b"]
        else f"{found['index']}/{found['index_b']}"
    )
    print(f"optrace: first difference at operator call {at} of {len(a)}/{len(b)} "
          f"({found['kind']}; {found['differing_after']} later calls differ too)\n"
          f"  {args.a}: {_describe(found['a'])}\n  {args.b}: {_describe(found['b'])}")  # fmt: skip
    return 1


if __name__ == "__main__":
    sys.exit(main())
