"""modelzoo.export: every exported file against the eager model, at other sizes than exported.

The oracle is the eager PyTorch model in eval mode. Each file is exported once (module-scoped
fixtures: the ONNX exporter takes seconds per model) at one size and run at another batch,
sequence length or graph size, so a dimension that did not stay dynamic fails the test.
BatchNorm statistics are randomized and the models are handed over in training mode: a file
exported in training mode (batch statistics, dropout) would not match.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from modelzoo import export, get_model
from modelzoo.export import ExportError, example_inputs
from modelzoo.nlp.bert import BertConfig, build_bert

from ._reference import randomize_batchnorm

GNNS = ["gcn", "graphsage_mean", "gat", "gin"]
TORCHSCRIPT_DEPRECATED = "ignore:`torch.jit.(script|trace|trace_method|save|load)` is deprecated"
TRACER = "ignore::torch.jit.TracerWarning"


def _randomize_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Running statistics and affine parameters far from their initial 0/1, in train mode
    (the export must switch to eval mode itself)."""
    return randomize_batchnorm(model, seed).train()


def _eager(model: nn.Module, inputs: tuple) -> list[torch.Tensor]:
    """The oracle: the model in eval mode, outputs flattened; the mode is put back."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model(*inputs)
    model.train(was_training)
    return [out] if isinstance(out, torch.Tensor) else [t for t in out if t is not None]


def _ort(path, inputs: tuple) -> list:
    ort = pytest.importorskip("onnxruntime")
    import numpy as np

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    values = [v for v in inputs if v is not None]
    feeds = {
        i.name: np.asarray(v) if isinstance(v, int) else v.numpy()
        for i, v in zip(session.get_inputs(), values, strict=True)
    }
    return [torch.from_numpy(a) for a in session.run(None, feeds)]


def _max_diff(got: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape
    return max(float((a - b).abs().max()) for a, b in zip(got, expected, strict=True))


def _onnx_axes(path) -> tuple[dict, dict]:
    onnx = pytest.importorskip("onnx")

    def dims(value):
        return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]

    graph = onnx.load(str(path)).graph
    return {i.name: dims(i) for i in graph.input}, {o.name: dims(o) for o in graph.output}


# ---------------------------------------------------------------------------------------------
# ResNeSt
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resnest() -> nn.Module:
    torch.manual_seed(0)
    model = _randomize_norms(get_model("resnest14", num_classes=10))
    x = example_inputs(model, image_size=32)
    with torch.no_grad():
        train_mode = copy.deepcopy(model)(*x)  # a copy: batch statistics update the buffers
    assert not torch.allclose(train_mode, _eager(model, x)[0], atol=1e-3)  # eval mode matters
    return model


@pytest.fixture(scope="module")
def resnest_onnx(resnest, tmp_path_factory):
    pytest.importorskip("onnxscript")
    path = tmp_path_factory.mktemp("resnest") / "resnest14.onnx"
    assert export.export_model(resnest, path, image_size=32) == path  # batch 2
    assert resnest.training  # its mode is given back
    return path


@pytest.mark.parametrize("batch", [1, 3])
def test_resnest_onnx_at_another_batch(resnest, resnest_onnx, batch):
    x = example_inputs(resnest, batch_size=batch, image_size=32, seed=batch)
    assert _max_diff(_ort(resnest_onnx, x), _eager(resnest, x)) < 1e-4


def test_resnest_onnx_names_and_dynamic_batch(resnest_onnx):
    inputs, outputs = _onnx_axes(resnest_onnx)
    assert inputs == {"x": ["batch", 3, 32, 32]}
    assert outputs == {"logits": ["batch", 10]}


def test_resnest_torch_export_at_another_batch(resnest, tmp_path):
    path = export.export_program(
        resnest, example_inputs(resnest, image_size=32), tmp_path / "r.pt2"
    )
    assert resnest.training
    program = torch.export.load(path).module()
    for batch in (1, 5):
        x = example_inputs(resnest, batch_size=batch, image_size=32, seed=batch)
        with torch.no_grad():
            got = [program(*x)]
        assert _max_diff(got, _eager(resnest, x)) < 1e-5


@pytest.mark.filterwarnings(TORCHSCRIPT_DEPRECATED)
def test_resnest_torchscript_at_another_batch(resnest, tmp_path):
    path = export.export_model(resnest, tmp_path / "r.torchscript.pt", image_size=32)
    assert resnest.training
    loaded = torch.jit.load(str(path))
    x = example_inputs(resnest, batch_size=4, image_size=32, seed=4)
    with torch.no_grad():
        got = [loaded(*x)]
    assert _max_diff(got, _eager(resnest, x)) < 1e-5


@pytest.mark.filterwarnings(TORCHSCRIPT_DEPRECATED)
def test_resnest_does_not_script(resnest):
    """Documented: only tracing works (split attention defines ``splits`` in one branch)."""
    with pytest.raises(RuntimeError, match="splits is not defined in the false branch"):
        torch.jit.script(resnest)


def test_each_module_mode_is_restored(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)).train()
    model[1].eval()  # a frozen BN must stay frozen
    export.export_program(model, (torch.randn(3, 4),), tmp_path / "m.pt2")
    assert [m.training for m in model] == [True, False, True]


# ---------------------------------------------------------------------------------------------
# BERT with the span (SQuAD) head
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert() -> nn.Module:
    torch.manual_seed(0)
    # initializer_range 0.5 (BERT's 0.02 leaves attention almost uniform): the mask matters
    config = BertConfig(vocab_size=100, hidden_size=32, num_layers=1, num_heads=4,
                        intermediate_size=64, max_position_embeddings=64,
                        initializer_range=0.5)  # fmt: skip
    model = build_bert(config, head="qa").train()
    x = example_inputs(model, batch_size=3, seq_len=11)
    unmasked = (x[0], x[1], torch.ones_like(x[2]))
    assert _max_diff(_eager(model, x), _eager(model, unmasked)) > 1e-2  # the padding matters
    return model


@pytest.fixture(scope="module")
def bert_onnx(bert, tmp_path_factory):
    pytest.importorskip("onnxscript")
    path = tmp_path_factory.mktemp("bert") / "qa.onnx"
    export.export_onnx(bert, example_inputs(bert), path)  # batch 2, 16 tokens
    assert bert.training
    return path


@pytest.mark.parametrize(("batch", "seq_len"), [(3, 11), (1, 64)])
def test_bert_qa_onnx_at_another_batch_and_length(bert, bert_onnx, batch, seq_len):
    x = example_inputs(bert, batch_size=batch, seq_len=seq_len, seed=seq_len)
    assert _max_diff(_ort(bert_onnx, x), _eager(bert, x)) < 1e-4


def test_check_onnx_measures_and_refuses(bert, bert_onnx):
    x = example_inputs(bert, batch_size=3, seq_len=20, seed=7)
    diff = export.check_onnx(bert_onnx, bert, x, atol=1e-4)
    assert diff == pytest.approx(_max_diff(_ort(bert_onnx, x), _eager(bert, x)), abs=1e-7)
    other = copy.deepcopy(bert)
    with torch.no_grad():
        other.span_classifier.bias.add_(1e-3)  # a model the file no longer reproduces
    with pytest.raises(ExportError, match="differs from the eager model by 0.001"):
        export.check_onnx(bert_onnx, other, x, atol=1e-4)
    assert bert.training and other.training  # check_onnx gives the mode back too


def test_bert_qa_onnx_names_and_dynamic_axes(bert_onnx):
    inputs, outputs = _onnx_axes(bert_onnx)
    both = ["batch", "seq"]
    assert inputs == {"input_ids": both, "token_type_ids": both, "attention_mask": both}
    assert outputs == {"start": both, "end": both}  # SpanLogits' fields


@pytest.fixture(scope="module")
def bert_program(bert, tmp_path_factory):
    path = export.export_model(bert, tmp_path_factory.mktemp("bert") / "qa.pt2")
    return torch.export.load(path).module()


def test_bert_qa_torch_export_at_another_batch_and_length(bert, bert_program):
    program = bert_program
    for batch, seq_len in [(3, 11), (5, 40)]:
        x = example_inputs(bert, batch_size=batch, seq_len=seq_len, seed=batch)
        with torch.no_grad():
            got = program(*x)
        assert isinstance(got, tuple) and len(got) == 2  # (start, end): loads without modelzoo
        assert _max_diff(list(got), _eager(bert, x)) < 1e-5


def test_bert_torch_export_refuses_longer_than_positions(bert, bert_program):
    x = example_inputs(bert, seq_len=64)
    too_long = tuple(torch.cat([t, t[:, :1]], dim=1) for t in x)  # 65 > 64 positions
    with pytest.raises(AssertionError, match=r"Guard failed: input_ids.size\(\)\[1\] <= 64"):
        bert_program(*too_long)


@pytest.mark.filterwarnings(TORCHSCRIPT_DEPRECATED, TRACER)
def test_bert_qa_torchscript_at_another_batch_and_length(bert, tmp_path):
    loaded = torch.jit.load(str(export.export_model(bert, tmp_path / "qa.ts")))
    x = example_inputs(bert, batch_size=4, seq_len=23, seed=4)
    with torch.no_grad():
        got = list(loaded(*x))
    assert _max_diff(got, _eager(bert, x)) < 1e-5


# ---------------------------------------------------------------------------------------------
# GNNs: GCN, GraphSAGE, GAT (node classification) and GIN (graph classification)
# ---------------------------------------------------------------------------------------------


def _gnn(name: str) -> nn.Module:
    torch.manual_seed(0)
    return _randomize_norms(get_model(name, in_channels=8, num_classes=3))


def _bigger_graph(model: nn.Module) -> tuple:
    """Other node, edge (and graph) counts than example_inputs' default 12, 48 (and 2)."""
    return example_inputs(model, num_nodes=23, num_edges=90, num_graphs=3, seed=3)


# ONNX for a node classifier (GCN's normalisation) and the graph classifier (GIN's extra
# inputs); GraphSAGE's and GAT's ONNX files were measured once (docs/export.md), each ONNX
# export costs 3-6 s here and the suite keeps under 15 minutes. torch.export and TorchScript
# (below) cover all four.
@pytest.fixture(scope="module", params=["gcn", "gin"])
def gnn_onnx(request, tmp_path_factory):
    pytest.importorskip("onnxscript")
    model = _gnn(request.param)
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}.onnx"
    export.export_model(model, path)
    return model, path


def test_gnn_onnx_on_another_graph(gnn_onnx):
    model, path = gnn_onnx
    x = _bigger_graph(model)
    assert _max_diff(_ort(path, x), _eager(model, x)) < 1e-4
    inputs, outputs = _onnx_axes(path)
    assert inputs["x"] == ["num_nodes", 8] and inputs["edge_index"] == [2, "num_edges"]
    rows = "num_graphs" if "num_graphs" in inputs else "num_nodes"
    assert outputs == {"logits": [rows, 3]}


@pytest.mark.parametrize("name", GNNS)
def test_gnn_torch_export_on_another_graph(name, tmp_path):
    model = _gnn(name)
    program = torch.export.load(export.export_model(model, tmp_path / "g.pt2")).module()
    x = _bigger_graph(model)
    with torch.no_grad():
        got = [program(*x)]
    assert _max_diff(got, _eager(model, x)) < 1e-5


@pytest.mark.filterwarnings(TORCHSCRIPT_DEPRECATED, TRACER)
@pytest.mark.parametrize("name", GNNS)
def test_gnn_torchscript_on_another_graph(name, tmp_path):
    model = _gnn(name)
    loaded = torch.jit.load(str(export.export_model(model, tmp_path / "g.ts")))
    x = example_inputs(model, num_nodes=23, num_edges=90, num_graphs=None, seed=3)
    with torch.no_grad():
        got = [loaded(*x)]
    assert _max_diff(got, _eager(model, x)) < 1e-5


@pytest.mark.parametrize("fmt", ["onnx", "torch.export"])
def test_graphsage_lstm_does_not_export(fmt, tmp_path):
    """Documented: the LSTM aggregator's degree-dependent packing is data-dependent control
    flow; torch.export (hence the ONNX exporter) cannot capture it."""
    if fmt == "onnx":
        pytest.importorskip("onnxscript")
    model = _gnn("graphsage_lstm")
    with pytest.raises(ExportError, match="torch.export cannot capture GraphSAGE") as info:
        export.export_model(model, tmp_path / "g.bin", format=fmt)
    assert isinstance(info.value.__cause__, GuardOnDataDependentSymNode)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.filterwarnings(TORCHSCRIPT_DEPRECATED, TRACER)
def test_graphsage_lstm_trace_is_refused(tmp_path):
    """Its trace runs, but bakes the example's neighbour counts in: refused, not saved."""
    with pytest.raises(ExportError, match="baked in a data-dependent value"):
        export.export_model(_gnn("graphsage_lstm"), tmp_path / "g.ts")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.filterwarnings(TORCHSCRIPT_DEPRECATED, TRACER)
def test_gin_trace_of_a_batch_of_graphs_is_refused(tmp_path):
    """A trace over ``batch`` bakes the number of graphs in; only one graph per call traces."""
    model = _gnn("gin")
    x = example_inputs(model)[:3]  # x, edge_index, batch of 2 graphs
    with pytest.raises(ExportError, match="baked in a size"):
        export.export_torchscript(model, x, tmp_path / "g.ts")
    with pytest.raises(ValueError, match="takes tensors only"):
        export.export_torchscript(model, example_inputs(model), tmp_path / "g.ts")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Formats, bad inputs, atomic files, missing packages
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "fmt", "expected"),
    [
        ("m.onnx", None, "onnx"),
        ("m.pt2", None, "torch.export"),
        ("M.TS", None, "torchscript"),
        ("m.torchscript.pt", None, "torchscript"),
        ("m.bin", "pt2", "torch.export"),
        ("m.bin", "ts", "torchscript"),
    ],
)
def test_resolve_format(name, fmt, expected):
    assert export.resolve_format(name, fmt) == expected


@pytest.mark.parametrize(
    ("name", "fmt", "message"),
    [
        ("m.bin", None, r"cannot tell the format of '.*m\.bin'"),
        ("m.pt", None, r"cannot tell the format of '.*m\.pt'"),
        ("m.onnx", "tflite", "unknown format 'tflite'"),
        ("m.pt2", "onnx", "format 'onnx' but .* has the extension of 'torch.export' files"),
    ],
)
def test_bad_format_is_refused_before_any_work(name, fmt, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        export.export_model(nn.Linear(2, 2), tmp_path / name, format=fmt)
    assert list(tmp_path.iterdir()) == []


def test_bad_example_inputs(resnest, tmp_path):
    with pytest.raises(ValueError, match="do not run through ResNeSt"):
        export.export_program(resnest, torch.randn(2, 5, 32, 32), tmp_path / "r.pt2")
    with pytest.raises(TypeError, match="example input 0 is a str"):
        export.export_program(resnest, ("image.jpg",), tmp_path / "r.pt2")
    with pytest.raises(ValueError, match="only shape the default example inputs"):
        export.export_model(resnest, tmp_path / "r.pt2", example_inputs=(1,), image_size=32)
    with pytest.raises(ValueError, match="no default inputs for Linear"):
        export.export_model(nn.Linear(2, 2), tmp_path / "l.pt2")
    assert list(tmp_path.iterdir()) == []
    assert resnest.training


def test_wrong_number_of_onnx_names_is_refused(tmp_path):
    pytest.importorskip("onnxscript")
    x = (torch.randn(2, 4),)
    with pytest.raises(ValueError, match=r"2 input_names \['a', 'b'\] for the model's 1 inputs"):
        export.export_onnx(nn.Linear(4, 3), x, tmp_path / "l.onnx", input_names=["a", "b"])
    with pytest.raises(ValueError, match=r"0 output_names \[\] for the model's 1 outputs"):
        export.export_onnx(nn.Linear(4, 3), x, tmp_path / "l.onnx", output_names=[])
    assert list(tmp_path.iterdir()) == []


def test_a_size_1_dynamic_dimension_is_refused_with_the_fix(tmp_path):
    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"size 1.*batch_size=2.*dynamic_batch=False"):
        export.export_program(model, (torch.randn(1, 4),), tmp_path / "l.pt2")
    path = export.export_program(model, (torch.randn(1, 4),), tmp_path / "l.pt2",
                                 dynamic_batch=False)  # fmt: skip
    x = torch.randn(1, 4)
    assert torch.allclose(torch.export.load(path).module()(x), model(x))


def test_files_get_the_umask_permissions_not_mkstemp_s(tmp_path):
    umask = os.umask(0o022)
    try:
        path = export.export_program(nn.Linear(4, 3), (torch.randn(2, 4),), tmp_path / "l.pt2")
    finally:
        os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o644  # mkstemp alone would give 0o600


def _failing(*args, **kwargs):
    raise RuntimeError("exporter crashed")


def _partial_then_fail(obj, f, *args, **kwargs):
    f.write(b"half a file")
    raise RuntimeError("disk full")


def test_failed_onnx_export_leaves_no_file(tmp_path, monkeypatch):
    pytest.importorskip("onnxscript")
    model = nn.Linear(4, 3)
    monkeypatch.setattr(torch.onnx, "export", _failing)
    with pytest.raises(ExportError, match="exporter crashed"):
        export.export_onnx(model, (torch.randn(2, 4),), tmp_path / "l.onnx")
    assert list(tmp_path.iterdir()) == []
    assert model.training


@pytest.mark.filterwarnings(TORCHSCRIPT_DEPRECATED)
@pytest.mark.parametrize(("fmt", "target"), [("pt2", torch.export), ("ts", torch.jit)])
def test_failed_write_leaves_the_old_file_and_no_partial_one(fmt, target, tmp_path, monkeypatch):
    model = _gnn("gcn")
    path = tmp_path / f"g.{fmt}"
    path.write_bytes(b"the previous export")
    monkeypatch.setattr(target, "save", _partial_then_fail)
    with pytest.raises(RuntimeError, match="disk full"):
        export.export_model(model, path)
    assert list(tmp_path.iterdir()) == [path]
    assert path.read_bytes() == b"the previous export"


@pytest.mark.parametrize("module", ["onnx", "onnxscript"])
def test_missing_onnx_packages_say_what_to_install(module, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r'pip install "modelzoo-trainers-pt\[export\]"'):
        export.export_onnx(nn.Linear(2, 2), (torch.randn(2, 2),), tmp_path / "l.onnx")
    assert list(tmp_path.iterdir()) == []


def test_missing_onnxruntime_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(ImportError, match=r'pip install "modelzoo-trainers-pt\[export\]"'):
        export.check_onnx(tmp_path / "l.onnx", nn.Linear(2, 2), (torch.randn(2, 2),))


def test_example_inputs_shapes():
    gin = get_model("gin", in_channels=5, num_classes=2)
    x, edges, batch, graphs = example_inputs(gin, num_nodes=9, num_edges=30, num_graphs=3)
    assert x.shape == (9, 5) and edges.shape == (2, 30) and graphs == 3
    assert batch.tolist() == sorted(batch.tolist()) and set(batch.tolist()) == {0, 1, 2}
    assert (batch[edges[0]] == batch[edges[1]]).all()  # no edge between two graphs
    assert (edges[1][1:] >= edges[1][:-1]).all()  # sorted by target
    bert = build_bert(BertConfig(vocab_size=50, hidden_size=8, num_layers=1, num_heads=2,
                                 intermediate_size=8, max_position_embeddings=8), head="qa")  # fmt: skip
    ids, types, mask = example_inputs(bert, batch_size=2, seq_len=8)
    assert ids.shape == (2, 8) and int(ids.max()) < 50 and mask[-1].tolist() == [1] * 6 + [0] * 2
    with pytest.raises(ValueError, match="longer than the model's max_position_embeddings 8"):
        example_inputs(bert, seq_len=9)
