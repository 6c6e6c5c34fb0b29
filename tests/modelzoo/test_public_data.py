"""Public data sets by name (modelzoo.data) through the store (modelzoo.store.fetch_data).

Every network test talks to a real HTTP server on 127.0.0.1 (tests/loopback.py) serving
small files in the official SQuAD layout under the official file names; the oracle for each
hash is :mod:`hashlib` on the served bytes, and ``git hash-object`` for git blob ids. The
pinned digests of the real files are checked against the references that state them (quoted
in modelzoo/nlp/squad.py and modelzoo/graph/datasets.py).
"""

from __future__ import annotations

import hashlib
import shutil
import socket
import subprocess

import pytest

from modelzoo import store
from modelzoo.data import DataFile, DataSet, get_dataset, list_datasets, register_dataset
from modelzoo.graph import datasets as graph_datasets
from modelzoo.nlp import squad

from ..loopback import LocalServer
from ..squad_files import OFFICIAL, num_questions, pin_small_squad, squad_json

# The references' digests (Hugging Face datasets' dataset_infos.json and TensorFlow Datasets'
# squad/checksums.tsv state the same sha256 and size for each URL).
REFERENCE_SHA256 = {
    "train-v1.1.json": ("3527663986b8295af4f7fcdff1ba1ff3f72d07d61a20f487cb238a6ef92fd955", 30288272),
    "dev-v1.1.json": ("95aa6a52d5d6a735563366753ca50492a658031da74f301ac5238b03966972c9", 4854279),
    "train-v2.0.json": ("68dcfbb971bd3e96d5b46c7177b16c1a4e7d4bdef19fb204502738552dede002", 42123633),
    "dev-v2.0.json": ("80a5225e94905956a6446d296ca1093975c4d3b3260f1d6c8f68bc2ab77182d8", 4370528),
}  # fmt: skip


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def server():
    srv = LocalServer()
    yield srv
    srv.close()


pytestmark = pytest.mark.usefixtures("isolated_home")  # tests/conftest.py


@pytest.fixture
def home(isolated_home):
    """This test's cache directory (not created)."""
    return isolated_home


def leftovers(directory) -> set[str]:
    """Names in ``directory`` other than download lock files."""
    if not directory.exists():
        return set()
    return {p.name for p in directory.iterdir() if not p.name.endswith(".lock")}


# ------------------------------------------------------------------------------- registry


def test_squad_entries_are_the_official_files_with_the_references_hashes():
    for version in ("1.1", "2.0"):
        dataset = get_dataset(f"squad{version}")
        assert dataset is squad.SQUAD_DATASETS[version]
        assert set(dataset.files) == {"train", "dev"}
        for split, data_file in dataset.files.items():
            name = f"{split}-v{version}.json"
            assert data_file.file_name == name
            assert data_file.url == f"{OFFICIAL}/{name}"
            assert (data_file.hash_prefix, data_file.num_bytes) == REFERENCE_SHA256[name]
            assert data_file.hash_algo == "sha256" and "datasets" in data_file.hash_source


def test_every_registered_file_pins_a_full_digest_and_its_source():
    assert {"squad1.1", "squad2.0", "cora", "citeseer", "pubmed"} <= set(list_datasets())
    for name in list_datasets():
        for data_file in get_dataset(name).files.values():
            full = 64 if data_file.hash_algo == "sha256" else 40
            assert len(data_file.hash_prefix) == full, (name, data_file.url)
            assert data_file.hash_source and data_file.url.startswith("https://")


def test_planetoid_entries_are_the_repository_blob_ids():
    cora = get_dataset("cora")
    assert [f.file_name for f in cora.files.values()] == [
        f"ind.cora.{s}" for s in graph_datasets.PLANETOID_SUFFIXES
    ]
    for data_file in cora.files.values():
        assert data_file.hash_algo == store.GIT_SHA1
        assert data_file.hash_prefix == graph_datasets.PLANETOID_BLOBS[data_file.file_name]
        assert data_file.url == f"{graph_datasets.PLANETOID_URL}/{data_file.file_name}"


def test_registry_refuses_duplicates_and_unhashed_files_and_suggests_names():
    with pytest.raises(ValueError, match="already registered"):
        register_dataset(get_dataset("squad1.1"))
    with pytest.raises(ValueError, match="did you mean squad1.1"):
        get_dataset("squad11")
    with pytest.raises(ValueError, match="hash_prefix"):
        DataFile(url=f"{OFFICIAL}/x.json", hash_prefix="", hash_source="none")
    with pytest.raises(ValueError, match="hash_source"):
        DataFile(url=f"{OFFICIAL}/x.json", hash_prefix="0123abcd")
    with pytest.raises(ValueError, match="no part 'test'"):
        get_dataset("squad2.0").file("test")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")
def test_git_sha1_is_git_hash_object(tmp_path):
    for size in (0, 5, 3 * (1 << 20) + 17):  # empty, tiny, across the 1 MiB read chunks
        path = tmp_path / f"f{size}"
        path.write_bytes(bytes(i % 251 for i in range(size)))
        expected = subprocess.run(
            ["git", "hash-object", str(path)], capture_output=True, text=True, check=True
        ).stdout.strip()
        assert store.file_hash(path, "git-sha1") == expected


# ----------------------------------------------------------------------------- by name


def test_squad_by_name_downloads_verifies_and_parses(server, home, monkeypatch):
    bodies = pin_small_squad(monkeypatch, "1.1", base=server.url("SQuAD-explorer/dataset"))
    for name, body in bodies.items():
        server.serve(f"SQuAD-explorer/dataset/{name}", body)
    path = squad.squad_file("1.1", "train", progress=False)
    assert path == home / "datasets" / "squad" / "train-v1.1.json"
    assert path.read_bytes() == bodies["train-v1.1.json"]
    parsed = squad.read_squad(path, training=True)
    assert parsed.version == "1.1" and len(parsed) == num_questions("1.1")
    assert {e.title for e in parsed.examples} == {
        "Python_(programming_language)",
        "Zachary's_karate_club",
        "SQuAD",
    }
    assert squad.squad_file("1.1", "train", progress=False) == path  # verified, not fetched
    assert server.hits["SQuAD-explorer/dataset/train-v1.1.json"] == 1
    dev = squad.read_squad(squad.squad_file("1.1", "dev", root=home / "mine", progress=False))
    assert len(dev) == num_questions("1.1")
    assert leftovers(home / "mine") == {"dev-v1.1.json"}


def test_mirror_base_url_serves_the_official_names(server, home, monkeypatch):
    bodies = pin_small_squad(monkeypatch, "2.0")  # official URLs, unreachable from here
    for name, body in bodies.items():
        server.serve(f"mirror/squad/{name}", body)
    monkeypatch.setenv("MODELZOO_DATA_URL", server.url("mirror/squad") + "/")
    monkeypatch.setenv("MODELZOO_REPO_URL", server.url("weights-mirror"))  # not for data
    paths = get_dataset("squad2.0").fetch_all(progress=False)
    assert server.hits == {"mirror/squad/train-v2.0.json": 1, "mirror/squad/dev-v2.0.json": 1}
    dev = squad.read_squad(paths["dev"])
    assert dev.version == "2.0" and sum(e.is_impossible for e in dev.examples) == 2
    assert len(dev) == num_questions("2.0")


def test_hash_mismatch_is_refused_and_nothing_is_left(server, home, monkeypatch):
    # The real entry: the official sha256; the "mirror" serves other bytes under its name.
    server.serve("mirror/train-v1.1.json", squad_json("1.1", "train"))
    monkeypatch.setenv("MODELZOO_DATA_URL", server.url("mirror"))
    with pytest.raises(store.ChecksumError) as info:
        squad.squad_file("1.1", "train", progress=False)
    message = str(info.value)
    assert REFERENCE_SHA256["train-v1.1.json"][0] in message
    assert str(home / "datasets" / "squad" / "train-v1.1.json") in message
    assert leftovers(home / "datasets" / "squad") == set()  # no file, no temporary file


def test_a_wrong_cached_file_is_replaced_once(server, home, monkeypatch):
    bodies = pin_small_squad(monkeypatch, "1.1", base=server.url("d"))
    server.serve("d/dev-v1.1.json", bodies["dev-v1.1.json"])
    dest = home / "datasets" / "squad" / "dev-v1.1.json"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b'{"version": "1.1", "data": []}')  # not the published bytes
    with pytest.warns(UserWarning, match="downloading it again"):
        path = squad.squad_file("1.1", "dev", progress=False)
    assert path.read_bytes() == bodies["dev-v1.1.json"] and server.hits["d/dev-v1.1.json"] == 1


def test_interrupted_transfer_leaves_no_partial_file(server, home, monkeypatch):
    bodies = pin_small_squad(monkeypatch, "1.1", base=server.url("d"))
    body = bodies["train-v1.1.json"]
    # The server promises the whole file and closes the connection halfway.
    server.serve("d/train-v1.1.json", body[: len(body) // 2], length=len(body), chunk_size=256)
    with pytest.raises(store.DownloadError) as info:
        squad.squad_file("1.1", "train", progress=False)
    message = str(info.value)
    assert server.url("d/train-v1.1.json") in message
    assert str(home / "datasets" / "squad" / "train-v1.1.json") in message
    assert leftovers(home / "datasets" / "squad") == set()
    server.serve("d/train-v1.1.json", body)  # the transfer works again: a clean start
    assert squad.squad_file("1.1", "train", progress=False).read_bytes() == body


def test_offline_message_names_the_file_its_url_and_destination(server, home, monkeypatch):
    server.serve("mirror/dev-v2.0.json", squad_json("2.0", "dev"))
    monkeypatch.setenv("MODELZOO_DATA_URL", server.url("mirror"))
    monkeypatch.setenv("MODELZOO_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as info:
        squad.squad_file("2.0", "dev", progress=False)
    message = str(info.value)
    dest = home / "datasets" / "squad" / "dev-v2.0.json"
    assert "data file dev-v2.0.json is not cached" in message
    assert server.url("mirror/dev-v2.0.json") in message and str(dest) in message
    assert server.total_hits == 0
    monkeypatch.delenv("MODELZOO_DATA_URL")
    with pytest.raises(FileNotFoundError, match=f"{OFFICIAL}/dev-v2.0.json"):
        squad.squad_file("2.0", "dev", progress=False)


def test_unreachable_host_names_the_url_the_mirror_variable_and_destination(home, monkeypatch):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("MODELZOO_DATA_URL", f"http://127.0.0.1:{port}/squad")
    with pytest.raises(store.DownloadError) as info:
        squad.squad_file("1.1", "dev", progress=False)
    message = str(info.value)
    assert f"http://127.0.0.1:{port}/squad/dev-v1.1.json" in message
    assert "MODELZOO_DATA_URL" in message and "MODELZOO_REPO_URL" not in message
    assert str(home / "datasets" / "squad" / "dev-v1.1.json") in message
    assert leftovers(home / "datasets" / "squad") == set()


def test_a_data_set_of_your_own_fetches_through_the_store(server, tmp_path):
    body = b"x" * 1000
    server.serve("files/part.bin", body)
    dataset = DataSet(
        name="toy",
        folder="toy",
        files={"all": DataFile(server.url("files/part.bin"), sha256(body), hash_source="test")},
    )
    assert dataset.fetch("all", tmp_path / "toy", progress=False).read_bytes() == body
    assert dataset.path("all", tmp_path / "toy") == tmp_path / "toy" / "part.bin"
