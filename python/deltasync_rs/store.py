"""Object stores: one small interface (put/get/list/delete of whole objects by key) and its backends: a local
folder (the embedded default), anything fsspec serves (s3://, gs://, ...), and Hugging Face Buckets."""

from __future__ import annotations

import builtins
import errno
import inspect
import json
import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

try:
    import fcntl
except ImportError:  # Windows: no flock; private temporary files are never swept there
    fcntl = None  # type: ignore[assignment]

from .errors import DeltaSyncError, MissingObjectError, StoreError, shown

log = logging.getLogger(__name__)

_KEY_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def check_key(key: str) -> str:
    """Keys are relative '/'-separated names of plain parts: never absolute, never '..', never a local path trick."""
    if not isinstance(key, str) or not key or len(key) > 512:
        raise StoreError(f"invalid store key {key!r}")
    parts = key.split("/")
    if any(not _KEY_PART.match(part) or part in (".", "..") for part in parts):
        raise StoreError(f"invalid store key {key!r}: use letters, digits, '.', '_', '-' and '/' between parts")
    return key


class Sink(Protocol):
    """Where ``Store.get_file`` writes: a binary file, or anything with its ``write``."""

    def write(self, data: bytes, /) -> object: ...


class Store(ABC):
    """Whole-object storage by key. `put` is atomic: a reader sees the old object, the new one, or none."""

    url: str

    @abstractmethod
    def put(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes; raises MissingObjectError when absent."""

    #: True when ``create`` is atomic: of several writers creating one key at once, exactly one writes it.
    atomic_create: bool = False

    def create(self, key: str, data: bytes) -> bool:
        """Writes the object only where the key is absent: True when written, False when an object was there (which
        is left as it is). Atomic where ``atomic_create`` is True; this fallback looks, then writes, so two writers
        at once may both write."""
        if self.exists(key):
            return False
        self.put(key, data)
        return True

    def get_small(self, key: str, max_bytes: int) -> bytes:
        """The bytes of an object that may hold at most ``max_bytes`` (a manifest document); a larger one is a
        StoreError. Backends override this to stop reading at the cap; this fallback reads the whole object."""
        data = self.get(key)
        if len(data) > max_bytes:
            raise too_large(f"{self.url}/{key}", max_bytes)
        return data

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Writes the object from a local file, as atomically as ``put``; the file must not change until this
        returns (a LocalStore may link it in place: delete it afterwards, never write to it). Backends upload from
        the file; this fallback reads it into memory."""
        self.put(key, Path(path).read_bytes())

    def staging_folder(self) -> Path | None:
        """A local folder where a file meant for ``put_file`` is best made (None: anywhere, e.g. the temp folder)."""
        return None

    def get_file(self, key: str, out: Sink, max_bytes: int | None = None) -> int:
        """Writes the object's bytes into ``out`` (a writable binary file) in pieces and returns how many; raises
        MissingObjectError when absent, and TooLargeError for an object of more than ``max_bytes`` (written in part
        at most). Backends stream; this fallback holds the object in memory."""
        data = self.get(key)
        if max_bytes is not None and len(data) > max_bytes:
            raise too_large(f"{self.url}/{key}", max_bytes)
        out.write(data)
        return len(data)

    def open_local(self, key: str) -> BinaryIO | None:
        """The object opened for reading as a local regular file, where the store keeps it as one (a reader can then
        read it in place rather than copy it first); None for stores that do not. Raises MissingObjectError when
        absent. The caller closes it."""
        return None

    #: True when ``get_range`` reads only the bytes asked for; False when it falls back to reading the whole object
    #: (readers then prefer one whole read to many ranged ones).
    supports_ranges: bool = False

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """The ``length`` bytes of the object from offset ``start``; raises MissingObjectError when absent and
        StoreError when the object ends before ``start + length``. Backends read only that range; this fallback
        reads the whole object."""
        _check_range(start, length)
        return _exact_range(self.get(key)[start : start + length], f"{self.url}/{key}", start, length)

    def check_ranges(self, small_key: str) -> None:
        """Raises RangesIgnoredError where this store's server is found to answer a ranged read with the whole
        object, probing with a one-byte read of ``small_key`` (an object of two bytes or more, small enough to be
        read whole without harm). Readers call it before reading a large object by ranges, so that a server that
        ignores them costs a small object's read, not a whole anchor's held in memory. Stores that cannot be
        mistaken about their ranges do nothing."""
        del small_key

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Keys under `prefix` (a folder-like prefix ending in '/', or ''), sorted."""

    @abstractmethod
    def delete(self, keys: builtins.list[str]) -> None:
        """Deletes the keys; absent keys are ignored."""

    def exists(self, key: str) -> bool:
        try:
            self.get(key)
        except MissingObjectError:
            return False
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


TEMP_PREFIX = ".deltasync-"
# A temporary file untouched this long belongs to a writer that was killed: live writers keep touching theirs.
STALE_TEMP_SECONDS = 15 * 60
_NO_LINK_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def stale_temps(folder: int | str, *, folders: bool = False) -> list[str]:
    """The names of the ``.deltasync-*.tmp`` files (with ``folders``, folders) directly in ``folder`` (a path or a
    descriptor) untouched for STALE_TEMP_SECONDS; never links. [] where the folder cannot be read."""
    cutoff = time.time() - STALE_TEMP_SECONDS
    try:
        with os.scandir(folder) as entries:
            return [
                e.name
                for e in entries
                if e.name.startswith(TEMP_PREFIX)
                and e.name.endswith(".tmp")
                and (e.is_dir(follow_symlinks=False) if folders else e.is_file(follow_symlinks=False))
                and e.stat(follow_symlinks=False).st_mtime < cutoff
            ]
    except OSError:
        return []


def remove_stale_temps(dir_fd: int) -> int:
    """Removes the ``.deltasync-*.tmp`` files directly in a folder (given as a descriptor) untouched for
    STALE_TEMP_SECONDS that no live process holds (``_remove_if_abandoned``): a writer killed mid-write (``kill -9``, a lost
    machine) leaves one behind, and nothing else would ever remove it. Links and non-regular files are left alone.
    Returns how many were removed."""
    removed = 0
    for name in stale_temps(dir_fd):
        if _remove_if_abandoned(name, dir_fd):
            removed += 1
    return removed


#: A temporary file or folder named by the process that made it, and 12 random hex digits.
TEMP_OF_A_PROCESS = re.compile(re.escape(TEMP_PREFIX) + r"([1-9][0-9]{0,9})-[0-9a-f]{12}\.tmp")


def alive(pid: int) -> bool:
    """True when process ``pid`` is running on this machine."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


# The lock each private temporary file is held by while its process uses it (private_temp, remove_temp).
_TEMP_LOCKS: dict[str, int] = {}
_TEMP_LOCKS_GUARD = threading.Lock()


def _remove_if_abandoned(name: str, dir_fd: int | None = None) -> bool:
    """Unlinks the stale temporary file ``name`` (in the folder ``dir_fd``, or a path) unless a live process holds
    it: one whose lock (``private_temp``) is held, wherever that process runs (another PID namespace, a container
    restarted as the same pid, another machine sharing the folder). Where the file system takes no lock, the pid in
    the name decides (a process of this machine that is gone). True when it was removed."""
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    except OSError:
        return False  # gone, or another user's
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # held: its process lives
            except OSError:  # no locks here (ENOLCK): by the pid in the name
                match = TEMP_OF_A_PROCESS.fullmatch(os.path.basename(name))
                if match is not None and alive(int(match.group(1))):
                    return False
        os.unlink(name, dir_fd=dir_fd)  # while locked: its owner is gone
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _remove_folder_if_abandoned(path: str) -> None:
    """Removes the stale private temporary folder ``path`` (``private_temp_folder``) unless a live process holds
    its lock, or the process its name names lives on this machine (a checkpoint's staging folder, which is not
    locked, written into TMPDIR: deltasync_rs._sharded)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # held: its process lives
            except OSError:
                pass  # no locks here: by the pid in the name
        match = TEMP_OF_A_PROCESS.fullmatch(os.path.basename(path))
        if match is not None and alive(int(match.group(1))):
            return
        shutil.rmtree(path, ignore_errors=True)  # while locked: its owner is gone
    finally:
        os.close(fd)


def remove_abandoned_temps(folder: str) -> None:
    """Removes the private temporary files and folders (``private_temp``, ``private_temp_folder``) that killed
    processes left in ``folder``: those untouched for STALE_TEMP_SECONDS that no live process holds
    (``_remove_if_abandoned``). A file another user owns stays."""
    for name in stale_temps(folder):
        _remove_if_abandoned(os.path.join(folder, name))
    for name in stale_temps(folder, folders=True):
        _remove_folder_if_abandoned(os.path.join(folder, name))


def private_temp(folder: str | None = None) -> tuple[int, str]:
    """A new private temporary file (mode 0o600), open for reading and writing: its descriptor and path, named
    ``.deltasync-<pid>-<hex>.tmp`` in ``folder`` (TMPDIR by default), after removing those that killed processes
    left there (``remove_abandoned_temps``: an anchor downloaded to a file is as large as the model, and a worker
    that is killed again and again would otherwise fill the disk). The file stays locked, whatever the caller
    closes, until :func:`remove_temp` removes it."""
    folder = folder or tempfile.gettempdir()
    remove_abandoned_temps(folder)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    while True:
        path = os.path.join(folder, f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            continue
        if fcntl is not None:
            _hold(path, os.dup(fd))  # the same open file: locked until remove_temp closes this one
        return fd, path


def _hold(path: str, lock: int) -> None:
    """Locks ``lock`` (a descriptor of ``path``) and keeps it until :func:`remove_temp`; on a file system without
    locks it is closed, and ``path`` is swept once stale and its pid gone."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock)
    else:
        with _TEMP_LOCKS_GUARD:
            _TEMP_LOCKS[path] = lock


def remove_temp(path: str) -> None:
    """Unlinks a temporary file (or removes a folder of :func:`private_temp_folder`), and releases its lock."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    finally:
        with _TEMP_LOCKS_GUARD:
            lock = _TEMP_LOCKS.pop(path, None)
        if lock is not None:
            os.close(lock)


def private_temp_folder() -> str:
    """A new private temporary folder (mode 0o700) in TMPDIR, named as :func:`private_temp` names files, for a
    download that writes files of its own: locked until :func:`remove_temp` removes it, and removed by a later
    sweep once its process is gone (a killed one's would otherwise keep a whole anchor forever)."""
    folder = tempfile.gettempdir()
    remove_abandoned_temps(folder)
    while True:
        path = os.path.join(folder, f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}.tmp")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        if fcntl is not None:
            _hold(path, os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)))
        return path


def _check_keys(keys: Any) -> None:
    """Refuses one key given where a list of keys is meant: a string would be deleted letter by letter."""
    if isinstance(keys, (str, bytes)):
        raise DeltaSyncError(f"delete takes a list of keys, not one key {keys!r}: delete([{keys!r}])")


#: Bytes read and written at a time when an object is streamed to or from a file.
COPY_BYTES = 8 << 20

#: Seconds an interrupted upload is given to stop before what it left open in the bucket is aborted.
ABORT_WAIT_SECONDS = 10.0


#: The HF Bucket store looks up an object's size before a download capped at this many bytes or more (anchors,
#: large deltas): below it, the size is checked after the download, saving a listing per document read.
LISTED_SIZE_FROM = 4 << 20


class TooLargeError(StoreError):
    """An object larger than the most a read accepts (``get_small``'s ``max_bytes``)."""


def too_large(where: str, max_bytes: int) -> StoreError:
    return TooLargeError(f"{where}: larger than {max_bytes} bytes, the most this read accepts")


def _check_range(start: int, length: int) -> None:
    if isinstance(start, bool) or isinstance(length, bool) or not isinstance(start, int) or not isinstance(length, int):
        raise StoreError(f"a byte range needs integers, not {shown(start)} and {shown(length)}")
    if start < 0 or length < 0:
        raise StoreError(f"invalid byte range: {length} bytes from {start}")


class UploadCancelled(StoreError):
    """An upload stopped by ``abort_uploads_in_flight`` (a publisher's at exit): not to be tried again."""


class RangesIgnoredError(StoreError):
    """A ranged read answered with more bytes than asked: a server that ignores the Range header (some
    S3-compatible ones) and sends the whole object; the store then reads anchors whole."""


def _exact_range(data: bytes, where: str, start: int, length: int) -> bytes:
    if len(data) > length:
        raise RangesIgnoredError(
            f"{where}: a read of {length} bytes from byte {start} got {len(data)}: the server ignores byte ranges"
        )
    if len(data) != length:
        raise StoreError(f"{where}: ends before byte {start + length} ({len(data)} of {length} bytes from {start})")
    return data


class LocalStore(Store):
    """A folder on a local filesystem. Writes go to a temporary file in the same folder, then are renamed.

    Every path below the root is opened one component at a time relative to its folder, never following a
    symbolic link, so a link planted in the store cannot make a read, write or delete reach outside it; only
    regular files are read. ``create=False`` (readers) never creates the root: a missing root is a StoreError.
    """

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True) -> None:
        self.root = Path(root).expanduser().resolve()
        self.url = str(self.root)
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise StoreError(f"{self.root}: cannot create the store folder: {error}") from error
        self._swept: set[tuple[str, ...]] = set()

    def _open_folder(self, parts: list[str], *, create: bool) -> int:
        """A descriptor of the folder root/parts; FileNotFoundError when a part is absent and ``create`` is False."""
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            raise StoreError(f"{self.root}: no such store folder") from None
        except OSError as error:
            raise StoreError(f"{self.root}: cannot open the store folder: {error}") from error
        for depth, part in enumerate(parts):
            try:
                if create:
                    try:
                        os.mkdir(part, dir_fd=fd)
                    except FileExistsError:
                        pass
                child = os.open(part, _NO_LINK_DIRECTORY, dir_fd=fd)
            except FileNotFoundError:
                os.close(fd)
                raise
            except OSError as error:
                os.close(fd)
                where = self.root.joinpath(*parts[: depth + 1])
                if error.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise StoreError(
                        f"{where}: a symbolic link or not a folder; the store never follows links out of its root"
                    ) from None
                raise StoreError(f"{where}: cannot open: {error}") from error
            os.close(fd)
            fd = child
        return fd

    def _split(self, key: str) -> tuple[list[str], str]:
        parts = check_key(key).split("/")
        return parts[:-1], parts[-1]

    def put(self, key: str, data: bytes) -> None:
        self._replace(key, _writer(data))

    atomic_create = True

    def create(self, key: str, data: bytes) -> bool:
        """Made durable in a temporary file, then linked to the key's name, which fails where the name exists:
        atomic."""
        return self._replace(key, _writer(data), exclusive=True)

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Links the file into the store's folder when both are on one filesystem (the object then has the file's
        mode), else copies it there; either way made durable, then renamed into place."""
        source = os.fspath(path)

        def write(dir_fd: int, temp: str) -> None:
            try:
                os.link(source, temp, dst_dir_fd=dir_fd, follow_symlinks=False)
                fd = os.open(temp, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
            except OSError as error:
                if error.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
                    raise
                with open(source, "rb") as src, os.fdopen(_create(temp, dir_fd), "wb") as f:
                    shutil.copyfileobj(src, f, COPY_BYTES)
                    f.flush()
                    os.fsync(f.fileno())
                return
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        self._replace(key, write)

    def _replace(self, key: str, write: Callable[[int, str], None], *, exclusive: bool = False) -> bool:
        """Has ``write(dir_fd, temp)`` make a durable temporary file in the key's folder, then renames it over the
        key, or with ``exclusive`` links it to the key's name only where that is absent (False when it was there);
        the temporary file is removed whatever happens."""
        folder, name = self._split(key)
        path = self.root / key
        try:
            dir_fd = self._open_folder(folder, create=True)
        except OSError as error:
            raise StoreError(f"{path}: cannot write: {error}") from error
        if tuple(folder) not in self._swept:  # once per folder and store object: writers clean up after killed ones
            self._swept.add(tuple(folder))
            remove_stale_temps(dir_fd)
        temp = f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}.tmp"
        try:
            try:
                write(dir_fd, temp)
                if not exclusive:
                    os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                    return True
                try:
                    os.link(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
                except FileExistsError:
                    return False
                finally:
                    os.unlink(temp, dir_fd=dir_fd)
                return True
            except BaseException:
                try:
                    os.unlink(temp, dir_fd=dir_fd)
                except FileNotFoundError:
                    pass
                raise
        except OSError as error:
            raise StoreError(f"{path}: cannot write: {error}") from error
        finally:
            os.close(dir_fd)

    def staging_folder(self) -> Path | None:
        """The store's root: a temporary file made there can be linked into the store instead of copied (its
        name must start with ``.deltasync-`` and end with ``.tmp``, so listings skip it and writers sweep it
        once stale)."""
        return self.root

    def _open_object(self, key: str) -> BinaryIO:
        """The object's regular file, opened for reading without following a link."""
        folder, name = self._split(key)
        path = self.root / key
        try:
            dir_fd = self._open_folder(folder, create=False)
        except FileNotFoundError:
            raise MissingObjectError(f"{path}: no such object") from None
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below like any non-regular file.
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except FileNotFoundError:
            raise MissingObjectError(f"{path}: no such object") from None
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise StoreError(f"{path}: a symbolic link; the store reads only regular files") from None
            raise StoreError(f"{path}: cannot read: {error}") from error
        finally:
            os.close(dir_fd)
        # Checked before fdopen, which refuses a folder with a bare IsADirectoryError naming the descriptor.
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise StoreError(f"{path}: not a regular file; the store reads only regular files")
        return os.fdopen(fd, "rb")

    def open_local(self, key: str) -> BinaryIO | None:
        return self._open_object(key)

    def _read(self, key: str, max_bytes: int | None) -> bytes:
        path = self.root / key
        with self._open_object(key) as f:
            try:
                data = f.read() if max_bytes is None else f.read(max_bytes + 1)
            except OSError as error:
                raise StoreError(f"{path}: cannot read: {error}") from error
        if max_bytes is not None and len(data) > max_bytes:
            raise too_large(str(path), max_bytes)
        return data

    def get(self, key: str) -> bytes:
        return self._read(key, None)

    def get_small(self, key: str, max_bytes: int) -> bytes:
        return self._read(key, max_bytes)

    supports_ranges = True

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """pread on the object's regular file, opened as for ``get`` (no link followed)."""
        _check_range(start, length)
        path = self.root / key
        with self._open_object(key) as f:
            chunks = []
            got = 0
            try:
                while got < length:
                    chunk = os.pread(f.fileno(), min(length - got, 1 << 30), start + got)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    got += len(chunk)
            except OSError as error:
                raise StoreError(f"{path}: cannot read: {error}") from error
        return _exact_range(b"".join(chunks) if len(chunks) != 1 else chunks[0], str(path), start, length)

    def get_file(self, key: str, out: Sink, max_bytes: int | None = None) -> int:
        """Into a real file (one with a ``fileno``), the kernel copies the bytes (copy_file_range), never through
        this process's memory; into anything else, in pieces. An object of more than ``max_bytes`` is refused
        (TooLargeError) by its size before anything is copied."""
        where = str(self.root / key)
        with self._open_object(key) as f:
            try:
                if max_bytes is not None and os.fstat(f.fileno()).st_size > max_bytes:
                    raise too_large(where, max_bytes)
                out_fd = _fileno(out)
                if out_fd is not None:
                    out.flush()  # type: ignore[attr-defined]  # a file object: what it buffered goes first
                    try:
                        return _copy_in_kernel(f.fileno(), out_fd, max_bytes, where)
                    except _NotInKernel:  # another file system type (EXDEV), or no copy_file_range there
                        pass
                return _copy(f, out, max_bytes, where)
            except OSError as error:
                raise StoreError(f"{where}: cannot read: {error}") from error

    def list(self, prefix: str = "") -> list[str]:
        parts = [p for p in prefix.split("/") if p]
        if parts:
            check_key("/".join(parts))
        try:
            fd = self._open_folder(parts, create=False)
        except FileNotFoundError:
            return []
        except StoreError:
            target = self.root.joinpath(*parts)
            if self.root.is_dir() and parts and not target.is_symlink() and not target.is_dir():
                return []  # a prefix that names a file holds no keys
            raise
        try:
            return sorted("/".join(parts + found) for found in _regular_files(fd))
        except OSError as error:
            raise StoreError(f"{self.root.joinpath(*parts)}: cannot list: {error}") from error
        finally:
            os.close(fd)

    def delete(self, keys: builtins.list[str]) -> None:
        _check_keys(keys)
        for key in keys:
            folder, name = self._split(key)
            try:
                dir_fd = self._open_folder(folder, create=False)
            except FileNotFoundError:
                continue
            try:
                os.unlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            except OSError as error:
                raise StoreError(f"{self.root / key}: cannot delete: {error}") from error
            finally:
                os.close(dir_fd)


def _writer(data: bytes) -> Callable[[int, str], None]:
    """A ``write(dir_fd, temp)`` for LocalStore._replace that writes ``data`` durably."""

    def write(dir_fd: int, temp: str) -> None:
        with os.fdopen(_create(temp, dir_fd), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    return write


def _create(name: str, dir_fd: int) -> int:
    """A new file in a folder, never through a link; mode 0o666 less the umask, as any new file gets (mkstemp's
    0o600 would survive the rename)."""
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666, dir_fd=dir_fd)


def _copy(source: BinaryIO, out: Sink, max_bytes: int | None = None, where: str = "") -> int:
    """Copies ``source`` to ``out`` in COPY_BYTES pieces; returns the bytes copied. TooLargeError (``where``) once
    more than ``max_bytes`` arrived, before they are written."""
    copied = 0
    while piece := source.read(COPY_BYTES):
        copied += len(piece)
        if max_bytes is not None and copied > max_bytes:
            raise too_large(where, max_bytes)
        out.write(piece)
    return copied


def _fileno(out: Sink) -> int | None:
    """The descriptor of a real file with a position (copy_file_range's target), else None."""
    if not hasattr(os, "copy_file_range"):
        return None
    try:
        fd = out.fileno()  # type: ignore[attr-defined]
    except (AttributeError, OSError):  # no file behind it (io.BytesIO raises UnsupportedOperation)
        return None
    return fd if isinstance(fd, int) and stat.S_ISREG(os.fstat(fd).st_mode) else None


class _NotInKernel(Exception):
    """copy_file_range copied nothing and cannot here: the caller copies through memory instead."""


def _copy_in_kernel(source: int, out: int, max_bytes: int | None = None, where: str = "") -> int:
    """Copies the rest of descriptor ``source`` to ``out`` at its position with copy_file_range; TooLargeError
    (``where``) where it holds more than ``max_bytes``, with no more than one byte beyond them copied.
    _NotInKernel where the kernel cannot copy between the two (files on file systems of other types: EXDEV),
    before anything was copied."""
    copied = 0
    limit = (1 << 62) if max_bytes is None else max_bytes
    while True:
        try:
            done = os.copy_file_range(source, out, max(1, min(1 << 30, limit + 1 - copied)))
        except OSError as error:
            if copied == 0 and error.errno in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise _NotInKernel from error
            raise
        if not done:
            return copied
        copied += done
        if copied > limit:
            raise too_large(where, limit)


def _regular_files(dir_fd: int) -> Iterator[list[str]]:
    """The regular files below a folder descriptor as lists of name parts, not entering linked folders and
    skipping temporary files."""
    with os.scandir(dir_fd) as entries:
        listed = list(entries)
    for entry in listed:
        if entry.name.startswith(TEMP_PREFIX):
            continue
        if entry.is_file(follow_symlinks=False):
            yield [entry.name]
        elif entry.is_dir(follow_symlinks=False):
            child = os.open(entry.name, _NO_LINK_DIRECTORY, dir_fd=dir_fd)
            try:
                for below in _regular_files(child):
                    yield [entry.name, *below]
            finally:
                os.close(child)


# Servers (FsspecStore._server: how a store reaches its server) that answered a ranged read with the whole object.
_IGNORE_RANGES: set[tuple[Any, ...]] = set()
# Servers whose answer to a probe's ranged read (FsspecStore.check_ranges) was the byte asked for.
_HONOUR_RANGES: set[tuple[Any, ...]] = set()

# Uploads running on fsspec's loop (FsspecStore._upload_async), for abort_uploads_in_flight: (store, future,
# the event set when the upload ends, the target path), by the future's id.
_IN_FLIGHT: dict[int, tuple[Any, Any, threading.Event, str]] = {}
_IN_FLIGHT_GUARD = threading.Lock()


def abort_uploads_in_flight(store: Store) -> int:
    """Cancels ``store``'s uploads still running on other threads (a background publisher's, at exit, when waiting
    for them ran out: the process would end mid-upload and leave its multipart upload open in the bucket) and
    aborts what they opened. Returns how many were running."""
    with _IN_FLIGHT_GUARD:
        running = [item for item in _IN_FLIGHT.values() if item[0] is store]
    for _, future, _, _ in running:
        future.cancel()
    for owner, _, ended, target in running:
        ended.wait(ABORT_WAIT_SECONDS)
        owner._abort_uploads(target)
    return len(running)


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
        if "//" in self.root or not self.root:
            # An empty part ("s3://bucket//run"): written to, but listings name its keys otherwise, so nothing
            # published there could be read back.
            raise StoreError(f"{url}: an empty part in the store's path; write it without the doubled '/'")
        # s3fs sends pipe_file(..., mode="create") as a conditional PUT; other fsspec backends may only look first.
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        # Object stores whose path starts with a bucket: a listing of a bucket that does not exist is an error.
        buckets = {"s3", "s3a", "gs", "gcs", "az", "abfs"}
        self._bucket = self.root.split("/")[0] if buckets & set(protocols) and self.root.split("/")[0] else None
        self.atomic_create = "s3" in protocols and "mode" in inspect.signature(self.fs.pipe_file).parameters
        # The server, for what this process learns of its byte ranges (RangesIgnoredError, check_ranges): the bucket
        # and everything that may choose the endpoint (every option, as text, and the AWS variables that do), so
        # that two stores share what was learnt only when they reach the same server the same way.
        try:
            chosen_by = json.dumps(storage_options, sort_keys=True, default=repr)
        except (TypeError, ValueError):  # keys that do not sort or serialise
            chosen_by = repr(storage_options)
        environment = tuple(os.environ.get(name) for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"))
        self._server = (protocols, self.root.split("/")[0], chosen_by, environment)
        if self._server in _IGNORE_RANGES:
            self.supports_ranges = False

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _read_path(self, key: str) -> str:
        """The path of ``key``, with what the filesystem remembers of it and its folders forgotten: s3fs and gcsfs
        keep the folder listings that ``find`` fills (``list``), and an ``open`` looks a file up there first, so a
        long-lived reader would never see an object written after its first listing of that folder."""
        path = self._path(key)
        self._forget(path)
        return path

    def _forget(self, path: str) -> None:
        invalidate = getattr(self.fs, "invalidate_cache", None)
        if invalidate is not None:
            invalidate(path)

    def put(self, key: str, data: bytes) -> None:
        try:
            if self._async:  # a large delta goes up in parts too (s3fs: from 2 x 50 MiB)
                self._upload_async(lambda: self.fs._pipe_file(self._path(key), data), self._path(key))
            else:
                self.fs.pipe_file(self._path(key), data)
        except UploadCancelled:
            raise
        except Exception as error:  # fsspec backends raise their own exception types
            raise StoreError(f"{self.url}/{key}: cannot write: {error}") from error

    def create(self, key: str, data: bytes) -> bool:
        """On S3 (s3fs), one conditional PUT (``If-None-Match: *``): atomic. Elsewhere the fallback."""
        if not self.atomic_create:
            return super().create(key, data)
        try:
            self.fs.pipe_file(self._path(key), data, mode="create")
        except FileExistsError:
            return False
        except Exception as error:
            raise StoreError(f"{self.url}/{key}: cannot write: {error}") from error
        return True

    @property
    def _async(self) -> bool:
        return bool(getattr(self.fs, "async_impl", False)) and getattr(self.fs, "loop", None) is not None

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        try:
            if self._async and hasattr(self.fs, "_put_file"):
                self._upload_async(lambda: self.fs._put_file(os.fspath(path), self._path(key)), self._path(key))
            else:
                self.fs.put_file(os.fspath(path), self._path(key))
        except UploadCancelled:
            raise
        except Exception as error:
            raise StoreError(f"{self.url}/{key}: cannot write: {error}") from error

    def _upload_async(self, start: Callable[[], Any], target: str) -> None:
        """The upload coroutine ``start()`` gives, run on fsspec's loop thread, stopped when this thread is
        interrupted (Ctrl-C, SIGTERM's SystemExit): fsspec's own wait returns at the interrupt and leaves the upload
        running until the process exits, and s3fs aborts a multipart upload only when its coroutine fails, so the
        parts uploaded so far were left in the bucket (unlisted, billed). Here the upload is cancelled, then what it
        left open is aborted. One cancelled from another thread (``abort_uploads_in_flight``) is UploadCancelled."""
        import asyncio
        import concurrent.futures

        ended = threading.Event()

        async def upload() -> None:
            try:
                await start()
            finally:
                ended.set()

        future = asyncio.run_coroutine_threadsafe(upload(), self.fs.loop)
        with _IN_FLIGHT_GUARD:
            _IN_FLIGHT[id(future)] = (self, future, ended, target)
        try:
            while True:
                try:
                    future.result(timeout=1)  # in short waits, so that a signal is handled between them
                    return
                except concurrent.futures.TimeoutError:
                    continue
                except concurrent.futures.CancelledError:
                    raise UploadCancelled(f"{target}: the upload was cancelled (the process is ending)") from None
        except UploadCancelled:
            raise
        except BaseException:
            if not future.done():
                future.cancel()
                ended.wait(ABORT_WAIT_SECONDS)
                self._abort_uploads(target)
            raise
        finally:
            with _IN_FLIGHT_GUARD:
                _IN_FLIGHT.pop(id(future), None)

    def _abort_uploads(self, target: str) -> None:
        """Aborts the S3 multipart uploads open for ``target`` (best effort: logged, never raised)."""
        call = getattr(self.fs, "call_s3", None)
        if call is None:
            return
        try:
            bucket, key = self.fs.split_path(target)[:2]
            listed = call("list_multipart_uploads", Bucket=bucket, Prefix=key)
            for upload in listed.get("Uploads", []):
                if upload.get("Key") == key:
                    call("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload["UploadId"])
        except Exception as error:
            log.warning("%s: an interrupted upload may be left open in the bucket: %s", target, error)

    def get_file(self, key: str, out: Sink, max_bytes: int | None = None) -> int:
        try:
            with self.fs.open(self._read_path(key), "rb", block_size=COPY_BYTES) as source:
                return _copy(source, out, max_bytes, f"{self.url}/{key}")
        except FileNotFoundError:
            raise MissingObjectError(f"{self.url}/{key}: no such object") from None
        except DeltaSyncError:
            raise  # the sink's own verdict (e.g. too many bytes)
        except Exception as error:
            raise StoreError(f"{self.url}/{key}: cannot read: {error}") from error

    def get(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self._read_path(key))
        except FileNotFoundError:
            raise MissingObjectError(f"{self.url}/{key}: no such object") from None
        except Exception as error:
            raise StoreError(f"{self.url}/{key}: cannot read: {error}") from error

    supports_ranges = True

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """One ranged read (``cat_file`` with start and end: an HTTP Range request on S3 and GCS)."""
        _check_range(start, length)
        try:
            if length == 0:
                if not self.fs.exists(self._read_path(key)):
                    raise FileNotFoundError(key)
                return b""
            data = self.fs.cat_file(self._read_path(key), start=start, end=start + length)
        except FileNotFoundError:
            raise MissingObjectError(f"{self.url}/{key}: no such object") from None
        except Exception as error:
            raise StoreError(f"{self.url}/{key}: cannot read bytes {start}..{start + length}: {error}") from error
        try:
            return _exact_range(bytes(data), f"{self.url}/{key}", start, length)
        except RangesIgnoredError:
            self._ignores_ranges()
            raise

    def _ignores_ranges(self) -> None:
        """Every later anchor is read whole, once, by this store and every store made later in this process on the
        same server (a vLLM worker makes one per pull); documents have their listed size checked first."""
        self.supports_ranges = False
        _IGNORE_RANGES.add(self._server)

    def check_ranges(self, small_key: str) -> None:
        """Probes the server once per process (a one-byte read of ``small_key``), unless it is known either way:
        some S3-compatible servers ignore the Range header and send the whole object, and ``get_range`` on an
        anchor would then hold all of it in memory before finding out."""
        if not self.supports_ranges:
            raise RangesIgnoredError(f"{self.url}: the server ignores byte ranges")
        if self._server in _HONOUR_RANGES:
            return
        self.get_range(small_key, 0, 1)
        _HONOUR_RANGES.add(self._server)

    def get_small(self, key: str, max_bytes: int) -> bytes:
        path = self._read_path(key)
        try:
            if self._server in _IGNORE_RANGES:
                # The read below would bring the whole object, whatever its size: its listed size is asked first.
                if self.fs.info(path).get("size", 0) > max_bytes:
                    raise too_large(f"{self.url}/{key}", max_bytes)
            data = self.fs.cat_file(path, start=0, end=max_bytes + 1)
        except FileNotFoundError:
            raise MissingObjectError(f"{self.url}/{key}: no such object") from None
        except TooLargeError:
            raise
        except Exception as error:
            raise StoreError(f"{self.url}/{key}: cannot read: {error}") from error
        if len(data) > max_bytes + 1:  # more than the range asked for
            self._ignores_ranges()
        if len(data) > max_bytes:
            raise too_large(f"{self.url}/{key}", max_bytes)
        return data

    def list(self, prefix: str = "") -> list[str]:
        base = f"{self.root}/{prefix}".rstrip("/")
        self._forget(base)  # exists() would answer from a listing kept since an earlier call
        try:
            found = self.fs.find(base) if self.fs.exists(base) else []
            if not found and self._bucket is not None and not self.fs.exists(self._bucket):
                # An empty prefix is a new store; a bucket that does not exist is a mistake (a typo in its name).
                raise StoreError(f"{self.url}: no such bucket {self._bucket!r}")
        except FileNotFoundError:
            return []
        except DeltaSyncError:
            raise
        except Exception as error:
            raise StoreError(f"{self.url}/{prefix}: cannot list: {error}") from error
        offset = len(self.root) + 1
        return sorted(path[offset:] for path in found if path.startswith(self.root + "/"))

    def delete(self, keys: builtins.list[str]) -> None:
        _check_keys(keys)
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
    (the module itself by default); tests pass an in-process stand-in. Those calls download whole files only, so
    ``get_range`` is the base class's whole-object fallback and ``supports_ranges`` is False: readers then download
    an anchor whole.
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
        # Large objects upload from a path: huggingface_hub's batch_bucket_files copies bytes once more on the way (through Xet).
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

    def put_file(self, key: str, path: str | os.PathLike[str]) -> None:
        try:
            self.api.batch_bucket_files(self.bucket_id, add=[(os.fspath(path), self._remote(key))], token=self.token)
        except Exception as error:
            raise StoreError(f"{self.url}/{key}: cannot upload: {error}") from error

    def get_file(self, key: str, out: Sink, max_bytes: int | None = None) -> int:
        folder = private_temp_folder()  # swept if this process is killed: it holds a whole anchor
        try:
            local = self._download_to(key, Path(folder) / "object", max_bytes)
            with open(local, "rb") as source:
                return _copy(source, out)
        finally:
            remove_temp(folder)

    def _download(self, key: str, max_bytes: int | None) -> bytes:
        folder = private_temp_folder()
        try:
            return self._download_to(key, Path(folder) / "object", max_bytes).read_bytes()
        finally:
            remove_temp(folder)

    def _download_to(self, key: str, local: Path, max_bytes: int | None) -> Path:
        """Downloads the object to ``local`` (a path in a private folder) and returns it; one of more than
        ``max_bytes`` is refused by the size the bucket lists for it, before the download."""
        remote = self._remote(key)
        if max_bytes is not None and max_bytes >= LISTED_SIZE_FROM:
            self._refuse_larger(key, remote, max_bytes)
        try:
            self.api.download_bucket_files(
                self.bucket_id, files=[(remote, str(local))], raise_on_missing_files=True, token=self.token
            )
        except FileNotFoundError:
            raise MissingObjectError(f"{self.url}/{key}: no such object") from None
        except Exception as error:
            if "not found" in str(error).lower() or "missing" in str(error).lower():
                raise MissingObjectError(f"{self.url}/{key}: no such object") from None
            raise StoreError(f"{self.url}/{key}: cannot download: {error}") from error
        if not local.exists():
            raise MissingObjectError(f"{self.url}/{key}: no such object")
        if max_bytes is not None and local.stat().st_size > max_bytes:
            raise too_large(f"{self.url}/{key}", max_bytes)
        return local

    def _refuse_larger(self, key: str, remote: str, max_bytes: int) -> None:
        """TooLargeError where the bucket lists ``remote`` as larger than ``max_bytes``."""
        try:
            entries = self.api.list_bucket_tree(self.bucket_id, prefix=remote, recursive=True, token=self.token)
            size = next((getattr(e, "size", None) for e in entries if e.path == remote), None)
        except Exception as error:
            raise StoreError(f"{self.url}/{key}: cannot look up its size: {error}") from error
        if isinstance(size, int) and size > max_bytes:
            raise too_large(f"{self.url}/{key}", max_bytes)

    def get(self, key: str) -> bytes:
        return self._download(key, None)

    def get_small(self, key: str, max_bytes: int) -> bytes:
        return self._download(key, max_bytes)

    def list(self, prefix: str = "") -> list[str]:
        remote_prefix = self._remote(prefix.rstrip("/")) if prefix else self.prefix
        try:
            entries = self.api.list_bucket_tree(
                self.bucket_id, prefix=remote_prefix or None, recursive=True, token=self.token
            )
            paths = [entry.path for entry in entries if getattr(entry, "type", "file") == "file"]
        except Exception as error:
            raise StoreError(f"{self.url}/{prefix}: cannot list: {error}") from error
        strip = len(self.prefix) + 1 if self.prefix else 0
        own = [path[strip:] for path in paths if not self.prefix or path.startswith(self.prefix + "/")]
        return sorted(key for key in own if key.startswith(prefix))

    def delete(self, keys: builtins.list[str]) -> None:
        _check_keys(keys)
        if not keys:
            return
        try:
            self.api.batch_bucket_files(self.bucket_id, delete=[self._remote(k) for k in keys], token=self.token)
        except Exception as error:
            raise StoreError(f"{self.url}: cannot delete {len(keys)} objects: {error}") from error


def open_store(store: str | os.PathLike[str] | Store, *, create: bool = True, **options: Any) -> Store:
    """A Store from a URL or path: hf://buckets/... → HFBucketStore, scheme:// → FsspecStore, else a LocalStore
    (created when missing unless ``create`` is False: readers pass False, so a mistyped path is an error)."""
    if isinstance(store, Store):
        return store
    if not isinstance(store, (str, os.PathLike)):
        raise StoreError(f"a store is a path, a URL or a Store, not {type(store).__name__}")
    text = os.fspath(store)
    if text.startswith("hf://"):
        return HFBucketStore(text, **options)
    if "://" in text and not text.startswith("file://"):
        return FsspecStore(text, **options)
    return LocalStore(text.removeprefix("file://"), create=create)


__all__ = ["FsspecStore", "HFBucketStore", "LocalStore", "Sink", "Store", "check_key", "open_store"]
