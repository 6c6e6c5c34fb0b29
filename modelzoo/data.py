"""Public data sets by name: where each file is published, its hash, and the store that fetches it.

A :class:`DataSet` names the files of one public data set (SQuAD v1.1's ``train-v1.1.json``
and ``dev-v1.1.json``, Cora's eight Planetoid files); each :class:`DataFile` carries the
publisher's URL, a hash pinned from a reference that states it (``hash_source``) and the size.
:meth:`DataSet.fetch` goes through :func:`modelzoo.store.fetch_data`, with the guarantees the
weights have: the hash is checked on every use, a download is renamed into place only once
verified, under a lock, ``$MODELZOO_DATA_URL`` names a mirror and ``MODELZOO_OFFLINE=1``
never touches the network (the error then names the file, its URL and where to put it).

Entries are registered next to the code that reads them (:mod:`modelzoo.nlp.squad`,
:mod:`modelzoo.graph.datasets`); ``docs/data.md`` lists them.

Example:
    >>> from modelzoo.data import get_dataset
    >>> path = get_dataset("squad1.1").fetch("dev")  # doctest: +SKIP
"""

from __future__ import annotations

import os
import posixpath
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from . import store
from ._lookup import unknown_name

__all__ = ["DataFile", "DataSet", "get_dataset", "list_datasets", "register_dataset"]


@dataclass(frozen=True)
class DataFile:
    """One published file of a data set.

    Attributes:
        url: Where the publisher serves it (``$MODELZOO_DATA_URL`` replaces the base).
        hash_prefix: Its hex digest (full, or at least 8 leading digits).
        hash_algo: ``"sha256"``, ``"sha1"`` or ``"git-sha1"`` (git's blob id, which a GitHub
            repository pins for every file it serves).
        num_bytes: Its size, where the reference states it.
        hash_source: The reference that states the hash (a file of a public project), so a
            reader can check it; required.
    """

    url: str
    hash_prefix: str
    hash_algo: str = "sha256"
    num_bytes: int | None = None
    hash_source: str = ""

    def __post_init__(self) -> None:
        try:
            store._check_hash_args(self.hash_prefix, self.hash_algo)
        except ValueError as e:
            raise ValueError(f"DataFile({self.url}): {e}") from None
        if not self.hash_source:
            raise ValueError(
                f"DataFile({self.url}): hash_source must say where the hash comes from"
            )
        store._check_file_name(self.file_name, f"DataFile({self.url}): the URL's file name")

    @property
    def file_name(self) -> str:
        """The file's name, as the publisher names it (the last part of the URL)."""
        return posixpath.basename(urllib.parse.urlsplit(self.url).path)


@dataclass(frozen=True)
class DataSet:
    """A public data set: its files by part (``"train"``, ``"dev"``, ...) and where they go.

    Attributes:
        name: The registry name (``"squad1.1"``, ``"cora"``).
        files: Part -> :class:`DataFile`.
        folder: Its default folder under :func:`modelzoo.store.datasets_dir` (data sets that
            share files' home, such as SQuAD's two versions, share a folder).
        description: One line: what it is.
        homepage: The publisher's page.
        license: The data's license.
    """

    name: str
    files: Mapping[str, DataFile]
    folder: str
    description: str = ""
    homepage: str = ""
    license: str = ""

    def __post_init__(self) -> None:
        if not self.files:
            raise ValueError(f"DataSet({self.name!r}) has no files")
        store._check_file_name(self.folder, f"DataSet({self.name!r}).folder")

    def root(self, root: str | os.PathLike[str] | None = None) -> Path:
        """The folder of its files: ``root``, or ``$MODELZOO_HOME/datasets/<folder>``."""
        return Path(root) if root is not None else store.datasets_dir() / self.folder

    def file(self, part: str) -> DataFile:
        """The :class:`DataFile` of ``part``.

        Raises:
            ValueError: ``part`` is not one of the data set's parts (listed).
        """
        if part not in self.files:
            raise ValueError(
                f"data set {self.name!r} has no part {part!r}; its parts are {list(self.files)}"
            )
        return self.files[part]

    def path(self, part: str, root: str | os.PathLike[str] | None = None) -> Path:
        """Where the file of ``part`` is (or will be once fetched)."""
        return self.root(root) / self.file(part).file_name

    def fetch(
        self,
        part: str,
        root: str | os.PathLike[str] | None = None,
        *,
        progress: bool = True,
        timeout: float = 60.0,
    ) -> Path:
        """The verified file of ``part`` in :meth:`root`, downloaded if missing or corrupt.

        Raises:
            FileNotFoundError: ``MODELZOO_OFFLINE=1`` and the file is not there (the message
                names the file, its URL and the path to put it at).
            modelzoo.store.DownloadError: The host (or mirror) could not be reached; the
                message says the same.
            modelzoo.store.ChecksumError: The bytes are not the published file's.
        """
        data_file = self.file(part)
        return store.fetch_data(
            data_file.url,
            self.path(part, root),
            hash_prefix=data_file.hash_prefix,
            hash_algo=data_file.hash_algo,
            progress=progress,
            timeout=timeout,
        )

    def fetch_all(
        self, root: str | os.PathLike[str] | None = None, *, progress: bool = True
    ) -> dict[str, Path]:
        """Every part's verified file (:meth:`fetch` each)."""
        return {part: self.fetch(part, root, progress=progress) for part in self.files}


_REGISTRY: dict[str, DataSet] = {}


def register_dataset(dataset: DataSet) -> DataSet:
    """Add ``dataset`` to the registry under its (lower-case) name and return it.

    Raises:
        ValueError: The name is taken.
    """
    key = dataset.name.lower()
    if key in _REGISTRY:
        raise ValueError(f"register_dataset: data set name {key!r} is already registered")
    _REGISTRY[key] = dataset
    return dataset


def get_dataset(name: str) -> DataSet:
    """The registered data set ``name`` (case-insensitive).

    Raises:
        ValueError: Unknown name; the message lists the closest registered names.
    """
    key = name.lower()
    if key not in _REGISTRY:
        listing = f"modelzoo.data.list_datasets() lists {', '.join(sorted(_REGISTRY))}"
        raise unknown_name("data set", name, _REGISTRY, listing)
    return _REGISTRY[key]


def list_datasets() -> list[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)
