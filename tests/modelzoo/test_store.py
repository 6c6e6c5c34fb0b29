"""Tests for modelzoo.store: download, cache, lock and verify.

Every network test talks to a real ``http.server.ThreadingHTTPServer`` on 127.0.0.1; the
oracle for every hash is :mod:`hashlib` on the bytes the server serves.
"""

from __future__ import annotations

import hashlib
import io
import multiprocessing
import os
import pathlib
import socket
import time
import urllib.request
import warnings
import zipfile

import pytest

from modelzoo import store

from ..loopback import LocalServer

PAYLOAD = bytes(range(256)) * 257  # 65,792 bytes: more than one 8 KiB server chunk


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


@pytest.fixture
def server():
    srv = LocalServer()
    yield srv
    srv.close()


pytestmark = pytest.mark.usefixtures("isolated_home")  # tests/conftest.py


@pytest.fixture
def home(isolated_home) -> pathlib.Path:
    """This test's cache directory (not created)."""
    return isolated_home


def leftovers(directory: pathlib.Path) -> set[str]:
    """Names in ``directory`` other than download lock files."""
    if not directory.exists():
        return set()
    return {p.name for p in directory.iterdir() if not p.name.endswith(".lock")}


def make_zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(zipfile.ZipInfo(name), data)
    return buf.getvalue()


# ------------------------------------------------------------------------ paths, hashes


def test_cache_root_reads_env_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("MODELZOO_HOME", str(tmp_path / "a"))
    assert store.cache_root() == tmp_path / "a"
    assert store.weights_dir() == tmp_path / "a" / "weights"
    monkeypatch.delenv("MODELZOO_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert store.cache_root() == tmp_path / "user" / ".cache" / "modelzoo"


def test_resolve_url(monkeypatch):
    url = "https://example.org/models/resnest50-0123abcd.pth?download=1"
    assert store.resolve_url(url) == url
    monkeypatch.setenv("MODELZOO_REPO_URL", "http://mirror.local/zoo/")
    assert store.resolve_url(url) == "http://mirror.local/zoo/resnest50-0123abcd.pth"


@pytest.mark.parametrize("algo", ["sha256", "sha1"])
def test_file_hash_matches_hashlib(tmp_path, algo):
    path = tmp_path / "f.bin"
    data = os.urandom(3 * (1 << 20) + 17)  # crosses the 1 MiB chunk boundary
    path.write_bytes(data)
    assert store.file_hash(path, algo) == hashlib.new(algo, data).hexdigest()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"hash_prefix": "0123abcd", "hash_algo": "md5"}, "hash_algo"),
        ({"hash_prefix": "0123"}, "hash_prefix"),
        ({"hash_prefix": "xyz12345"}, "hash_prefix"),
        ({"hash_prefix": "a" * 65}, "hash_prefix"),
        ({"hash_prefix": "a" * 41, "hash_algo": "sha1"}, "hash_prefix"),
        ({"hash_prefix": "0123abcd", "file_name": "../x.pth"}, "file_name"),
        ({"hash_prefix": "0123abcd", "archive_member": "../x.params"}, "archive_member"),
    ],
)
def test_bad_arguments_raise_value_error_without_request(server, kwargs, match):
    url = server.serve("x.pth", PAYLOAD)
    kwargs = {"file_name": "x.pth", **kwargs}
    with pytest.raises(ValueError, match=match):
        store.fetch(url, progress=False, **kwargs)
    assert server.total_hits == 0


# ------------------------------------------------------------------------------- fetch


@pytest.mark.parametrize(
    ("algo", "prefix"),
    [
        ("sha256", sha256(PAYLOAD)),
        ("sha256", sha256(PAYLOAD)[:8]),
        ("sha256", sha256(PAYLOAD)[:8].upper()),
        ("sha1", sha1(PAYLOAD)[:8]),
    ],
    ids=["sha256-full", "sha256-prefix", "sha256-upper", "sha1-prefix"],
)
def test_fresh_download(server, home, algo, prefix):
    name = f"model-{prefix[:8].lower()}.pth"
    url = server.serve(name, PAYLOAD)
    path = store.fetch(url, file_name=name, hash_prefix=prefix, hash_algo=algo, progress=False)
    assert path == home / "weights" / name
    assert path.read_bytes() == PAYLOAD
    assert server.hits[name] == 1
    assert leftovers(path.parent) == {name}


def test_cached_file_makes_no_request(server):
    name = "model.pth"
    url = server.serve(name, PAYLOAD)
    first = store.fetch(url, file_name=name, hash_prefix=sha256(PAYLOAD)[:8], progress=False)
    second = store.fetch(url, file_name=name, hash_prefix=sha256(PAYLOAD)[:8], progress=False)
    assert first == second
    assert server.hits[name] == 1


def test_corrupted_cache_is_downloaded_again_once(server, home):
    name = "model.pth"
    dest = home / "weights" / name
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"truncated")
    url = server.serve(name, PAYLOAD)
    with pytest.warns(UserWarning, match=name):
        path = store.fetch(url, file_name=name, hash_prefix=sha256(PAYLOAD)[:8], progress=False)
    assert path.read_bytes() == PAYLOAD
    assert server.hits[name] == 1


def test_wrong_bytes_raise_checksum_error_and_leave_nothing(server, home):
    name = "model.pth"
    url = server.serve(name, b"not the published weights" * 1000)
    expected = sha256(PAYLOAD)[:8]
    actual = sha256(b"not the published weights" * 1000)
    with pytest.raises(store.ChecksumError) as info:
        store.fetch(url, file_name=name, hash_prefix=expected, progress=False)
    message = str(info.value)
    assert url in message and expected in message and actual in message and "sha256" in message
    assert leftovers(home / "weights") == set()
    assert server.hits[name] == 1


def test_corrupted_cache_and_bad_redownload_raise_and_leave_nothing(server, home):
    name = "model.pth"
    dest = home / "weights" / name
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"old corrupt copy")
    url = server.serve(name, b"still wrong")
    with pytest.warns(UserWarning, match=name), pytest.raises(store.ChecksumError, match=url):
        store.fetch(url, file_name=name, hash_prefix=sha256(PAYLOAD)[:8], progress=False)
    assert leftovers(home / "weights") == set()
    assert server.hits[name] == 1  # downloaded again exactly once, not in a loop


def test_http_404_raises_download_error(server, home):
    url = server.url("missing-0123abcd.pth")
    with pytest.raises(store.DownloadError) as info:
        store.fetch(url, file_name="missing-0123abcd.pth", hash_prefix="0123abcd", progress=False)
    message = str(info.value)
    assert url in message and "404" in message
    assert "MODELZOO_REPO_URL" in message
    assert str(home / "weights" / "missing-0123abcd.pth") in message
    assert leftovers(home / "weights") == set()


def test_http_500_raises_download_error(server):
    url = server.serve("model.pth", b"oops", status=500)
    with pytest.raises(store.DownloadError, match="500"):
        store.fetch(url, file_name="model.pth", hash_prefix="0123abcd", progress=False)


def test_connection_refused_raises_download_error(home):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/model.pth"
    with pytest.raises(store.DownloadError, match=url):
        store.fetch(url, file_name="model.pth", hash_prefix="0123abcd", progress=False)
    assert leftovers(home / "weights") == set()


def test_timeout_before_headers_raises_download_error(server, home):
    url = server.serve("model.pth", PAYLOAD, delay=5.0)
    start = time.monotonic()
    with pytest.raises(store.DownloadError, match=url):
        store.fetch(url, file_name="model.pth", hash_prefix="0123abcd", timeout=0.5, progress=False)
    assert time.monotonic() - start < 3.0
    assert leftovers(home / "weights") == set()


def test_timeout_mid_body_raises_download_error(server, home):
    url = server.serve("model.pth", PAYLOAD, chunk_delay=5.0)
    start = time.monotonic()
    with pytest.raises(store.DownloadError, match=url):
        store.fetch(url, file_name="model.pth", hash_prefix="0123abcd", timeout=0.5, progress=False)
    assert time.monotonic() - start < 3.0
    assert leftovers(home / "weights") == set()


def test_keyboard_interrupt_removes_temp_file(server, home, monkeypatch):
    url = server.serve("model.pth", PAYLOAD)
    real_urlopen = urllib.request.urlopen

    def interrupted_urlopen(*args, **kwargs):
        response = real_urlopen(*args, **kwargs)
        real_read = response.read
        calls = []

        def read(*a):
            calls.append(1)
            if len(calls) > 1:
                raise KeyboardInterrupt
            return real_read(1024)

        response.read = read
        return response

    monkeypatch.setattr(urllib.request, "urlopen", interrupted_urlopen)
    with pytest.raises(KeyboardInterrupt):
        store.fetch(url, file_name="model.pth", hash_prefix=sha256(PAYLOAD), progress=False)
    assert leftovers(home / "weights") == set()


# ----------------------------------------------------------------------- offline, mirror


def test_offline_missing_file_raises_without_request(server, home, monkeypatch):
    monkeypatch.setenv("MODELZOO_OFFLINE", "1")
    url = server.serve("model.pth", PAYLOAD)
    with pytest.raises(FileNotFoundError) as info:
        store.fetch(url, file_name="model.pth", hash_prefix=sha256(PAYLOAD)[:8], progress=False)
    message = str(info.value)
    assert "model.pth" in message
    assert str(home / "weights" / "model.pth") in message
    assert url in message
    assert server.total_hits == 0


def test_offline_corrupt_file_raises_without_request(server, home, monkeypatch):
    dest = home / "weights" / "model.pth"
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"corrupt")
    monkeypatch.setenv("MODELZOO_OFFLINE", "1")
    url = server.serve("model.pth", PAYLOAD)
    with pytest.raises(FileNotFoundError, match="corrupt"):
        store.fetch(url, file_name="model.pth", hash_prefix=sha256(PAYLOAD)[:8], progress=False)
    assert server.total_hits == 0


def test_offline_uses_cached_file(server, monkeypatch):
    url = server.serve("model.pth", PAYLOAD)
    cached = store.fetch(url, file_name="model.pth", hash_prefix=sha1(PAYLOAD)[:8], **_sha1())
    monkeypatch.setenv("MODELZOO_OFFLINE", "1")
    again = store.fetch(url, file_name="model.pth", hash_prefix=sha1(PAYLOAD)[:8], **_sha1())
    assert again == cached
    assert server.total_hits == 1


def _sha1() -> dict:
    return {"hash_algo": "sha1", "progress": False}


def test_repo_url_mirror(server, monkeypatch):
    server.serve("mirror/zoo/model-0123abcd.pth", PAYLOAD)
    monkeypatch.setenv("MODELZOO_REPO_URL", server.url("mirror/zoo") + "/")
    path = store.fetch(
        "https://unreachable.invalid/models/model-0123abcd.pth",
        file_name="model-0123abcd.pth",
        hash_prefix=sha256(PAYLOAD)[:8],
        progress=False,
    )
    assert path.read_bytes() == PAYLOAD
    assert server.hits == {"mirror/zoo/model-0123abcd.pth": 1}


def test_file_url_source(tmp_path, home):
    src = tmp_path / "published" / "model.pth"
    src.parent.mkdir()
    src.write_bytes(PAYLOAD)
    path = store.fetch(
        src.as_uri(), file_name="model.pth", hash_prefix=sha256(PAYLOAD)[:8], progress=False
    )
    assert path == home / "weights" / "model.pth"
    assert path.read_bytes() == PAYLOAD
    with pytest.raises(store.DownloadError, match="missing.pth"):
        store.fetch(
            (tmp_path / "published" / "missing.pth").as_uri(),
            file_name="missing.pth",
            hash_prefix="0123abcd",
            progress=False,
        )


def test_progress_bar_is_silent_when_stderr_is_not_a_tty(server, capfd):
    url = server.serve("model.pth", PAYLOAD)
    store.fetch(url, file_name="model.pth", hash_prefix=sha256(PAYLOAD)[:8], progress=True)
    assert capfd.readouterr().err == ""


# ----------------------------------------------------------------------------- archives


def test_zip_archive_member_is_extracted_and_verified(server, home):
    # GluonCV layout: {name}-{hash8}.zip holding {name}-{hash8}.params, hashed as the member.
    short = sha1(PAYLOAD)[:8]
    member = f"resnet50_v1b-{short}.params"
    url = server.serve(f"resnet50_v1b-{short}.zip", make_zip({member: PAYLOAD, "README": b"x"}))
    path = store.fetch(
        url,
        file_name=member,
        hash_prefix=short,
        hash_algo="sha1",
        archive_member=member,
        progress=False,
    )
    assert path == home / "weights" / member
    assert path.read_bytes() == PAYLOAD
    assert leftovers(home / "weights") == {member}  # the zip is gone


def test_zip_missing_member_lists_members(server, home):
    url = server.serve("model.zip", make_zip({"other.params": PAYLOAD}))
    with pytest.raises(store.DownloadError) as info:
        store.fetch(
            url,
            file_name="model.params",
            hash_prefix=sha256(PAYLOAD)[:8],
            archive_member="model.params",
            progress=False,
        )
    message = str(info.value)
    assert url in message and "model.params" in message and "other.params" in message
    assert leftovers(home / "weights") == set()


@pytest.mark.parametrize("evil", ["../evil.params", "/etc/evil.params", "a/../../evil.params"])
def test_zip_with_unsafe_member_is_rejected(server, home, evil):
    url = server.serve("model.zip", make_zip({"model.params": PAYLOAD, evil: b"pwned"}))
    with pytest.raises(store.DownloadError, match="unsafe"):
        store.fetch(
            url,
            file_name="model.params",
            hash_prefix=sha256(PAYLOAD)[:8],
            archive_member="model.params",
            progress=False,
        )
    assert leftovers(home / "weights") == set()
    assert not (home / "evil.params").exists()


def test_a_failed_zip_download_hint_names_the_archive_the_mirror_must_serve(server, home):
    """GluonCV weights come as {name}.zip holding {name}.params: a mirror must serve the
    .zip, and placing the .params by hand works; the hint says both, not one for the other."""
    url = server.url("resnet50_v1b-0123abcd.zip")  # never served: HTTP 404
    with pytest.raises(store.DownloadError) as info:
        store.fetch(
            url,
            file_name="resnet50_v1b-0123abcd.params",
            hash_prefix="0123abcd",
            hash_algo="sha1",
            archive_member="resnet50_v1b-0123abcd.params",
            progress=False,
        )
    message = str(info.value)
    assert "serves resnet50_v1b-0123abcd.zip (the archive holding" in message
    assert f"by hand at {home / 'weights' / 'resnet50_v1b-0123abcd.params'}" in message


def test_download_that_is_not_a_zip_raises(server, home):
    url = server.serve("model.zip", b"<html>mirror error page</html>")
    with pytest.raises(store.DownloadError, match="zip"):
        store.fetch(
            url,
            file_name="model.params",
            hash_prefix="0123abcd",
            archive_member="model.params",
            progress=False,
        )
    assert leftovers(home / "weights") == set()


# -------------------------------------------------------------------------------- purge


def test_purge(home):
    weights = home / "weights"
    assert store.purge() == []  # no cache yet
    weights.mkdir(parents=True)
    for name in ["resnest50-aaaa1111.pth", "resnest101-bbbb2222.pth", "bert-cccc3333.params"]:
        (weights / name).write_bytes(b"w")
    (weights / "bert-cccc3333.params.lock").write_bytes(b"")
    removed = store.purge("resnest*")
    assert removed == [weights / "resnest101-bbbb2222.pth", weights / "resnest50-aaaa1111.pth"]
    assert store.purge("nothing-*") == []
    assert store.purge() == [weights / "bert-cccc3333.params"]
    assert leftovers(weights) == set()


# ------------------------------------------------------------------------ multi-process


# Each worker loads store.py on its own: ``import modelzoo`` would also import torch and the
# model families, which costs seconds per spawned process and is not what is under test.
_WORKER = """
import importlib.util
spec = importlib.util.spec_from_file_location("_modelzoo_store_worker", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.fetch(url, **kwargs)
"""


@pytest.mark.dist
def test_concurrent_processes_download_once(server, home):
    # Served slowly (~1.8 s) so the four processes overlap; the lock must make three wait.
    url = server.serve("model.pth", PAYLOAD, chunk_delay=0.2)
    kwargs = {"file_name": "model.pth", "hash_prefix": sha256(PAYLOAD)[:8], "progress": False}
    scope = {"path": store.__file__, "url": url, "kwargs": kwargs}
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=exec, args=(_WORKER, scope)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert server.hits["model.pth"] == 1
    dest = home / "weights" / "model.pth"
    assert dest.read_bytes() == PAYLOAD
    assert leftovers(dest.parent) == {"model.pth"}


def test_no_warnings_on_clean_download(server):
    url = server.serve("model.pth", PAYLOAD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store.fetch(url, file_name="model.pth", hash_prefix=sha256(PAYLOAD)[:8], progress=False)
