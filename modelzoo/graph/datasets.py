"""Graph datasets: the files users have on disk, a built-in real graph and synthetic graphs.

* :func:`karate_club` — Zachary's karate club (34 members, 78 friendships, the two clubs
  after the split), built in: no file needed.
* :func:`load_planetoid` — Cora / Citeseer / Pubmed in the Planetoid raw files
  ``ind.<name>.{x,tx,allx,y,ty,ally,graph,test.index}`` (Yang et al. 2016), with the
  standard semi-supervised split (20 labels a class, 500 validation, 1000 test nodes). The
  pickles are read by an unpickler that only builds the numpy/scipy/collections classes
  those files hold, so a crafted file cannot run code.
* :func:`load_ogb_node` — the OGB node-property layout (``raw/edge.csv.gz``,
  ``raw/node-feat.csv.gz``, ``raw/node-label.csv.gz``,
  ``split/<scheme>/{train,valid,test}.csv.gz``), e.g. ogbn-products, ogbn-arxiv.
* :func:`load_edge_list` / :func:`load_npz_graph` — a plain ``src dst`` text edge list, or
  ``.npz`` arrays ``edge_index``, ``x``, ``y`` and optional masks.
* :func:`sbm_graph` / :func:`sbm_graph_classification` — synthetic stochastic-block-model
  graphs of any size, for tests, benchmarks and the published runs.

Nothing is downloaded unless asked (``download=True``): a missing dataset raises
:class:`DatasetNotFoundError` saying which files to place where. Downloads go through the
store (:func:`modelzoo.store.fetch_data`: verified, locked, renamed into place, mirrored by
``$MODELZOO_DATA_URL``): the Planetoid files against the git blob ids the Planetoid
repository pins (:data:`PLANETOID_BLOBS`, registered as the data sets ``cora``, ``citeseer``
and ``pubmed`` in :mod:`modelzoo.data`); OGB publishes no checksum of its zips, so an OGB
download needs the sha256 of the archive from the caller. Every graph comes back as a
``torch_geometric.data.Data`` with ``x``, ``edge_index`` (both directions of every
undirected edge, sorted by target), ``y`` and boolean ``train_mask``/``val_mask``/``test_mask``;
where the source names its classes, ``class_names`` holds them in the order of ``y``
(karate club, SBM, OGB's ``mapping/labelidx2*.csv.gz``, an ``.npz``'s ``class_names``). The
Planetoid files carry no class names (their labels are one-hot columns), so those graphs
have none.
"""

from __future__ import annotations

import csv
import gzip
import io
import os
import pickle
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data import DataFile, DataSet, register_dataset
from ..store import GIT_SHA1, DownloadError, cache_root, fetch_data
from ._graph_data import _data, _index_mask
from .synthetic import (
    SBM_GRAPH_CLASS_NAMES,
    SBM_GRAPH_CLASSES,
    sbm_block_names,
    sbm_graph,
    sbm_graph_classification,
)

__all__ = [
    "DatasetError",
    "DatasetNotFoundError",
    "KARATE_CLUB_EDGES",
    "KARATE_CLUB_LABELS",
    "KARATE_CLUB_NAMES",
    "OGB_URL",
    "PLANETOID_BLOBS",
    "PLANETOID_NAMES",
    "PLANETOID_URL",
    "dataset_root",
    "download_ogb_node",
    "download_planetoid",
    "karate_club",
    "load_edge_list",
    "load_npz_graph",
    "load_ogb_node",
    "load_planetoid",
    "restricted_unpickle",
    "SBM_GRAPH_CLASSES",
    "SBM_GRAPH_CLASS_NAMES",
    "sbm_block_names",
    "sbm_graph",
    "sbm_graph_classification",
]

PLANETOID_NAMES = ("cora", "citeseer", "pubmed")
PLANETOID_URL = "https://github.com/kimiyoung/planetoid/raw/master/data"
PLANETOID_SUFFIXES = ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")
#: The Planetoid files' git blob ids (``git ls-tree -r af6abf468a772cc055bec88c52e4d6f51b7c37e3
#: data/`` in github.com/kimiyoung/planetoid, its last commit): GitHub serves exactly these
#: blobs at :data:`PLANETOID_URL`, and the store checks them as ``"git-sha1"`` (``git
#: hash-object FILE`` prints the same id).
PLANETOID_BLOBS = {
    "ind.citeseer.allx": "592091071ac35b78599c722d0e60b1c655711728",
    "ind.citeseer.ally": "7503f81a0b6ac1cc21cb5a97073542a6b1dfe99c",
    "ind.citeseer.graph": "a01dca663d0103c130f525017a4a9c313037e286",
    "ind.citeseer.test.index": "62d9e3d5ed53c66b069125af98529d76c70d9b3e",
    "ind.citeseer.tx": "b2aff18aa1fc6f4f5e8c64db7643b59b24e42584",
    "ind.citeseer.ty": "3795f79df0cd1123f4478b77c148a5fbacc4cefb",
    "ind.citeseer.x": "f094104a66f2689ffbd01085fe6a856689e9db9e",
    "ind.citeseer.y": "e857ac49b611da98e101a068cf4855350274f68a",
    "ind.cora.allx": "44d53b1fece343538e45592caac521d73c6f98d6",
    "ind.cora.ally": "04fbd0b083d09341fcf16b395c642329637f0542",
    "ind.cora.graph": "4d3bf85dfc8b1c105a2c995597a1b3eed6947925",
    "ind.cora.test.index": "ded8092db4cd767a367eebe09003b954a5316f24",
    "ind.cora.tx": "6e856d777401ee15dc8619db76c97d0a40ba2d60",
    "ind.cora.ty": "da1734ab670b5c8ecee78a9c30b35566df916f4b",
    "ind.cora.x": "c4a91d008245403e7f26aa616b437191509793c0",
    "ind.cora.y": "58e30ef120d3553cfaac33ff28c6b5436dbef661",
    "ind.pubmed.allx": "3b86bccf08111c37c632a9dd8ab63db25ea76361",
    "ind.pubmed.ally": "4c8bcdc80882dd225fe4dd4fafd723baa616ac97",
    "ind.pubmed.graph": "76eb87e628a6b9d43fc31ea42c8c6c8f3e52b404",
    "ind.pubmed.test.index": "41f6befcb7750cc4858cb852f2b349a9598cb2f4",
    "ind.pubmed.tx": "eee4f3c988fde0da87a9ec7b01ca5e7863c1b1f1",
    "ind.pubmed.ty": "225a0bb9bb6430e3925d04688daf6a0da964c07a",
    "ind.pubmed.x": "16c0eca8d2b3297014ff80327416f9332eda10d7",
    "ind.pubmed.y": "e86670576c85340eeb2271b3c918bfa89322b2cf",
}
OGB_URL = "http://snap.stanford.edu/ogb/data/nodeproppred"


class DatasetError(ValueError):
    """A dataset file is malformed (names the file, the field or line, and the fix)."""


class DatasetNotFoundError(FileNotFoundError):
    """The files of a dataset are not where they were looked for (says where to put them)."""


def dataset_root(name: str) -> Path:
    """Default directory of a dataset: ``$MODELZOO_HOME/datasets/<name>``."""
    return cache_root() / "datasets" / name


# ------------------------------------------------------------------------------ karate club
#: Zachary (1977): the 78 friendships among the 34 members, 0-based as in networkx.
KARATE_CLUB_EDGES = (
    (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (0, 6), (0, 7), (0, 8), (0, 10), (0, 11), (0, 12),
    (0, 13), (0, 17), (0, 19), (0, 21), (0, 31), (1, 2), (1, 3), (1, 7), (1, 13), (1, 17),
    (1, 19), (1, 21), (1, 30), (2, 3), (2, 7), (2, 8), (2, 9), (2, 13), (2, 27), (2, 28),
    (2, 32), (3, 7), (3, 12), (3, 13), (4, 6), (4, 10), (5, 6), (5, 10), (5, 16), (6, 16),
    (8, 30), (8, 32), (8, 33), (9, 33), (13, 33), (14, 32), (14, 33), (15, 32), (15, 33),
    (18, 32), (18, 33), (19, 33), (20, 32), (20, 33), (22, 32), (22, 33), (23, 25), (23, 27),
    (23, 29), (23, 32), (23, 33), (24, 25), (24, 27), (24, 31), (25, 31), (26, 29), (26, 33),
    (27, 33), (28, 31), (28, 33), (29, 32), (29, 33), (30, 32), (30, 33), (31, 32), (31, 33),
    (32, 33),
)  # fmt: skip
#: The club each member joined after the split: 0 Mr. Hi (node 0), 1 Officer (node 33).
KARATE_CLUB_LABELS = (
    0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1,
    1, 1, 1, 1,
)  # fmt: skip
#: Class names in the order of :data:`KARATE_CLUB_LABELS` (networkx's ``"club"`` attribute).
KARATE_CLUB_NAMES = ("Mr. Hi", "Officer")
#: The semi-supervised split: 3 labelled members per club (the two leaders among them),
#: 6 for validation, the other 22 held out.
KARATE_TRAIN = (0, 1, 2, 33, 32, 31)
KARATE_VAL = (3, 7, 13, 29, 23, 30)


def karate_club() -> Any:
    """Zachary's karate club: 34 nodes, one-hot identity features, labels = the two clubs.

    Returns:
        A ``Data`` with ``x`` ``(34, 34)`` (identity), ``edge_index`` ``(2, 156)``, ``y`` the
        club (0: Mr. Hi, 1: Officer), masks of 6 train / 6 val / 22 test nodes and
        ``class_names`` :data:`KARATE_CLUB_NAMES`.
    """
    edges = torch.tensor(KARATE_CLUB_EDGES, dtype=torch.long).t()
    y = torch.tensor(KARATE_CLUB_LABELS, dtype=torch.long)
    train = _index_mask(torch.tensor(KARATE_TRAIN), 34)
    val = _index_mask(torch.tensor(KARATE_VAL), 34)
    masks = {"train_mask": train, "val_mask": val, "test_mask": ~(train | val)}
    data = _data(torch.eye(34), edges, y, masks)
    data.class_names = KARATE_CLUB_NAMES
    return data


# --------------------------------------------------------------------------------- Planetoid
#: The only globals a Planetoid pickle may name: numpy arrays, scipy sparse matrices (under
#: their Python 2 era and current module paths), the defaultdict/list of the adjacency dict,
#: and the helpers Python 2 pickles and protocol-2 re-pickles use to rebuild them.
_PLANETOID_GLOBALS = {
    ("numpy", "ndarray"): "numpy:ndarray",
    ("numpy", "dtype"): "numpy:dtype",
    ("numpy.core.multiarray", "_reconstruct"): "numpy._core.multiarray:_reconstruct",
    ("numpy._core.multiarray", "_reconstruct"): "numpy._core.multiarray:_reconstruct",
    ("numpy.core.multiarray", "scalar"): "numpy._core.multiarray:scalar",
    ("numpy._core.multiarray", "scalar"): "numpy._core.multiarray:scalar",
    ("scipy.sparse.csr", "csr_matrix"): "scipy.sparse:csr_matrix",
    ("scipy.sparse._csr", "csr_matrix"): "scipy.sparse:csr_matrix",
    ("scipy.sparse.csc", "csc_matrix"): "scipy.sparse:csc_matrix",
    ("scipy.sparse._csc", "csc_matrix"): "scipy.sparse:csc_matrix",
    ("scipy.sparse.lil", "lil_matrix"): "scipy.sparse:lil_matrix",
    ("scipy.sparse._lil", "lil_matrix"): "scipy.sparse:lil_matrix",
    ("collections", "defaultdict"): "collections:defaultdict",
    ("builtins", "list"): "builtins:list",
    ("__builtin__", "list"): "builtins:list",
    ("builtins", "object"): "builtins:object",
    ("__builtin__", "object"): "builtins:object",
    ("copy_reg", "_reconstructor"): "copyreg:_reconstructor",
    ("copyreg", "_reconstructor"): "copyreg:_reconstructor",
    ("_codecs", "encode"): "_codecs:encode",
}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        super().__init__(file, encoding="latin1")  # the files were written by Python 2
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        target = _PLANETOID_GLOBALS.get((module, name))
        if target is None:
            raise DatasetError(
                f"{self.source}: the pickle asks for {module}.{name}, which a Planetoid file "
                "never holds (only numpy arrays, scipy sparse matrices and dict/list); refusing "
                f"to load it. Replace the file with the original from {PLANETOID_URL}"
            )
        import importlib

        module_name, attr = target.split(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except ModuleNotFoundError:  # numpy < 2 has numpy.core, not numpy._core
            return getattr(importlib.import_module(module_name.replace("._core", ".core")), attr)


def restricted_unpickle(path: str | os.PathLike[str]) -> Any:
    """Load a Planetoid pickle, building only numpy/scipy/collections objects.

    Raises:
        DatasetError: The pickle names any other class or is truncated/corrupt.
    """
    path = Path(path)
    with path.open("rb") as f:
        try:
            return _RestrictedUnpickler(f, str(path)).load()
        except DatasetError:
            raise
        except Exception as e:  # noqa: BLE001 (every unpickling failure means a bad file)
            raise DatasetError(
                f"{path}: not a readable Planetoid pickle ({type(e).__name__}: {e}); replace "
                f"it with the original from {PLANETOID_URL}"
            ) from e


def _dense(value: Any, path: Path, field: str) -> np.ndarray:
    if hasattr(value, "toarray"):
        value = value.toarray()
    array = np.asarray(value)
    if array.ndim != 2:
        raise DatasetError(
            f"{path}: '{field}' must be a 2-D matrix, got shape {array.shape}; replace the file "
            f"with the original from {PLANETOID_URL}"
        )
    return array.astype(np.float32)


def _planetoid_files(root: Path, name: str) -> dict[str, Path]:
    return {s: root / f"ind.{name}.{s}" for s in PLANETOID_SUFFIXES}


def load_planetoid(
    name: str, root: str | os.PathLike[str] | None = None, *, download: bool = False
) -> Any:
    """Cora, Citeseer or Pubmed from the Planetoid raw files, with the standard split.

    Args:
        name: ``"cora"``, ``"citeseer"`` or ``"pubmed"`` (case-insensitive).
        root: Directory holding ``ind.<name>.*`` (default :func:`dataset_root` ``(name)``).
        download: Fetch missing files from :data:`PLANETOID_URL` first.

    Returns:
        A ``Data`` as PyG's ``Planetoid(split="public")`` builds it: training nodes are the
        first ``len(y)``, validation the next 500, test the ``test.index`` nodes (Citeseer's
        isolated test nodes get zero features and label 0, excluded from no mask).

    Raises:
        DatasetNotFoundError: Files missing (the message lists them and where to put them).
        DatasetError: A file is malformed or names a disallowed class.
    """
    key = name.lower()
    if key not in PLANETOID_NAMES:
        raise ValueError(
            f"Planetoid name must be one of {', '.join(PLANETOID_NAMES)}, got {name!r}"
        )
    root = Path(root) if root is not None else dataset_root(key)
    if download:
        download_planetoid(key, root)
    files = _planetoid_files(root, key)
    missing = [p.name for p in files.values() if not p.is_file()]
    if missing:
        raise DatasetNotFoundError(
            f"Planetoid {key!r}: {', '.join(missing)} not found in {root}. Download the files "
            f"ind.{key}.* from {PLANETOID_URL} (the Planetoid repository's data/ folder) and "
            f"place them in {root}, or pass download=True (--download) where the network is "
            "reachable."
        )
    raw = {s: restricted_unpickle(p) for s, p in files.items() if s != "test.index"}
    x, tx, allx = (_dense(raw[s], files[s], s) for s in ("x", "tx", "allx"))
    y, ty, ally = (_dense(raw[s], files[s], s) for s in ("y", "ty", "ally"))
    graph = raw["graph"]
    if not isinstance(graph, dict):
        raise DatasetError(
            f"{files['graph']}: expected a dict node -> neighbour list, got {type(graph).__name__}"
        )
    test_index = _read_test_index(files["test.index"])
    for field, a, b in (("tx", tx, ty), ("allx", allx, ally), ("x", x, y)):
        if a.shape[0] != b.shape[0]:
            raise DatasetError(
                f"{files[field]}: {a.shape[0]} rows, but its labels have {b.shape[0]}; the "
                f"ind.{key}.* files come from different releases"
            )
    sorted_test = np.sort(test_index)
    if key == "citeseer":  # isolated test nodes have no row in tx/ty: pad with zeros
        span = int(sorted_test[-1] - sorted_test[0]) + 1
        tx_ext = np.zeros((span, tx.shape[1]), np.float32)
        ty_ext = np.zeros((span, ty.shape[1]), np.float32)
        tx_ext[sorted_test - sorted_test[0]] = tx
        ty_ext[sorted_test - sorted_test[0]] = ty
        tx, ty = tx_ext, ty_ext
    if len(test_index) != tx.shape[0] and key != "citeseer":
        raise DatasetError(
            f"{files['test.index']}: {len(test_index)} test nodes, but "
            f"{files['tx'].name} has {tx.shape[0]} rows"
        )
    features = np.concatenate([allx, tx])
    labels = np.concatenate([ally, ty]).argmax(axis=1)
    n = features.shape[0]
    if sorted_test[-1] >= n or sorted_test[0] < 0:
        raise DatasetError(
            f"{files['test.index']}: node {int(sorted_test[-1])} is out of range for {n} nodes"
        )
    features[test_index] = features[sorted_test]
    labels[test_index] = labels[sorted_test]
    edges = _edges_from_dict(graph, n, files["graph"])
    masks = {
        "train_mask": _index_mask(torch.arange(y.shape[0]), n),
        "val_mask": _index_mask(torch.arange(y.shape[0], y.shape[0] + 500), n),
        "test_mask": _index_mask(torch.from_numpy(test_index), n),
    }
    return _data(torch.from_numpy(features), edges, torch.from_numpy(labels).long(), masks)


def _read_test_index(path: Path) -> np.ndarray:
    values = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            values.append(int(line))
        except ValueError:
            raise DatasetError(
                f"{path}:{lineno}: expected one node index per line, got {line.strip()!r}"
            ) from None
    if not values:
        raise DatasetError(f"{path}: no test node indices")
    return np.asarray(values, dtype=np.int64)


def _edges_from_dict(graph: dict, num_nodes: int, path: Path) -> torch.Tensor:
    src, dst = [], []
    for node, neighbours in graph.items():
        if not isinstance(node, (int, np.integer)) or not isinstance(neighbours, (list, tuple)):
            raise DatasetError(
                f"{path}: entry {node!r} -> {type(neighbours).__name__}: expected int -> list"
            )
        src.extend([int(node)] * len(neighbours))
        dst.extend(int(v) for v in neighbours)
    edges = torch.tensor([src, dst], dtype=torch.long).reshape(2, -1)
    if edges.numel() and (int(edges.max()) >= num_nodes or int(edges.min()) < 0):
        raise DatasetError(f"{path}: an edge names node {int(edges.max())}, beyond {num_nodes}")
    return edges


# ------------------------------------------------------------------------------------- OGB
def _read_csv(path: Path, dtype: type, *, columns: int | None = None) -> np.ndarray:
    if not path.is_file():
        raise DatasetNotFoundError(f"{path} not found")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            rows = [line.strip() for line in f if line.strip()]
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: cannot read it ({type(e).__name__}: {e})") from e
    out = []
    for lineno, row in enumerate(rows, 1):
        fields = row.split(",")
        if columns is not None and len(fields) != columns:
            raise DatasetError(
                f"{path}:{lineno}: expected {columns} comma-separated values, got {len(fields)}"
            )
        try:
            out.append([dtype(float(v)) if dtype is int else dtype(v) for v in fields])
        except ValueError:
            raise DatasetError(f"{path}:{lineno}: not a number in {row!r}") from None
    widths = {len(r) for r in out}
    if len(widths) > 1:
        raise DatasetError(f"{path}: rows have different numbers of values {sorted(widths)}")
    return np.asarray(out, dtype=np.float32 if dtype is float else np.int64)


def load_ogb_node(
    name: str,
    root: str | os.PathLike[str] | None = None,
    *,
    split: str | None = None,
    download: bool = False,
    sha256: str | None = None,
    to_undirected: bool = True,
) -> Any:
    """An OGB node-property dataset (``ogbn-products``, ``ogbn-arxiv``, ...) from its files.

    Args:
        name: The dataset name, e.g. ``"ogbn-products"``; its folder is ``root``.
        root: Directory holding ``raw/`` and ``split/`` (default :func:`dataset_root`).
        split: The split scheme folder under ``split/`` (default: the only one there).
        download: Fetch and unpack ``<name>.zip`` from :data:`OGB_URL` first (needs ``sha256``).
        sha256: The sha256 of ``<name>.zip`` to check the download against: OGB publishes
            none, so the caller supplies the digest of the copy they trust.
        to_undirected: Add reverse edges (DGL/PyG do for products; arxiv is symmetrized too
            in their examples).

    Returns:
        A ``Data`` with the split's masks, and ``class_names`` when the dataset folder has
        OGB's ``mapping/labelidx2<what>.csv.gz`` (label index -> category, e.g. ogbn-arxiv's
        ``"arxiv cs na"``).

    Raises:
        DatasetNotFoundError: Files missing (the message lists the layout to place).
        DatasetError: A malformed file (path and line).
    """
    root = Path(root) if root is not None else dataset_root(name)
    if download:
        download_ogb_node(name, root, sha256=sha256)
    raw = root / "raw"
    needed = [raw / "edge.csv.gz", raw / "node-feat.csv.gz", raw / "node-label.csv.gz"]
    schemes = (
        sorted(p.name for p in (root / "split").iterdir()) if (root / "split").is_dir() else []
    )
    if split is None and len(schemes) == 1:
        split = schemes[0]
    missing = [p for p in needed if not p.is_file()]
    split_dir = root / "split" / (split or "<scheme>")
    missing += [split_dir / f"{s}.csv.gz" for s in ("train", "valid", "test")
                if not (split_dir / f"{s}.csv.gz").is_file()]  # fmt: skip
    if missing:
        raise DatasetNotFoundError(
            f"OGB dataset {name!r}: missing {', '.join(str(p.relative_to(root)) for p in missing)} "
            f"under {root}. Unzip {OGB_URL}/{name.removeprefix('ogbn-')}.zip so that {root} holds "
            "raw/edge.csv.gz, raw/node-feat.csv.gz, raw/node-label.csv.gz and "
            "split/<scheme>/{train,valid,test}.csv.gz, or pass download=True (--download) where "
            "the network is reachable."
            + (f" Split schemes found: {schemes}." if schemes and split not in schemes else "")
        )
    edges = _read_csv(raw / "edge.csv.gz", int, columns=2)
    x = _read_csv(raw / "node-feat.csv.gz", float)
    y = _read_csv(raw / "node-label.csv.gz", int, columns=1).reshape(-1)
    n = x.shape[0]
    if y.shape[0] != n:
        raise DatasetError(
            f"{raw / 'node-label.csv.gz'}: {y.shape[0]} labels for {n} feature rows in "
            f"{raw / 'node-feat.csv.gz'}"
        )
    if edges.size and (edges.max() >= n or edges.min() < 0):
        raise DatasetError(f"{raw / 'edge.csv.gz'}: an edge names node {edges.max()}, beyond {n}")
    masks = {}
    for part, key in (("train", "train_mask"), ("valid", "val_mask"), ("test", "test_mask")):
        path = split_dir / f"{part}.csv.gz"
        index = _read_csv(path, int, columns=1).reshape(-1)
        if index.size and (index.max() >= n or index.min() < 0):
            raise DatasetError(f"{path}: node {index.max()} is out of range for {n} nodes")
        masks[key] = _index_mask(torch.from_numpy(index), n)
    edge_index = torch.from_numpy(edges).t().contiguous()
    data = _data(torch.from_numpy(x), edge_index, torch.from_numpy(y), masks,
                 undirected=to_undirected)  # fmt: skip
    names = _ogb_class_names(root, int(y.max()) + 1 if y.size else 0)
    if names is not None:
        data.class_names = names
    return data


def _ogb_class_names(root: Path, num_classes: int) -> tuple[str, ...] | None:
    """The names in ``mapping/labelidx2*.csv.gz`` (header, then ``index,name`` rows)."""
    files = sorted((root / "mapping").glob("labelidx2*.csv*"))
    if len(files) != 1:
        return None
    path = files[0]
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8", newline="") as f:
            rows = [r for r in csv.reader(f) if r]
    except (OSError, EOFError, UnicodeDecodeError, csv.Error) as e:
        raise DatasetError(f"{path}: cannot read it ({type(e).__name__}: {e})") from e
    if rows and not rows[0][0].strip().lstrip("-").isdigit():
        rows = rows[1:]  # the header, "label idx,<what> category"
    names: dict[int, str] = {}
    for lineno, row in enumerate(rows, 2):
        if len(row) < 2 or not row[0].strip().isdigit():
            raise DatasetError(f"{path}:{lineno}: expected 'label index,name', got {row!r}")
        names[int(row[0])] = row[1].strip()
    if sorted(names) != list(range(len(names))):
        raise DatasetError(
            f"{path}: the label indices must be 0, 1, ... without gaps or repeats; got "
            f"{len(rows)} rows with indices {sorted(names)[:8]}..."
        )
    if len(names) < num_classes:
        raise DatasetError(
            f"{path}: {len(names)} class names, but node-label.csv.gz has {num_classes} "
            "classes; give one name per class"
        )
    return tuple(names[i] for i in range(len(names)))


# ------------------------------------------------------------------------- edge lists, npz
def load_edge_list(
    path: str | os.PathLike[str], *, num_nodes: int | None = None, delimiter: str | None = None
) -> torch.Tensor:
    """A plain-text edge list: one ``src dst`` pair a line (``#`` comments, blank lines ok).

    Returns:
        ``edge_index`` ``(2, E)`` as written (no symmetrization).

    Raises:
        DatasetNotFoundError: No such file.
        DatasetError: A line without two integer node ids, or an id out of ``num_nodes``.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetNotFoundError(f"edge list {path} not found")
    pairs = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            fields = text.split(delimiter)
            if len(fields) < 2:
                raise DatasetError(f"{path}:{lineno}: expected 'src dst', got {text!r}")
            try:
                src, dst = int(fields[0]), int(fields[1])
            except ValueError:
                raise DatasetError(
                    f"{path}:{lineno}: node ids must be integers, got {text!r}"
                ) from None
            if src < 0 or dst < 0 or (num_nodes is not None and max(src, dst) >= num_nodes):
                raise DatasetError(
                    f"{path}:{lineno}: node id out of range [0, {num_nodes}) in {text!r}"
                )
            pairs.append((src, dst))
    return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2).t().contiguous()


def load_npz_graph(path: str | os.PathLike[str], *, undirected: bool = True) -> Any:
    """A graph in an ``.npz``: ``edge_index`` ``(2, E)`` (or ``edges`` ``(E, 2)``), ``x``,
    ``y`` and optionally boolean ``train_mask``/``val_mask``/``test_mask`` and a string array
    ``class_names`` (one per class, in the order of ``y``; becomes ``data.class_names``).

    Raises:
        DatasetNotFoundError: No such file.
        DatasetError: A missing array or inconsistent shapes (named).
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetNotFoundError(f"graph file {path} not found")
    try:
        arrays = dict(np.load(path, allow_pickle=False))
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise DatasetError(f"{path}: not a readable .npz ({e})") from e
    if "edge_index" in arrays:
        edges = arrays["edge_index"]
    elif "edges" in arrays:
        edges = arrays["edges"].T
    else:
        raise DatasetError(f"{path}: needs an 'edge_index' (2, E) or 'edges' (E, 2) array")
    for key in ("x", "y"):
        if key not in arrays:
            raise DatasetError(f"{path}: needs an array {key!r}; it has {sorted(arrays)}")
    x, y = arrays["x"], arrays["y"]
    n = x.shape[0]
    if edges.ndim != 2 or edges.shape[0] != 2:
        raise DatasetError(f"{path}: 'edge_index' must have shape (2, E), got {edges.shape}")
    if y.shape[0] != n:
        raise DatasetError(f"{path}: 'y' has {y.shape[0]} entries for {n} rows of 'x'")
    if edges.size and (edges.max() >= n or edges.min() < 0):
        raise DatasetError(f"{path}: 'edge_index' names node {edges.max()}, beyond {n} nodes")
    masks = {}
    for key in ("train_mask", "val_mask", "test_mask"):
        if key in arrays:
            if arrays[key].shape != (n,):
                raise DatasetError(
                    f"{path}: {key!r} must have shape ({n},), got {arrays[key].shape}"
                )
            masks[key] = torch.from_numpy(arrays[key].astype(bool))
    names = arrays.get("class_names")
    if names is not None and (names.ndim != 1 or names.dtype.kind not in "US"):
        raise DatasetError(
            f"{path}: 'class_names' must be a 1-D array of strings, got {names.dtype} "
            f"shape {names.shape}"
        )
    if names is not None and y.size and names.shape[0] <= int(y.max()):
        raise DatasetError(
            f"{path}: {names.shape[0]} 'class_names' for labels up to {int(y.max())}; give "
            "one name per class"
        )
    data = _data(torch.from_numpy(x.astype(np.float32)), torch.from_numpy(edges.astype(np.int64)),
                 torch.from_numpy(y.astype(np.int64)), masks, undirected=undirected)  # fmt: skip
    if names is not None:
        data.class_names = tuple(str(n) for n in names)
    return data


# -------------------------------------------------------------------------------- download
def _planetoid_dataset(name: str, base_url: str = PLANETOID_URL) -> DataSet:
    """The data set of Planetoid ``name``: its 8 files at ``base_url``, by their blob ids."""
    files = {}
    for suffix in PLANETOID_SUFFIXES:
        file_name = f"ind.{name}.{suffix}"
        files[suffix] = DataFile(
            url=f"{base_url.rstrip('/')}/{file_name}",
            hash_prefix=PLANETOID_BLOBS[file_name],
            hash_algo=GIT_SHA1,
            hash_source="git ls-tree -r af6abf4 data/ of github.com/kimiyoung/planetoid",
        )
    return DataSet(
        name=name,
        files=files,
        folder=name,
        description=f"Planetoid {name} (Yang et al. 2016), the standard semi-supervised split",
        homepage="https://github.com/kimiyoung/planetoid",
        license="as published by the Planetoid authors (no license file)",
    )


for _name in PLANETOID_NAMES:
    register_dataset(_planetoid_dataset(_name))


def download_planetoid(
    name: str, root: str | os.PathLike[str], *, base_url: str = PLANETOID_URL
) -> Path:
    """Fetch the ``ind.<name>.*`` files from ``base_url`` into ``root``, each verified
    against its git blob id (:data:`PLANETOID_BLOBS`); verified files present stay."""
    root = Path(root)
    for data_file in _planetoid_dataset(name, base_url).files.values():
        fetch_data(
            data_file.url,
            root / data_file.file_name,
            hash_prefix=data_file.hash_prefix,
            hash_algo=data_file.hash_algo,
            progress=False,
        )
    return root


def download_ogb_node(
    name: str,
    root: str | os.PathLike[str],
    *,
    sha256: str | None = None,
    base_url: str = OGB_URL,
) -> Path:
    """Fetch ``<base_url>/<short name>.zip``, check its ``sha256`` and unpack its dataset
    folder into ``root``.

    OGB zips hold one top folder (``products/raw/...``); its content becomes ``root``. The
    archive is downloaded through the store (verified, ``$MODELZOO_DATA_URL`` mirror), unpacked
    into a temporary folder next to ``root`` and renamed into place, after rejecting absolute
    paths and ``..`` members.

    Raises:
        DatasetNotFoundError: ``sha256`` not given (OGB publishes no checksum, and an
            unverified archive is not unpacked); the message says what to do instead.
    """
    root = Path(root)
    if (root / "raw" / "edge.csv.gz").is_file():
        return root
    short = name.removeprefix("ogbn-")
    url = f"{base_url.rstrip('/')}/{short}.zip"
    if sha256 is None:
        raise DatasetNotFoundError(
            f"OGB dataset {name!r}: OGB publishes no checksum of {url}, and this project "
            "downloads no file it cannot verify. Pass the sha256 of the copy you trust "
            f"(sha256=... in Python, --ogb-sha256 HEX to train_gnn.py), or unzip {short}.zip "
            f"by hand so that {root} holds raw/ and split/."
        )
    root.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}."))
    try:
        archive = work / f"{short}.zip"
        fetch_data(url, archive, hash_prefix=sha256, progress=False)
        try:
            with zipfile.ZipFile(archive) as zf:
                names = zf.namelist()
                bad = [
                    m for m in names if m.startswith("/") or ".." in m.replace("\\", "/").split("/")
                ]
                if bad:
                    raise DownloadError(f"{url}: unsafe member names {bad}; refusing to unpack")
                zf.extractall(work / "unpacked")
        except zipfile.BadZipFile as e:
            raise DownloadError(f"{url}: not a valid zip archive ({e})") from e
        tops = [p for p in (work / "unpacked").iterdir()]
        source = tops[0] if len(tops) == 1 and tops[0].is_dir() else work / "unpacked"
        if not (source / "raw" / "edge.csv.gz").is_file():
            raise DownloadError(f"{url}: the archive has no raw/edge.csv.gz")
        if root.exists():
            shutil.rmtree(root)
        os.replace(source, root)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return root
