"""The reading side of the sync protocol: a Subscriber finds the newest step it can verify, and downloads, checks
and replays the anchor and deltas that lead there (docs/format.md §10)."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from . import _arrays
from ._checkpoint import (
    READS_BY_DESCRIPTOR,
    CheckpointFile,
    FilledAnchor,
    LocalAnchor,
    apply_to,
    copy_checked,
    require_names,
)
from ._core import file_piece_hashes
from ._outputs import remove_stale_temps, write_atomically
from ._ranged import NeededRanges, PartialAnchor, read_ranged
from ._turns import one_at_a_time, track
from .delta import Delta, _check_step, load, load_checked_copy, state_digest_knowing
from .errors import (
    BaseMismatchError,
    ChainError,
    DeltaFormatError,
    DeltaSyncError,
    IntegrityError,
    MissingObjectError,
    RunChangedError,
    StaleStoreError,
    StoreError,
    flag,
    seconds,
    shown,
)
from .manifest import (
    LATEST_KEY,
    MAX_DOCUMENT_BYTES,
    RUN_KEY,
    Entry,
    Pieces,
    Pointer,
    check_run,
    entry_key,
    listed_steps,
    parse_latest,
    parse_run,
    resolve_signing_key,
    step_of,
)
from .store import LocalStore, RangesIgnoredError, Store, TooLargeError, open_store, private_temp, remove_temp

log = logging.getLogger("deltasync_rs.sync")

T = TypeVar("T")
#: Reads one way to a step: the anchor's entry (None: from the current step) and the entries of the deltas after it.
Download = Callable[[Entry | None, list[Entry]], T]

# Entries kept in memory: far more than one pull's chain needs (anchor_every of them), bounded for long runs.
_CACHED_ENTRIES = 64
# Entries tried, newest first, when looking for the newest one that verifies.
_NEWEST_TRIES = 16


def _progress(total: int, description: str):
    """A tqdm bar on an interactive terminal, else None: quiet in logs, pipes and CI."""
    if total <= 1 or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=description, unit="file", file=sys.stderr, leave=False)


def attempts(retries: Any) -> int:
    """How many times a store read or write is tried for the option ``retries``: an integer, at least once."""
    if isinstance(retries, bool) or not isinstance(retries, int):
        raise DeltaSyncError(f"retries must be an integer (how many times a store call is tried), not {shown(retries)}")
    return max(1, retries)


def _same_memory(a: Any, b: Any) -> bool:
    """Whether two tensors of one dtype and shape are the same memory (tied)."""

    def device(t: Any) -> str:
        return str(t.device) if _arrays.is_torch(t) else "cpu"

    return bool(_arrays.address(a) == _arrays.address(b) and device(a) == device(b))


def _write_aliases(state: Any, untied: list[tuple[str, str]]) -> None:
    """Copies each published tensor's bits into its untied alias in ``state``."""
    for alias, name in untied:
        target, source = state[alias], state[name]
        if _arrays.is_torch(target):
            import torch

            # Inference tensors take in-place writes only in inference mode (as Writes writes them).
            with torch.inference_mode() if target.is_inference() else torch.no_grad():
                target.copy_(source)
        else:
            import numpy as np

            np.copyto(target, source, casting="no")


def _copy_whole(source: BinaryIO, ref: dict[str, Any], pieces: Pieces, path: str) -> None:
    """Anchor ``ref``, open as ``source``, copied whole into the file at ``path``, every piece checked first."""
    copy_checked(source.fileno(), ref["key"], pieces, path, [(0, ref["size"], 0)] if ref["size"] else [])


def _larger_than_its_entry(key: str, size: int) -> IntegrityError:
    return IntegrityError(f"{key}: larger than the {size} bytes its manifest entry says")


class _AtMost:
    """A sink writing into ``file`` that refuses (IntegrityError) more than ``limit`` bytes, as they arrive."""

    def __init__(self, file: BinaryIO, limit: int, key: str) -> None:
        self.file, self.limit, self.key, self.written = file, limit, key, 0

    def write(self, data: bytes, /) -> object:
        self.written += len(data)
        if self.written > self.limit:
            raise _larger_than_its_entry(self.key, self.limit)
        return self.file.write(data)


def _target_key(state: Mapping[str, Any]) -> tuple[tuple[str, int, int], ...]:
    """Which tensors a pull writes: each name with its object and the address of its memory, so that a subscriber
    knows a target other than the one it brought to its step (whose step it then checks before reporting it)."""
    return tuple((name, id(tensor), _arrays.address(tensor)) for name, tensor in state.items())


def _store_object(store: LocalStore, path: str) -> bool:
    """Whether ``path`` is (or would be) one of the sync protocol's files in the local ``store``: its pointer, its
    run id, or anything under its anchors/, deltas/ or manifest/ folders."""
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(store.root):
        return False
    parts = real.relative_to(store.root).parts
    return bool(parts) and (
        parts[0] in ("anchors", "deltas", "manifest") or parts == (LATEST_KEY,) or parts == (RUN_KEY,)
    )


class Subscriber:
    """Pulls a store's published steps into a state, verifying every file and signature on the way.

    ``pull(state)`` brings a mapping of tensors to the newest step, in place and bit-exact: from the newest anchor
    when the subscriber is fresh or too far behind, else by replaying the deltas it missed. The newest step is the
    newest manifest entry that verifies (``latest.json`` is checked against it, never followed past it), and a
    subscriber never moves back to an older step. Every file's SHA-256, every entry's run and predecessor and (with
    ``signing_key`` or ``DELTASYNC_SIGNING_KEY``) every signature are checked before use; a failed read is retried,
    then the newest anchor is tried, and ChainError is raised only when no consistent chain exists.

    With ``check_base`` (the default) every delta is applied only to the exact base it was made against (its
    per-tensor base identity, docs/format.md §3.1): a state changed behind the subscriber's back is refused before
    any write and brought back from the newest anchor, with a warning.

    With ``max_age`` (seconds), the newest step the store offers must have been published (its entry's signed
    ``created``, by the publisher's clock) at most that long ago, else StaleStoreError and nothing is pulled: with
    ``signing_key`` a writer without the key can then hide the newer steps (put back an earlier copy of the store)
    from a new subscriber for no longer than that.
    """

    def __init__(
        self,
        store: str | os.PathLike[str] | Store,
        *,
        signing_key: bytes | str | None = None,
        retries: int = 3,
        retry_delay: float = 0.02,
        check_base: bool = True,
        anchor_ranges: NeededRanges | None = None,
        max_age: float | None = None,
    ) -> None:
        self.max_age = None if max_age is None else seconds(max_age, "max_age", positive=True)
        if anchor_ranges is not None and not callable(anchor_ranges):
            raise DeltaSyncError(
                f"anchor_ranges must be None or a function of an anchor's tensors, not {type(anchor_ranges).__name__}"
            )
        self.store = open_store(store, create=False)
        self.anchor_ranges = anchor_ranges
        self.check_base = flag(check_base, "check_base")
        self.retries = retries
        self.retry_delay = seconds(retry_delay, "retry_delay")
        self.step: int | None = None
        self._key = resolve_signing_key(signing_key)
        self._run: str | None = None
        self._run_confirmed = False  # an entry carried the run read from run.json
        self._entries: OrderedDict[int, Entry] = OrderedDict()
        self._at: Entry | None = None  # the entry of `step`, once a pull got there
        # Entries (by SHA-256) whose anchor the delta after it was not made against: no way starts from them.
        self._refused_anchors: set[str] = set()
        self._gone_warned: int | None = None  # the held step last said to be gone from the store
        self._names: list[str] | None = None
        self._lock = threading.RLock()  # pulls take turns (one_at_a_time): each moves `step` and its target
        self._forked_mid_call: int | None = None
        track(self)  # a forked child refuses it if another thread was inside a pull (one_at_a_time)
        self._target: tuple[tuple[str, int, int], ...] | None = None  # _target_key of the state `step` is of
        self._aliases_at: int | None = None  # the step the target's untied aliases were written at

    @property
    def retries(self) -> int:
        """How many times each read is tried before its error is raised (at least once; values below 1 mean once)."""
        return self._retries

    @retries.setter
    def retries(self, value: int) -> None:
        self._retries = attempts(value)

    # -- reading with verification ------------------------------------------------------------------------------
    def _retry(self, what: str, read: Callable[[], Any]) -> Any:
        for attempt in range(self.retries):
            try:
                return read()
            except MissingObjectError:
                if attempt + 1 == self.retries:
                    raise
            except RunChangedError:
                raise  # run.json was read again to tell: reading once more cannot undo it
            except (StoreError, IntegrityError, DeltaFormatError) as error:
                if attempt + 1 == self.retries:
                    raise
                log.warning("reading %s failed (%s); retrying", what, error)
            time.sleep(self.retry_delay * 2**attempt)
        raise AssertionError("unreachable")

    @property
    def run(self) -> str | None:
        """The store's run id from `run.json`, kept once an entry confirmed it: entries of any other run are
        refused. None while the store has no run.json (nothing published yet, or a store written before run ids)."""
        if self._run is None:
            try:
                self._run = self._retry(RUN_KEY, self._read_run)
            except MissingObjectError:
                if self._key is not None:
                    raise IntegrityError(
                        f"{RUN_KEY} is missing, but a signing key is set: no entry can be bound to this store's run"
                    ) from None
        return self._run

    def _read_run(self) -> str:
        """The run id of the store's run.json, as it is now (read, parsed and verified)."""
        return parse_run(self.store.get_small(RUN_KEY, MAX_DOCUMENT_BYTES), self._key)

    def entry(self, step: int) -> Entry:
        """The verified manifest entry of ``step``."""
        _check_step(step, "step", optional=False)
        cached = self._entries.get(step)
        if cached is not None:
            self._entries.move_to_end(step)
            return cached
        key = entry_key(step)
        entry = self._retry(
            key, lambda: self._bound(Entry.parse(self.store.get_small(key, MAX_DOCUMENT_BYTES), key, self._key), key)
        )
        self._entries[step] = entry
        while len(self._entries) > _CACHED_ENTRIES:
            self._entries.popitem(last=False)
        return entry

    def _verified_entry(self, delta: Delta) -> Entry:
        """The manifest entry ``delta``'s file was verified against, as the fetch recorded it (an entry read again
        could be another: evicted from the cache and published again since); else the one read now."""
        if isinstance(delta._entry, Entry):
            return delta._entry
        assert delta.step is not None
        return self.entry(delta.step)

    def _bound(self, document: Entry | Pointer, key: str) -> Any:
        """``document`` when it belongs to this store's run; an unsigned run.json is read again after a mismatch
        until an entry has confirmed it, so one corrupted read of it cannot stick."""
        run = self.run
        if document.run != run and not self._run_confirmed:
            self._run = None
        if document.run != run and self._run_confirmed:
            self._check_run_changed(document.run, key)
        check_run(document.run, run, key)
        if isinstance(document, Entry) and run is not None:
            self._run_confirmed = True
        return document

    def _check_run_changed(self, found: str | None, key: str) -> None:
        """``key`` names run ``found``, not the run this subscriber confirmed: RunChangedError when run.json, read
        again and verified, now names ``found`` too (the store was emptied and published into again, or replaced).
        Otherwise (run.json unreadable or still naming our run) ``key`` alone disagrees, and the caller refuses it
        as any other file of another run."""
        try:
            current = self._read_run()
        except DeltaSyncError:
            return
        if found is None or current != found:
            return
        at = "nothing pulled yet" if self.step is None else f"it stays at step {self.step} of run {self._run!r}"
        raise RunChangedError(
            f"{self.store.url}: the store now holds run {found!r} ({RUN_KEY} and {key}), not run {self._run!r} "
            f"that this subscriber followed ({at}): it was emptied and published into again, or replaced. "
            "A new Subscriber follows the new run, starting from its anchor"
        )

    def _pointer(self) -> Pointer | None:
        try:
            return self._retry(
                LATEST_KEY,
                lambda: self._bound(
                    parse_latest(self.store.get_small(LATEST_KEY, MAX_DOCUMENT_BYTES), self._key), LATEST_KEY
                ),
            )
        except MissingObjectError:
            return None

    def _newest_entry(self, pointer: Pointer | None = None) -> Entry | None:
        """The newest entry that verifies, trying the listed ones newest first (``_NEWEST_TRIES`` of them). Where
        none of those does, the entry ``pointer`` (a verified ``latest.json``) names: entries that never verify,
        written above the run's steps by someone without the key, would otherwise stop every reader for good."""
        error: DeltaSyncError | None = None
        tried = listed_steps(self.store)[::-1][:_NEWEST_TRIES]
        for step in tried:
            try:
                return self.entry(step)
            except RunChangedError:
                raise
            except (DeltaFormatError, IntegrityError, StoreError) as problem:
                log.warning("%s", problem)
                error = error or problem
        if error is not None and pointer is not None and pointer.step not in tried:
            try:
                entry = self.entry(pointer.step)
            except RunChangedError:
                raise
            except (DeltaFormatError, IntegrityError, StoreError) as problem:
                log.warning("%s", problem)
            else:
                log.warning(
                    "the %d newest manifest entries do not verify; step %d, which %s names, does",
                    len(tried),
                    pointer.step,
                    LATEST_KEY,
                )
                return entry
        if error is not None:
            raise error
        return None

    def _newest(self) -> tuple[int | None, DeltaSyncError | None]:
        """The newest verified step, and what is wrong with `latest.json` (None when it agrees with the entries,
        or only lags behind them as it does between the publisher's two writes)."""
        try:
            pointer, problem = self._pointer(), None
        except RunChangedError:
            raise
        except (DeltaFormatError, IntegrityError, StoreError) as error:
            pointer, problem = None, error
        try:
            newest = self._newest_entry(pointer)
        except RunChangedError:
            raise
        except DeltaSyncError:
            if problem is not None:
                raise problem from None
            raise
        if pointer is None and newest is not None:
            # Nothing confirms the cached newest entry (no pointer: a publisher resumed at a step without an entry
            # removed it, then stopped between an entry and its pointer): it may have been written over since.
            newest = self._read_again(newest)
        elif pointer is not None:
            if newest is None or pointer.step > newest.step:
                problem = IntegrityError(f"{LATEST_KEY} names step {pointer.step}, which has no verified entry")
            elif pointer.step < newest.step:
                # Between a publisher's entry and its pointer (or a publisher stopped there): the newest entry may
                # have been written over one cached, with no pointer naming it yet.
                newest = self._read_again(newest)
            elif pointer.step == newest.step and pointer.entry_sha256 != newest.sha256:
                newest = self._read_again(newest)
                if pointer.entry_sha256 != newest.sha256:
                    problem = IntegrityError(f"{LATEST_KEY}: its entry_sha256 does not match {entry_key(newest.step)}")
        if newest is None and problem is not None:
            raise problem
        if newest is not None and self._stale(newest.step, newest):
            raise StaleStoreError(
                f"{self.store.url}: its newest step, {newest.step}, was published {time.time() - newest.created:.0f} s "
                f"ago, more than max_age={self.max_age:g} s: the trainer stopped publishing, or the newer steps were "
                "hidden (an earlier copy of the store put back); nothing was pulled"
            )
        return (None if newest is None else newest.step), problem

    def _stale(self, step: int, entry: Entry | None = None) -> bool:
        """True under ``max_age`` when ``step`` (its entry, read if not given) was published longer ago than that."""
        if self.max_age is None:
            return False
        if entry is None:
            try:
                entry = self.entry(step)
            except RunChangedError:
                raise
            except DeltaSyncError:
                return False  # its chain is tried, and refused there
        return time.time() - entry.created > self.max_age

    def _read_again(self, cached: Entry) -> Entry:
        """``cached``'s step's entry read from the store again: the store may have replaced it since it was cached
        (a publisher resumed at an earlier step publishes that step again). ``cached`` when it does not read."""
        self._entries.pop(cached.step, None)
        try:
            return self.entry(cached.step)
        except RunChangedError:
            raise
        except DeltaSyncError as error:
            log.warning("%s", error)
            self._entries[cached.step] = cached
            return cached

    def latest_step(self) -> int | None:
        """The newest published step this subscriber can verify, or None for an empty store. A `latest.json` that
        disagrees with the entries is logged as an IntegrityError and not followed."""
        newest, problem = self._newest()
        if problem is not None:
            log.error("%s; using the newest verified entry, step %s", problem, newest)
        return newest

    def _file(
        self, ref: dict[str, Any], step: int, kind: str, *, ranged: bool = True, fill: bool = False, defer: bool = False
    ) -> Delta:
        """The file ``ref`` of ``step`` (``kind`` "anchor" or "delta"), checked against its entry. An anchor is read
        by ranges with ``anchor_ranges`` (and ``ranged``); with ``fill``, from a store that keeps it as a local file,
        only its header is read here: it is applied straight from that file (``FilledAnchor``). A delta read with
        ``defer``, to be applied at once, leaves the check of its bit-packed streams to the apply
        (``load(check="apply")``)."""

        def read() -> Delta:
            delta: Delta | None = None
            ranges = self.anchor_ranges if ranged else None
            if kind == "anchor" and ranges is not None and "pieces" in ref and self.store.supports_ranges:
                try:
                    pieces = self._pieces(ref)
                    if ref["pieces"]["size"] >= 2:  # a probe of one byte tells only on two or more
                        self.store.check_ranges(ref["pieces"]["key"])
                    delta = read_ranged(self.store, ref, pieces, ranges)
                except RangesIgnoredError as error:  # each range would download the whole anchor: read it once
                    log.warning("%s; reading the anchor whole", error)
            elif kind == "anchor" and fill:
                delta = self._fillable(ref, step)
            if delta is None:
                delta = self._streamed(ref) if kind == "anchor" else self._in_memory(ref, defer=defer)
            if delta.step is not None and delta.step != step:
                raise IntegrityError(f"{ref['key']}: the file says step {delta.step}, its entry step {step}")
            if kind == "anchor" and not delta.is_anchor:
                raise IntegrityError(f"{ref['key']}: not an anchor")
            if delta.step is None:  # a file that names no step (an older writer's): its entry's step
                delta.step = step
            return delta

        return self._retry(ref["key"], read)

    def _local_source(self, ref: dict[str, Any]) -> tuple[BinaryIO, Pieces] | None:
        """Anchor ``ref``'s file, open (the caller closes it), and its checked pieces sidecar, when the store keeps
        it as a local file and it has a readable sidecar; else None, and the anchor is read the usual way (checked by
        its whole-file SHA-256 when the sidecar does not read; without one, that sidecar's error is raised). The
        sidecar is read only for a local file."""
        if "pieces" not in ref or not READS_BY_DESCRIPTOR:
            return None
        source = self.store.open_local(ref["key"])
        if source is None:
            return None
        try:
            return source, self._pieces(ref)
        except DeltaSyncError as error:
            source.close()
            self._without_pieces(ref, error)
            return None
        except BaseException:
            source.close()
            raise

    def _fillable(self, ref: dict[str, Any], step: int) -> FilledAnchor | None:
        """Anchor ``ref`` as a FilledAnchor, every piece checked, when the store keeps it as a local file with a
        readable pieces sidecar; else None."""
        local = self._local_source(ref)
        if local is None:
            return None
        source, pieces = local
        try:
            return FilledAnchor.open(
                source, ref["key"], step, pieces, self._retry, lambda: self._loaded_from(source, ref, step, pieces)
            )
        except BaseException:
            source.close()
            raise

    def _loaded_from(self, source: BinaryIO, ref: dict[str, Any], step: int, pieces: Pieces) -> Delta:
        """Anchor ``ref`` loaded whole from ``source``, its file as already opened (still readable where the
        store's retention removed it since: read again by its key, a pull raised MissingObjectError), every piece
        checked as it is copied into a private file, which is then memory-mapped."""
        fd, path = private_temp()
        os.close(fd)
        try:
            _copy_whole(source, ref, pieces, path)
            delta = load_checked_copy(path)
        finally:
            remove_temp(path)
        if delta.step != step or not delta.is_anchor:
            raise IntegrityError(f"{ref['key']}: not the anchor of step {step} its entry names")
        return delta

    @staticmethod
    def _without_pieces(ref: dict[str, Any], error: DeltaSyncError) -> None:
        """Anchor ``ref``'s sidecar could not be read (``error``): with a whole-file SHA-256 in its entry, which
        checks the file as well, a warning; without one (entries of version 2) nothing else can check it, so
        ``error`` is raised."""
        if "sha256" not in ref:
            raise error
        log.warning("%s; checking %s by its whole-file SHA-256 instead", error, ref["key"])

    def _pieces(self, ref: dict[str, Any]) -> Pieces:
        """The pieces sidecar of anchor ``ref``, checked against the size and SHA-256 its entry records."""
        sidecar = ref["pieces"]
        raw = self.store.get_small(sidecar["key"], sidecar["size"])
        if len(raw) != sidecar["size"] or hashlib.sha256(raw).hexdigest() != sidecar["sha256"]:
            raise IntegrityError(f"{sidecar['key']}: content does not match the digest in its manifest entry")
        return Pieces.parse(raw, ref)

    def _check_pieces(self, ref: dict[str, Any]) -> None:
        """Reads anchor ``ref`` whole and checks every piece against its sidecar, and its whole-file SHA-256 when
        its entry has one (an auditor checks both, whichever a reader uses): in place when the store keeps it as a
        local file (an audit writes nothing, so it needs no private copy), else through a checked temporary copy."""
        pieces = self._pieces(ref)
        source = self.store.open_local(ref["key"]) if READS_BY_DESCRIPTOR else None
        if source is None:
            remove_temp(self._checked_copy(ref, pieces, whole_sha256="sha256" in ref))
            return
        with source:
            size = os.fstat(source.fileno()).st_size
            if size != ref["size"]:
                raise IntegrityError(f"{ref['key']}: {size} bytes, its manifest entry says {ref['size']}")
            path = f"/proc/self/fd/{source.fileno()}"
            pieces.check_all(file_piece_hashes(path, pieces.piece_bytes, pieces.algorithm), ref["key"])
            if "sha256" not in ref:
                return
            with open(path, "rb") as whole:  # the very file opened above (its descriptor's link)
                sha256 = hashlib.file_digest(whole, "sha256").hexdigest()
            if sha256 != ref["sha256"]:
                raise IntegrityError(f"{ref['key']}: content does not match the digest in its manifest entry")

    def _checked_copy(self, ref: dict[str, Any], pieces: Pieces | None, *, whole_sha256: bool) -> str:
        """The path of a private temporary file (in TMPDIR; the caller unlinks it) holding anchor ``ref``, checked
        against its entry's size, against ``pieces`` (every piece's hash, in parallel) when given, and against its
        whole-file SHA-256 when ``whole_sha256`` or without pieces (an entry without pieces always has one)."""
        fd, path = private_temp()
        try:
            with os.fdopen(fd, "w+b") as file:  # closed on every way out, a failed local copy's included
                if pieces is not None and not whole_sha256 and self._copy_local(ref, pieces, path):
                    return path
                # No more bytes are taken than the entry says (a store holding a huge object in its place, written
                # without the key, would fill the disk before the size check): by the store itself where it takes a
                # limit (a local folder's file is then copied by the kernel), else by the sink.
                try:
                    if "max_bytes" in inspect.signature(self.store.get_file).parameters:
                        self.store.get_file(ref["key"], file, max_bytes=ref["size"])
                    else:
                        self.store.get_file(ref["key"], _AtMost(file, ref["size"], ref["key"]))
                except TooLargeError:
                    raise _larger_than_its_entry(ref["key"], ref["size"]) from None
                file.flush()
                size = file.seek(0, os.SEEK_END)
                if size != ref["size"]:
                    raise IntegrityError(f"{ref['key']}: {size} bytes, its manifest entry says {ref['size']}")
                if whole_sha256 or pieces is None:
                    file.seek(0)
                    if hashlib.file_digest(file, "sha256").hexdigest() != ref["sha256"]:
                        raise IntegrityError(f"{ref['key']}: content does not match the digest in its manifest entry")
            if pieces is not None:
                # The signed entry binds the sidecar (size and SHA-256), the sidecar binds every piece, and the
                # size is checked: all pieces matching is the whole file matching.
                pieces.check_all(file_piece_hashes(path, pieces.piece_bytes, pieces.algorithm), ref["key"])
        except BaseException:
            remove_temp(path)
            raise
        return path

    def _copy_local(self, ref: dict[str, Any], pieces: Pieces, path: str) -> bool:
        """Copies anchor ``ref`` from a store that keeps it as a local file into the file at ``path`` in one read,
        every piece checked before it is written (then True); False for a store that keeps no local file."""
        if not READS_BY_DESCRIPTOR:
            return False
        source = self.store.open_local(ref["key"])
        if source is None:
            return False
        with source:
            _copy_whole(source, ref, pieces, path)
        return True

    def _in_memory(self, ref: dict[str, Any], *, defer: bool = False) -> Delta:
        try:  # no more bytes than the entry says: an object put in its place may be of any size
            blob = self.store.get_small(ref["key"], ref["size"])
        except TooLargeError:
            raise _larger_than_its_entry(ref["key"], ref["size"]) from None
        if len(blob) != ref["size"] or hashlib.sha256(blob).hexdigest() != ref["sha256"]:
            raise IntegrityError(f"{ref['key']}: content does not match the digest in its manifest entry")
        return load(blob, check="apply" if defer else "load")

    def _streamed(self, ref: dict[str, Any]) -> Delta:
        """An anchor downloaded into a private temporary file (in TMPDIR), checked against its entry's size and
        its pieces sidecar (every piece's hash, in parallel) or, without one, its whole-file SHA-256, then
        memory-mapped: its tensors are copied from the file as they are applied, never held in memory whole. The
        file is unlinked before this returns; the mapping keeps it."""
        pieces = None
        if "pieces" in ref:
            try:
                pieces = self._pieces(ref)
            except DeltaSyncError as error:
                self._without_pieces(ref, error)
        path = self._checked_copy(ref, pieces, whole_sha256=False)
        try:
            return load_checked_copy(path)
        finally:
            remove_temp(path)

    # -- planning ---------------------------------------------------------------------------------------------------
    def _walk_back(self, target: int, floor: int, stop: Callable[[Entry], bool]) -> list[Entry]:
        """Entries from ``target`` back to the first one where ``stop`` holds (never below ``floor``), oldest first;
        each must be the very entry its successor names by SHA-256. Where two do not link, the entries cached may
        be ones the store has replaced since (steps published again by a publisher resumed before them): the walk is
        made once more with every entry read again."""
        for fresh in (False, True):
            chain: list[Entry] = []
            step: int | None = target
            while step is not None and step >= floor:
                entry = self.entry(step)
                if chain:
                    try:
                        _check_link(entry, chain[-1])
                    except IntegrityError:
                        self._entries.clear()
                        if fresh:
                            raise
                        break
                chain.append(entry)
                if stop(entry):
                    return chain[::-1]
                if entry.delta is None:
                    raise ChainError(f"no chain of deltas from step {target} back to the required start")
                step = entry.base_step
            else:
                raise ChainError(f"no chain of deltas from step {target} back to the required start")
        raise AssertionError("unreachable")

    def _fetch_to(self, current: int | None, target: int, download: Download[T]) -> T:
        """Downloads a verified way to ``target`` with ``download``: the missed deltas when ``current`` is on the
        chain, else the newest usable anchor and the deltas after it. Each way is tried in turn until one reads back
        whole."""
        errors: list[Exception] = []
        plans: list[Callable[[], tuple[Entry | None, list[Entry]]]] = []
        if current is not None:

            def from_current() -> tuple[Entry | None, list[Entry]]:
                chain = self._walk_back(target, current + 1, lambda e: e.base_step == current and e.delta is not None)
                if self._at is not None and self._at.step == current:
                    _check_link(self._at, chain[0])
                return None, chain

            plans.append(from_current)

        def from_anchor(anchor_step: int) -> tuple[Entry | None, list[Entry]]:
            chain = self._walk_back(target, anchor_step, lambda e: e.step == anchor_step)
            if chain[0].anchor is None:
                raise ChainError(f"step {anchor_step} has no anchor entry")
            if chain[0].sha256 in self._refused_anchors:
                raise ChainError(
                    f"the anchor of step {anchor_step} was refused: it is not the state its entry or the delta "
                    "after it says"
                )
            return chain[0], chain[1:]

        anchors = sorted(
            {s for k in self.store.list("anchors/") if (s := step_of(k)) is not None and s <= target}, reverse=True
        )
        plans.extend(functools.partial(from_anchor, a) for a in anchors)
        for plan in plans:
            try:
                return download(*plan())
            except RunChangedError:
                raise
            except (ChainError, StoreError, IntegrityError, DeltaFormatError) as error:
                errors.append(error)
        detail = f": {errors[-1]}" if errors else " (the store holds no anchor)"
        raise ChainError(f"no consistent chain leads to step {target}{detail}")

    def fetch(self, current_step: int | None, *, until: int | None = None) -> list[Delta]:
        """Verified deltas that bring a state at ``current_step`` (None: no state yet) to the newest step, or to step
        ``until`` exactly (a ChainError naming it when it is not published or cannot be reached): an anchor first
        when needed, then deltas in order; [] when already there or past it (a subscriber never moves back). An
        anchor is returned only with a first delta made against its tensors (their base identities compared), or
        the way from an older anchor is taken.

        The entry of the step they reach is kept: a later ``fetch`` from that step requires its way on to start from
        that very entry (not another entry of the same number, of a history published over it), and takes an anchor
        otherwise, as ``pull`` does."""
        deltas = self._fetch(current_step, until, self._download) or []
        if deltas and deltas[-1].step is not None:
            self._at = self._verified_entry(deltas[-1])
        return deltas

    def _fetch_checked_by_the_apply(self, current_step: int | None, until: int | None) -> list[Delta]:
        """``fetch``, for deltas that are applied at once: their bit-packed streams are checked as they are applied
        (``load(check="apply")``), not decoded once more here."""
        return self._fetch(current_step, until, functools.partial(self._download, defer=True)) or []

    def _fetch(self, current_step: int | None, until: int | None, download: Download[T]) -> T | None:
        """``fetch``'s choice of target and way, each way read with ``download``; None when already there."""
        _check_step(current_step, "current_step")
        _check_step(until, "until")
        latest = self.latest_step()
        if latest is None:
            if current_step is None:
                raise ChainError(f"{self.store.url}: nothing has been published yet")
            if self._gone_warned != current_step:
                self._gone_warned = current_step
                log.warning(
                    "%s: step %d, held here, is no longer in the store, which holds no step (a publisher resumed "
                    "at an older step left that history?); held until a later step is published",
                    self.store.url,
                    current_step,
                )
            return None
        if until is not None:
            if until > latest:
                raise ChainError(
                    f"{self.store.url}: step {until} is not published (the newest verified step is {latest})"
                )
            if current_step is not None and until <= current_step:
                # Never back; but the step held, published again since, is rebuilt as it now is.
                return self._rebuilt_if_published_again(current_step, latest, download)
            try:
                try:
                    return self._fetch_to(current_step, until, download)
                except ChainError:
                    # Entries cached may be of a history published over since (a resume): read every one again.
                    self._entries.clear()
                    return self._fetch_to(current_step, until, download)
            except ChainError as error:
                raise ChainError(f"{self.store.url}: step {until}: {error}") from error
        if current_step is not None and latest <= current_step:
            return self._rebuilt_if_published_again(current_step, latest, download)
        last_error: Exception | None = None
        newest_tried = latest
        for _ in range(3):
            targets = [latest]
            tried = 0
            while targets:
                target = targets.pop(0)
                if current_step is not None and target <= current_step:
                    break  # nothing newer than where we are can be reached: that is an error, not "up to date"
                if target != latest and self._stale(target):
                    # An older step, tried where the newest is out of reach (its files gone): under max_age only a
                    # step published within it is taken, or the newest could be hidden behind a removed file.
                    raise StaleStoreError(
                        f"{self.store.url}: no usable chain to step {latest} ({last_error}), and step {target}, "
                        f"the newest older one, was published more than max_age={self.max_age:g} s ago; nothing "
                        "was pulled"
                    )
                try:
                    return self._fetch_to(current_step, target, download)
                except ChainError as error:
                    last_error = error
                    tried += 1
                    log.warning("no usable chain to step %d: %s", target, error)
                    if tried == 1:
                        # Entries cached may be of a history published over since (a resume): the newest step once
                        # more with every entry read again, then older published steps.
                        self._entries.clear()
                        targets = [target] + [s for s in listed_steps(self.store)[::-1] if s < target][:8]
            # Retention may have removed what was tried as the publisher moved on (an anchor published during the
            # pull): where the store now holds a newer step than any tried, that one is tried too.
            newer = [s for s in listed_steps(self.store) if s > newest_tried]
            if not newer:
                break
            latest = newest_tried = max(newer)
            log.warning("%s: the store moved on to step %d during the pull; trying it", self.store.url, latest)
        start = "an empty state" if current_step is None else f"step {current_step}"
        raise ChainError(f"{self.store.url}: no consistent chain from {start}: {last_error}")

    def _rebuilt_if_published_again(self, current_step: int, latest: int, download: Download[T]) -> T | None:
        """None (nothing to fetch: a subscriber never moves back), unless the step held, ``current_step``, was
        published again since it was pulled, with another entry (by a publisher resumed before it): the state held
        is not the store's step any more, and is rebuilt from an anchor, never patched, with every entry read again
        (those cached may be of the history published over). The held step's entry is read again here, at every
        pull that finds nothing newer."""
        if self._at is None or self._at.step != current_step:
            return None
        if latest < current_step:
            # Ahead of the store's newest: a pointer that lags (the held step still listed), or a history the run
            # left (a publisher resumed at an older step removed it). Held even so, and said once: moving back on
            # the strength of entries gone is what an attacker who deletes newer entries of a signed store (and
            # replays an older pointer) would have subscribers do; the next step published past it brings the
            # state onto the store's history again (re-synced from an anchor: it names another entry of the step
            # it follows, or none).
            if self._gone_warned != current_step:
                self._entries.pop(current_step, None)
                try:
                    self.entry(current_step)
                except MissingObjectError:
                    self._gone_warned = current_step
                    log.warning(
                        "%s: step %d, held here, is no longer in the store, whose newest step is %d (a publisher "
                        "resumed at an older step left that history?); held until a later step is published",
                        self.store.url,
                        current_step,
                        latest,
                    )
            return None
        # Read again whatever the pointer says: a replayed pointer names the entry cached, and a pointer write that
        # failed leaves none to say the step was published again (one small read per pull that finds nothing new).
        self._entries.pop(current_step, None)
        try:
            if self.entry(current_step).sha256 == self._at.sha256:
                return None
        except MissingObjectError:
            # Gone (retention): published again and gone, when the entry after it names another entry of it.
            after = next((s for s in listed_steps(self.store) if s > current_step), None)
            successor = None if after is None else self.entry(after)
            if successor is None or successor.base_step != current_step:
                return None
            try:
                _check_link(self._at, successor)
            except IntegrityError:
                raise ChainError(
                    f"{self.store.url}: step {current_step}, held here, was published again since and is no longer "
                    f"in the store; pull without until to reach the newest step (step {latest})"
                ) from None
            return None
        log.warning("step %d was published again since it was pulled; re-syncing from an anchor", current_step)
        self._entries.clear()
        return self._fetch_to(None, current_step, download)

    def _download(
        self, anchor_entry: Entry | None, chain: list[Entry], *, fill: bool = False, defer: bool = False
    ) -> list[Delta]:
        """The files of the way: the anchor (when the way starts from one), then each delta. With ``fill`` (a pull
        that applies them at once) an anchor in a local store is a FilledAnchor, applied straight from its file;
        with ``defer``, the deltas' bit-packed streams are checked as they are applied (``_file``)."""
        bar = _progress(len(chain) + (anchor_entry is not None), "pull")
        out = []
        try:
            if anchor_entry is not None:
                assert anchor_entry.anchor is not None  # the plan chose an entry with an anchor
                out.append(self._file(anchor_entry.anchor, anchor_entry.step, "anchor", fill=fill))
                out[0]._entry = anchor_entry  # what the file was verified against
                self._check_anchor(anchor_entry, out[0])
                if bar is not None:
                    bar.update()
            for entry in chain:
                assert entry.delta is not None  # every entry after the start of a chain has a delta
                delta = self._file(entry.delta, entry.step, "delta", defer=defer)
                if delta.base_step is not None and delta.base_step != entry.base_step:
                    raise IntegrityError(f"{entry.delta['key']}: base step {delta.base_step} differs from its entry")
                delta.step, delta.base_step = entry.step, entry.base_step
                delta._entry = entry
                if anchor_entry is not None and len(out) == 1:
                    self._check_follows(anchor_entry, out[0], delta)
                out.append(delta)
                if bar is not None:
                    bar.update()
        finally:
            if bar is not None:
                bar.close()
        return out

    def _refuse_anchor(self, anchor_entry: Entry, message: str) -> _WrongAnchor:
        """The error for a wrong anchor (every file of its way matched its entry: a publisher that wrote one), which
        no way starts from again; ``_fetch_to`` takes an older anchor's way instead."""
        self._refused_anchors.add(anchor_entry.sha256)
        return _WrongAnchor(f"{self.store.url}: {message}; that anchor is not used", anchor_entry.sha256)

    def _check_anchor(self, anchor_entry: Entry, anchor: Delta) -> None:
        """Refuses an anchor read whole whose tensors do not make its entry's state digest. (One read by ranges, or
        a FilledAnchor, is checked piece by piece only: a pull checks the digest of the state it fills.)"""
        if isinstance(anchor, PartialAnchor):
            return
        digest = anchor._raw.whole_state_digest()
        if digest is not None and digest != anchor_entry.state_digest:
            raise self._refuse_anchor(
                anchor_entry,
                f"the tensors of the anchor of step {anchor_entry.step} do not make the state digest of its entry "
                f"({digest}, the entry says {anchor_entry.state_digest})",
            )

    def _check_follows(self, anchor_entry: Entry, anchor: Delta, delta: Delta) -> None:
        """Refuses a way whose first delta was not made against the tensors of the anchor before it, as far as they
        were read here, before anything of the way is applied or further downloaded: each record naming a base
        identity must be of a tensor the anchor holds, of its dtype and shape, and is compared with the identity of
        the anchor's bytes (every tensor of an anchor read whole; of one read by ranges, those it read whole; none
        of a FilledAnchor, which a pull checks against the state it fills instead)."""
        usable = anchor.whole_tensors() if isinstance(anchor, PartialAnchor) else None
        try:
            delta._raw.check_follows(anchor._raw, usable)
        except BaseMismatchError as error:
            raise self._refuse_anchor(
                anchor_entry,
                f"the delta of step {delta.step} was not made against the state the anchor of step "
                f"{anchor_entry.step} gives ({error})",
            ) from error

    # -- applying -----------------------------------------------------------------------------------------------------
    @one_at_a_time
    def pull(self, state: Any, *, until: int | None = None) -> int:
        """Brings ``state`` (a mapping of tensors, modified in place) to the newest step (or to step ``until``) and
        returns the step it holds then. A subscriber never moves back: one already past ``until`` stays at its step
        and returns it (compare the result with ``until``). Each delta is applied all-or-nothing; when ``state``
        holds every published tensor, its digest is checked against the manifest, and a mismatch re-syncs from the
        newest anchor before raising IntegrityError. A delta that does not fit the store's anchor before it (a wrong
        anchor, every file matching its entry) makes the pull take the way from an older anchor (never that one
        again); where none is left it is an IntegrityError, after which the subscriber holds no step: ``state``
        holds the last anchor tried, not a published step."""
        _arrays.check_state(state, "state")
        this_target = _target_key(state)
        deltas = self._fetch_to_apply(self.step, until)
        if not deltas:
            if self.step is None:
                raise ChainError(f"{self.store.url}: nothing to pull")
            if this_target != self._target or self._aliases_at != self.step:
                # Not the target this subscriber brought to its step (a new or replaced one, or one a pull left part
                # way): it must hold that step, or be brought there, before the step is reported.
                missing = [name for name in self._names or () if name not in state]
                if missing:
                    # Nothing would be written into it (the digest check needs every tensor), yet the step reported.
                    raise BaseMismatchError(
                        f"{len(missing)} published tensor(s) of step {self.step} are not in the target: "
                        f"{', '.join(repr(name) for name in missing[:5])}; nothing was written"
                    )
                tied = self._untied_aliases(state, self.step, self._names)
                try:
                    self._hold_the_step(state, {}, written=False)
                except (MissingObjectError, ChainError) as error:
                    raise ChainError(
                        f"{self.store.url}: this subscriber holds step {self.step}, which the store can no longer "
                        "rebuild (its anchor or deltas removed by retention as the publisher moved on, or by a "
                        "publisher resumed at an older step), so a new target cannot be brought to it; pull it "
                        f"with a new Subscriber, which takes the store's newest step ({error})"
                    ) from error
                _write_aliases(state, tied)
                self._target, self._aliases_at = this_target, self.step
            return self.step
        self._aliases_at = None  # until this pull has written them
        tied = self._untied_aliases(state, deltas[-1].step, deltas[0].names if deltas[0]._whole_state else self._names)
        try:
            try:
                known = self._apply_from_anchors(state, deltas)
            except DeltaFormatError as error:
                # A stream checked only as it was applied is malformed (its file matched its entry: the publisher
                # wrote it so). Nothing of that delta was written: the state is at the step before it. Read the way
                # on again with every file checked first, so that a way around the bad file is taken, as when a
                # file is refused at download.
                log.warning("%s; reading the way from step %s again with every stream checked first", error, self.step)
                if self.step is not None and (self._at is None or self._at.step != self.step):
                    # The entry the way on must continue from: the one the last file applied was verified against
                    # (kept by `_apply_all` as it went), read from the store only where no file of this pull got
                    # there (a step held since an earlier pull, whose entry `_at` was then)
                    self._at = self.entry(self.step)
                known = self._apply_from_anchors(state, self._fetch_to_apply(self.step, until, defer=False))
        except BaseMismatchError as error:
            if not self.check_base or deltas[0]._whole_state:
                raise
            # The state is not the base the next delta was made against (changed behind our back): nothing of that
            # delta was written, and the newest anchor brings the state back onto the chain.
            log.warning("%s; re-syncing from the newest anchor", error)
            target, held = deltas[-1].step, self.step
            self.step = None
            try:
                known = self._apply_from_anchors(state, self._fetch_to_apply(None, target))
            except BaseMismatchError:
                if self.step is None:
                    # The anchor refused the target too (another dtype or shape), so nothing was applied: the state
                    # is as it was, and the subscriber still where it was, never moving back from there. (Where the
                    # anchor could not be read, the step stays forgotten: the state drifted from it.)
                    self.step = held
                raise
        self._hold_the_step(state, known)
        if self.step != deltas[-1].step:
            tied = self._untied_aliases(state, self._reached(), self._names)
        _write_aliases(state, tied)
        self._target, self._aliases_at = this_target, self.step
        return self._reached()

    def _untied_aliases(self, state: Any, step: int | None, published: Any) -> list[tuple[str, str]]:
        """The (alias, published name) pairs of ``step``'s entry (names the trainer's model ties, published once)
        that ``state`` holds as tensors of their own: they are written from the published tensor after the pull.
        An alias that is itself a published tensor (``published``: the names of the state's anchor) is never written
        over; one of another dtype, shape or kind than its tensor, or one that cannot be written, is refused before
        anything is written."""
        if step is None:
            return []
        try:
            aliases = self.entry(step).aliases or {}
        except DeltaSyncError:
            return []  # the entry is read (and its errors raised) by the pull itself
        untied = []
        published = None if published is None else set(published)
        for alias, name in aliases.items():
            if alias not in state or name not in state or (published is not None and alias in published):
                continue
            mine, theirs = _arrays.describe(state[alias], alias), _arrays.describe(state[name], name)
            problem = None
            if mine != theirs:
                problem = f"holds {alias!r} as {mine[0]}{list(mine[1])} and {name!r} as {theirs[0]}{list(theirs[1])}"
            elif _arrays.is_torch(state[alias]) != _arrays.is_torch(state[name]):
                problem = f"holds one of {alias!r} and {name!r} as a torch tensor and the other as a numpy array"
            elif not _arrays.is_torch(state[alias]) and not state[alias].flags.writeable:
                problem = f"holds {alias!r} as a read-only array"
            if problem is not None:
                raise BaseMismatchError(
                    f"tensor {alias!r} is tied to {name!r} in the trainer's model and published as it, but the target "
                    f"{problem}; nothing was written"
                )
            if not _same_memory(state[alias], state[name]):
                untied.append((alias, name))
        return untied

    def _hold_the_step(self, state: Any, known: Mapping[str, bytes], *, written: bool = True) -> None:
        """Makes sure ``state`` holds this subscriber's step (``_state_matches``): where its digest differs, it is
        re-synced from the newest anchor, and IntegrityError raised if it still differs. Until a way makes the
        digest the subscriber holds no step, unless the way cannot be read and this pull has not ``written`` into
        ``state`` (a new target: the step stays that of the target it was pulled into)."""
        if self._state_matches(state, known):
            return
        log.warning("state digest mismatch at step %d; re-syncing from the newest anchor", self.step)
        # The state holds bytes no entry vouches for: until a way is applied that makes the digest, this subscriber
        # holds no step of the store's (a caller that went on after an error, or pulled again, would otherwise be
        # told it held the step).
        target, at = self.step, self._at
        self.step, self._at = None, None
        try:
            deltas = self._fetch_to_apply(None, target)
        except BaseException:
            if not written:  # a target this pull has not written into: the subscriber's step is as it was
                self.step, self._at = target, at
            raise

        def made(way: list[Delta], known: Mapping[str, bytes]) -> None:
            """Raises unless the way applied made the state digest; an anchor that alone misses it (a publisher that
            wrote a wrong one, every file matching its entry; read whole, the download refuses it) is refused, and
            the way from an older anchor taken (``_apply_from_anchors``)."""
            if self._state_matches(state, known):
                return
            self.step, self._at = None, None
            message = f"state digest at step {target} does not match the manifest after a re-sync"
            step = way[0].step if len(way) == 1 and way[0]._whole_state else None
            try:
                entry = None if step is None else self.entry(step)
            except DeltaSyncError:
                entry = None
            if entry is not None and entry.sha256 not in self._refused_anchors:
                raise self._refuse_anchor(entry, f"{message}: the anchor of step {entry.step} alone misses it")
            raise IntegrityError(message)

        self._apply_from_anchors(state, deltas, made)

    def _fetch_to_apply(self, current_step: int | None, until: int | None, *, defer: bool = True) -> list[Delta]:
        """``fetch``, for files applied at once: an anchor in a local store is applied straight from its file, and
        with ``defer`` the deltas' bit-packed streams are checked as they are applied, not decoded once more at load
        (a malformed one is then a DeltaFormatError from the apply, with nothing of its delta written)."""
        return self._fetch(current_step, until, functools.partial(self._download, fill=True, defer=defer)) or []

    def _reached(self) -> int:
        if self.step is None:
            raise ChainError(f"{self.store.url}: the pulled files name no step")
        return self.step

    def _apply_from_anchors(
        self,
        state: Any,
        deltas: list[Delta],
        check: Callable[[list[Delta], Mapping[str, bytes]], None] | None = None,
    ) -> dict[str, bytes]:
        """``_apply_all``, then ``check(way, known)`` where given; where a delta turns out not to fit the anchor
        before it, or ``check`` refuses the way's anchor (``_WrongAnchor``: a wrong anchor in the store, every file
        matching its entry), the way to the same step from an older anchor is taken, each anchor at most once, and
        the error raised when none is left."""
        refused: set[str] = set()
        while True:
            try:
                known = self._apply_all(state, deltas)
                if check is not None:
                    check(deltas, known)
                return known
            except _WrongAnchor as error:
                if not deltas or deltas[-1].step is None or error.entry_sha256 in refused:
                    raise
                refused.add(error.entry_sha256)
                log.warning("%s; taking the way from an older anchor", error)
                try:
                    deltas = self._fetch_to_apply(None, deltas[-1].step)
                except ChainError as none_left:
                    raise error from none_left
            except DeltaSyncError as error:
                if not refused:
                    raise
                # On an older anchor's way, after a wrong anchor was written: the state holds no published step
                # (callers that restore the step they held where nothing was written must not).
                self.step, self._at = None, None
                raise IntegrityError(
                    f"{self.store.url}: the way from an older anchor, taken after a wrong anchor was applied, failed "
                    f"({type(error).__name__}: {error}); the state holds no published step"
                ) from error

    def _apply_all(self, state: Any, deltas: list[Delta]) -> dict[str, bytes]:
        """Applies ``deltas`` in order; returns the state-digest hashes the writes made in passing
        (``Delta._apply``) of tensors that no later delta wrote again: the hashes of those tensors as they now are."""
        known: dict[str, bytes] = {}
        for index, delta in enumerate(deltas):
            try:
                hashes = delta._apply(state, check_base=self.check_base, digest=True)
            except BaseMismatchError as error:
                at = next((i for i in range(index - 1, -1, -1) if deltas[i]._whole_state), None)
                if at is None:
                    raise
                # Every base from the anchor on came from the store, which disagrees with itself: the state holds
                # bytes no entry vouches for, so this subscriber holds no step of the store's now.
                self.step, self._at = None, None
                anchor = deltas[at]
                if at != index - 1 or anchor.step is None:
                    # A later delta: that delta, or one before it, was not made as its entry says.
                    raise IntegrityError(
                        f"{self.store.url}: the delta of step {delta.step} was not made against the state the way "
                        f"from the anchor of step {anchor.step} gives ({error}); the state holds no published step"
                    ) from error
                # The delta right after the anchor: the anchor is wrong (a publisher that wrote one). No way starts
                # from it again (pull tries an older anchor's).
                try:
                    anchor_entry = self.entry(anchor.step)
                except DeltaSyncError:
                    raise IntegrityError(
                        f"{self.store.url}: the delta of step {delta.step} was not made against the state the anchor "
                        f"of step {anchor.step} gives ({error}); the state holds that anchor's tensors"
                    ) from error
                raise self._refuse_anchor(
                    anchor_entry,
                    f"the delta of step {delta.step} was not made against the state the anchor of step {anchor.step} "
                    f"gives ({error}); the state holds that anchor's tensors, not a published step",
                ) from error
            for name, hash_ in hashes.items():
                if hash_ is None:
                    known.pop(name, None)
                else:
                    known[name] = hash_
            if delta._whole_state:
                self._names = delta.names
            # The step and the entry the file was verified against, together: where a later delta of the way fails,
            # the way on continues from this entry, not one read again (evicted from the cache, published again).
            self.step, self._at = delta.step, None if delta.step is None else self._verified_entry(delta)
        reached = self._reached()  # the loop left `_at` at the last file's entry, whose step is `reached`
        if not deltas:
            self._at = self.entry(reached)
        return known

    @one_at_a_time
    def pull_to_file(self, path: str | os.PathLike[str], *, until: int | None = None) -> int:
        """Writes the newest step (or step ``until``) as a plain safetensors checkpoint at ``path``, the bytes
        ``safetensors.numpy.save_file`` writes for that state, and returns the step. The state is rebuilt in the
        file itself, never in memory: the file is laid out first, then filled about 256 MiB at a time, each batch's
        tensors copied from the anchor (from a local store straight from the anchor's file, every piece checked
        against the pieces sidecar before it is used; from other stores through a checked temporary copy), patched
        by the deltas after it through a memory map of that batch alone, and hashed; the hashes must make the step's
        state digest. It is written beside ``path`` and renamed over it only then; on any error ``path`` is left as
        it was. Does not move this subscriber's step."""
        reached: list[int] = []

        def write(temp: str) -> None:
            def into_file(anchor_entry: Entry | None, chain: list[Entry]) -> int:
                assert anchor_entry is not None and anchor_entry.anchor is not None  # no current step: from an anchor
                deltas = self._download(None, chain)
                step = chain[-1].step if chain else anchor_entry.step
                try:
                    out = self._anchor_file(anchor_entry.anchor, anchor_entry.step, temp, deltas)
                except BaseMismatchError as error:
                    # Every base here came from the store: its anchor and a delta after it disagree (a publisher
                    # that wrote a wrong anchor), and an older anchor's way may not (tried next).
                    raise IntegrityError(
                        f"{self.store.url}: the anchor of step {anchor_entry.step} is not the base the deltas after "
                        f"it were made against: {error}"
                    ) from error
                out.close()
                if out.state_digest() != self.entry(step).state_digest:
                    # Every file of the way checked out, so another way is no answer: raised past the ways.
                    raise _NotTheState(
                        f"{self.store.url}: the state rebuilt at step {step} does not match the state digest in "
                        f"{entry_key(step)}; nothing was written"
                    )
                return step

            try:
                step = self._fetch(None, until, into_file)
            except _NotTheState as error:
                raise IntegrityError(str(error)) from None
            assert step is not None  # from no step, there is always a way or an error
            reached.append(step)

        if not isinstance(path, (str, os.PathLike)):
            raise DeltaSyncError(f"pull_to_file: path must be a str or os.PathLike, not {type(path).__name__}")
        target = os.fsdecode(os.fspath(path))
        if isinstance(self.store, LocalStore) and _store_object(self.store, target):
            # It would replace (or leave temporary files among) the very files it is rebuilt from.
            raise DeltaSyncError(
                f"{target}: one of the files of the store {self.store.url} being pulled; write it elsewhere"
            )
        remove_stale_temps(target)
        write_atomically(target, write)
        return reached[0]

    def _anchor_file(self, ref: dict[str, Any], step: int, path: str, deltas: list[Delta]) -> CheckpointFile:
        """The checkpoint at ``path`` laid out for anchor ``ref`` of ``step``, holding its tensors with ``deltas``
        applied, batch by batch of the output: from a store that keeps the anchor as a local file (and its pieces
        sidecar), each batch copied with every piece it touches checked first, then patched; else from the anchor
        read as ``pull`` reads it, each batch written from it and patched."""

        def local() -> CheckpointFile | None:
            opened = self._local_source(ref)
            if opened is None:
                return None
            source, pieces = opened
            with source:
                anchor = LocalAnchor(source, ref["key"], step, pieces)
                require_names(deltas, set(anchor.tensors), ref["key"])
                return self._filled(CheckpointFile(path, anchor.specs()), anchor.copy_into, deltas)

        done = self._retry(ref["key"], local)
        if done is not None:
            return done
        whole = self._file(ref, step, "anchor", ranged=False)  # every byte: the file holds every tensor
        require_names(deltas, set(whole.names), ref["key"])
        specs = [(t.name, t.dtype, tuple(t.shape or ())) for t in whole.tensors]
        return self._filled(CheckpointFile(path, specs), None, [whole, *deltas])

    def _filled(
        self, out: CheckpointFile, copy: Callable[[CheckpointFile, list[str]], None] | None, deltas: list[Delta]
    ) -> CheckpointFile:
        """``out`` with, batch by batch, ``copy`` (when given) then ``deltas`` applied and the state digest's hashes
        taken: a batch's pages are patched and hashed while the copy has just written them, and only a batch of the
        file is mapped at a time."""
        try:
            for batch in out.batches():
                if copy is not None:
                    copy(out, batch)
                arrays = out.arrays(batch)
                apply_to(deltas, arrays, check_base=self.check_base)
                out.hash(arrays)  # the state digest's part for this batch, while its pages are still at hand
                del arrays
                out.release()
        except BaseException:
            out.close()
            raise
        return out

    def _state_matches(self, state: Any, known: Mapping[str, bytes]) -> bool:
        """True when ``state``'s digest is the current entry's; ``known`` holds tensors' hashes already made from
        their present bytes (``_apply_all``), the others are read and hashed here."""
        if self.step is None or self._names is None or not isinstance(state, Mapping):
            return True
        if any(name not in state for name in self._names):
            return True  # a partial state (a shard) cannot be checked against the whole-state digest
        digest = state_digest_knowing({name: state[name] for name in self._names}, known)
        return digest == self.entry(self.step).state_digest

    # -- auditing -----------------------------------------------------------------------------------------------------
    def verify(self, *, signatures: bool = True) -> list[str]:
        """Checks every entry (signature, run, fields), every file's digest, that each delta's base entry is in the
        store and is the one it names, and that `latest.json` agrees; returns the problems found (empty when all
        is well; an empty store is a problem). Signatures are checked with this subscriber's signing key: a signed
        store read without one is a problem (its signatures went unchecked, so a writer without the key could have
        changed entries and files alike unseen), unless ``signatures`` is False."""
        problems = []
        if signatures and self._key is None and self._signed():
            problems.append(
                "the store is signed, but no signing key is set (signing_key, or DELTASYNC_SIGNING_KEY): its "
                "signatures were not checked"
            )
        steps = listed_steps(self.store)
        if not steps:
            problems.append("the store holds no published step")
        for step in steps:
            try:
                entry = self.entry(step)
                for ref, kind in ((entry.delta, "delta"), (entry.anchor, "anchor")):
                    if ref is not None:
                        checked = self._file(ref, step, kind, fill=True)  # a local store's anchor: checked in place
                        if isinstance(checked, FilledAnchor):
                            checked.close()
                if entry.anchor is not None and "pieces" in entry.anchor:
                    self._retry(entry.anchor["pieces"]["key"], functools.partial(self._check_pieces, entry.anchor))
                if entry.delta is not None and step != steps[0]:
                    if entry.base_step not in steps:
                        problems.append(f"step {step}: its base step {entry.base_step} is not in the store")
                    else:
                        _check_link(self.entry(entry.base_step), entry)
            except DeltaSyncError as error:
                problems.append(f"step {step}: {error}")
        try:
            _, problem = self._newest()
        except DeltaSyncError as error:
            problem = error
        if problem is not None:
            problems.append(str(problem))
        return problems

    def _signed(self) -> bool:
        """Whether any document of the store (run.json, latest.json, an entry) carries a signature, whatever the
        key: a writer without the key could strip some of them."""
        for key in (RUN_KEY, LATEST_KEY, *(entry_key(step) for step in listed_steps(self.store))):
            try:
                document = json.loads(self.store.get_small(key, MAX_DOCUMENT_BYTES))
            except (DeltaSyncError, ValueError, RecursionError):
                continue
            if isinstance(document, dict) and "signature" in document:
                return True
        return False


class _WrongAnchor(IntegrityError):
    """A delta that does not fit the anchor before it, every file matching its entry: that anchor is wrong.
    ``entry_sha256`` names the anchor's entry, which no later way starts from (``Subscriber._refused_anchors``)."""

    def __init__(self, message: str, entry_sha256: str) -> None:
        super().__init__(message)
        self.entry_sha256 = entry_sha256


class _NotTheState(Exception):
    """A rebuilt state that misses its entry's state digest, raised past ``_fetch_to``'s other ways."""


def _check_link(base: Entry, successor: Entry) -> None:
    """``successor`` must name ``base``'s entry by SHA-256 (entries without a run id predate this rule)."""
    if successor.run is not None and successor.base_entry_sha256 != base.sha256:
        raise IntegrityError(
            f"{entry_key(base.step)}: not the entry that {entry_key(successor.step)} was published "
            "after (its base_entry_sha256 differs)"
        )


def log_entries(store: str | os.PathLike[str] | Store, *, signing_key: bytes | str | None = None) -> list[Entry]:
    """Every manifest entry of a store, verified, oldest first."""
    subscriber = Subscriber(store, signing_key=signing_key, retries=1)
    return [subscriber.entry(step) for step in listed_steps(subscriber.store)]


def verify_store(
    store: str | os.PathLike[str] | Store, *, signing_key: bytes | str | None = None, signatures: bool = True
) -> list[str]:
    """The problems :meth:`Subscriber.verify` finds in a store (empty when all is well)."""
    return Subscriber(store, signing_key=signing_key, retries=1).verify(signatures=signatures)


__all__ = ["Subscriber", "log_entries", "verify_store"]
