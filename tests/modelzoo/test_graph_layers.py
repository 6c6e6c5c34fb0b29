"""Each graph model's layers against dense reference math written here from the papers.

The oracles are the published formulas on a dense adjacency matrix (numpy/torch written in
this file), never the layers' own output: GCN (Kipf & Welling eq. 2), GraphSAGE (Hamilton et
al. Alg. 1 with the mean / max-pool / LSTM aggregators), GAT (Velickovic et al. eq. 1-5) and
GIN (Xu et al. eq. 4.1).
"""

from __future__ import annotations

import pytest
import torch

import modelzoo
from modelzoo.graph import GAT, GCN, GIN, GraphSAGE

# A small directed-both-ways graph with unequal degrees, an isolated node (5) and a leaf.
EDGES = [(0, 1), (0, 2), (1, 2), (2, 3), (3, 4), (0, 4), (4, 6), (1, 6)]
N = 7


def _edge_index() -> torch.Tensor:
    pairs = EDGES + [(b, a) for a, b in EDGES]
    pairs.sort(key=lambda e: (e[1], e[0]))  # by target (the LSTM aggregation needs it)
    return torch.tensor(pairs).t()


def _adjacency() -> torch.Tensor:
    """A[i, j] = 1 if j -> i (row = target)."""
    a = torch.zeros(N, N, dtype=torch.float64)
    for s, t in EDGES:
        a[t, s] = a[s, t] = 1.0
    return a


def _x(channels: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.randn(N, channels, generator=torch.Generator().manual_seed(seed)).double()


def test_gcn_layer_is_normalized_adjacency_times_x_w():
    model = GCN(5, 3, hidden_channels=4).double()
    conv = model.convs[0]
    x, a = _x(), _adjacency()
    a_hat = a + torch.eye(N, dtype=torch.float64)
    d = a_hat.sum(1).pow(-0.5)
    expected = d[:, None] * a_hat * d[None, :] @ x @ conv.lin.weight.t() + conv.bias
    torch.testing.assert_close(conv(x, _edge_index()), expected)


def test_gcn_model_is_two_propagations_with_relu():
    model = GCN(5, 3, hidden_channels=4).double().eval()
    x, a = _x(), _adjacency()
    a_hat = a + torch.eye(N, dtype=torch.float64)
    d = a_hat.sum(1).pow(-0.5)
    s = d[:, None] * a_hat * d[None, :]
    c1, c2 = model.convs[0], model.head
    h = torch.relu(s @ x @ c1.lin.weight.t() + c1.bias)
    expected = s @ h @ c2.lin.weight.t() + c2.bias
    torch.testing.assert_close(model(x, _edge_index()), expected)


def _mean_neighbours(a: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    deg = a.sum(1, keepdim=True)
    return torch.where(deg > 0, a @ h / deg.clamp(min=1), torch.zeros_like(h[:, :1]))


def test_sage_mean_layer():
    model = GraphSAGE(5, 3, hidden_channels=4, aggregator="mean").double()
    conv = model.convs[0]
    x, a = _x(), _adjacency()
    expected = _mean_neighbours(a, x) @ conv.lin_l.weight.t() + conv.lin_l.bias
    expected = expected + x @ conv.lin_r.weight.t()
    torch.testing.assert_close(conv(x, _edge_index()), expected)


def test_sage_pool_layer_is_max_of_relu_projection():
    model = GraphSAGE(5, 3, hidden_channels=4, aggregator="pool").double()
    conv = model.convs[0]
    x, a = _x(), _adjacency()
    pooled = torch.relu(x @ conv.lin.weight.t() + conv.lin.bias)  # (N, 5)
    agg = torch.zeros(N, 5, dtype=torch.float64)
    for i in range(N):
        nbrs = a[i].nonzero().view(-1)
        if nbrs.numel():
            agg[i] = pooled[nbrs].max(0).values
    expected = agg @ conv.lin_l.weight.t() + conv.lin_l.bias + x @ conv.lin_r.weight.t()
    torch.testing.assert_close(conv(x, _edge_index()), expected)


def _lstm_reference(lstm: torch.nn.LSTM, seq: torch.Tensor) -> torch.Tensor:
    """The LSTM cell equations (Hochreiter & Schmidhuber; PyTorch's gate order i, f, g, o)."""
    hidden = lstm.hidden_size
    h = torch.zeros(hidden, dtype=torch.float64)
    c = torch.zeros(hidden, dtype=torch.float64)
    for x_t in seq:
        gates = lstm.weight_ih_l0 @ x_t + lstm.bias_ih_l0 + lstm.weight_hh_l0 @ h + lstm.bias_hh_l0
        i, f, g, o = gates.split(hidden)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
    return h


def test_sage_lstm_layer_runs_the_lstm_over_each_nodes_own_neighbours():
    model = GraphSAGE(5, 3, hidden_channels=4, aggregator="lstm").double()
    conv = model.convs[0]
    lstm = conv.aggr_module.lstm
    x = _x()
    edge_index = _edge_index()
    agg = torch.zeros(N, 5, dtype=torch.float64)
    for i in range(N):
        sources = edge_index[0][edge_index[1] == i]  # in edge order
        if sources.numel():
            agg[i] = _lstm_reference(lstm, x[sources])
    expected = agg @ conv.lin_l.weight.t() + conv.lin_l.bias + x @ conv.lin_r.weight.t()
    torch.testing.assert_close(conv(x, edge_index), expected)


def test_gat_layer_multi_head_attention():
    heads, out = 3, 4
    model = GAT(5, 2, hidden_channels=out, heads=heads).double().eval()
    conv = model.convs[0]
    x, a = _x(), _adjacency()
    a_self = a + torch.eye(N, dtype=torch.float64)  # GATConv adds self-loops
    wx = (x @ conv.lin.weight.t()).view(N, heads, out)  # (N, H, F)
    att_src = conv.att_src.view(heads, out)
    att_dst = conv.att_dst.view(heads, out)
    parts = []
    for k in range(heads):
        e_src = wx[:, k] @ att_src[k]  # (N,)
        e_dst = wx[:, k] @ att_dst[k]
        scores = torch.nn.functional.leaky_relu(e_dst[:, None] + e_src[None, :], 0.2)
        scores = scores.masked_fill(a_self == 0, float("-inf"))
        alpha = torch.softmax(scores, dim=1)  # row i: attention of i over its neighbours j
        parts.append(alpha @ wx[:, k])
    expected = torch.cat(parts, dim=1) + conv.bias
    torch.testing.assert_close(conv(x, _edge_index()), expected)


def test_gat_output_layer_averages_heads():
    model = GAT(5, 2, hidden_channels=4, heads=2, out_heads=3).double().eval()
    head = model.head
    h = _x(8, seed=1)
    a_self = _adjacency() + torch.eye(N, dtype=torch.float64)
    wx = (h @ head.lin.weight.t()).view(N, 3, 2)
    outs = []
    for k in range(3):
        e_src = wx[:, k] @ head.att_src.view(3, 2)[k]
        e_dst = wx[:, k] @ head.att_dst.view(3, 2)[k]
        s = torch.nn.functional.leaky_relu(e_dst[:, None] + e_src[None, :], 0.2)
        alpha = torch.softmax(s.masked_fill(a_self == 0, float("-inf")), dim=1)
        outs.append(alpha @ wx[:, k])
    expected = torch.stack(outs).mean(0) + head.bias
    torch.testing.assert_close(head(h, _edge_index()), expected)


def test_gin_layer_sums_neighbours_plus_self():
    model = GIN(5, 2, hidden_channels=4, train_eps=True).double().eval()
    conv = model.convs[0]
    with torch.no_grad():
        conv.eps.fill_(0.25)
    x, a = _x(), _adjacency()
    expected = conv.nn((1 + 0.25) * x + a @ x)
    torch.testing.assert_close(conv(x, _edge_index()), expected)


def test_gin_readout_sums_every_layers_pooled_prediction():
    model = GIN(5, 3, hidden_channels=4, num_layers=3).double().eval()
    x, a = _x(), _adjacency()
    batch = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    # hidden representations by the formula (eval-mode batch norm is an affine map)
    hs = [x]
    h = x
    for conv, norm in zip(model.convs, model.norms, strict=True):
        h = conv.nn(h + a @ h)
        h = (h - norm.running_mean) / torch.sqrt(norm.running_var + norm.eps)
        h = torch.relu(h * norm.weight + norm.bias)
        hs.append(h)
    expected = torch.zeros(2, 3, dtype=torch.float64)
    for h, lin in zip(hs, model.heads, strict=True):
        pooled = torch.stack([h[batch == g].sum(0) for g in range(2)])
        expected += pooled @ lin.weight.t() + lin.bias
    torch.testing.assert_close(model(x, _edge_index(), batch, 2), expected)


def test_bad_options_say_how_to_fix_them():
    with pytest.raises(ValueError, match="aggregator must be one of mean, pool, lstm"):
        GraphSAGE(5, 2, aggregator="sum")
    with pytest.raises(ValueError, match="dropout must be in"):
        GCN(5, 2, dropout=1.5)
    with pytest.raises(ValueError, match="readout must be one of"):
        GIN(5, 2, readout="attention")


# Not graphsage_lstm: an LSTM reads the neighbours in order, so relabelling changes it.
@pytest.mark.parametrize("name", ["gcn", "graphsage_mean", "graphsage_pool", "gat"])
def test_node_models_are_permutation_equivariant(name):
    """Relabelling the nodes permutes the output rows (a property of every message-passing net)."""
    torch.manual_seed(0)
    model = modelzoo.get_model(name, num_classes=3, in_channels=5).double().eval()
    x, edge_index = _x(), _edge_index()
    perm = torch.tensor([3, 6, 0, 5, 1, 4, 2])  # new id of old node i is inverse[i]
    inverse = torch.argsort(perm)
    new_edges = inverse[edge_index]
    order = torch.argsort(new_edges[1] * N + new_edges[0])
    out = model(x, edge_index)
    out_perm = model(x[perm], new_edges[:, order])
    torch.testing.assert_close(out_perm, out[perm])
