"""Layer-wise inference and the node-classification pipeline.

Oracles: the models' own full-graph forward (layer-wise inference must equal it), the
pre-protocol formulation of each forward (the per-layer refactor must not change a bit, in
training mode under the same seed), the real clubs of Zachary's karate club (networkx) and
the published test accuracy of the shipped karate weights.
"""

from __future__ import annotations

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modelzoo
from modelzoo.graph import datasets as gd
from modelzoo.graph._common import bipartite
from modelzoo.graph.inference import NodeClassificationPipeline, layerwise_inference
from modelzoo.graph.transforms import NodeFeatures

NODE_MODELS = ["gcn", "graphsage_mean", "graphsage_pool", "graphsage_lstm", "gat"]
KARATE_WEIGHTS = ["gcn_karate", "gat_karate", "graphsage_mean_karate"]


@pytest.fixture(scope="module")
def karate():
    return gd.karate_club()


@pytest.fixture(scope="module")
def sbm():
    return gd.sbm_graph(2000, num_blocks=5, num_features=16, avg_degree=8.0, seed=3)


@pytest.fixture(scope="module")
def small_sbm():  # the LSTM aggregator runs one packed sequence per node: keep it small
    return gd.sbm_graph(400, num_blocks=5, num_features=16, avg_degree=6.0, seed=4)


def _model(name: str, in_channels: int, num_layers: int = 3) -> nn.Module:
    torch.manual_seed(0)
    model = modelzoo.get_model(name, in_channels=in_channels, num_classes=5,
                               num_layers=num_layers)  # fmt: skip
    return model.eval()


# ---------------------------------------------------------------------------- layer-wise
@pytest.mark.parametrize("name", NODE_MODELS)
def test_layerwise_equals_the_full_graph_forward(name, karate, sbm, small_sbm):
    graphs = [(karate, 5), (small_sbm if name == "graphsage_lstm" else sbm, 128)]
    for data, batch_size in graphs:
        model = _model(name, data.x.size(1))
        full = model(data.x, data.edge_index)
        out = layerwise_inference(model, data, batch_size=batch_size)
        assert out.shape == full.shape == (data.num_nodes, 5)
        torch.testing.assert_close(out, full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["gcn", "graphsage_mean", "graphsage_pool", "gat"])
def test_layerwise_on_a_directed_graph_with_self_loops_and_unsorted_edges(name):
    """GCN's degrees and GAT's softmax must come from the whole graph whatever its edges."""
    g = torch.Generator().manual_seed(5)
    n = 300
    edge_index = torch.randint(n, (2, 2400), generator=g)  # directed, duplicates, self-loops
    edge_index[:, :20] = torch.arange(20).repeat(2, 1)
    x = torch.randn(n, 16, generator=g)
    model = _model(name, 16)
    full = model(x, edge_index)
    for batch_size in (16, n):
        out = layerwise_inference(model, (x, edge_index), batch_size=batch_size)
        torch.testing.assert_close(out, full, atol=1e-5, rtol=0)


def test_gin_layerwise_equals_its_graph_scores():
    from torch_geometric.data import Batch

    graphs, _ = gd.sbm_graph_classification(40, seed=1)
    batch = Batch.from_data_list(graphs)
    torch.manual_seed(0)
    model = modelzoo.get_model("gin", in_channels=1, num_classes=3).eval()
    for norm in model.norms:  # running statistics that do something
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2.0)
    full = model(batch.x, batch.edge_index, batch.batch, batch.num_graphs)
    out = layerwise_inference(model, batch, batch_size=97)
    assert out.shape == (40, 3)
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)
    one = graphs[0]  # a plain Data: one graph, as GIN.forward without a batch vector
    torch.testing.assert_close(
        layerwise_inference(model, one, batch_size=8), model(one.x, one.edge_index), atol=1e-5,
        rtol=1e-5,
    )  # fmt: skip


def test_layerwise_keeps_the_outputs_where_the_features_are(karate):
    model = _model("gcn", 34)
    out = layerwise_inference(model, karate, batch_size=8, device="cpu")
    assert out.device == karate.x.device and out.dtype == torch.float32


def test_what_cannot_run_layerwise_says_why(karate):
    model = _model("gat", 34).train()
    with pytest.raises(ValueError, match=r"GAT is in training mode.*model\.eval\(\)"):
        layerwise_inference(model, karate, batch_size=8)
    with pytest.raises(TypeError, match="Linear exposes no per-layer structure"):
        layerwise_inference(nn.Linear(34, 2).eval(), karate, batch_size=8)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        layerwise_inference(model.eval(), karate, batch_size=0)
    with pytest.raises(ValueError, match="in_channels=34 features per node"):
        layerwise_inference(model, (torch.ones(34, 3), karate.edge_index), batch_size=8)
    gcn = _model("gcn", 34)
    with pytest.raises(ValueError, match="needs edge_weight, the whole graph's normalisation"):
        gcn.layer_forward(0, karate.x, karate.edge_index, size=(10, 20))
    with pytest.raises(IndexError, match="GCN has 3 layers; no layer 3"):
        gcn.layer(3)


# ------------------------------------------------------ the per-layer refactor changed nothing
def _reference_forward(model, x, edge_index, layer_sizes=None):
    """Each family's forward as written before layer_forward existed."""
    name = type(model).__name__
    if name == "GIN":
        hidden = [x]
        for conv, norm in zip(model.convs, model.norms, strict=True):
            x = F.relu(norm(conv(x, edge_index)))
            hidden.append(x)
        batch = x.new_zeros(x.size(0), dtype=torch.long)
        score = 0
        for h, head in zip(hidden, model.heads, strict=True):
            score = score + F.dropout(head(model._pool(h, batch, 1)), model.dropout, training=True)
        return score
    sizes = [None] * (len(model.convs) + 1) if layer_sizes is None else layer_sizes
    drop = model.dropout
    for conv, size in zip(model.convs, sizes[:-1], strict=True):
        if name == "GAT":
            x = F.dropout(x, drop, training=True)
        if name == "GCN":
            x = F.dropout(F.relu(conv(x, edge_index)), drop, training=True)
        elif name == "GAT":
            x = F.elu(conv(*bipartite(x, edge_index, size)))
        else:
            x = F.dropout(F.relu(conv(*bipartite(x, edge_index, size))), drop, training=True)
    if name == "GAT":
        x = F.dropout(x, drop, training=True)
    if name == "GCN":
        return model.head(x, edge_index)
    return model.head(*bipartite(x, edge_index, sizes[-1]))


@pytest.mark.parametrize("name", ["gcn", "graphsage_mean", "gat", "gin"])
def test_forward_is_bit_for_bit_the_pre_protocol_forward(name, karate):
    in_channels = 1 if name == "gin" else 34
    x = karate.x[:, :1].contiguous() if name == "gin" else karate.x
    torch.manual_seed(0)
    model = modelzoo.get_model(name, in_channels=in_channels, num_classes=2).train()
    torch.manual_seed(1)
    ours = model(x, karate.edge_index)
    torch.manual_seed(1)
    theirs = _reference_forward(model, x, karate.edge_index)
    assert torch.equal(ours, theirs)
    if name in ("graphsage_mean", "gat"):  # the sampled, trimmed path (layer_sizes)
        from modelzoo.graph.sampler import NeighborSampler

        sub = NeighborSampler(karate.edge_index, 34, [5, 5]).sample(torch.tensor([0, 9, 33]))
        xs = x[sub.n_id]
        torch.manual_seed(2)
        ours = model(xs, sub.edge_index, layer_sizes=sub.layer_sizes)
        torch.manual_seed(2)
        theirs = _reference_forward(model, xs, sub.edge_index, sub.layer_sizes)
        assert torch.equal(ours, theirs)


# ------------------------------------------------------------------------------- pipeline
def _clubs() -> list[str]:
    graph = nx.karate_club_graph()
    return [graph.nodes[i]["club"] for i in range(34)]


@pytest.mark.parametrize("name", KARATE_WEIGHTS)
def test_published_karate_weights_predict_the_clubs(name, karate):
    pipe = NodeClassificationPipeline.from_pretrained(name)
    weights = modelzoo.get_weights(name)
    assert pipe.labels == weights.labels == ("Mr. Hi", "Officer")
    preds = pipe(karate)
    assert [p["node"] for p in preds] == list(range(34))
    # independent: the full-graph output of the published model, argmax through the labels
    net = modelzoo.get_model(name, pretrained=True).eval()
    with torch.no_grad():
        expected = net(karate.x, karate.edge_index).argmax(1).tolist()
    assert [p["index"] for p in preds] == expected
    assert [p["label"] for p in preds] == [weights.labels[k] for k in expected]
    clubs = _clubs()
    right = [p["label"] == clubs[p["node"]] for p in preds]
    assert sum(right) >= 30  # most members' real club
    test_nodes = karate.test_mask.nonzero().view(-1).tolist()
    test_acc = 100 * sum(right[i] for i in test_nodes) / len(test_nodes)
    assert round(test_acc, 2) == weights.metrics["test_acc"]
    # layer-wise inference predicts the same, with the same scores
    blocks = NodeClassificationPipeline.from_pretrained(name, batch_size=4)(karate)
    assert [p["index"] for p in blocks] == expected
    assert [p["score"] for p in blocks] == pytest.approx([p["score"] for p in preds], abs=1e-5)


def test_output_forms_and_top_k(karate):
    pipe = NodeClassificationPipeline.from_pretrained("gcn_karate")
    one = pipe(karate, nodes=33)
    assert set(one) == {"node", "label", "index", "score"} and one["node"] == 33
    assert one["label"] == "Officer" and 0.5 < one["score"] <= 1.0
    picked = pipe(karate, nodes=[33, 0, 5])
    assert [p["node"] for p in picked] == [33, 0, 5]
    assert pipe(karate, nodes=torch.tensor([33, 0, 5])) == picked
    masked = pipe(karate, nodes=karate.test_mask)
    assert [p["node"] for p in masked] == karate.test_mask.nonzero().view(-1).tolist()
    assert pipe(karate, nodes=[]) == []
    both = pipe(karate, nodes=[0, 33], top_k=2)
    for node, entry in zip([0, 33], both, strict=True):
        assert [p["node"] for p in entry] == [node, node]
        assert entry[0]["score"] >= entry[1]["score"]
        assert {p["index"] for p in entry} == {0, 1}
        assert sum(p["score"] for p in entry) == pytest.approx(1.0, abs=1e-6)
    probs = pipe.probabilities(karate, nodes=[0, 33])
    assert probs.shape == (2, 2)
    assert [e[0]["score"] for e in both] == pytest.approx(probs.max(1).values.tolist())
    assert pipe((karate.x, karate.edge_index), nodes=[0, 33]) == pipe(karate, nodes=[0, 33])


def test_top_k_ordering_over_many_classes(sbm):
    model = _model("graphsage_mean", 16, num_layers=2)
    pipe = NodeClassificationPipeline(model, top_k=3, batch_size=512)
    preds = pipe(sbm, nodes=range(50))
    probs = torch.softmax(model(sbm.x, sbm.edge_index)[:50], dim=1)
    for node, entry in enumerate(preds):
        scores = [p["score"] for p in entry]
        assert scores == sorted(scores, reverse=True) and sum(scores) <= 1.0 + 1e-6
        assert [p["label"] for p in entry] == [str(p["index"]) for p in entry]  # no labels
        assert entry[0]["index"] == int(probs[node].argmax())
        assert scores == pytest.approx(probs[node].topk(3).values.tolist(), abs=1e-5)


def test_the_transform_is_applied_and_the_input_left_alone(karate):
    torch.manual_seed(0)
    x = torch.rand(34, 34)
    data = karate.clone()
    data.x = x.clone()
    model = modelzoo.get_model("gcn_karate").eval()
    pipe = NodeClassificationPipeline(model, transform=NodeFeatures(normalize=True))
    probs = pipe.probabilities(data)
    expected = torch.softmax(model(x / x.sum(1, keepdim=True), karate.edge_index), dim=1)
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=0)
    assert torch.equal(data.x, x)  # not normalized in place
    assert torch.equal(pipe.probabilities((x, karate.edge_index)), probs)


def test_float64_and_device_options(karate):
    base = NodeClassificationPipeline.from_pretrained("gcn_karate")
    wide = NodeClassificationPipeline.from_pretrained("gcn_karate", dtype=torch.float64,
                                                      device="cpu")  # fmt: skip
    assert wide.dtype == torch.float64 and wide.device == torch.device("cpu")
    assert all(p.dtype == torch.float64 for p in wide.model.parameters())
    p32, p64 = base.probabilities(karate), wide.probabilities(karate)
    assert p32.dtype == torch.float32 and p64.dtype == torch.float64
    torch.testing.assert_close(p64, p32.double(), atol=1e-5, rtol=0)
    named = NodeClassificationPipeline.from_pretrained("gcn_karate", dtype="float64", batch_size=5)
    torch.testing.assert_close(named.probabilities(karate), p64, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        NodeClassificationPipeline.from_pretrained("gcn_karate", dtype="float8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_layerwise_runs_on_the_gpu_with_the_features_on_the_host(sbm):
    model = _model("gat", 16)
    full = model(sbm.x, sbm.edge_index)
    out = layerwise_inference(model.cuda(), sbm, batch_size=256)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, full, atol=1e-4, rtol=1e-4)
    pipe = NodeClassificationPipeline(model, device="cuda", batch_size=256)
    assert pipe(sbm, nodes=7)["index"] == int(full[7].argmax())


def test_bad_inputs_name_the_fix(karate):
    pipe = NodeClassificationPipeline.from_pretrained("gcn_karate")
    ei = karate.edge_index
    with pytest.raises(ValueError, match=r"in_channels=34 features per node, but x has 10"):
        pipe((torch.ones(34, 10), ei))
    with pytest.raises(ValueError, match=r"\(2, num_edges\).*transpose an \(E, 2\) edge list"):
        pipe((karate.x, ei.t()))
    with pytest.raises(ValueError, match=r"int64 node ids \(torch\.long\), got torch\.int32"):
        pipe((karate.x, ei.int()))
    with pytest.raises(ValueError, match="edge_index names node 40, out of range for the 34"):
        pipe((karate.x, torch.tensor([[0, 40], [1, 2]])))
    with pytest.raises(ValueError, match="edge_index names node -1"):
        pipe((karate.x, torch.tensor([[0, -1], [1, 2]])))
    with pytest.raises(IndexError, match="node 34 is out of range for a graph of 34 nodes"):
        pipe(karate, nodes=[0, 34])
    with pytest.raises(IndexError, match="node -1 is out of range"):
        pipe(karate, nodes=-1)
    with pytest.raises(ValueError, match=r"boolean node mask must have shape \(34,\)"):
        pipe(karate, nodes=torch.ones(10, dtype=torch.bool))
    with pytest.raises(TypeError, match="integer node ids"):
        pipe(karate, nodes=[0.5])
    with pytest.raises(ValueError, match="top_k=3 > the model's 2 classes"):
        pipe(karate, top_k=3)
    with pytest.raises(TypeError, match=r"Data with x and edge_index, or a tuple"):
        pipe(karate.x)
    with pytest.raises(TypeError, match=r"a tuple input is \(x, edge_index\)"):
        pipe((karate.x, ei, None))


def test_bad_pipeline_options_are_clear(karate):
    model = modelzoo.get_model("gcn_karate")
    with pytest.raises(ValueError, match="top_k=3 > the model's 2 classes"):
        NodeClassificationPipeline(model, top_k=3)
    with pytest.raises(ValueError, match="3 labels for a model with num_classes=2"):
        NodeClassificationPipeline(model, labels=["a", "b", "c"])
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        NodeClassificationPipeline(model, batch_size=0)
    with pytest.raises(ValueError, match="GIN is a graph classifier"):
        NodeClassificationPipeline(modelzoo.get_model("gin"))
    with pytest.raises(TypeError, match="Linear exposes no per-layer structure"):
        NodeClassificationPipeline(nn.Linear(34, 2), batch_size=8)
    with pytest.raises(ValueError, match="has image weights"):
        NodeClassificationPipeline.from_pretrained("resnest50")

    # a plain module without the protocol still runs full-graph
    class Plain(nn.Module):
        def forward(self, x, edge_index):
            return x[:, :3]

    out = NodeClassificationPipeline(Plain(), labels=["a", "b", "c"])((karate.x, karate.edge_index))
    assert [out[i]["label"] for i in range(3)] == ["a", "b", "c"]  # x is the identity


def test_the_pipeline_factory_builds_it(karate):
    pipe = modelzoo.pipeline("node-classification", "gcn_karate", top_k=2)
    assert isinstance(pipe, NodeClassificationPipeline) and pipe.labels == ("Mr. Hi", "Officer")
    assert pipe.transform == NodeFeatures(normalize=False)
    assert pipe(karate, nodes=0)[0]["label"] == "Mr. Hi"
