"""Graph loaders on small files written here in the exact on-disk formats.

Oracles: networkx's karate club (the real club labels), PyG's own Planetoid reader
(``torch_geometric.io.read_planetoid_data``) on the same files, and the arrays the test
wrote for the OGB, edge-list and npz formats.
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import io
import os
import pickle
import zipfile
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
import scipy.sparse as sp
import torch

from modelzoo.graph import datasets as gd
from modelzoo.store import ChecksumError, DownloadError, file_hash

from ..loopback import LocalServer


# ------------------------------------------------------------------------------ karate club
def test_karate_club_is_zacharys_graph_with_the_real_clubs():
    data = gd.karate_club()
    graph = nx.karate_club_graph()
    ours = {tuple(sorted(e)) for e in data.edge_index.t().tolist()}
    theirs = {tuple(sorted(e)) for e in graph.edges()}
    assert ours == theirs and len(theirs) == 78
    assert data.edge_index.size(1) == 2 * 78  # both directions
    clubs = [0 if graph.nodes[i]["club"] == "Mr. Hi" else 1 for i in range(34)]
    assert data.y.tolist() == clubs
    masks = data.train_mask.int() + data.val_mask.int() + data.test_mask.int()
    assert masks.eq(1).all() and int(data.test_mask.sum()) == 22


# --------------------------------------------------------------------------------- Planetoid
def _write_planetoid(root: Path, name: str, *, citeseer_gap: bool = False, protocol: int = 2):
    """A 516-node Planetoid-format dataset: 4 train, 506 more in allx (500 of them the
    validation nodes), 6 test nodes listed in shuffled order."""
    rng = np.random.default_rng(0)
    n_all, n_train, n_test, dim, classes = 510, 4, 6, 5, 3
    feats = (rng.random((n_all + n_test, dim)) > 0.5).astype(np.float32)
    labels = rng.integers(0, classes, n_all + n_test)
    onehot = np.eye(classes, dtype=np.float64)[labels]
    test_nodes = np.arange(n_all, n_all + n_test)
    if citeseer_gap:  # node 512 is an isolated test node with no row in tx/ty
        test_nodes = np.array([510, 511, 513, 514, 515])
    test_order = rng.permutation(test_nodes)
    objects = {
        "x": sp.csr_matrix(feats[:n_train]),
        "y": onehot[:n_train],
        "allx": sp.csr_matrix(feats[:n_all]),
        "ally": onehot[:n_all],
        "tx": sp.csr_matrix(feats[np.sort(test_nodes)]),
        "ty": onehot[np.sort(test_nodes)],
    }
    graph = collections.defaultdict(list)
    for s, t in [(0, 1), (1, 2), (2, 3), (3, 510), (510, 511), (4, 5), (5, 515), (7, 8), (514, 6)]:
        graph[s].append(t)
        graph[t].append(s)
    graph[0].append(1)  # a duplicate edge and a self-loop, as the real files have
    graph[2].append(2)
    objects["graph"] = graph
    root.mkdir(parents=True, exist_ok=True)
    for key, obj in objects.items():
        (root / f"ind.{name}.{key}").write_bytes(pickle.dumps(obj, protocol=protocol))
    (root / f"ind.{name}.test.index").write_text("\n".join(str(i) for i in test_order) + "\n")
    return test_order


@pytest.mark.parametrize("protocol", [2, 4])
def test_planetoid_matches_pygs_reader(tmp_path, protocol):
    from torch_geometric.io import read_planetoid_data

    _write_planetoid(tmp_path, "cora", protocol=protocol)
    ours = gd.load_planetoid("cora", tmp_path)
    ref = read_planetoid_data(str(tmp_path), "cora")
    torch.testing.assert_close(ours.x, ref.x.float())
    assert torch.equal(ours.y, ref.y)
    for key in ("train_mask", "val_mask", "test_mask"):
        assert torch.equal(ours[key], ref[key]), key
    ref_edges = {tuple(e) for e in ref.edge_index.t().tolist()}
    assert {tuple(e) for e in ours.edge_index.t().tolist()} == ref_edges
    assert bool((ours.edge_index[1][1:] >= ours.edge_index[1][:-1]).all())  # sorted by target


def test_planetoid_citeseer_isolated_test_nodes_match_pyg(tmp_path):
    from torch_geometric.io import read_planetoid_data

    _write_planetoid(tmp_path, "citeseer", citeseer_gap=True)
    ours = gd.load_planetoid("citeseer", tmp_path)
    ref = read_planetoid_data(str(tmp_path), "citeseer")
    torch.testing.assert_close(ours.x, ref.x.float())
    assert torch.equal(ours.y, ref.y) and torch.equal(ours.test_mask, ref.test_mask)


class _Marker:
    """Unpickling this would create a file: proof that code ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_planetoid_refuses_a_pickle_with_a_disallowed_class(tmp_path):
    _write_planetoid(tmp_path, "cora")
    marker = tmp_path / "pwned"
    (tmp_path / "ind.cora.graph").write_bytes(pickle.dumps(_Marker(str(marker)), protocol=2))
    with pytest.raises(gd.DatasetError, match=r"ind\.cora\.graph: the pickle asks for .*refusing"):
        gd.load_planetoid("cora", tmp_path)
    assert not marker.exists()
    pickle.loads((tmp_path / "ind.cora.graph").read_bytes())  # a plain unpickler runs it
    assert marker.exists()


def test_planetoid_refuses_os_system(tmp_path):
    _write_planetoid(tmp_path, "pubmed")
    payload = b"cos\nsystem\n(S'touch pwned'\ntR."
    (tmp_path / "ind.pubmed.x").write_bytes(payload)
    with pytest.raises(gd.DatasetError, match=r"ind\.pubmed\.x.*os\.system"):
        gd.load_planetoid("pubmed", tmp_path)
    assert not (Path.cwd() / "pwned").exists()


def test_planetoid_truncated_and_malformed_files_name_the_file(tmp_path):
    _write_planetoid(tmp_path, "cora")
    good = (tmp_path / "ind.cora.ally").read_bytes()
    (tmp_path / "ind.cora.ally").write_bytes(good[: len(good) // 2])
    with pytest.raises(gd.DatasetError, match=r"ind\.cora\.ally: not a readable Planetoid pickle"):
        gd.load_planetoid("cora", tmp_path)
    _write_planetoid(tmp_path, "cora")
    (tmp_path / "ind.cora.test.index").write_text("10\neleven\n")
    with pytest.raises(gd.DatasetError, match=r"ind\.cora\.test\.index:2: .*'eleven'"):
        gd.load_planetoid("cora", tmp_path)


def test_missing_planetoid_says_where_to_put_the_files(tmp_path):
    with pytest.raises(gd.DatasetNotFoundError) as info:
        gd.load_planetoid("Cora", tmp_path / "nowhere")
    message = str(info.value)
    assert "ind.cora.x" in message and str(tmp_path / "nowhere") in message
    assert gd.PLANETOID_URL in message and "download=True" in message


def test_planetoid_download_from_a_local_server(tmp_path, monkeypatch):
    monkeypatch.delenv("MODELZOO_DATA_URL", raising=False)
    monkeypatch.delenv("MODELZOO_OFFLINE", raising=False)
    source = tmp_path / "source"
    _write_planetoid(source, "cora")
    for path in source.iterdir():  # pin these files' git blob ids in place of Planetoid's
        monkeypatch.setitem(gd.PLANETOID_BLOBS, path.name, file_hash(path, "git-sha1"))
    server = LocalServer()
    try:
        for path in source.iterdir():
            server.serve(f"planetoid/data/{path.name}", path.read_bytes())
        root = tmp_path / "cora"
        gd.download_planetoid("cora", root, base_url=server.url("planetoid/data"))
        data = gd.load_planetoid("cora", root)
        assert data.num_nodes == 516
        assert server.total_hits == 8
        gd.download_planetoid("cora", root, base_url=server.url("planetoid/data"))
        assert server.total_hits == 8  # present, verified files are not fetched again
        # a missing file on the host: DownloadError, and no partial file is left
        with pytest.raises(DownloadError, match="HTTP 404") as info:
            gd.download_planetoid(
                "citeseer", tmp_path / "cs", base_url=server.url("planetoid/data")
            )
        assert "place the file by hand at" in str(info.value)
        assert "MODELZOO_DATA_URL" in str(info.value)  # the data mirror, not the weights one
        assert "MODELZOO_REPO_URL" not in str(info.value)  # a weights mirror serves no data
        assert not any(p.name.endswith(".part") for p in (tmp_path / "cs").iterdir())
        # bytes that are not the pinned blob: refused, nothing kept
        monkeypatch.setitem(gd.PLANETOID_BLOBS, "ind.cora.x", "0" * 40)
        with pytest.raises(ChecksumError, match="git-sha1"):
            gd.download_planetoid("cora", tmp_path / "c2", base_url=server.url("planetoid/data"))
        assert not (tmp_path / "c2" / "ind.cora.x").exists()
        assert not any(p.name.endswith(".part") for p in (tmp_path / "c2").iterdir())
    finally:
        server.close()


# ------------------------------------------------------------------------------------- OGB
def _gz(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def _write_ogb(root: Path, scheme: str = "sales_ranking") -> dict:
    rng = np.random.default_rng(1)
    n, dim = 12, 3
    x = rng.normal(size=(n, dim)).round(4)
    y = rng.integers(0, 4, n)
    edges = [(i, (i * 5 + 1) % n) for i in range(n)]
    _gz(root / "raw" / "edge.csv.gz", [f"{a},{b}" for a, b in edges])
    _gz(root / "raw" / "node-feat.csv.gz", [",".join(str(v) for v in row) for row in x])
    _gz(root / "raw" / "node-label.csv.gz", [str(v) for v in y])
    _gz(root / "raw" / "num-node-list.csv.gz", [str(n)])
    splits = {"train": [0, 1, 2, 3, 4, 5], "valid": [6, 7, 8], "test": [9, 10, 11]}
    for part, idx in splits.items():
        _gz(root / "split" / scheme / f"{part}.csv.gz", [str(i) for i in idx])
    return {"x": x, "y": y, "edges": edges, "splits": splits}


def test_ogb_node_layout(tmp_path):
    truth = _write_ogb(tmp_path / "ogbn-products")
    data = gd.load_ogb_node("ogbn-products", tmp_path / "ogbn-products")
    torch.testing.assert_close(data.x, torch.tensor(truth["x"], dtype=torch.float32))
    assert data.y.tolist() == truth["y"].tolist()
    expected = {(a, b) for a, b in truth["edges"] if a != b} | {
        (b, a) for a, b in truth["edges"] if a != b
    }
    assert {tuple(e) for e in data.edge_index.t().tolist()} == expected
    assert data.train_mask.nonzero().view(-1).tolist() == truth["splits"]["train"]
    assert data.val_mask.nonzero().view(-1).tolist() == truth["splits"]["valid"]
    assert data.test_mask.nonzero().view(-1).tolist() == truth["splits"]["test"]


def test_ogb_malformed_and_missing_files(tmp_path):
    root = tmp_path / "ogbn-arxiv"
    _write_ogb(root)
    _gz(root / "raw" / "edge.csv.gz", ["0,1", "1,2,3"])
    with pytest.raises(gd.DatasetError, match=r"edge\.csv\.gz:2: expected 2 comma-separated"):
        gd.load_ogb_node("ogbn-arxiv", root)
    _gz(root / "raw" / "edge.csv.gz", ["0,1", "1,99"])
    with pytest.raises(gd.DatasetError, match=r"edge\.csv\.gz: an edge names node 99"):
        gd.load_ogb_node("ogbn-arxiv", root)
    (root / "raw" / "node-label.csv.gz").unlink()
    with pytest.raises(gd.DatasetNotFoundError, match=r"raw/node-label\.csv\.gz.*arxiv\.zip"):
        gd.load_ogb_node("ogbn-arxiv", root)


def test_ogb_download_unpacks_a_served_zip(tmp_path):
    source = tmp_path / "src" / "products"
    truth = _write_ogb(source)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for path in source.rglob("*"):
            if path.is_file():
                zf.write(path, "products/" + path.relative_to(source).as_posix())
    evil = io.BytesIO()
    with zipfile.ZipFile(evil, "w") as zf:
        zf.writestr("../escape.txt", b"x")
    server = LocalServer()
    try:
        server.serve("ogb/products.zip", buffer.getvalue())
        server.serve("bad/products.zip", evil.getvalue())
        root = tmp_path / "data" / "ogbn-products"
        # OGB publishes no checksum: without one, nothing is downloaded
        with pytest.raises(gd.DatasetNotFoundError, match="no checksum.*--ogb-sha256"):
            gd.download_ogb_node("ogbn-products", root, base_url=server.url("ogb"))
        assert server.total_hits == 0 and not root.exists()
        digest = hashlib.sha256(buffer.getvalue()).hexdigest()
        with pytest.raises(ChecksumError):
            gd.download_ogb_node("ogbn-products", root, sha256="0" * 64, base_url=server.url("ogb"))
        assert not root.exists() and [p.name for p in root.parent.iterdir()] == []
        gd.download_ogb_node("ogbn-products", root, sha256=digest, base_url=server.url("ogb"))
        assert gd.load_ogb_node("ogbn-products", root).num_nodes == len(truth["y"])
        evil_digest = hashlib.sha256(evil.getvalue()).hexdigest()
        with pytest.raises(DownloadError, match="unsafe member names"):
            gd.download_ogb_node(
                "ogbn-products", tmp_path / "d3" / "p", sha256=evil_digest,
                base_url=server.url("bad"),
            )  # fmt: skip
        assert not (tmp_path / "d3" / "escape.txt").exists()
        assert not (tmp_path / "d3" / "p").exists()
        assert [p.name for p in (tmp_path / "d3").iterdir()] == []  # no temp folder left
    finally:
        server.close()


# ------------------------------------------------------------------------ edge lists, npz
def test_edge_list_and_its_errors(tmp_path):
    path = tmp_path / "g.txt"
    path.write_text("# a comment\n0 1\n1 2  # trailing comment\n\n2 0\n")
    assert gd.load_edge_list(path).tolist() == [[0, 1, 2], [1, 2, 0]]
    path.write_text("0 1\n1 x\n")
    with pytest.raises(gd.DatasetError, match=r"g\.txt:2: node ids must be integers"):
        gd.load_edge_list(path)
    path.write_text("0 1\n1 5\n")
    with pytest.raises(gd.DatasetError, match=r"g\.txt:2: node id out of range \[0, 3\)"):
        gd.load_edge_list(path, num_nodes=3)
    with pytest.raises(gd.DatasetNotFoundError, match="missing.txt"):
        gd.load_edge_list(tmp_path / "missing.txt")


def test_npz_graph(tmp_path):
    path = tmp_path / "g.npz"
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.savez(path, edges=np.array([[0, 1], [1, 2], [3, 3]]), x=x, y=np.array([0, 1, 1, 0]),
             train_mask=np.array([1, 1, 0, 0], bool))  # fmt: skip
    data = gd.load_npz_graph(path)
    assert {tuple(e) for e in data.edge_index.t().tolist()} == {(0, 1), (1, 0), (1, 2), (2, 1)}
    assert data.train_mask.tolist() == [True, True, False, False]
    np.savez(path, edge_index=np.array([[0], [9]]), x=x, y=np.zeros(4))
    with pytest.raises(gd.DatasetError, match=r"g\.npz: 'edge_index' names node 9"):
        gd.load_npz_graph(path)
    np.savez(path, edge_index=np.array([[0], [1]]), x=x)
    with pytest.raises(gd.DatasetError, match=r"needs an array 'y'"):
        gd.load_npz_graph(path)


# ------------------------------------------------------------------------------ synthetic
def test_sbm_graph_is_seeded_and_homophilous():
    a = gd.sbm_graph(2000, num_blocks=4, avg_degree=8, p_intra=0.7, seed=3)
    b = gd.sbm_graph(2000, num_blocks=4, avg_degree=8, p_intra=0.7, seed=3)
    assert torch.equal(a.edge_index, b.edge_index) and torch.equal(a.x, b.x)
    src, dst = a.edge_index
    same = (a.y[src] == a.y[dst]).float().mean().item()
    assert abs(same - 0.7) < 0.05  # the planted intra-block fraction
    assert abs(a.edge_index.size(1) / 2000 - 8) < 0.5  # average degree (both directions)
    assert not bool((src == dst).any())


def test_sbm_graph_classification_classes():
    graphs, splits = gd.sbm_graph_classification(60, seed=1)
    assert sorted(splits["train"] + splits["val"] + splits["test"]) == list(range(60))
    for g in graphs:
        blocks, degree, _ = gd.SBM_GRAPH_CLASSES[int(g.y)]
        assert 20 <= g.num_nodes <= 60 and g.x.shape == (g.num_nodes, 1)
        assert g.edge_index.size(1) <= g.num_nodes * degree


def test_default_root_is_under_modelzoo_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MODELZOO_HOME", str(tmp_path))
    assert gd.dataset_root("cora") == tmp_path / "datasets" / "cora"
    with pytest.raises(gd.DatasetNotFoundError, match=str(tmp_path / "datasets" / "cora")):
        gd.load_planetoid("cora")
    assert os.environ["MODELZOO_HOME"] == str(tmp_path)
