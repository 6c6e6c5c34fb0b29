"""Deployment export of the zoo's models: ONNX, ``torch.export`` (``.pt2``) and TorchScript.

=================  ==========================  =============================================
format             function                    how
=================  ==========================  =============================================
``"onnx"``         :func:`export_onnx`         ``torch.export.export`` then
                                               ``torch.onnx.export(..., dynamo=True)``
``"torch.export"`` :func:`export_program`      ``torch.export.export`` + ``torch.export.save``
``"torchscript"``  :func:`export_torchscript`  ``torch.jit.trace`` (checked on other sizes)
=================  ==========================  =============================================

:func:`export_model` picks the format from its name or the file extension (``.onnx``,
``.pt2``, ``.ts`` / ``.torchscript`` / ``.torchscript.pt``) and builds the example inputs
from the model's family (:func:`example_inputs`). Dynamic dimensions: the batch of ResNeSt
(the image size is fixed at export), batch and sequence length of BERT, nodes and edges of
the GNNs (and the number of graphs of GIN).

Every export runs the model in eval mode (each module's mode is restored afterwards), and
every file is written through :func:`modelzoo.fileio.atomic_write`: a failed export leaves no
file behind (and an older file at ``path`` untouched). What does not export, and why, is in
``docs/export.md``; an exporter's failure is raised as :class:`ExportError` with the
exporter's own exception as its ``__cause__``.

Example:
    >>> from modelzoo import get_model
    >>> from modelzoo.export import export_model
    >>> net = get_model("resnest14", num_classes=10)
    >>> export_model(net, "resnest14.onnx", image_size=32)  # doctest: +SKIP
    PosixPath('resnest14.onnx')
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .family import FamilyError, ModelFamily, find_family
from .fileio import atomic_write

__all__ = [
    "FORMATS",
    "ExportError",
    "check_onnx",
    "example_inputs",
    "export_model",
    "export_onnx",
    "export_program",
    "export_torchscript",
    "resolve_format",
]

FORMATS = ("onnx", "torch.export", "torchscript")
_ALIASES = {
    "onnx": "onnx",
    "torch.export": "torch.export",
    "pt2": "torch.export",
    "torchscript": "torchscript",
    "ts": "torchscript",
}
# No bare ".pt": state dicts and checkpoints use it too, so it names no format.
_EXTENSIONS = (
    (".torchscript.pt", "torchscript"),
    (".torchscript", "torchscript"),
    (".ts", "torchscript"),
    (".onnx", "onnx"),
    (".pt2", "torch.export"),
)
_INSTALL = 'pip install "modelzoo-trainers-pt[export]"'
# protobuf cannot serialize a message of 2 GiB or more; the zoo's largest (BERT-Large) is 1.3.
_PROTOBUF_LIMIT = 2**31 - 1


class ExportError(RuntimeError):
    """An exporter failed on a model, or an exported file does not reproduce the model.

    The exporter's own exception (``torch.export``'s, ``torch.onnx``'s, ``torch.jit``'s) is
    the ``__cause__``.
    """


# ---------------------------------------------------------------------------------------------
# Formats
# ---------------------------------------------------------------------------------------------


def resolve_format(path: str | os.PathLike[str], format: str | None = None) -> str:
    """The export format for ``path``: ``format`` (or an alias) or the file extension.

    Returns:
        One of :data:`FORMATS`.

    Raises:
        ValueError: Unknown ``format``; no ``format`` and an unknown extension; or a
            ``format`` that contradicts an extension another format owns.
    """
    name = Path(path).name.lower()
    by_extension = next((fmt for ext, fmt in _EXTENSIONS if name.endswith(ext)), None)
    if format is None:
        if by_extension is None:
            raise ValueError(
                f"export: cannot tell the format of {str(path)!r} from its extension; name it "
                "FILE.onnx, FILE.pt2 or FILE.ts (FILE.torchscript.pt), or pass "
                f"format= one of {', '.join(FORMATS)}"
            )
        return by_extension
    fmt = _ALIASES.get(format.lower()) if isinstance(format, str) else None
    if fmt is None:
        raise ValueError(
            f"export: unknown format {format!r}; use one of {', '.join(FORMATS)} "
            "('pt2' and 'ts' are aliases of 'torch.export' and 'torchscript')"
        )
    if by_extension is not None and by_extension != fmt:
        raise ValueError(
            f"export: format {format!r} but {str(path)!r} has the extension of "
            f"{by_extension!r} files; rename the file or drop format="
        )
    return fmt


def _first_line(exc: BaseException) -> str:
    """``Type: first line of the message``: exporters' messages run to pages of graph."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _file_mode() -> int:
    """``0o666`` less the umask, as ``open`` would create it (``mkstemp`` gives ``0o600``):
    an exported file is read by serving processes, often under another user."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _require(*modules: str) -> None:
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ImportError(
                f"modelzoo.export: {module} is not installed (ONNX export needs onnx and "
                f"onnxscript, checking it onnxruntime); {_INSTALL}"
            ) from exc


# ---------------------------------------------------------------------------------------------
# Example inputs
# ---------------------------------------------------------------------------------------------


def _family(model: nn.Module) -> ModelFamily | None:
    return find_family(model)


def _device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def example_inputs(
    model: nn.Module,
    *,
    batch_size: int = 2,
    image_size: int = 224,
    seq_len: int = 16,
    num_nodes: int = 12,
    num_edges: int = 48,
    num_graphs: int | None = 2,
    seed: int = 0,
) -> tuple[Any, ...]:
    """Default positional inputs of ``model``'s forward, from its family, on its device.

    * ResNeSt (and its ``features_only`` backbones): ``x`` ``(batch_size, C, image_size,
      image_size)``, C the model's input channels.
    * BERT (encoder and every head): ``input_ids``, ``token_type_ids`` (0 then 1 from the
      middle) and ``attention_mask``, each ``(batch_size, seq_len)``; the last row ends in
      padding, so the mask matters.
    * GCN, GraphSAGE, GAT: ``x`` ``(num_nodes, in_channels)`` and a random ``edge_index``
      ``(2, num_edges)`` sorted by target.
    * GIN: ``x``, ``edge_index`` (edges inside each graph), ``batch`` ``(num_nodes,)`` and
      the int ``num_graphs``; with ``num_graphs=None`` only ``x`` and ``edge_index`` (one
      graph; TorchScript traces tensors only).

    A dimension exported as dynamic must be at least 2 in the example: ``torch.export``
    specializes a dimension of size 1 to the constant 1, hence ``batch_size=2``.

    Raises:
        ValueError: ``model`` is of no known family (pass your own example inputs), or a
            size is out of range.
    """
    family = _family(model)
    if family is None:
        raise ValueError(
            f"example_inputs: no default inputs for {type(model).__name__} (it is of no "
            "registered model family, see modelzoo.family); pass example_inputs=(tensor, ...) "
            "matching its forward"
        )
    for option, value in (("batch_size", batch_size), ("image_size", image_size),
                          ("seq_len", seq_len), ("num_nodes", num_nodes),
                          ("num_edges", num_edges)):  # fmt: skip
        if value < 1:
            raise ValueError(f"example_inputs: {option} must be >= 1, got {value}")
    generator = torch.Generator().manual_seed(seed)
    device = _device(model)
    try:
        inputs = family.example_inputs(
            model, batch_size=batch_size, generator=generator, image_size=image_size,
            seq_len=seq_len, num_nodes=num_nodes, num_edges=num_edges, num_graphs=num_graphs,
        )  # fmt: skip
    except FamilyError as exc:
        raise ValueError(
            f"example_inputs: {exc}; pass example_inputs=(tensor, ...) matching its forward"
        ) from None
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)


def _inputs_like(model: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Inputs of the same structure as ``inputs`` but other sizes (``None``: unknown family),
    to check that a trace did not bake a size in."""
    family = _family(model)
    if family is None:
        return None
    try:
        sizes = family.inputs_like(model, inputs)
    except FamilyError:
        return None
    built = example_inputs(model, seed=1, **sizes)
    # Same arity, and None where the caller left an optional input out.
    return tuple(None if given is None else new for given, new in zip(inputs, built, strict=False))


def _as_inputs(example: Any) -> tuple[Any, ...]:
    if isinstance(example, torch.Tensor):
        return (example,)
    if not isinstance(example, (tuple, list)) or not example:
        raise TypeError(
            f"export: example_inputs must be a tensor or a non-empty tuple of the forward's "
            f"positional inputs, got {type(example).__name__}; build them with "
            "modelzoo.export.example_inputs(model)"
        )
    for i, value in enumerate(example):
        if value is not None and not isinstance(value, (torch.Tensor, int)):
            raise TypeError(
                f"export: example input {i} is a {type(value).__name__}; only tensors, ints "
                "(GIN's num_graphs) and None can be exported"
            )
    return tuple(example)


# ---------------------------------------------------------------------------------------------
# What is exported: the model (or a tuple-returning view of it), its names and dimensions
# ---------------------------------------------------------------------------------------------


class _TupleOutputs(nn.Module):
    """Any model's NamedTuple (or None-holding) output as a plain tuple of its tensors."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any) -> tuple[torch.Tensor, ...]:
        out = self.model(*args)
        return tuple(t for t in out if t is not None)


def _is_named_tuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _output_names(model: nn.Module, out: Any) -> list[str]:
    if isinstance(out, torch.Tensor):
        family = _family(model)
        classifier = family is not None and isinstance(model, family.classifiers)
        return ["logits" if classifier else "output"]
    if _is_named_tuple(out):
        return [name for name, t in zip(out._fields, out, strict=True) if t is not None]
    if isinstance(out, (tuple, list)):
        return [f"output_{i}" for i, t in enumerate(out) if t is not None]
    raise ExportError(
        f"export: {type(model).__name__} returns a {type(out).__name__}; only a tensor or a "
        "tuple/list/NamedTuple of tensors can be exported"
    )


def _flat_outputs(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if t is not None]


def _input_names(model: nn.Module, inputs: tuple[Any, ...]) -> list[str]:
    """The forward's parameter names of the given (non-None) positional inputs."""
    try:
        params = [
            p.name
            for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    names = [params[i] if i < len(params) else f"input_{i}" for i in range(len(inputs))]
    return [name for name, value in zip(names, inputs, strict=True) if value is not None]


def _dynamic_shapes(model: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """``torch.export`` dynamic shapes for the family's data dimensions (for an unknown
    model: dimension 0 of every tensor, one shared batch)."""
    family = _family(model) or ModelFamily()
    return family.dynamic_shapes(model, inputs)


def _check_dynamic_sizes(inputs: tuple[Any, ...], shapes: tuple[Any, ...], owner: str) -> None:
    for i, (value, spec) in enumerate(zip(inputs, shapes, strict=True)):
        if isinstance(value, int) and spec is not None and value < 2:
            raise ValueError(
                f"{owner}: example input {i} is {value}; a dynamic int must be >= 2 in the "
                "example (torch.export specializes 0 and 1 to constants); pass a larger "
                "example or dynamic_batch=False"
            )
        if not isinstance(spec, dict):
            continue
        for dim, symbol in spec.items():
            if value.shape[dim] < 2:
                raise ValueError(
                    f"{owner}: dimension {dim} ({symbol.__name__}) of example input {i} has "
                    f"size {value.shape[dim]}; torch.export specializes a size-1 dimension to "
                    "a constant, so a dynamic dimension needs an example of size >= 2 (e.g. "
                    "example_inputs(model, batch_size=2)), or pass dynamic_batch=False"
                )


@dataclass
class _Prepared:
    """The module to export (the model or a tuple-returning view), its inputs and names."""

    module: nn.Module
    model: nn.Module
    inputs: tuple[Any, ...]
    dynamic_shapes: tuple[Any, ...] | None
    input_names: list[str]
    output_names: list[str]


def _prepare(
    model: nn.Module,
    inputs: tuple[Any, ...],
    *,
    dynamic_batch: bool,
    dynamic_shapes: Any = None,
    owner: str,
) -> _Prepared:
    """Runs the model once on the example (in the caller's eval mode) to check the inputs
    and read the outputs' structure."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{owner}: model must be a torch.nn.Module, got {type(model).__name__}")
    try:
        with torch.no_grad():
            out = model(*inputs)
    except Exception as exc:
        raise ValueError(
            f"{owner}: the example inputs do not run through {type(model).__name__} "
            f"({_first_line(exc)}); build them with "
            "modelzoo.export.example_inputs(model)"
        ) from exc
    module = model
    if _is_named_tuple(out) or (isinstance(out, (tuple, list)) and any(t is None for t in out)):
        family = _family(model)
        view = family.export_view(model, inputs) if family is not None else None
        module = view if view is not None else _TupleOutputs(model)
    if dynamic_shapes is None and dynamic_batch:
        dynamic_shapes = _dynamic_shapes(model, inputs)
        _check_dynamic_sizes(inputs, dynamic_shapes, owner)
    return _Prepared(
        module=module,
        model=model,
        inputs=inputs,
        dynamic_shapes=dynamic_shapes,
        input_names=_input_names(model, inputs),
        output_names=_output_names(model, out),
    )


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode inside, each module's own mode restored after (frozen BNs stay frozen)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _torch_export(prepared: _Prepared, owner: str) -> torch.export.ExportedProgram:
    try:
        return torch.export.export(
            prepared.module,
            prepared.inputs,
            dynamic_shapes=prepared.dynamic_shapes,
            strict=False,
        )
    except Exception as exc:
        name = type(prepared.model).__name__
        raise ExportError(
            f"{owner}: torch.export cannot capture {name}: {_first_line(exc)} "
            "(see docs/export.md for what exports to which format)"
        ) from exc


# ---------------------------------------------------------------------------------------------
# Exporters
# ---------------------------------------------------------------------------------------------


def export_program(
    model: nn.Module,
    example_inputs: Any,
    path: str | os.PathLike[str],
    *,
    dynamic_batch: bool = True,
    dynamic_shapes: Any = None,
) -> Path:
    """``torch.export.export`` of ``model`` in eval mode, saved with ``torch.export.save``.

    Load it with ``torch.export.load(path).module()`` (no modelzoo needed); a NamedTuple
    output (BERT's :class:`~modelzoo.nlp.bert.SpanLogits`) comes back as a plain tuple of its
    tensors, in field order, without the None ones.

    Args:
        model: The model (its training mode is restored afterwards).
        example_inputs: Its positional inputs (a tensor or a tuple), e.g.
            :func:`example_inputs`.
        path: The ``.pt2`` file, written atomically.
        dynamic_batch: Make the family's data dimensions dynamic (see the module docstring);
            ``False``: every size is fixed at the example's.
        dynamic_shapes: ``torch.export``'s ``dynamic_shapes``, overriding ``dynamic_batch``.

    Raises:
        TypeError, ValueError: Bad example inputs (the message says how to build them).
        ExportError: ``torch.export`` fails on the model.
    """
    inputs = _as_inputs(example_inputs)
    with _eval_mode(model):
        prepared = _prepare(model, inputs, dynamic_batch=dynamic_batch,
                            dynamic_shapes=dynamic_shapes, owner="export_program")  # fmt: skip
        program = _torch_export(prepared, "export_program")
    return atomic_write(path, lambda f: torch.export.save(program, f), mode=_file_mode())


def _rename_axes(onnx_program: Any, prepared: _Prepared) -> None:
    """Names the ONNX graph's symbolic axes after our ``Dim``s (``batch``, ``seq``,
    ``num_nodes``...) instead of the exporter's ``s77``."""
    import onnx_ir as ir

    specs = prepared.dynamic_shapes
    if not isinstance(specs, (tuple, list)):  # none, or a caller's dict by argument name
        return
    mapping: dict[str, str] = {}
    values = [v for v in prepared.inputs if v is not None]
    specs = [s for v, s in zip(prepared.inputs, specs, strict=False) if v is not None]
    for graph_input, spec in zip(onnx_program.model.graph.inputs, specs, strict=False):
        if not isinstance(spec, dict):
            continue
        for dim, symbol in spec.items():
            axis = graph_input.shape[dim]
            name = getattr(symbol, "__name__", None)  # a Dim; Dim.AUTO and the like have none
            if name and isinstance(axis, ir.SymbolicDim) and axis.value is not None:
                mapping.setdefault(axis.value, name)
    family = _family(prepared.model)
    named = family.output_axes(prepared.model, tuple(values)) if family is not None else {}
    for (output, dim), name in named.items():
        axis = onnx_program.model.graph.outputs[output].shape[dim]
        if isinstance(axis, ir.SymbolicDim) and axis.value is not None:
            mapping.setdefault(axis.value, name)
    if mapping:
        onnx_program.rename_axes(mapping)


def export_onnx(
    model: nn.Module,
    example_inputs: Any,
    path: str | os.PathLike[str],
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    dynamic_batch: bool = True,
    opset: int | None = None,
    optimize: bool = True,
    dynamic_shapes: Any = None,
) -> Path:
    """An ONNX file of ``model`` in eval mode: ``torch.export.export``, then
    ``torch.onnx.export(..., dynamo=True)`` (the maintained exporter) on that program.

    The program is captured by one non-strict ``torch.export`` here rather than inside
    ``torch.onnx``, which falls back to a draft export when ``torch.export`` fails (resolving
    data-dependent values with the example's own); a model that does not export raises.

    Args:
        model: The model (its training mode is restored afterwards).
        example_inputs: Its positional inputs (a tensor or a tuple), e.g.
            :func:`example_inputs`.
        path: The ``.onnx`` file, written atomically (weights inside, under 2 GiB).
        input_names: ONNX input names; default the forward's parameter names.
        output_names: ONNX output names; default ``logits`` for classifiers, a NamedTuple's
            field names (BERT QA: ``start``, ``end``), else ``output``/``output_i``.
        dynamic_batch: Make the family's data dimensions dynamic (named ``batch``, ``seq``,
            ``num_nodes``, ``num_edges``, ``num_graphs`` in the file).
        opset: ONNX opset version; default ``torch.onnx``'s.
        optimize: Run the ONNX optimizer (constant folding, fusions) on the graph.
        dynamic_shapes: ``torch.export``'s ``dynamic_shapes``, overriding ``dynamic_batch``.

    Raises:
        ImportError: onnx or onnxscript missing (``pip install "modelzoo-trainers-pt[export]"``).
        TypeError, ValueError: Bad example inputs or names.
        ExportError: An exporter fails on the model, or the file would exceed 2 GiB.
    """
    _require("onnx", "onnxscript")
    inputs = _as_inputs(example_inputs)
    with _eval_mode(model):
        prepared = _prepare(model, inputs, dynamic_batch=dynamic_batch,
                            dynamic_shapes=dynamic_shapes, owner="export_onnx")  # fmt: skip
        names_in = list(prepared.input_names if input_names is None else input_names)
        names_out = list(prepared.output_names if output_names is None else output_names)
        for kind, given, expected in (("input", names_in, prepared.input_names),
                                      ("output", names_out, prepared.output_names)):  # fmt: skip
            if len(given) != len(expected):
                raise ValueError(
                    f"export_onnx: {len(given)} {kind}_names {given} for the model's "
                    f"{len(expected)} {kind}s {expected}"
                )
        program = _torch_export(prepared, "export_onnx")
        try:
            onnx_program = torch.onnx.export(
                program, (), dynamo=True, input_names=names_in, output_names=names_out,
                opset_version=opset, optimize=optimize, verbose=False,
            )  # fmt: skip
        except Exception as exc:
            raise ExportError(
                f"export_onnx: torch.onnx cannot translate {type(model).__name__}: "
                f"{_first_line(exc)}"
            ) from exc
        _rename_axes(onnx_program, prepared)
        proto = onnx_program.model_proto
    size = proto.ByteSize()
    if size > _PROTOBUF_LIMIT:
        raise ExportError(
            f"export_onnx: the ONNX model of {type(model).__name__} is {size / 2**30:.1f} GiB, "
            "over protobuf's 2 GiB limit for one file; export it with export_program (.pt2)"
        )
    data = proto.SerializeToString()
    return atomic_write(path, lambda f: f.write(data), mode=_file_mode())


def export_torchscript(
    model: nn.Module,
    example_inputs: Any,
    path: str | os.PathLike[str],
    *,
    check_inputs: Sequence[Any] | None = None,
) -> Path:
    """A TorchScript file of ``model`` in eval mode: ``torch.jit.trace`` + ``torch.jit.save``.

    Tracing, not scripting: ``torch.jit.script`` fails on every family of the zoo (ResNeSt's
    split attention, BERT's keyword-only arguments, ``torch_geometric``'s layers; see
    ``docs/export.md``). A trace records the operations the example ran, so it is checked
    against inputs of other sizes (``check_inputs``; by default, for a known family, another
    batch/sequence/graph size built by :func:`example_inputs`): a trace that baked in a
    data-dependent value (GraphSAGE-LSTM's neighbour counts, GIN's number of graphs) is
    refused rather than saved. TorchScript is deprecated upstream; prefer ONNX or
    ``torch.export``.

    Args:
        model: The model (its training mode is restored afterwards).
        example_inputs: Its positional tensor inputs (a tensor or a tuple).
        path: The file (``.ts``, ``.torchscript``, ``.torchscript.pt``), written atomically.
        check_inputs: Other input tuples the trace must reproduce the model on.

    Raises:
        TypeError, ValueError: Bad example inputs (an int input such as GIN's
            ``num_graphs``: tracing takes tensors only).
        ExportError: Tracing fails, or the trace does not reproduce the model on
            ``check_inputs``.
    """
    inputs = _as_inputs(example_inputs)
    for i, value in enumerate(inputs):
        if isinstance(value, int):
            raise ValueError(
                f"export_torchscript: example input {i} is the int {value}; torch.jit.trace "
                "takes tensors only (for GIN: example_inputs(model, num_graphs=None), one "
                "graph per call)"
            )
    with _eval_mode(model):
        prepared = _prepare(model, inputs, dynamic_batch=False, owner="export_torchscript")
        if check_inputs is None:
            other = _inputs_like(model, inputs)
            check_inputs = [] if other is None else [other]
        try:
            with torch.no_grad():
                # torch.jit's own check re-traces and compares graphs, several times slower
                # than comparing outputs, which is the check that matters.
                traced = torch.jit.trace(prepared.module, inputs, check_trace=False, strict=False)
        except Exception as exc:
            raise ExportError(
                f"export_torchscript: torch.jit.trace fails on {type(model).__name__}: "
                f"{_first_line(exc)}"
            ) from exc
        for other in check_inputs:
            _check_trace(traced, prepared.module, _as_inputs(other), type(model).__name__)
    return atomic_write(path, lambda f: torch.jit.save(traced, f), mode=_file_mode())


def _check_trace(
    traced: torch.jit.ScriptModule, module: nn.Module, inputs: tuple[Any, ...], name: str
) -> None:
    """Raises unless the trace gives the eager outputs on ``inputs`` (other sizes)."""
    # Unoptimized execution: the trace's own graph, without the profiling executor's
    # warm-up runs (seconds for a ResNeSt), which the loaded file does on its first calls.
    with torch.no_grad(), torch.jit.optimized_execution(False):
        expected = _flat_outputs(module(*inputs))
        try:
            got = _flat_outputs(traced(*inputs))
        except Exception as exc:
            raise ExportError(
                f"export_torchscript: the trace of {name} fails on inputs of other sizes "
                f"({_first_line(exc)}): it baked in a size; docs/export.md lists the "
                "formats this model exports to"
            ) from exc
    shapes = [tuple(t.shape) for t in got], [tuple(t.shape) for t in expected]
    if shapes[0] != shapes[1]:
        raise ExportError(
            f"export_torchscript: the trace of {name} gives shapes {shapes[0]} on inputs of "
            f"other sizes where the model gives {shapes[1]}: it baked in a data-dependent "
            "value; docs/export.md lists the formats this model exports to"
        )
    for a, b in zip(got, expected, strict=True):
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
            diff = float((a - b).abs().max())
            raise ExportError(
                f"export_torchscript: the trace of {name} differs from the model by {diff:.3g} "
                "on inputs of other sizes: it baked in a data-dependent value; "
                "docs/export.md lists the formats this model exports to"
            )


def export_model(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    format: str | None = None,
    example_inputs: Any = None,
    dynamic_batch: bool = True,
    **input_options: Any,
) -> Path:
    """Exports ``model`` to ``path`` in ``format`` (default: from the extension).

    Args:
        model: The model (its training mode is restored afterwards).
        path: ``FILE.onnx``, ``FILE.pt2`` or ``FILE.ts`` (``.torchscript``,
            ``.torchscript.pt``).
        format: ``"onnx"``, ``"torch.export"`` (``"pt2"``) or ``"torchscript"`` (``"ts"``).
        example_inputs: The forward's positional inputs; default :func:`example_inputs`
            of the model's family with ``input_options``.
        dynamic_batch: As :func:`export_onnx` (ignored by TorchScript, whose trace is
            checked on other sizes instead).
        **input_options: :func:`example_inputs` keywords, e.g. ``image_size=32``.

    Returns:
        The written path.

    Raises:
        ValueError: Unknown format or extension, ``input_options`` with ``example_inputs``,
            bad example inputs.
        ImportError, ExportError: As the format's exporter.
    """
    fmt = resolve_format(path, format)
    if example_inputs is None:
        family = _family(model)
        if fmt == "torchscript" and family is not None:
            for option, value in family.tracing_options.items():  # tracing takes tensors only
                input_options.setdefault(option, value)
        inputs = _default_inputs(model, **input_options)
    elif input_options:
        raise ValueError(
            f"export_model: {sorted(input_options)} only shape the default example inputs; "
            "drop them or drop example_inputs"
        )
    else:
        inputs = example_inputs
    if fmt == "onnx":
        return export_onnx(model, inputs, path, dynamic_batch=dynamic_batch)
    if fmt == "torch.export":
        return export_program(model, inputs, path, dynamic_batch=dynamic_batch)
    return export_torchscript(model, inputs, path)


_default_inputs = example_inputs  # export_model's keyword of the same name shadows it


# ---------------------------------------------------------------------------------------------
# Checking an ONNX file
# ---------------------------------------------------------------------------------------------


def check_onnx(
    path: str | os.PathLike[str],
    model: nn.Module,
    inputs: Any,
    *,
    atol: float = 1e-4,
) -> float:
    """Runs the ONNX file in onnxruntime (CPU) and compares it with the eager model.

    Args:
        path: The ``.onnx`` file.
        model: The model it was exported from (run in eval mode, its mode restored).
        inputs: Positional inputs (a tensor or a tuple); sizes may differ from the export
            example along the dynamic dimensions.
        atol: The largest absolute difference accepted.

    Returns:
        The largest absolute difference over all outputs.

    Raises:
        ImportError: onnxruntime missing (``pip install "modelzoo-trainers-pt[export]"``).
        ExportError: Other output count or shapes, or a difference over ``atol``.
    """
    _require("onnxruntime")
    import numpy as np
    import onnxruntime as ort

    values = [v for v in _as_inputs(inputs) if v is not None]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    graph_inputs = session.get_inputs()
    if len(graph_inputs) != len(values):
        raise ValueError(
            f"check_onnx: {path} takes {len(graph_inputs)} inputs "
            f"{[i.name for i in graph_inputs]}, got {len(values)}"
        )
    feeds = {
        spec.name: np.asarray(v, dtype=np.int64) if isinstance(v, int) else v.detach().cpu().numpy()
        for spec, v in zip(graph_inputs, values, strict=True)
    }
    got = session.run(None, feeds)
    with _eval_mode(model), torch.no_grad():
        expected = _flat_outputs(model(*_as_inputs(inputs)))
    if len(got) != len(expected):
        raise ExportError(f"check_onnx: {path} has {len(got)} outputs, the model {len(expected)}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        if tuple(a.shape) != tuple(b.shape):
            raise ExportError(
                f"check_onnx: output {i} of {path} is {tuple(a.shape)}, the model's "
                f"{tuple(b.shape)}"
            )
        diff = float(np.max(np.abs(a.astype(np.float64) - b.double().cpu().numpy()), initial=0.0))
        worst = max(worst, diff)
    if worst > atol:
        raise ExportError(
            f"check_onnx: {path} differs from the eager model by {worst:.3g} > atol {atol}"
        )
    return worst
