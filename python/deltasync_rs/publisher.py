"""The writing side of the sync protocol: a Publisher turns a training run's states into anchors, deltas, manifest
entries and the `latest.json` pointer of one run in a store (docs/format.md §10), uploading in the background."""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import logging
import math
import operator
import os
import queue
import secrets
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar, overload

from . import _arrays
from ._identity import BLOCK_BYTES
from ._turns import one_at_a_time, track
from .delta import (
    Delta,
    _check_step,
    _Deferred,
    _Recode,
    check_codec,
    check_ties,
    state_digest,
    write_anchor_pieces,
)
from .errors import (
    BaseMismatchError,
    ChainError,
    DeltaFormatError,
    DeltaSyncError,
    IntegrityError,
    MissingObjectError,
    StoreError,
    at_least_one,
    flag,
    seconds,
)
from .manifest import (
    DEFAULT_PIECE_BYTES,
    DEFAULT_PIECE_HASH,
    LATEST_KEY,
    MAX_DOCUMENT_BYTES,
    RUN_FORMAT,
    RUN_KEY,
    Entry,
    anchor_key,
    check_piece_bytes,
    check_piece_hash,
    delta_key,
    entry_key,
    file_ref,
    latest_document,
    parse_document,
    parse_run,
    pieces_document,
    pieces_key,
    resolve_signing_key,
    run_document,
    step_of,
)
from .mirror import Mirror
from .store import TEMP_PREFIX, Store, UploadCancelled, abort_uploads_in_flight, open_store, private_temp, remove_temp
from .subscriber import Subscriber, attempts

log = logging.getLogger("deltasync_rs.sync")

#: On a store without atomic creates, how long a publisher waits before it reads a young run.json again
#: (Publisher._open_run), so that publishers opening one new store at once all end with the last one written; and
#: how young (by its ``created`` time) a run.json must be for that.
RUN_SETTLE_SECONDS = 1.0
RUN_YOUNG_SECONDS = 60.0


def _young_run(raw: bytes) -> bool:
    """Whether a run.json (already parsed once) was made less than RUN_YOUNG_SECONDS ago, by this machine's clock."""
    created = json.loads(raw).get("created")
    return isinstance(created, (int, float)) and abs(time.time() - created) < RUN_YOUNG_SECONDS


#: What a shard's mirror held before a step: (tensor name, first element, elements, base identity of those elements'
#: bytes as a tensor of their own, 16 hex digits). ``ds.torch.Mirror.last_bases`` lists them; publish_shards checks them.
ShardProof = tuple[str, int, int, str]

T = TypeVar("T")


class _Option(Generic[T]):
    """An option of a Publisher that is checked whenever it is set, at construction too, so a bad value is refused
    by the caller's own line and never reaches the upload thread: ``check(value, name)`` returns the value to keep
    or raises DeltaSyncError naming the option."""

    def __init__(self, check: Callable[[Any, str], T], doc: str) -> None:
        self._check = check
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self._name, self._slot = name, f"_{name}"

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> _Option[T]: ...
    @overload
    def __get__(self, instance: object, owner: type | None = None) -> T: ...
    def __get__(self, instance: object | None, owner: type | None = None) -> T | _Option[T]:
        return self if instance is None else getattr(instance, self._slot)

    def __set__(self, instance: object, value: Any) -> None:
        setattr(instance, self._slot, self._check(value, self._name))


def _piece_size(value: Any, name: str) -> int | None:
    if value is None:
        return None
    try:
        return check_piece_bytes(value, name)
    except DeltaFormatError as error:
        raise DeltaSyncError(str(error)) from None


def _published_state(state: Any, role: str) -> Mapping[str, Any]:
    """``state`` (``_arrays.check_state``), or DeltaSyncError where it holds no tensor: there is nothing to publish,
    and no reader could read an anchor of nothing."""
    _arrays.check_state(state, role)
    if not state:
        raise DeltaSyncError(f"{role} holds no tensors: nothing to publish")
    return state


#: How many of the steps after a resumed step whose entry is gone ``resume`` compares the state with.
_LATER_STEPS_CHECKED = 16


class Publisher:
    """Publishes a training run's states to a store: an anchor first and every ``anchor_every`` publishes, and a
    delta against the last published state for every publish after the first (anchor steps get both, so no
    delta is ever dropped). Uploads run in a background thread; ``flush()`` waits and raises any upload error.

    ``store`` is a path (the local-folder default), an ``s3://``/``gs://`` URL, ``hf://buckets/ORG/NAME/PREFIX``,
    or a :class:`Store`. ``signing_key`` (or ``DELTASYNC_SIGNING_KEY``) signs every manifest entry with
    HMAC-SHA256, and with a key what the publisher reads back (run.json, the newest step) is verified too.
    ``keep_anchors`` anchors are kept, with the deltas after the oldest of them; older files are deleted.
    ``values`` and ``codec`` are as for :func:`deltasync_rs.diff`: ``codec="compact"`` writes ``rice``, ``diffbits``
    or ``rans`` streams where smaller, which every reader of this version reads; ``codec="context"`` (with
    ``values="diff"``) also codes positions against the base's exponent classes, smaller on training steps, read by
    subscribers and vLLM workers of this version (at any tensor parallel size) and joined FSDP2 shards
    (:meth:`publish_shards`).

    Anchors are streamed: the upload thread writes the anchor file straight from the publisher's mirror into a
    temporary file (hashing it on the way) and uploads from that file, so an anchor costs no copy of the state in
    memory. The mirror must hold still until that file is written, so a publish that follows an anchor waits for
    the anchor's file first (not for its upload). With ``piece_bytes`` (a power of two, 256 KiB by default; None:
    none) each anchor also gets a pieces sidecar, the hash of each piece of that size, hashed in the same pass, so
    that a reader can verify a byte range of it alone, or the whole anchor on every core (docs/format.md §10, anchor
    pieces). ``piece_hash`` is BLAKE3 by default; ``piece_hash="sha256"`` writes the sidecars that readers before
    BLAKE3 sidecars check. An anchor with pieces has no whole-file SHA-256 in its entry unless ``whole_sha256=True``
    (its sidecar, which the signed entry binds, checks every byte; the whole-file hash is one more pass on one core,
    about as long as writing the file): such entries are protocol version 2, which readers before it refuse by
    their version. Publish with ``whole_sha256=True`` (and ``piece_hash="sha256"`` for the oldest) while such
    readers remain. Without pieces an anchor always has its whole-file SHA-256.

    Every entry carries the store's run id (``run.json``, made by the first publisher of the store) and the
    SHA-256 of its base step's entry. Use it as a context manager, or call ``close()``: uploads still pending at
    interpreter exit are waited for up to ``exit_timeout`` seconds, and any that are lost are reported on stderr.
    """

    anchor_every = _Option(
        at_least_one,
        "An anchor is published at the first publish and every this many publishes after (an integer, at least 1).",
    )
    keep_anchors = _Option(
        at_least_one, "How many of the newest anchors retention keeps, with the deltas after the oldest of them."
    )
    piece_bytes = _Option(
        _piece_size,
        "The size of an anchor's pieces (a power of two from 1 KiB to 1 GiB), or None for anchors without a pieces "
        "sidecar (docs/format.md §10).",
    )
    piece_hash = _Option(check_piece_hash, 'The hash of each anchor piece: "blake3" (the default) or "sha256".')
    whole_sha256 = _Option(
        flag,
        "Whether an anchor with pieces also gets its whole-file SHA-256 (for readers of sync protocol version 1); "
        "anchors without pieces always do.",
    )
    exit_timeout = _Option(
        seconds,
        "How long, in seconds, uploads still pending at interpreter exit are waited for (a number, at least 0).",
    )
    retries = _Option(
        lambda value, _name: attempts(value),
        "How many times each store write is tried before its error is raised: at least once, whatever it is set to "
        "(values below 1 mean once, so no write is ever skipped); anything but an integer is refused.",
    )

    def __init__(
        self,
        store: str | os.PathLike[str] | Store,
        *,
        anchor_every: int = 10,
        keep_anchors: int = 2,
        values: str = "diff",
        codec: str = "compact",
        signing_key: bytes | str | None = None,
        background: bool = True,
        max_pending: int = 2,
        retries: int = 3,
        exit_timeout: float = 60.0,
        piece_bytes: int | None = DEFAULT_PIECE_BYTES,
        piece_hash: str = DEFAULT_PIECE_HASH,
        whole_sha256: bool = False,
    ) -> None:
        self.piece_bytes = piece_bytes
        self.piece_hash = piece_hash
        self.whole_sha256 = whole_sha256
        check_codec(codec, values=values, mirror=True)
        self.anchor_every = anchor_every  # checked (as the options above) before the store is opened or made
        self.keep_anchors = keep_anchors
        self.retries = retries
        self.exit_timeout = exit_timeout
        flag(background, "background")
        at_least_one(max_pending, "max_pending")
        self.store = open_store(store)
        self.values = values
        self.codec = codec
        self._key = resolve_signing_key(signing_key)
        # Calls that move the publisher's state take turns (one_at_a_time): without it two publishes at once moved
        # one mirror together and wrote entries whose base was another step's.
        self._lock = threading.RLock()
        self._forked_mid_call: int | None = None
        track(self)  # a forked child refuses it if another thread was inside a call (one_at_a_time)
        self._mirror = Mirror()
        # Set while a publish moves the mirror, and left set when that raised: the mirror may then hold part of a
        # step, so it is no base for a delta, and the next publish is an anchor (_advance).
        self._torn = False
        self._since_anchor = 0
        # Tied names of a shared mirror (publish_shared), listed in every entry; a publisher opening a store goes
        # on with those of its newest entry (a checkpoint published by `deltasync publish` leaves the tie out).
        self._aliases: dict[str, str] = {}
        self._errors: list[BaseException] = []
        self.run = self._open_run()
        self._reader = Subscriber(self.store, signing_key=self._key, retries=self.retries)
        self._last_step = self._store_latest_step()
        if self._last_step is not None:
            with contextlib.suppress(DeltaSyncError):
                self._aliases = dict(self._reader.entry(self._last_step).aliases or {})
        self._base_entry: tuple[int, str] | None = None  # (step, SHA-256) of the last entry written
        self._closed = False
        self._abandoned = False  # set at exit when pending uploads were given up (_close_at_exit)
        # The process that made it: a forked child inherits the object but not its upload thread (nor its uploads).
        self._made_in = os.getpid()
        # Set while no upload job reads the mirror (for an anchor or the state digest): it may change only then.
        self._mirror_free = threading.Event()
        self._mirror_free.set()
        self._queue: queue.Queue | None = None
        self._worker: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=max_pending)
            # The thread holds the queue, not the publisher: each queued job holds it (_enqueue), so a publisher
            # dropped without close() still uploads what it queued, and is then collected, which ends the thread.
            self._worker = threading.Thread(target=_drain, args=(self._queue,), name="deltasync-publisher", daemon=True)
            self._worker.start()
            # Not at exit (the atexit flush waits at most exit_timeout), and never blocking (a forked child has no
            # thread draining the queue).
            weakref.finalize(self, _stop_drain, self._queue).atexit = False
            _open_publishers.add(self)

    def _open_run(self) -> str:
        """The store's run id: read from run.json (verified with a key), or made and written by this publisher.

        Several publishers may open a new store at once (a training script run on every rank, each making one).
        Where the store creates objects atomically (``Store.atomic_create``: a local folder, S3) exactly one of them
        writes run.json and all read that one. Elsewhere each may write its own: so a run.json made less than
        ``RUN_YOUNG_SECONDS`` ago (by its ``created`` time) is read again ``RUN_SETTLE_SECONDS`` later, as is one this
        publisher wrote, by when the others' writes have landed: every publisher ends with the last one written
        (two reads a pause apart must agree, or it reads again). A write that does not read back is made again, so
        a delayed write cannot change the run."""
        written, confirmed = False, None
        for attempt in range(self.retries + 4):
            last = attempt >= self.retries + 3
            try:
                raw = self.store.get_small(RUN_KEY, MAX_DOCUMENT_BYTES)
                run = parse_run(raw, self._key)
                if self._key is None and "signature" in parse_document(raw, RUN_KEY, RUN_FORMAT):
                    # Its steps would be unsigned, and every reader with the key would refuse them.
                    raise IntegrityError(
                        f"{self.store.url}: the store is signed ({RUN_KEY} carries a signature), but this publisher "
                        "has no signing key: give it the store's key (signing_key=, or DELTASYNC_SIGNING_KEY)"
                    )
            except MissingObjectError:
                if last:
                    break
            except (DeltaFormatError, StoreError):
                if not written or last:
                    raise
            else:
                if self.store.atomic_create or written or run == confirmed or not _young_run(raw):
                    return run
                confirmed = run  # another publisher may still write its own over it: read it again
                time.sleep(RUN_SETTLE_SECONDS)
                continue
            document = run_document(self._key)
            if self.store.atomic_create:
                self._retrying(RUN_KEY, functools.partial(self.store.create, RUN_KEY, document))
            else:
                self._put(RUN_KEY, document)
                time.sleep(RUN_SETTLE_SECONDS)
            written = True
        raise StoreError(f"{self.store.url}/{RUN_KEY}: written {self.retries} times, but never read back the same")

    def _store_latest_step(self) -> int | None:
        """The newest step in the store that verifies; a bad `latest.json` is logged and then overwritten."""
        try:
            return self._reader.latest_step()
        except (DeltaFormatError, IntegrityError) as error:
            log.error("%s: ignoring what the store says about its newest step: %s", self.store.url, error)
            return None

    @property
    def step(self) -> int | None:
        """The last step handed to publish (uploaded, or queued for upload)."""
        return self._mirror.step

    def _check_step(self, step: int) -> None:
        _check_step(step, "step", optional=False)
        last = self._mirror.step if self._mirror.step is not None else self._last_step
        if last is not None and step <= last:
            raise DeltaSyncError(
                f"step {step} is not after the last published step {last}"
                + (
                    "; to go on from an earlier step (a trainer restarted from an older checkpoint), call "
                    "resume(state, step=...) with that step's state first: it removes the later steps"
                    if self._mirror.is_empty
                    else ""
                )
            )

    def _check_open(self) -> None:
        if self._closed:
            raise DeltaSyncError(f"{self.store.url}: the publisher is closed; make a new one to publish again")
        self._check_process()

    def _in_a_forked_child(self) -> bool:
        return self._made_in != os.getpid()

    def _check_process(self) -> None:
        if self._in_a_forked_child():
            raise DeltaSyncError(
                f"{self.store.url}: this Publisher was made in process {self._made_in}, which this one forked from: "
                "its upload thread and its uploads are that process's; make a new one here"
            )

    @one_at_a_time
    def publish(self, step: int, state: Mapping[str, Any]) -> None:
        """Publishes ``state`` as ``step``: a delta against the last published state, and an anchor when due.
        The state is diffed (or copied) before this returns, so training may change it right after."""
        self._check_open()
        self._raise_errors(step)
        self._check_step(step)
        _published_state(state, "state")
        if self._mirror.is_empty:
            self._mirror.reset(state, step=step)
            self._enqueue(step, None)
            return
        # A state the mirror cannot take is refused here, before the mirror could be torn (_advance).
        self._mirror._check_advance(state, step=step, values=self.values, codec=self.codec)
        self._wait_for_mirror()
        delta = self._advance(
            step, lambda: self._mirror._advance(state, step=step, values=self.values, codec=self.codec, defer=True)
        )
        self._enqueue(step, delta)

    def _advance(self, step: int, advance: Callable[[], Delta | _Deferred]) -> Delta | _Deferred | None:
        """Runs ``advance()``, which moves the mirror to ``step`` and returns the delta; None (publish an anchor)
        when an earlier move of the mirror raised part way: the delta would start from a state never published."""
        torn, self._torn = self._torn, True
        delta = advance()
        self._torn = False
        if not torn:
            return delta
        log.warning(
            "%s: an earlier publish failed while it moved the publisher's state, which may hold part of that step; "
            "step %d is published as an anchor",
            self.store.url,
            step,
        )
        return None

    @one_at_a_time
    def resume(self, state: Mapping[str, Any], *, step: int, copy: bool = True) -> None:
        """Starts from ``state`` as already published at ``step`` (e.g. pulled back from the store), so the next
        publish is a delta against it rather than a first anchor.

        The publisher's mirror is a copy of ``state``; with ``copy=False`` it adopts ``state``'s tensors instead
        (contiguous, writable CPU tensors or arrays), so that only one copy is in memory: the caller must not use
        them afterwards, since every publish writes the new state into them."""
        self._check_open()
        _published_state(state, "state")
        _check_step(step, "step", optional=False)
        if not self._mirror.is_empty:
            raise DeltaSyncError("resume must come before the first publish")
        self._resume(state, step, copy=copy)

    def _resume(
        self,
        state: Mapping[str, Any],
        step: int,
        *,
        copy: bool,
        shared: bool = False,
        digest: str | None = None,
        entry: Entry | None = None,
        newest: bool = False,
    ) -> None:
        """``resume``, its arguments checked; ``shared``: the mirror is ``state`` itself, a mapping the caller keeps
        and moves (ds.torch.Mirror's tensors); ``digest`` and ``entry``: ``state``'s and step's, already read;
        ``newest``: the caller read ``step`` as the store's newest and goes on after it (``deltasync publish``),
        so steps after it are not a history to leave but another publisher's, and are refused, nothing removed."""
        keys = [k for prefix in ("manifest/", "anchors/", "deltas/") for k in self.store.list(prefix)]
        later = [k for k in keys if (s := step_of(k)) is not None and s > step]
        later_steps = sorted({s for k in later if k.startswith("manifest/") and (s := step_of(k)) is not None})
        if newest:
            if later_steps:
                raise DeltaSyncError(
                    f"{self.store.url}: step {step} is no longer the store's newest: step {later_steps[-1]} was "
                    "published meanwhile (by another publisher: a store takes one at a time); nothing was changed"
                )
            # Later files without entries: a publisher stopped before their entries, or one writing them now. Not
            # a history to leave: left alone (a step published over them replaces them).
            later = []
        digest = digest or state_digest(state)
        try:
            entry = entry or self._reader.entry(step)
        except DeltaSyncError as error:
            if later and not isinstance(error, MissingObjectError):
                # Later steps are removed on resume: never on the strength of an entry that did not read.
                raise DeltaSyncError(
                    f"{self.store.url}: resume(state, step={step}): its entry did not read ({error}); nothing was "
                    "changed: try again"
                ) from error
            log.warning("resuming at step %d without its entry (%s): the next publish is an anchor", step, error)
            entry = None
        if entry is not None and digest != entry.state_digest:
            # Deltas against it would not apply to what subscribers hold at that step.
            raise IntegrityError(
                f"{self.store.url}: resume(state, step={step}): the state is not the one published as step {step} "
                f"(its state digest differs from {entry_key(step)}'s); nothing was changed. A state of another "
                f"history: publish it without resume as a step after the store's newest ({(later_steps or [step])[-1]}"
                "; a publisher's first publish is an anchor), or into a new store"
            )
        if entry is None:
            # Nothing to check the state against: at least it must not be a later step's (a wrong step number,
            # which would remove the very steps the state comes from). The newest ones are checked, a store read
            # each: the state a caller holds is most likely the newest it published.
            for later_step in later_steps[::-1][:_LATER_STEPS_CHECKED]:
                try:
                    same = self._reader.entry(later_step).state_digest == digest
                except MissingObjectError:
                    continue
                if same:
                    raise IntegrityError(
                        f"{self.store.url}: resume(state, step={step}): the state is the one published as step "
                        f"{later_step}; resume at that step (resuming at {step} removes the steps after it); "
                        "nothing was changed"
                    )
        # Keep the anchor cadence across publisher restarts, and make sure subscribers can reach this step: the way
        # back from it to an anchor, each entry the one its successor names (the subscribers' own walk). Where there
        # is none (an entry on the way gone: a removal that stopped part way), the next publish is an anchor, so that
        # the steps after this one are not out of every subscriber's reach until the next anchor.
        since_anchor = self.anchor_every
        if entry is not None:
            try:
                since_anchor = len(self._reader._walk_back(step, 0, lambda e: e.anchor is not None)) - 1
            except (ChainError, MissingObjectError, IntegrityError) as error:
                log.warning("step %d cannot be reached from an anchor (%s): the next publish is an anchor", step, error)
        # The store first (a failure leaves this publisher as it was, to resume again), then the mirror: nothing
        # after this reads the store.
        self._leave_steps_after(step, entry, later, later_steps)
        if copy:
            self._mirror.reset(state, step=step)
        else:
            self._mirror.share(state if shared else dict(state), step=step)
        self._last_step = step
        self._base_entry = None if entry is None else (step, entry.sha256)
        self._since_anchor = since_anchor

    @one_at_a_time
    def _continue(self, state: Mapping[str, Any], step: int) -> None:
        """``resume(state, step=step, copy=False)`` for a caller that read ``step`` as the store's newest and
        rebuilt its state (``deltasync publish``): where a later step has appeared since, it is another
        publisher's, and this raises instead of removing it."""
        self._check_open()
        if not self._mirror.is_empty:
            raise DeltaSyncError("resume must come before the first publish")
        self._resume(state, step, copy=False, newest=True)

    def _resume_at_published(self, step: int, tensors: Mapping[str, Any]) -> bool:
        """``publish_shared(..., resume=True)``'s first call: resumes at ``step`` where the store holds it as
        ``tensors``, the mirror shared. Whether it did; False where the store has no such step (nothing newer, or
        its entry is gone: the caller's publish goes on and says what it finds)."""
        _check_step(step, "step", optional=False)
        # Step 0 is every run's start: a store's history after it is left only for a later step the state proves.
        if self._last_step is None or step > self._last_step or (step == 0 and self._last_step != 0):
            return False
        try:
            entry = self._reader.entry(step)
        except MissingObjectError:
            return False
        digest = state_digest(tensors)
        if digest != entry.state_digest:
            raise IntegrityError(
                f"{self.store.url}: the store holds step {step} as another state than the one to publish as step "
                f"{step} (its state digest differs from {entry_key(step)}'s): the weights are not the checkpoint of "
                "that step, or the store holds another run; nothing was changed"
            )
        log.info("%s: the store holds step %d as this state: resuming there", self.store.url, step)
        self._resume(tensors, step, copy=False, shared=True, digest=digest, entry=entry)
        return True

    def _leave_steps_after(self, step: int, entry: Entry | None, later: list[str], steps: list[int]) -> None:
        """Resumed at ``step``: the store's files of later ``steps`` (keys ``later``) are of a history this run
        leaves (a trainer restarted from an older checkpoint). They are removed, so that no subscriber takes them
        for this run's newest steps (nor retention this run's anchors for older ones): the pointer first, then the
        entries, then their files. The pointer is set to ``step``'s entry even with nothing to remove: a publisher
        stopped between its entry and its pointer left it a step behind, and a subscriber that holds the step as
        it was before being published again learns of it from the pointer."""
        if steps:
            log.warning(
                "%s: resumed at step %d; removing the later %s the store holds (%s), of a history this run leaves",
                self.store.url,
                step,
                "step" if len(steps) == 1 else f"{len(steps)} steps",
                ", ".join(map(str, steps[:5])) + (", ..." if len(steps) > 5 else ""),
            )
        elif later:  # files a killed publisher wrote before their entries
            log.info(
                "%s: resumed at step %d; removing %d later file(s) without entries", self.store.url, step, len(later)
            )
        blob = None
        if entry is not None:
            blob = self.store.get_small(entry_key(step), MAX_DOCUMENT_BYTES)
            if hashlib.sha256(blob).hexdigest() != entry.sha256:
                blob = None  # replaced since it was read: the pointer goes, the next publish writes it
        if blob is not None:
            self._put(LATEST_KEY, latest_document(step, blob, self.run, self._key))
        elif later:
            self.store.delete([LATEST_KEY])
        # Newest first, so that a removal stopped part way leaves the store a history with no gap: every entry
        # left is reached from an anchor as before.
        self.store.delete(
            sorted((k for k in later if k.startswith("manifest/")), key=lambda k: step_of(k) or 0, reverse=True)
        )
        self.store.delete(sorted(k for k in later if not k.startswith("manifest/")))

    @one_at_a_time
    def publish_delta(self, step: int, delta: Delta) -> None:
        """Publishes a delta made elsewhere (e.g. by the trainer's mirror) against the last published state.

        Ties the delta names (``delta.aliases``, docs/format.md §2.2) are kept: an alias this publisher publishes as
        a tensor of its own is given its tensor's changes in the published file (the delta object published is
        then a new one); the others are listed by this step's entry and files and by every later step's."""
        self._publish_delta(step, delta, recode=False)

    def _publish_delta(self, step: int, delta: Delta, *, recode: bool, checked: bool = False) -> None:
        """``publish_delta``; with ``recode`` the file published is ``delta`` re-encoded in the compact codec by the
        upload thread (as ``join_shards`` of it alone encodes it), for joined shard deltas; ``checked``: its base
        identities were just made from the mirror, which then skips their check."""
        self._check_open()
        self._raise_errors(step)
        self._check_step(step)
        if not isinstance(delta, Delta):
            raise DeltaSyncError(
                f"publish_delta takes a deltasync_rs.Delta (ds.load reads one), not {type(delta).__name__}"
            )
        if self._mirror.is_empty:
            raise DeltaSyncError("publish a full state first: the publisher has no state to apply a delta to")
        if delta.base_step is None:
            delta.base_step = self._mirror.step
        self._wait_for_mirror()
        published, ties = delta, {}
        if delta.aliases:
            # Ties whose alias this publisher publishes as a tensor of its own: the alias gets its tensor's record
            # (so the mirror and the file both write it); the others are this publisher's ties from now on, listed
            # by every entry and file (docs/format.md §2.2).
            published = delta._with_ties(self._mirror.tensors)
            ties = self._ties(published.aliases, self._mirror.tensors)
        self._mirror.apply(published, check_base=not checked)
        # Only once the mirror took it: a refused delta leaves the caller's object and these ties as they were.
        self._mirror.step = step
        delta.step = published.step = step
        if ties:
            self._aliases.update(ties)
            published.aliases = ties
        self._enqueue(step, _Recode(published, "compact") if recode else published)

    def _ties(self, own: Mapping[str, str], tensors: Mapping[str, Any]) -> dict[str, str]:
        """``own`` ties and this publisher's, as a step publishing ``tensors`` lists them: each alias to a tensor
        that is published, and which is not one itself."""
        return {a: n for a, n in {**own, **self._aliases}.items() if n in tensors and a not in tensors}

    @one_at_a_time
    def publish_shards(
        self, step: int, parts: Sequence[Delta], *, proofs: Sequence[Sequence[ShardProof]] | None = None
    ) -> None:
        """Publishes the deltas of every shard of one step (an FSDP rank's each, in rank order; ``varint``, positions
        in the whole tensors' index space) joined into one delta in this publisher's codec. With
        ``codec="context"`` the joined positions are coded against the mirror this publisher keeps, the last
        published state, whole (which no shard holds), and every tensor records its base identity.

        Nothing is joined unless every shard started from that state. A part that starts at another step (its
        ``base_step``, where known) is refused, BaseMismatchError: the shards' mirrors moved on without this
        publisher (a publish that raised). And every element of the last published state must be vouched for: by a
        part's own record of a whole tensor's base identity (as :func:`deltasync_rs.diff` writes), by a part that
        stores the tensor whole (it depends on no base), or by one of
        ``proofs[rank]``, ``(name, first element, elements, base identity)``: what that rank's mirror held over a
        range of a tensor before the step (``ds.torch.Mirror.last_bases``, which the scan hashes as it compares).
        Each is checked against the same range of this publisher's state; a range that differs (a rank's mirror
        drifted, or a step failed part way on it), a tensor or range nobody vouches for, or a tensor this
        publisher does not hold, is refused with BaseMismatchError naming it, before anything is published. Re-anchor
        from the shards' state then (:meth:`reanchor`; ``ds.torch.attach`` does)."""
        from ._core import join_shards

        self._check_open()
        self._raise_errors(step)
        if self._mirror.is_empty:
            raise DeltaSyncError("publish a full state first: the publisher has no state to join shard deltas against")
        if proofs is not None and len(proofs) != len(parts):
            raise DeltaSyncError(f"{len(proofs)} lists of proofs for {len(parts)} shard deltas: one per shard delta")
        self._check_step(step)  # first: a step not after the last is no reason to re-anchor
        for rank, part in enumerate(parts):
            if part.base_step is not None and part.base_step != self._mirror.step:
                raise BaseMismatchError(
                    f"shard delta {rank} starts at step {part.base_step}, but this publisher's last published state "
                    f"is step {self._mirror.step}: the shards moved on without it (did a publish raise?); re-anchor "
                    "from the shards' state"
                )
        # `context` joins against the whole bases, which records their identities itself.
        identities = self._check_proofs(parts, proofs or [()] * len(parts), identities=self.codec != "context")
        if self.codec == "context":
            # Coded against the whole last published state, which the mirror holds only until the delta moves it.
            bases = [(name, _arrays.host_bytes(tensor)[0]) for name, tensor in self._mirror.tensors.items()]
            self.publish_delta(step, Delta(join_shards([part._raw for part in parts], self.codec, bases)))
            return
        # Joined as the parts are, applied to the mirror so; the upload thread re-encodes the joined delta in this
        # publisher's codec (every rank waits for this call to return).
        joined = Delta(join_shards([part._raw for part in parts], "varint", identities=identities))
        # Its bases are the identities of this mirror's tensors, just hashed: not checked again by the apply.
        self._publish_delta(step, joined, recode=self.codec == "compact", checked=True)

    def _check_proofs(
        self, parts: Sequence[Delta], proofs: Sequence[Sequence[ShardProof]], *, identities: bool = True
    ) -> list[tuple[str, str]]:
        """Checks that the shards vouch for every element of the last published state, and truly (publish_shards):
        the coverage first, then every range's identity, all hashed in one call. Returns the base identity of each
        whole tensor that a part records a change of (not stored whole), for the joined delta to record: from the
        same hashes where its ranges start on 256 KiB blocks of the tensor (FSDP's shards of most weights), the
        tensor hashed in the same call otherwise (none without ``identities``)."""
        from ._core import base_identity_from_blocks, range_block_hashes

        # name -> (first, end, identity, rank); no identity where a part stores the tensor whole (it then does not
        # depend on the base at all).
        spans: dict[str, list[tuple[int, int, str | None, int]]] = {}
        based: set[str] = set()  # tensors a part records not stored whole: the joined delta records their bases
        for rank, (part, listed) in enumerate(zip(parts, proofs, strict=True)):
            raw = part._raw
            for index, (name, _, shape, _, positions, values, *_) in enumerate(raw.tensors()):
                if positions != "all" or values != "abs":
                    based.add(name)
                identity = raw.base_identity(index)
                if shape is not None and (identity is not None or positions == "all"):
                    spans.setdefault(name, []).append((0, math.prod(shape), identity, rank))
            for proof in listed:
                try:
                    name, first, elements, identity = proof
                    first, elements = operator.index(first), operator.index(elements)
                except (TypeError, ValueError) as error:
                    raise DeltaSyncError(
                        f"shard {rank}: a proof is (name, first element, elements, base identity), not {proof!r}"
                    ) from error
                spans.setdefault(name, []).append((first, first + elements, identity, rank))
        step = self._mirror.step
        checks: list[tuple[str, int, int, str, int]] = []  # (name, first, end, identity sent, rank)
        ranges: list[tuple[Any, int, int]] = []  # the published bytes of each, for range_block_hashes
        wholes: dict[str, list[int] | None] = {}  # name -> its tiling checks' indices, or None: hashed whole
        whole_ranges: list[tuple[Any, int, int]] = []  # the tensors hashed whole, in order
        for name, tensor in self._mirror.tensors.items():
            data = _arrays.flat_host_bytes(tensor)
            numel = math.prod(_arrays.describe(tensor, name)[1])
            width = len(data) // numel if numel else 0
            covered, gap_end = 0, numel
            tiles: list[int] | None = []  # the checks that tile the tensor, each from a block boundary
            for first, end, identity, rank in sorted(spans.pop(name, []), key=lambda span: span[:2]):
                if first > covered:
                    gap_end = first
                    break
                if not 0 <= first <= end <= numel:
                    raise BaseMismatchError(
                        f"tensor {name!r}: shard {rank} vouches for elements {first} to {end} of a tensor of {numel}"
                    )
                if tiles is not None and (identity is None or first != covered or (first * width) % BLOCK_BYTES):
                    tiles = None
                if identity is not None:
                    if tiles is not None:
                        tiles.append(len(checks))
                    checks.append((name, first, end, identity, rank))
                    ranges.append((data, first * width, (end - first) * width))
                covered = max(covered, end)
            if covered < gap_end:
                raise BaseMismatchError(
                    f"tensor {name!r}: no shard vouches for elements {covered} to {gap_end} of the last published "
                    f"state (step {step}): every shard delta must come with proofs of what its mirror held "
                    "(ds.torch.Mirror.last_bases)"
                )
            if identities and name in based:
                wholes[name] = tiles if tiles else None
                if not tiles:
                    whole_ranges.append((data, 0, len(data)))
        if spans:
            raise BaseMismatchError(
                f"shard deltas hold tensors the last published state (step {step}) does not: {sorted(spans)[:5]}"
            )
        hashes = range_block_hashes(ranges + whole_ranges)
        for (name, first, end, identity, rank), blocks in zip(checks, hashes, strict=False):
            found = base_identity_from_blocks(blocks, b"")
            if found != identity:
                raise BaseMismatchError(
                    f"tensor {name!r}: shard {rank} did not start from the last published state (step {step}) "
                    f"over elements {first} to {end} (base identity {identity} sent, {found} published): its "
                    "mirror drifted, or a step failed part way on it; re-anchor from the shards' state"
                )
        extra = iter(hashes[len(checks) :])
        return [
            (name, base_identity_from_blocks(b"".join(hashes[i] for i in tiles) if tiles else next(extra), b""))
            for name, tiles in wholes.items()
        ]

    @one_at_a_time
    def publish_shared(
        self,
        step: int,
        tensors: Mapping[str, Any],
        advance: Callable[[], Delta | _Deferred] | None = None,
        *,
        read_only: bool = False,
        resume: bool = False,
        aliases: Mapping[str, str] | None = None,
    ) -> None:
        """Publishes from a mirror the caller keeps (ds.torch.Mirror), shared rather than copied.

        ``aliases`` (the mirror's): names the model ties to a tensor of ``tensors``, which are not published as
        tensors of their own; every manifest entry lists them, so that a subscriber whose target holds such a name
        as a tensor of its own gets it written too.

        The first call (the publisher has no state yet) publishes ``tensors`` as ``step``; with ``read_only`` they
        may be read-only arrays (a mapped checkpoint, as ``deltasync publish`` of an anchor does), which the
        publisher then only reads: it publishes that step alone (later steps are refused), and the caller keeps
        the arrays unchanged until ``flush`` or ``close`` returns. With ``resume``, a first call at a step the store
        already holds as ``tensors`` (same state digest; a trainer restarted from the checkpoint of a step it
        published) resumes there instead (:meth:`resume`: steps after it are removed) and publishes nothing; the
        store holding that step as another state is an IntegrityError. Later calls run
        ``advance()`` only once the step is checked and earlier uploads are known good; it must move ``tensors`` to
        ``step`` and return the delta from the last published state. If the publisher holds its own copy (after
        ``resume``), ``tensors`` must equal it (checked by digest) and replace it; without ``advance`` that is all."""
        self._check_open()
        self._raise_errors(step)
        _published_state(tensors, "the shared mirror")
        if aliases is not None:
            bad = [(a, n) for a, n in aliases.items() if a in tensors or n not in tensors]
            if bad:
                raise DeltaSyncError(f"aliases {bad[:3]}: each must name a tensor not published to one that is")
            aliases = check_ties(aliases)  # names every file of a step can carry (docs/format.md §2.2)
        # Taken only once the mirror is accepted (a refused one must not leave its ties behind); None keeps them.
        accept = (lambda: setattr(self, "_aliases", dict(aliases))) if aliases is not None else (lambda: None)
        if self._mirror.is_empty:
            if resume and self._resume_at_published(step, tensors):
                accept()
                return
            self._check_step(step)
            self._mirror.share(tensors, step=step, read_only=read_only)
            accept()
            self._enqueue(step, None)
            return
        if self._mirror.tensors is not tensors:
            if state_digest(tensors) != self._mirror.digest():
                raise DeltaSyncError("the shared mirror does not hold the last published state")
            self._mirror.share(tensors, step=self._mirror.step)
        accept()
        if advance is None:
            if step != self._mirror.step:
                raise DeltaSyncError(f"the shared mirror is at step {self._mirror.step}, not {step}: pass advance()")
            return
        self._check_step(step)
        self._wait_for_mirror()
        delta = self._advance(step, advance)
        if delta is not None:
            delta.base_step = self._mirror.step
            delta.step = step
        self._mirror.step = step
        self._enqueue(step, delta)

    @one_at_a_time
    def reanchor(self, step: int, state: Mapping[str, Any], *, copy: bool = True) -> None:
        """Publishes ``state`` as ``step`` as an anchor (no delta), and makes it the state later deltas start from:
        for when the last published state is no base for a delta any more (FSDP shards whose mirrors no longer hold
        it: :meth:`publish_shards` refuses them, and ``ds.torch.attach`` re-anchors this way). With ``copy=False``
        the publisher adopts ``state``'s tensors (contiguous, writable CPU tensors or arrays the caller no longer
        uses) instead of copying them."""
        self._check_open()
        self._raise_errors(step)
        self._check_step(step)
        _published_state(state, "state")
        self._wait_for_mirror()
        if copy:
            self._mirror.reset(state, step=step)
        else:
            self._mirror.share(dict(state), step=step)
        self._torn = False
        self._enqueue(step, None)

    def _wait_for_mirror(self) -> None:
        """Waits until no upload job reads the mirror (an anchor, a state digest), so the mirror may change."""
        while not self._mirror_free.wait(0.1):
            if self._worker is None or not self._worker.is_alive():
                raise DeltaSyncError(
                    f"{self.store.url}: the upload thread stopped while reading the mirror (an anchor or the state digest)"
                )

    def _enqueue(self, step: int, delta: Delta | _Deferred | _Recode | None) -> None:
        due = delta is None or self._since_anchor + 1 >= self.anchor_every
        # The anchor and the state digest are made later, in the upload job, from the mirror itself (the tensors
        # of this step: a reset replaces the mapping, and every change in place waits for _mirror_free), so that
        # publish returns once the delta is made: the digest's read of the whole state is off the caller's path.
        tensors = dict(self._mirror.tensors)
        self._since_anchor = 0 if due else self._since_anchor + 1
        job = (step, delta, tensors, due, self._mirror_elements())
        if self._queue is None:
            self._upload(*job)
            return
        self._mirror_free.clear()
        try:
            while True:  # never wait on a full queue that no thread drains any more
                if self._worker is None or not self._worker.is_alive():
                    raise DeltaSyncError(f"{self.store.url}: the upload thread stopped; step {step} was not published")
                try:
                    self._queue.put((self, job), timeout=0.1)
                    return
                except queue.Full:
                    continue
        except BaseException:
            # Not queued (the upload thread is gone, or an interrupt): no upload will read the mirror or free it.
            # The step is lost; the next one is published as an anchor (its delta's base has no entry).
            self._mirror_free.set()
            raise

    def _mirror_elements(self) -> int:
        return sum(math.prod(_arrays.describe(t, name)[1]) for name, t in self._mirror.tensors.items())

    def _run_job(self, job: tuple[Any, ...]) -> None:
        if self._abandoned:  # the process is ending without close(): nothing more is started
            self._errors.append(DeltaSyncError(f"step {job[0]}: not uploaded, the process ended first"))
            return
        try:
            self._upload(*job)
        except BaseException as error:  # kept for flush(); the next publish re-anchors
            log.error("publishing step %s failed: %s", job[0], error)
            self._errors.append(error)
            self._since_anchor = self.anchor_every

    def _put(self, key: str, blob: bytes) -> None:
        self._retrying(key, lambda: self.store.put(key, blob))

    def _put_entry(self, step: int, blob: bytes) -> None:
        """Writes step's entry where the store has none (``Store.create``: atomic on a local folder and S3); one
        already there is this publisher's own only when it is ``blob`` (a write that landed, then failed)."""
        key = entry_key(step)

        def create() -> None:
            if not self.store.create(key, blob) and self.store.get_small(key, MAX_DOCUMENT_BYTES) != blob:
                raise self._published_elsewhere(step)

        self._retrying(key, create)

    def _published_elsewhere(self, step: int) -> DeltaSyncError:
        return DeltaSyncError(
            f"{self.store.url}: step {step} was published meanwhile by another publisher ({entry_key(step)} is in "
            "the store, not this publisher's): this publisher's step is not published; a store takes one "
            "publisher at a time"
        )

    def _put_file(self, key: str, path: str) -> None:
        self._retrying(key, lambda: self.store.put_file(key, path))

    def _retrying(self, key: str, write: Callable[[], object]) -> None:
        """Calls ``write`` up to ``retries`` times, backing off after each StoreError; the last one is raised."""
        for attempt in range(self.retries):
            try:
                write()
                return
            except StoreError as error:
                if attempt + 1 == self.retries or isinstance(error, UploadCancelled) or self._abandoned:
                    raise
                log.warning("writing %s failed (%s); retrying", key, error)
                time.sleep(0.05 * 2**attempt)

    def _anchor_file(
        self, tensors: Mapping[str, Any], step: int, aliases: Mapping[str, str]
    ) -> tuple[str, dict[str, Any], str, bytes | None]:
        """Writes the anchor of ``tensors`` into a new temporary file (in the store's own folder when it has one,
        so a local store links it in place) and returns its path, its manifest reference, the state digest and its
        pieces sidecar (None without ``piece_bytes``), all hashed in the same pass. The caller frees the mirror
        (``_upload``). The pieces options are read once, here: the training thread may set them while the file is
        being written, and the hashes, the sidecar and the reference must agree."""
        piece_bytes, piece_hash = self.piece_bytes or 0, self.piece_hash
        whole_sha256 = self.whole_sha256 or not piece_bytes
        folder = self.store.staging_folder()
        if folder is None:  # a private file in TMPDIR, uploaded, then unlinked (those of killed publishers removed)
            fd, path = private_temp()
            os.close(fd)
        else:  # the store's own folder (linked in place), whose writers remove what killed ones left
            path = os.path.join(folder, f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}.tmp")
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666))
        try:
            size, sha256, digest, hashes = write_anchor_pieces(
                tensors,
                path,
                step=step,
                piece_bytes=piece_bytes,
                piece_hash=piece_hash,
                whole_sha256=whole_sha256,
                early_writeback=True,  # the store's put_file fsyncs it (a local store), or reads it to upload
                aliases=aliases,
            )
        except BaseException:
            remove_temp(path)
            raise
        ref: dict[str, Any] = {"key": anchor_key(step), "size": size}
        if sha256 is not None:
            ref["sha256"] = sha256
        sidecar = None
        if piece_bytes:
            sidecar = pieces_document(size, piece_bytes, hashes, piece_hash)
            ref["pieces"] = file_ref(pieces_key(step), sidecar) | {"piece_bytes": piece_bytes}
        return path, ref, digest, sidecar

    def _upload(
        self,
        step: int,
        delta: Delta | _Deferred | _Recode | None,
        tensors: Mapping[str, Any],
        anchor: bool,
        elements: int,
    ) -> None:
        """Publishes one step: the anchor (when due) and the state digest from the mirror's ``tensors``, which
        stay unchanged until ``_mirror_free`` is set again, then the files, the entry and the pointer."""
        started = time.perf_counter()
        delta_ref = anchor_ref = None
        anchor_path = sidecar = None
        if not anchor and delta is not None and (self._base_entry or (None,))[0] != delta.base_step:
            # The step this delta starts from has no entry (its upload failed after the mirror was free, so this
            # step was queued before that was known): publish this step as an anchor too, so that subscribers need
            # not wait for the next one.
            anchor = True
        try:
            if isinstance(delta, (_Deferred, _Recode)):
                # The delta's encoding was left to this thread (the caller returned once the mirror moved); it reads
                # the mirror, which holds this step until _mirror_free is set.
                delta = delta.complete(tensors)
            # The ties, in the entry and in every file of the step (docs/format.md §2.2), so that a file applied
            # without its entry (an explicit path) still says which names it writes under another's.
            aliases = self._ties(delta.aliases if delta is not None else {}, tensors)
            if delta is not None and delta.aliases != aliases:  # publish_delta set a caller's delta's already
                delta.aliases = aliases
            if anchor:
                # The anchor's own pass over the mirror also gives the state digest.
                anchor_path, anchor_ref, digest, sidecar = self._anchor_file(tensors, step, aliases)
            else:
                digest = state_digest(tensors)
        except BaseException:
            # This step is lost: the next publish, which waits for the mirror, must be an anchor (the next delta
            # would start from a step that has no entry). Said before the mirror is free, so that it sees it.
            self._since_anchor = self.anchor_every
            raise
        finally:
            self._mirror_free.set()
        try:
            # One publisher per store: a step another one published meanwhile is not written over (its files would
            # no longer match its entry). Checked again, atomically where the store can, as the entry is written.
            if self.store.exists(entry_key(step)):
                raise self._published_elsewhere(step)
            if delta is not None:
                blob = delta.to_bytes()
                delta_ref = file_ref(delta_key(step), blob)
                self._put(delta_key(step), blob)
            if anchor_path is not None:
                self._put_file(anchor_key(step), anchor_path)
            if sidecar is not None:
                self._put(pieces_key(step), sidecar)
        finally:
            if anchor_path is not None:
                remove_temp(anchor_path)
        base_step = delta.base_step if delta is not None else None
        # A base entry that was never written (its upload failed) leaves the link empty: subscribers then take
        # the anchor that follows such a failure.
        base_entry = self._base_entry[1] if self._base_entry and self._base_entry[0] == base_step else None
        entry = Entry(
            step=step,
            base_step=base_step,
            delta=delta_ref,
            anchor=anchor_ref,
            state_digest=digest,
            num_changed=delta.num_changed if delta else elements,
            num_elements=elements,
            created=time.time(),
            run=self.run,
            base_entry_sha256=base_entry,
            aliases=aliases or None,
        )
        entry_blob = entry.to_json(self._key)
        self._put_entry(step, entry_blob)
        self._base_entry = (step, hashlib.sha256(entry_blob).hexdigest())
        self._put(LATEST_KEY, latest_document(step, entry_blob, self.run, self._key))
        kinds = " + ".join(kind for kind, ref in (("delta", delta_ref), ("anchor", anchor_ref)) if ref)
        log.info("published step %d (%s) in %.2f s", step, kinds, time.perf_counter() - started)
        if anchor:
            try:
                self._retain(step)
            except Exception as error:  # the step is published: a store that refuses deletes only grows
                log.warning("step %d is published, but the steps before it could not be removed: %s", step, error)

    def _retain(self, step: int) -> None:
        """After the anchor of ``step``: removes what comes before the oldest of the newest ``keep_anchors``
        anchors up to ``step`` (never counting an anchor of a later step, which is not of this run's history, nor
        one whose entry was never written, which no reader can use)."""
        keys = self.store.list("anchors/") + self.store.list("deltas/") + self.store.list("manifest/")
        entries = {s for k in keys if k.startswith("manifest/") and (s := step_of(k)) is not None} | {step}
        anchors = sorted(
            {
                s
                for k in keys
                if k.startswith("anchors/") and (s := step_of(k)) is not None and s <= step and s in entries
            }
        )
        if len(anchors) <= self.keep_anchors:
            return
        cutoff = anchors[-self.keep_anchors]
        old = [k for k in keys if (s := step_of(k)) is not None and s < cutoff]
        # Entries go first, so no reader follows an entry to a file that is already gone.
        self.store.delete(sorted(k for k in old if k.startswith("manifest/")))
        self.store.delete(sorted(k for k in old if not k.startswith("manifest/")))
        log.info("retention: removed %d objects before step %d", len(old), cutoff)

    def _raise_errors(self, step: int | None = None) -> None:
        """Raises what earlier uploads raised, once; ``step``: the step of the call that raises it, which is then
        not published either."""
        if self._errors:
            errors, self._errors = self._errors, []
            this = "" if step is None else f"; step {step} was not published either"
            raise DeltaSyncError(f"{len(errors)} publish(es) failed; the first: {errors[0]}{this}") from errors[0]

    def flush(self, timeout: float | None = None) -> None:
        """Waits for every queued upload (at most ``timeout`` seconds); raises if any failed, if the wait ran out,
        or if the upload thread is gone with uploads still pending."""
        self._check_process()
        if self._queue is not None:
            deadline = None if timeout is None else time.monotonic() + timeout
            with self._queue.all_tasks_done:
                while self._queue.unfinished_tasks:
                    left = None if deadline is None else deadline - time.monotonic()
                    if self._worker is None or not self._worker.is_alive():
                        raise DeltaSyncError(
                            f"{self.store.url}: the upload thread stopped with "
                            f"{self._queue.unfinished_tasks} upload(s) pending; they are lost"
                        )
                    if left is not None and left <= 0:
                        raise DeltaSyncError(
                            f"{self.store.url}: {self._queue.unfinished_tasks} upload(s) still "
                            f"pending after {timeout} s"
                        )
                    self._queue.all_tasks_done.wait(0.1 if left is None else min(0.1, left))
        self._raise_errors()

    @one_at_a_time
    def close(self) -> None:
        """Flushes, then stops the upload thread. Publishing after this raises DeltaSyncError. In a process forked
        from the one that made it, only marks it closed: its uploads are that process's."""
        if self._closed:
            return
        self._closed = True
        _open_publishers.discard(self)
        if self._in_a_forked_child():
            return
        try:
            self.flush()
        finally:
            if self._queue is not None and self._worker is not None and self._worker.is_alive():
                self._queue.put(None)
                self._worker.join()

    def _close_at_exit(self) -> None:
        """Waits up to ``exit_timeout`` for pending uploads; says so loudly when some are lost. Not in a forked
        child: the uploads are its parent's, which makes them (the child reported them lost, and aborted the
        parent's uploads in flight)."""
        if self._closed or self._in_a_forked_child():
            return
        self._closed = True
        try:
            self.flush(timeout=self.exit_timeout)
        except DeltaSyncError as error:
            # The process ends with the upload thread mid-upload: what it opened in the bucket is aborted, and the
            # thread neither tries it again nor starts the next.
            self._abandoned = True
            abort_uploads_in_flight(self.store)
            message = (
                f"deltasync: the publisher of {self.store.url} was not closed, and at exit not everything "
                f"it published reached the store: {error}"
            )
            if log.hasHandlers():  # else logging's last resort would print it to stderr a second time
                log.error(message)
            print(message, file=sys.stderr, flush=True)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop_drain(jobs: queue.Queue) -> None:
    """Ends the upload thread of a publisher that was collected (its queue is then empty: each job held it)."""
    with contextlib.suppress(queue.Full):
        jobs.put_nowait(None)


def _drain(jobs: queue.Queue) -> None:
    """A background publisher's upload thread: runs each queued ``(publisher, job)`` in order until it gets None
    (from ``close``, or from the publisher's finalizer). Between jobs it holds no reference to the publisher."""
    while True:
        item = jobs.get()
        try:
            if item is None:
                return
            item[0]._run_job(item[1])
        finally:
            item = None  # not held while waiting for the next job
            jobs.task_done()


_open_publishers: weakref.WeakSet[Publisher] = weakref.WeakSet()


@atexit.register
def _flush_open_publishers() -> None:
    # The upload threads are daemons: without this wait, interpreter exit would drop their pending uploads.
    for publisher in list(_open_publishers):
        publisher._close_at_exit()


__all__ = ["Publisher"]
