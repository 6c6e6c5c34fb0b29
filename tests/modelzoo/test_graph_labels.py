"""Class names of the graph weights and of the graph datasets.

Oracles: networkx's karate club (each member's ``"club"`` attribute against our ``y``), the
blocks :func:`sbm_graph` plants (``y == b`` is block ``b``) and the files the test writes in
OGB's and the npz layout.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

import modelzoo
from modelzoo.graph import datasets as gd


def _graph_weights() -> dict[str, modelzoo.Weights]:
    out = {}
    for name in modelzoo.list_models(pretrained=True):
        weights = modelzoo.get_weights(name)
        if weights.modality == "graph":
            out[name] = weights
    return out


def test_every_graph_weights_entry_names_its_classes():
    entries = _graph_weights()
    assert len(entries) == 7
    for name, weights in entries.items():
        assert weights.labels is not None and len(weights.labels) == weights.num_classes, name
        assert len(set(weights.labels)) == weights.num_classes, name
        assert weights.to_dict()["num_labels"] == weights.num_classes


def test_karate_labels_are_the_clubs_in_the_order_of_y():
    graph = nx.karate_club_graph()
    data = gd.karate_club()
    assert data.class_names == gd.KARATE_CLUB_NAMES == ("Mr. Hi", "Officer")
    clubs = [graph.nodes[i]["club"] for i in range(34)]
    assert [data.class_names[int(c)] for c in data.y] == clubs
    for name, weights in _graph_weights().items():
        if weights.tags["dataset"].startswith("karate"):
            assert weights.labels == data.class_names, name
            assert [weights.labels[int(c)] for c in data.y] == clubs, name


def test_sbm_labels_are_the_planted_blocks():
    data = gd.sbm_graph(500, num_blocks=8, seed=2)
    assert data.class_names == gd.sbm_block_names(8) == tuple(f"block {b}" for b in range(8))
    assert gd.sbm_graph(100, num_blocks=3).class_names == ("block 0", "block 1", "block 2")
    sbm = {n: w for n, w in _graph_weights().items() if "SBM, 100k nodes" in w.tags["dataset"]}
    assert sorted(sbm) == ["gat_sbm", "gcn_sbm", "graphsage_mean_sbm"]
    for weights in sbm.values():
        assert weights.labels == data.class_names
    gin = modelzoo.get_weights("gin_sbm")
    assert gin.labels == gd.SBM_GRAPH_CLASS_NAMES
    for label, (blocks, degree, p_intra) in zip(gin.labels, gd.SBM_GRAPH_CLASSES, strict=True):
        assert label.startswith(f"{blocks} block") and f"avg degree {degree:g}" in label
        assert f"p_intra {p_intra:g}" in label


def _gz(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def _ogb(root: Path, y: list[int]) -> None:
    n = len(y)
    _gz(root / "raw" / "edge.csv.gz", [f"{i},{(i + 1) % n}" for i in range(n)])
    _gz(root / "raw" / "node-feat.csv.gz", [f"{i}.0,1.0" for i in range(n)])
    _gz(root / "raw" / "node-label.csv.gz", [str(v) for v in y])
    for part, idx in {"train": [0, 1], "valid": [2], "test": [3]}.items():
        _gz(root / "split" / "time" / f"{part}.csv.gz", [str(i) for i in idx])


def test_ogb_class_names_come_from_its_mapping_file(tmp_path):
    root = tmp_path / "ogbn-arxiv"
    _ogb(root, [0, 2, 1, 2, 0])
    assert "class_names" not in gd.load_ogb_node("ogbn-arxiv", root)  # no mapping folder
    mapping = root / "mapping" / "labelidx2arxivcategeory.csv.gz"  # OGB's spelling
    _gz(mapping, ["label idx,arxiv category", "1,arxiv cs ai", "0,arxiv cs na",
                  '2,"Clothing, Shoes & Jewelry"'])  # fmt: skip
    data = gd.load_ogb_node("ogbn-arxiv", root)
    assert data.class_names == ("arxiv cs na", "arxiv cs ai", "Clothing, Shoes & Jewelry")
    _gz(mapping, ["label idx,arxiv category", "0,a", "1,b"])
    with pytest.raises(gd.DatasetError, match="2 class names, but node-label.csv.gz has 3"):
        gd.load_ogb_node("ogbn-arxiv", root)
    _gz(mapping, ["label idx,arxiv category", "0,a", "2,b", "3,c"])
    with pytest.raises(gd.DatasetError, match="without gaps or repeats"):
        gd.load_ogb_node("ogbn-arxiv", root)
    _gz(mapping, ["label idx,arxiv category", "0,a", "x,b"])
    with pytest.raises(gd.DatasetError, match=r"labelidx2arxivcategeory\.csv\.gz:3: expected"):
        gd.load_ogb_node("ogbn-arxiv", root)


def test_npz_class_names(tmp_path):
    path = tmp_path / "g.npz"
    arrays = dict(edge_index=np.array([[0, 1], [1, 2]]), x=np.ones((3, 2)), y=np.array([0, 1, 1]))
    np.savez(path, class_names=np.array(["cat", "dog"]), **arrays)
    assert gd.load_npz_graph(path).class_names == ("cat", "dog")
    np.savez(path, **arrays)
    assert "class_names" not in gd.load_npz_graph(path)
    np.savez(path, class_names=np.array(["cat"]), **arrays)
    with pytest.raises(gd.DatasetError, match="1 'class_names' for labels up to 1"):
        gd.load_npz_graph(path)
    np.savez(path, class_names=np.array([0, 1]), **arrays)
    with pytest.raises(gd.DatasetError, match="'class_names' must be a 1-D array of strings"):
        gd.load_npz_graph(path)
