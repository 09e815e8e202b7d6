"""Object stores: one small interface (put/get/list/delete of whole objects by key) and its backends: a local
folder (the embedded default), anything fsspec serves (s3://, gs://, ...), and Hugging Face Buckets."""

from __future__ import annotations

import os
import re
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from .errors import MissingObjectError, StoreError

_KEY_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def check_key(key: str) -> str:
    """Keys are relative '/'-separated names of plain parts: never absolute, never '..', never a local path trick."""
    if not isinstance(key, str) or not key or len(key) > 512:
        raise StoreError(f"invalid store key {key!r}")
    parts = key.split("/")
    if any(not _KEY_PART.match(part) or part in (".", "..") for part in parts):
        raise StoreError(f"invalid store key {key!r}: use letters, digits, '.', '_', '-' and '/' between parts")
    return key


class Store(ABC):
    """Whole-object storage by key. `put` is atomic: a reader sees the old object, the new one, or none."""

    url: str

    @abstractmethod
    def put(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes; raises MissingObjectError when absent."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys under `prefix` (a folder-like prefix ending in '/', or ''), sorted."""

    @abstractmethod
    def delete(self, keys: list[str]) -> None:
        """Deletes the keys; absent keys are ignored."""

    def exists(self, key: str) -> bool:
        try:
            self.get(key)
        except MissingObjectError:
            return False
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class LocalStore(Store):
    """A folder on a local filesystem. Writes go to a temporary file in the same folder, then are renamed."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()
        self.url = str(self.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StoreError(f"{self.root}: cannot create the store folder: {error}") from error

    def _path(self, key: str) -> Path:
        path = self.root.joinpath(*check_key(key).split("/"))
        if self.root not in path.parents:
            raise StoreError(f"invalid store key {key!r}")
        return path

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(dir=path.parent, prefix=".deltasync-", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(temp, path)
            except BaseException:
                Path(temp).unlink(missing_ok=True)
                raise
        except OSError as error:
            raise StoreError(f"{path}: cannot write: {error}") from error

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise MissingObjectError(f"{path}: no such object") from None
        except OSError as error:
            raise StoreError(f"{path}: cannot read: {error}") from error

    def list(self, prefix: str = "") -> list[str]:
        base = self.root.joinpath(*[p for p in prefix.split("/") if p]) if prefix else self.root
        if not base.is_dir():
            return []
        keys = []
        for path in base.rglob("*"):
            if path.is_file() and not path.name.startswith(".deltasync-"):
                keys.append(path.relative_to(self.root).as_posix())
        return sorted(keys)

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self._path(key).unlink(missing_ok=True)
            except OSError as error:
                raise StoreError(f"{self._path(key)}: cannot delete: {error}") from error


class FsspecStore(Store):
    """Any URL fsspec understands: s3://bucket/prefix, gs://..., memory://... (options go to the filesystem)."""

    def __init__(self, url: str, **storage_options: Any) -> None:
        try:
            from fsspec.core import url_to_fs
        except ImportError as error:  # pragma: no cover - fsspec ships with the package's dependencies
            raise StoreError("fsspec is needed for URL stores: pip install fsspec (and s3fs or gcsfs)") from error
        self.url = url.rstrip("/")
        try:
            self.fs, root = url_to_fs(self.url, **storage_options)
        except (ImportError, ValueError) as error:
            raise StoreError(f"{url}: cannot open this store: {error}") from error
        self.root = root.rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def put(self, key: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(self._path(key), data)
        except Exception as error:  # fsspec backends raise their own exception types
            raise StoreError(f"{self.url}/{key}: cannot write: {error}") from error

    def get(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self._path(key))
        except FileNotFoundError:
            raise MissingObjectError(f"{self.url}/{key}: no such object") from None
        except Exception as error:
            raise StoreError(f"{self.url}/{key}: cannot read: {error}") from error

    def list(self, prefix: str = "") -> list[str]:
        base = f"{self.root}/{prefix}".rstrip("/")
        try:
            found = self.fs.find(base) if self.fs.exists(base) else []
        except FileNotFoundError:
            return []
        except Exception as error:
            raise StoreError(f"{self.url}/{prefix}: cannot list: {error}") from error
        offset = len(self.root) + 1
        return sorted(path[offset:] for path in found if path.startswith(self.root + "/"))

    def delete(self, keys: list[str]) -> None:
        paths = [self._path(key) for key in keys]
        if not paths:
            return
        try:
            existing = [path for path in paths if self.fs.exists(path)]
            if existing:
                self.fs.rm(existing)
        except Exception as error:
            raise StoreError(f"{self.url}: cannot delete {len(paths)} objects: {error}") from error


class HFBucketStore(Store):
    """A Hugging Face Bucket: hf://buckets/ORG/NAME[/PREFIX]. The token comes from HF_TOKEN (or the saved login).

    `api` is anything with huggingface_hub's `batch_bucket_files`, `download_bucket_files` and `list_bucket_tree`
    (the module itself by default); tests pass an in-process stand-in.
    """

    def __init__(self, url: str, *, token: str | None = None, api: Any = None) -> None:
        match = re.match(r"^hf://buckets/([^/]+/[^/]+)(?:/(.*))?$", url.rstrip("/"))
        if not match:
            raise StoreError(f"{url}: a Hugging Face Bucket URL looks like hf://buckets/ORG/NAME[/PREFIX]")
        self.url = url.rstrip("/")
        self.bucket_id = match.group(1)
        self.prefix = (match.group(2) or "").strip("/")
        if self.prefix:
            check_key(self.prefix)
        self.token = token if token is not None else os.environ.get("HF_TOKEN")
        if api is None:
            import huggingface_hub as api
        self.api = api

    def _remote(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes) -> None:
        remote = self._remote(key)
        # Large objects upload from a path: the bytes path copies once more on the way (REFERENCE §6).
        try:
            if len(data) > 64 << 20:
                with tempfile.TemporaryDirectory(prefix="deltasync-") as folder:
                    path = Path(folder) / "object"
                    path.write_bytes(data)
                    self.api.batch_bucket_files(self.bucket_id, add=[(str(path), remote)], token=self.token)
            else:
                self.api.batch_bucket_files(self.bucket_id, add=[(data, remote)], token=self.token)
        except Exception as error:
            raise StoreError(f"{self.url}/{key}: cannot upload: {error}") from error

    def get(self, key: str) -> bytes:
        remote = self._remote(key)
        with tempfile.TemporaryDirectory(prefix="deltasync-") as folder:
            local = Path(folder) / "object"
            try:
                self.api.download_bucket_files(self.bucket_id, files=[(remote, str(local))],
                                               raise_on_missing_files=True, token=self.token)
            except FileNotFoundError:
                raise MissingObjectError(f"{self.url}/{key}: no such object") from None
            except Exception as error:
                if "not found" in str(error).lower() or "missing" in str(error).lower():
                    raise MissingObjectError(f"{self.url}/{key}: no such object") from None
                raise StoreError(f"{self.url}/{key}: cannot download: {error}") from error
            if not local.exists():
                raise MissingObjectError(f"{self.url}/{key}: no such object")
            return local.read_bytes()

    def list(self, prefix: str = "") -> list[str]:
        remote_prefix = self._remote(prefix.rstrip("/")) if prefix else self.prefix
        try:
            entries = self.api.list_bucket_tree(self.bucket_id, prefix=remote_prefix or None, recursive=True,
                                                token=self.token)
            paths = [entry.path for entry in entries if getattr(entry, "type", "file") == "file"]
        except Exception as error:
            raise StoreError(f"{self.url}/{prefix}: cannot list: {error}") from error
        strip = len(self.prefix) + 1 if self.prefix else 0
        own = [path[strip:] for path in paths if not self.prefix or path.startswith(self.prefix + "/")]
        return sorted(key for key in own if key.startswith(prefix))

    def delete(self, keys: list[str]) -> None:
        if not keys:
            return
        try:
            self.api.batch_bucket_files(self.bucket_id, delete=[self._remote(k) for k in keys], token=self.token)
        except Exception as error:
            raise StoreError(f"{self.url}: cannot delete {len(keys)} objects: {error}") from error


def open_store(store: str | os.PathLike[str] | Store, **options: Any) -> Store:
    """A Store from a URL or path: hf://buckets/... → HFBucketStore, scheme:// → FsspecStore, else a LocalStore."""
    if isinstance(store, Store):
        return store
    text = os.fspath(store)
    if text.startswith("hf://"):
        return HFBucketStore(text, **options)
    if "://" in text and not text.startswith("file://"):
        return FsspecStore(text, **options)
    return LocalStore(text.removeprefix("file://"))


__all__ = ["FsspecStore", "HFBucketStore", "LocalStore", "Store", "check_key", "open_store"]
