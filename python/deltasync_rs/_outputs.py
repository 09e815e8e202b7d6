"""The command line's local files: inputs must be regular files, an output is never one of its inputs, outputs are
written atomically with the mode any new file gets, and temporary files left by a killed run are removed."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

from .errors import DeltaSyncError
from .store import TEMP_PREFIX
from .store import remove_stale_temps as _remove_stale_temps


def require_regular_file(path: str) -> None:
    """Refuses FIFOs, devices and folders before anything opens them (a FIFO would block the reader)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DeltaSyncError(f"{path}: no such file") from None
    except (OSError, ValueError) as error:  # ValueError: a NUL in the path
        raise DeltaSyncError(f"{path!r}: cannot read: {error}") from None
    if not stat.S_ISREG(mode):
        raise DeltaSyncError(f"{path}: not a regular file")


def require_output_file(path: str) -> None:
    """Refuses, before any work, an output path that names no file to write: empty, a folder, or something other
    than a regular file (a device such as /dev/null, a FIFO, a socket), which the rename of the written file would
    replace."""
    if not os.fspath(path):
        raise DeltaSyncError(f"{path!r}: not a file to write (an empty path)")
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except (OSError, ValueError) as error:
        raise DeltaSyncError(f"{path!r}: cannot write: {error}") from None
    if stat.S_ISDIR(mode):
        raise DeltaSyncError(f"{path}: a folder, not a file to write")
    if not stat.S_ISREG(mode):
        raise DeltaSyncError(f"{path}: not a regular file (a device, FIFO or socket); write the output to a file")


def refuse_overwriting_inputs(output: str, inputs: list[str]) -> None:
    for source in inputs:
        same = os.path.realpath(output) == os.path.realpath(source)
        if not same and os.path.exists(output):
            same = os.path.samefile(output, source)
        if same:
            raise DeltaSyncError(f"{output}: this output is also the input {source}; write it to another path")


def remove_stale_temps(output: str) -> None:
    """Removes stale `.deltasync-*.tmp` files in the output's folder (see store.remove_stale_temps): a kill -9
    during a write leaves one behind."""
    folder = os.path.dirname(os.path.abspath(output))
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        _remove_stale_temps(fd)
    finally:
        os.close(fd)


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """Calls ``write(temp)`` on a new file beside ``path``, then renames it over ``path``. The result has the mode
    of the file it replaces, or 0o666 less the umask."""
    # Refused before any work: a path that names no file, a folder (os.replace would fail only at the end), or a
    # device or FIFO (which os.replace would replace).
    require_output_file(path)
    folder = os.path.dirname(os.path.abspath(path))
    temp = os.path.join(folder, f"{TEMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}.tmp")
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        new_file_mode = stat.S_IMODE(os.fstat(fd).st_mode)  # 0o666 less the umask, read without changing it
        os.close(fd)
    except OSError as error:
        raise DeltaSyncError(f"{path}: cannot write: {error}") from error
    try:
        write(temp)  # a writer may replace the file (safetensors does), so the mode is set afterwards
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            mode = new_file_mode
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
