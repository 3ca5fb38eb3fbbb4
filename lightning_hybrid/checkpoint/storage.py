"""Where checkpoints live: a local folder (``pathlib.Path``) or an fsspec URL (``s3://bucket/prefix``, ``gs://``, ...).

:func:`checkpoint_path` turns what a user gives into one of the two. An :class:`ObjectPath` has the few
``pathlib`` methods the checkpoint code uses (``/``, ``name``, ``is_file``, ``stat``, ``open``, ``glob``, ...),
so the writer, the manifest and the verifier read the same on both. The differences that matter live here:

- **Commit.** A local save is written to ``step-N.tmp`` and renamed. An object store has no atomic rename: a save
  is written straight into ``step-N/`` and counts only once its manifest object exists, written last after every
  shard was read back and checksummed (:func:`is_committed`). A killed upload leaves no manifest, never chosen.
- **Removal.** The manifest goes first, then the shards (:func:`remove_checkpoint`), so a removal killed half-way
  leaves an uncommitted prefix, never a committed checkpoint with missing shards.
- **Credentials and endpoint** come from the environment (``AWS_*``, ``AWS_ENDPOINT_URL``) or ``storage_options``,
  passed as given to fsspec and DCP's ``FsspecWriter``/``FsspecReader``.

``storage_options`` given for a URL are remembered for every path under it (:func:`checkpoint_path`), so the
strategy's loader, the rollback and ``export-hf`` reach the bucket with the same options as the callback.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator, Optional, Union

__all__ = ["ObjectPath", "checkpoint_path", "is_url", "is_committed", "remove_checkpoint", "move_checkpoint",
           "storage_writer", "storage_reader", "StorageError"]

_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_OPTIONS: dict[str, dict[str, Any]] = {}  # URL prefix -> storage_options given for it


class StorageError(ValueError):
    """A checkpoint URL that cannot be used: unknown scheme, missing package, no bucket, no credentials."""


def is_url(path: Any) -> bool:
    """True for an fsspec URL other than ``file://`` (a local path stays a ``pathlib.Path``)."""
    match = _URL.match(str(path))
    return bool(match) and match.group(1) not in ("file", "local")


class ObjectPath:
    """A file or "folder" (key prefix) on an fsspec file system, with the ``pathlib`` subset checkpoints use."""

    def __init__(self, url: str, fs: Any, options: dict[str, Any]) -> None:
        self.url = url.rstrip("/")
        self.fs = fs
        self.options = options

    # ---- naming
    def __truediv__(self, name: Union[str, Path]) -> "ObjectPath":
        return ObjectPath(f"{self.url}/{str(name).strip('/')}", self.fs, self.options)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> "ObjectPath":
        return ObjectPath(self.url.rsplit("/", 1)[0], self.fs, self.options)

    def with_name(self, name: str) -> "ObjectPath":
        return self.parent / name

    def resolve(self) -> "ObjectPath":
        return self

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"ObjectPath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    # ---- queries (no listing cache: other ranks and processes write the same bucket)
    def exists(self) -> bool:
        return bool(self.fs.exists(self.url))

    def is_file(self) -> bool:
        return bool(self.fs.isfile(self.url))

    def is_dir(self) -> bool:
        return bool(self.fs.isdir(self.url))

    def stat(self) -> SimpleNamespace:
        return SimpleNamespace(st_size=int(self.fs.size(self.url)))

    def iterdir(self) -> Iterator["ObjectPath"]:
        if not self.is_dir():
            return iter(())
        return iter(ObjectPath(_with_scheme(self.url, p), self.fs, self.options)
                    for p in self.fs.ls(self.url, detail=False) if p.rstrip("/") != _strip(self.url))

    def glob(self, pattern: str) -> Iterator["ObjectPath"]:
        return iter(ObjectPath(_with_scheme(self.url, p), self.fs, self.options)
                    for p in sorted(self.fs.glob(f"{self.url}/{pattern}")))

    def sizes(self) -> dict[str, int]:
        """Every object under this prefix, relative name -> size, from one listing."""
        root = _strip(self.url)
        found = self.fs.find(self.url, detail=True)
        return {path[len(root) + 1:]: int(info.get("size", 0)) for path, info in found.items()
                if info.get("type") != "directory"}

    # ---- reading and writing (one PUT per object: atomic on S3-compatible stores)
    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        pass  # prefixes exist once an object is written under them

    def open(self, mode: str = "rb") -> Any:
        return self.fs.open(self.url, mode)

    def read_bytes(self) -> bytes:
        return self.fs.cat_file(self.url)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        self.fs.pipe_file(self.url, data)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def unlink(self, missing_ok: bool = False) -> None:
        if missing_ok and not self.exists():
            return
        self.fs.rm_file(self.url)


def _strip(url: str) -> str:
    return _URL.sub("", url).rstrip("/")


def _with_scheme(like: str, path: str) -> str:
    match = _URL.match(like)
    return (match.group(0) if match else "") + _strip(path)


def _options_for(url: str) -> dict[str, Any]:
    best = ""
    for prefix in _OPTIONS:
        if (url == prefix or url.startswith(prefix.rstrip("/") + "/")) and len(prefix) > len(best):
            best = prefix
    return dict(_OPTIONS.get(best, {}))


def _filesystem(url: str, options: dict[str, Any]) -> Any:
    import fsspec

    scheme = _URL.match(url).group(1)  # type: ignore[union-attr]
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError:
        raise StorageError(f"checkpoint path {url}: unknown URL scheme {scheme}://; use a local folder or an "
                           f"fsspec URL (s3://, gs://, az://, ...)") from None
    except ImportError as err:
        extra = "s3" if scheme in ("s3", "s3a") else None
        fix = f"pip install 'lightning-hybrid[{extra}]'" if extra else f"install the fsspec package for {scheme}://"
        raise StorageError(f"checkpoint path {url} needs a package that is not installed "
                           f"({' '.join(str(err).split())}); {fix}") from None
    # Other ranks and processes write the same bucket: never answer a listing from this process's cache.
    return fsspec.filesystem(scheme, **{"use_listings_cache": False, **options})


def checkpoint_path(path: Union[str, Path, ObjectPath], storage_options: Optional[dict[str, Any]] = None,
                    check: bool = False) -> Union[Path, ObjectPath]:
    """A local ``Path`` or an :class:`ObjectPath` for ``path``; ``storage_options`` apply to every path under it.

    Args:
        path: a local folder or an fsspec URL.
        storage_options: passed to fsspec (``key``, ``secret``, ``endpoint_url``, ``client_kwargs``, ...);
            remembered for this URL and every URL under it. Not allowed with a local path.
        check: reach the store now: the bucket must exist and the credentials must work.

    Raises:
        StorageError: one line: an unknown scheme, the package for it missing (naming the extra), a bucket that
            does not exist, or the store's own error (no credentials, access denied).
    """
    if isinstance(path, ObjectPath):
        return path
    if not is_url(path):
        if storage_options:
            raise StorageError(f"storage_options={sorted(storage_options)} given with the local path {path}; "
                               f"they are for an fsspec URL such as s3://bucket/prefix")
        return Path(str(path).removeprefix("file://"))
    url = str(path).rstrip("/")
    if storage_options:
        _OPTIONS[url] = dict(storage_options)
    options = _options_for(url)
    result = ObjectPath(url, _filesystem(url, options), options)
    if check:
        _check_reachable(result)
    return result


def _check_reachable(path: ObjectPath) -> None:
    bucket = _strip(path.url).split("/", 1)[0]
    try:
        path.fs.ls(bucket, detail=False)  # not exists(): s3fs's hides a credentials error as "no such bucket"
        exists = True
    except FileNotFoundError:
        exists = False
    except Exception as err:  # noqa: BLE001 - the store's own error, in one line
        raise StorageError(f"checkpoint path {path.url}: {type(err).__name__}: {' '.join(str(err).split())} "
                           f"(set credentials and the endpoint in the environment or storage_options)") from None
    if not exists:
        raise StorageError(f"checkpoint path {path.url}: bucket {bucket!r} does not exist at "
                           f"{_endpoint(path)}; create it or fix the URL")


def _endpoint(path: ObjectPath) -> str:
    import os

    client = path.options.get("client_kwargs", {}) or {}
    return str(path.options.get("endpoint_url") or client.get("endpoint_url")
               or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
               or "the default endpoint")


def is_committed(folder: Union[Path, ObjectPath], manifest: str) -> bool:
    """Whether ``folder`` is a committed checkpoint: a local ``step-N`` folder, or a prefix with its manifest."""
    if isinstance(folder, ObjectPath):
        return (folder / manifest).is_file()
    return folder.is_dir()


def remove_checkpoint(folder: Union[Path, ObjectPath], manifest: str) -> None:
    """Delete a checkpoint: on an object store its manifest first (it stops counting at once), then the shards."""
    if isinstance(folder, ObjectPath):
        try:
            (folder / manifest).unlink(missing_ok=True)
            if folder.exists():
                folder.fs.rm(folder.url, recursive=True)
        except FileNotFoundError:
            pass
        return
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


def move_checkpoint(folder: Union[Path, ObjectPath], target: Union[Path, ObjectPath], manifest: str) -> None:
    """Move a checkpoint aside; on an object store (copy, then delete) the manifest leaves the old prefix first."""
    if isinstance(folder, ObjectPath):
        assert isinstance(target, ObjectPath)
        names = folder.sizes()
        if manifest in names:
            folder.fs.copy((folder / manifest).url, (target / manifest).url)
            (folder / manifest).unlink()
        for name in names:
            if name != manifest:
                folder.fs.copy((folder / name).url, (target / name).url)
        folder.fs.rm(folder.url, recursive=True)
        return
    import os

    os.replace(folder, target)


def storage_writer(folder: Union[Path, ObjectPath]) -> Optional[Any]:
    """DCP's ``FsspecWriter`` for an object-store folder (``None`` for a local one: DCP's file writer)."""
    if not isinstance(folder, ObjectPath):
        return None
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(folder.url, **folder.options)


def storage_reader(folder: Union[Path, ObjectPath]) -> Optional[Any]:
    """DCP's ``FsspecReader`` for an object-store folder (``None`` for a local one)."""
    if not isinstance(folder, ObjectPath):
        return None
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(folder.url, **folder.options)
