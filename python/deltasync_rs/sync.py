"""The sync protocol: a Publisher writes anchors, deltas and signed manifest entries to a store; any number of
Subscribers pull, verify and replay them. Layout and manifest are specified in docs/format.md §10."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import _arrays
from .delta import Delta, anchor, load, state_digest
from .errors import ChainError, DeltaFormatError, DeltaSyncError, IntegrityError, MissingObjectError, StoreError
from .mirror import Mirror
from .store import Store, open_store

log = logging.getLogger("deltasync_rs.sync")

MANIFEST_FORMAT = "deltasync-manifest"
LATEST_FORMAT = "deltasync-latest"
PROTOCOL_VERSION = 1
LATEST_KEY = "latest.json"
_STEP_KEY = re.compile(r"^(manifest|deltas|anchors)/step_(\d{12})\.(json|safetensors)$")


def entry_key(step: int) -> str:
    return f"manifest/step_{step:012d}.json"


def delta_key(step: int) -> str:
    return f"deltas/step_{step:012d}.safetensors"


def anchor_key(step: int) -> str:
    return f"anchors/step_{step:012d}.safetensors"


def step_of(key: str) -> int | None:
    match = _STEP_KEY.match(key)
    return int(match.group(2)) if match else None


def _signing_key(key: bytes | str | None) -> bytes | None:
    if key is None:
        key = os.environ.get("DELTASYNC_SIGNING_KEY") or None
    if key is None:
        return None
    return key.encode() if isinstance(key, str) else bytes(key)


def _canonical(document: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in document.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign(document: dict[str, Any], key: bytes | None) -> dict[str, Any]:
    """Adds an HMAC-SHA256 `signature` over the canonical JSON of every other field."""
    if key is not None:
        document["signature"] = hmac.new(key, _canonical(document), hashlib.sha256).hexdigest()
    return document


def verify_signature(document: Mapping[str, Any], key: bytes | None, what: str) -> None:
    if key is None:
        return
    signature = document.get("signature")
    if not isinstance(signature, str):
        raise IntegrityError(f"{what} is not signed, but a signing key is set")
    expected = hmac.new(key, _canonical(document), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(signature, expected):
        raise IntegrityError(f"{what} has a bad signature")


def _file_ref(key: str, blob: bytes) -> dict[str, Any]:
    return {"key": key, "size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}


@dataclass(frozen=True)
class Entry:
    """One manifest entry: a published step, its files, and the digest of the state it produces."""

    step: int
    base_step: int | None
    delta: dict[str, Any] | None
    anchor: dict[str, Any] | None
    state_digest: str
    num_changed: int
    num_elements: int
    created: float

    @classmethod
    def parse(cls, raw: bytes, key: str, signing_key: bytes | None) -> Entry:
        try:
            document = json.loads(raw)
            if not isinstance(document, dict) or document.get("format") != MANIFEST_FORMAT:
                raise ValueError("not a deltasync manifest entry")
            if document.get("version") != PROTOCOL_VERSION:
                raise ValueError(f"unsupported manifest version {document.get('version')!r}")
            verify_signature(document, signing_key, key)
            entry = cls(
                step=int(document["step"]),
                base_step=None if document["base_step"] is None else int(document["base_step"]),
                delta=document["delta"],
                anchor=document["anchor"],
                state_digest=str(document["state_digest"]),
                num_changed=int(document["num_changed"]),
                num_elements=int(document["num_elements"]),
                created=float(document["created"]),
            )
        except IntegrityError:
            raise
        except (ValueError, KeyError, TypeError) as error:
            raise DeltaFormatError(f"{key}: malformed manifest entry: {error}") from error
        if entry_key(entry.step) != key:
            raise DeltaFormatError(f"{key}: the entry is for step {entry.step}")
        for ref, expected in ((entry.delta, delta_key(entry.step)), (entry.anchor, anchor_key(entry.step))):
            if ref is not None and (ref.get("key") != expected or not isinstance(ref.get("sha256"), str)):
                raise DeltaFormatError(f"{key}: bad file reference {ref!r}")
        if entry.delta is None and entry.anchor is None:
            raise DeltaFormatError(f"{key}: the entry names no file")
        if entry.delta is not None and entry.base_step is None:
            raise DeltaFormatError(f"{key}: a delta entry needs a base step")
        return entry

    def to_json(self, signing_key: bytes | None) -> bytes:
        document = {
            "format": MANIFEST_FORMAT,
            "version": PROTOCOL_VERSION,
            "step": self.step,
            "base_step": self.base_step,
            "delta": self.delta,
            "anchor": self.anchor,
            "state_digest": self.state_digest,
            "num_changed": self.num_changed,
            "num_elements": self.num_elements,
            "created": self.created,
        }
        return json.dumps(sign(document, signing_key), indent=1, sort_keys=True).encode()


def _latest_document(step: int, entry_blob: bytes, signing_key: bytes | None) -> bytes:
    document = {"format": LATEST_FORMAT, "version": PROTOCOL_VERSION, "step": step,
                "entry_sha256": hashlib.sha256(entry_blob).hexdigest()}
    return json.dumps(sign(document, signing_key), sort_keys=True).encode()


def _progress(total: int, description: str):
    """A tqdm bar on an interactive terminal, else None: quiet in logs, pipes and CI."""
    if total <= 1 or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=description, unit="file", file=sys.stderr, leave=False)


class Publisher:
    """Publishes a training run's states to a store: an anchor first and every ``anchor_every`` publishes, and a
    delta against the last published state for every publish after the first (anchor steps get both, so no
    delta is ever dropped). Uploads run in a background thread; ``flush()`` waits and raises any upload error.

    ``store`` is a path (the local-folder default), an ``s3://``/``gs://`` URL, ``hf://buckets/ORG/NAME/PREFIX``,
    or a :class:`Store`. ``signing_key`` (or ``DELTASYNC_SIGNING_KEY``) signs every manifest entry with
    HMAC-SHA256. ``keep_anchors`` anchors are kept, with the deltas after the oldest of them; older files are
    deleted.
    """

    def __init__(self, store: str | os.PathLike[str] | Store, *, anchor_every: int = 10, keep_anchors: int = 2,
                 values: str = "diff", signing_key: bytes | str | None = None, background: bool = True,
                 max_pending: int = 2, retries: int = 3) -> None:
        if anchor_every < 1 or keep_anchors < 1:
            raise DeltaSyncError("anchor_every and keep_anchors must be at least 1")
        if values not in ("diff", "abs"):
            raise DeltaSyncError(f'values must be "diff" or "abs", not {values!r}')
        self.store = open_store(store)
        self.anchor_every = anchor_every
        self.keep_anchors = keep_anchors
        self.values = values
        self.retries = retries
        self._key = _signing_key(signing_key)
        self._mirror = Mirror()
        self._since_anchor = 0
        self._errors: list[BaseException] = []
        self._last_step = self._store_latest_step()
        self._queue: queue.Queue | None = None
        self._worker: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=max(1, max_pending))
            self._worker = threading.Thread(target=self._drain, name="deltasync-publisher", daemon=True)
            self._worker.start()

    def _store_latest_step(self) -> int | None:
        try:
            document = json.loads(self.store.get(LATEST_KEY))
            return int(document["step"])
        except MissingObjectError:
            return None
        except (ValueError, KeyError, TypeError):
            return None

    @property
    def step(self) -> int | None:
        """The last step handed to publish (uploaded, or queued for upload)."""
        return self._mirror.step

    def _check_step(self, step: int) -> None:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise DeltaSyncError(f"step must be a non-negative integer, not {step!r}")
        last = self._mirror.step if self._mirror.step is not None else self._last_step
        if last is not None and step <= last:
            raise DeltaSyncError(f"step {step} is not after the last published step {last}")

    def publish(self, step: int, state: Mapping[str, Any]) -> None:
        """Publishes ``state`` as ``step``: a delta against the last published state, and an anchor when due.
        The state is diffed (or copied) before this returns, so training may change it right after."""
        self._raise_errors()
        self._check_step(step)
        if self._mirror.is_empty:
            self._mirror.reset(state, step=step)
            self._enqueue(step, None)
            return
        delta = self._mirror.advance(state, step=step, values=self.values)
        self._enqueue(step, delta)

    def resume(self, state: Mapping[str, Any], *, step: int) -> None:
        """Starts from ``state`` as already published at ``step`` (e.g. pulled back from the store), so the next
        publish is a delta against it rather than a first anchor."""
        if not self._mirror.is_empty:
            raise DeltaSyncError("resume must come before the first publish")
        self._mirror.reset(state, step=step)
        self._last_step = step
        # Keep the anchor cadence across publisher restarts: count the steps published since the newest anchor.
        anchors = [s for k in self.store.list("anchors/") if (s := step_of(k)) is not None and s <= step]
        newest = max(anchors, default=None)
        if newest is None:
            self._since_anchor = self.anchor_every
        else:
            entries = {s for k in self.store.list("manifest/") if (s := step_of(k)) is not None}
            self._since_anchor = sum(1 for s in entries if newest < s <= step)

    def publish_delta(self, step: int, delta: Delta) -> None:
        """Publishes a delta made elsewhere (e.g. by the trainer's mirror) against the last published state."""
        self._raise_errors()
        self._check_step(step)
        if self._mirror.is_empty:
            raise DeltaSyncError("publish a full state first: the publisher has no state to apply a delta to")
        if delta.base_step is None:
            delta.base_step = self._mirror.step
        self._mirror.apply(delta)
        self._mirror.step = step
        delta.step = step
        self._enqueue(step, delta)

    def publish_shared(self, step: int, tensors: Mapping[str, Any], advance: Callable[[], Delta] | None = None) -> None:
        """Publishes from a mirror the caller keeps (ds.torch.Mirror), shared rather than copied.

        The first call (the publisher has no state yet) publishes ``tensors`` as ``step``. Later calls run
        ``advance()`` only once the step is checked and earlier uploads are known good; it must move ``tensors`` to
        ``step`` and return the delta from the last published state. If the publisher holds its own copy (after
        ``resume``), ``tensors`` must equal it (checked by digest) and replace it; without ``advance`` that is all."""
        self._raise_errors()
        if self._mirror.is_empty:
            self._check_step(step)
            self._mirror.share(tensors, step=step)
            self._enqueue(step, None)
            return
        if self._mirror.tensors is not tensors:
            if state_digest(tensors) != self._mirror.digest():
                raise DeltaSyncError("the shared mirror does not hold the last published state")
            self._mirror.share(tensors, step=self._mirror.step)
        if advance is None:
            if step != self._mirror.step:
                raise DeltaSyncError(f"the shared mirror is at step {self._mirror.step}, not {step}: pass advance()")
            return
        self._check_step(step)
        delta = advance()
        delta.base_step = self._mirror.step
        delta.step = step
        self._mirror.step = step
        self._enqueue(step, delta)

    def _enqueue(self, step: int, delta: Delta | None) -> None:
        due = delta is None or self._since_anchor + 1 >= self.anchor_every
        full = anchor(self._mirror.tensors, step=step) if due else None
        self._since_anchor = 0 if due else self._since_anchor + 1
        job = (step, delta, full, self._mirror.digest(), self._mirror_elements())
        if self._queue is None:
            self._upload(*job)
        else:
            self._queue.put(job)

    def _mirror_elements(self) -> int:
        return sum(math.prod(_arrays.describe(t, name)[1]) for name, t in self._mirror.tensors.items())

    def _drain(self) -> None:
        assert self._queue is not None
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._upload(*job)
            except BaseException as error:  # kept for flush(); the next publish re-anchors
                log.error("publishing step %s failed: %s", job[0] if job else "?", error)
                self._errors.append(error)
                self._since_anchor = self.anchor_every
            finally:
                self._queue.task_done()

    def _put(self, key: str, blob: bytes) -> None:
        for attempt in range(self.retries):
            try:
                self.store.put(key, blob)
                return
            except StoreError as error:
                if attempt + 1 == self.retries:
                    raise
                log.warning("writing %s failed (%s); retrying", key, error)
                time.sleep(0.05 * 2**attempt)

    def _upload(self, step: int, delta: Delta | None, full: Delta | None, digest: str, elements: int) -> None:
        started = time.perf_counter()
        delta_ref = anchor_ref = None
        if delta is not None:
            blob = delta.to_bytes()
            delta_ref = _file_ref(delta_key(step), blob)
            self._put(delta_key(step), blob)
        if full is not None:
            blob = full.to_bytes()
            anchor_ref = _file_ref(anchor_key(step), blob)
            self._put(anchor_key(step), blob)
        entry = Entry(step=step, base_step=delta.base_step if delta is not None else None, delta=delta_ref,
                      anchor=anchor_ref, state_digest=digest, num_changed=delta.num_changed if delta else elements,
                      num_elements=elements, created=time.time())
        entry_blob = entry.to_json(self._key)
        self._put(entry_key(step), entry_blob)
        self._put(LATEST_KEY, _latest_document(step, entry_blob, self._key))
        kinds = " + ".join(kind for kind, ref in (("delta", delta_ref), ("anchor", anchor_ref)) if ref)
        log.info("published step %d (%s) in %.2f s", step, kinds, time.perf_counter() - started)
        if full is not None:
            self._retain()

    def _retain(self) -> None:
        keys = self.store.list("anchors/") + self.store.list("deltas/") + self.store.list("manifest/")
        anchors = sorted({s for k in keys if k.startswith("anchors/") and (s := step_of(k)) is not None})
        if len(anchors) <= self.keep_anchors:
            return
        cutoff = anchors[-self.keep_anchors]
        old = [k for k in keys if (s := step_of(k)) is not None and s < cutoff]
        # Entries go first, so no reader follows an entry to a file that is already gone.
        self.store.delete(sorted(k for k in old if k.startswith("manifest/")))
        self.store.delete(sorted(k for k in old if not k.startswith("manifest/")))
        log.info("retention: removed %d objects before step %d", len(old), cutoff)

    def _raise_errors(self) -> None:
        if self._errors:
            errors, self._errors = self._errors, []
            raise DeltaSyncError(f"{len(errors)} publish(es) failed; the first: {errors[0]}") from errors[0]

    def flush(self) -> None:
        """Waits for every queued upload; raises if any failed."""
        if self._queue is not None:
            self._queue.join()
        self._raise_errors()

    def close(self) -> None:
        """Flushes, then stops the upload thread."""
        try:
            self.flush()
        finally:
            if self._queue is not None and self._worker is not None and self._worker.is_alive():
                self._queue.put(None)
                self._worker.join()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Subscriber:
    """Pulls a store's published steps into a state, verifying every file and signature on the way.

    ``pull(state)`` brings a mapping of tensors to the newest step, in place and bit-exact: from the newest anchor
    when the subscriber is fresh or too far behind, else by replaying the deltas it missed. Every file's SHA-256
    and (with ``signing_key`` or ``DELTASYNC_SIGNING_KEY``) every manifest signature is checked before use; a
    failed read is retried, then the newest anchor is tried, and ChainError is raised only when no consistent
    chain exists.
    """

    def __init__(self, store: str | os.PathLike[str] | Store, *, signing_key: bytes | str | None = None,
                 retries: int = 3, retry_delay: float = 0.02) -> None:
        self.store = open_store(store)
        self.retries = max(1, retries)
        self.retry_delay = retry_delay
        self.step: int | None = None
        self._key = _signing_key(signing_key)
        self._entries: dict[int, Entry] = {}
        self._names: list[str] | None = None

    # -- reading with verification ------------------------------------------------------------------------------
    def _retry(self, what: str, read: Callable[[], Any]) -> Any:
        for attempt in range(self.retries):
            try:
                return read()
            except MissingObjectError:
                if attempt + 1 == self.retries:
                    raise
            except (StoreError, IntegrityError, DeltaFormatError) as error:
                if attempt + 1 == self.retries:
                    raise
                log.warning("reading %s failed (%s); retrying", what, error)
            time.sleep(self.retry_delay * 2**attempt)
        raise AssertionError("unreachable")

    def latest_step(self) -> int | None:
        """The newest published step, or None for an empty store."""
        def read() -> int:
            document = json.loads(self.store.get(LATEST_KEY))
            if not isinstance(document, dict) or document.get("format") != LATEST_FORMAT:
                raise DeltaFormatError(f"{LATEST_KEY}: not a deltasync latest pointer")
            verify_signature(document, self._key, LATEST_KEY)
            return int(document["step"])

        try:
            return self._retry(LATEST_KEY, read)
        except MissingObjectError:
            return None
        except (ValueError, KeyError, TypeError) as error:
            raise DeltaFormatError(f"{LATEST_KEY}: malformed: {error}") from error

    def entry(self, step: int) -> Entry:
        """The verified manifest entry of ``step``."""
        if step not in self._entries:
            key = entry_key(step)
            self._entries[step] = self._retry(key, lambda: Entry.parse(self.store.get(key), key, self._key))
        return self._entries[step]

    def _file(self, ref: dict[str, Any], step: int, kind: str) -> Delta:
        def read() -> Delta:
            blob = self.store.get(ref["key"])
            if len(blob) != ref.get("size") or hashlib.sha256(blob).hexdigest() != ref["sha256"]:
                raise IntegrityError(f"{ref['key']}: content does not match the digest in its manifest entry")
            delta = load(blob)
            if delta.step is not None and delta.step != step:
                raise IntegrityError(f"{ref['key']}: the file says step {delta.step}, its entry step {step}")
            if kind == "anchor" and not delta.is_anchor:
                raise IntegrityError(f"{ref['key']}: not an anchor")
            return delta

        return self._retry(ref["key"], read)

    # -- planning ---------------------------------------------------------------------------------------------------
    def _walk_back(self, target: int, floor: int, stop: Callable[[Entry], bool]) -> list[Entry]:
        """Entries from ``target`` back to the first one where ``stop`` holds (never below ``floor``), oldest first."""
        chain = []
        step: int | None = target
        while step is not None and step >= floor:
            entry = self.entry(step)
            chain.append(entry)
            if stop(entry):
                return chain[::-1]
            if entry.delta is None:
                break
            step = entry.base_step
        raise ChainError(f"no chain of deltas from step {target} back to the required start")

    def _fetch_to(self, current: int | None, target: int) -> list[Delta]:
        """Downloads a verified way to ``target``: the missed deltas when ``current`` is on the chain, else the newest
        usable anchor and the deltas after it. Each way is tried in turn until one reads back whole."""
        errors: list[Exception] = []
        plans: list[Callable[[], tuple[Entry | None, list[Entry]]]] = []
        if current is not None:
            plans.append(lambda: (None, self._walk_back(target, current + 1,
                                                        lambda e: e.base_step == current and e.delta is not None)))

        def from_anchor(anchor_step: int) -> tuple[Entry | None, list[Entry]]:
            chain = self._walk_back(target, anchor_step, lambda e: e.step == anchor_step)
            if chain[0].anchor is None:
                raise ChainError(f"step {anchor_step} has no anchor entry")
            return chain[0], chain[1:]

        anchors = sorted({s for k in self.store.list("anchors/") if (s := step_of(k)) is not None and s <= target},
                         reverse=True)
        plans.extend(lambda a=a: from_anchor(a) for a in anchors)
        for plan in plans:
            try:
                return self._download(*plan())
            except (ChainError, StoreError, IntegrityError, DeltaFormatError) as error:
                errors.append(error)
        detail = f": {errors[-1]}" if errors else " (the store holds no anchor)"
        raise ChainError(f"no consistent chain leads to step {target}{detail}")

    def fetch(self, current_step: int | None, *, until: int | None = None) -> list[Delta]:
        """Verified deltas that bring a state at ``current_step`` (None: no state yet) to the newest step, or to
        ``until``: an anchor first when needed, then deltas in order; [] when already there."""
        latest = self.latest_step()
        if latest is None:
            if current_step is None:
                raise ChainError(f"{self.store.url}: nothing has been published yet")
            return []
        targets = [min(latest, until) if until is not None else latest]
        last_error: Exception | None = None
        tried = 0
        while targets:
            target = targets.pop(0)
            if current_step is not None and target <= current_step:
                if tried:
                    break  # nothing newer than where we are can be reached: that is an error, not "up to date"
                return []
            try:
                return self._fetch_to(current_step, target)
            except ChainError as error:
                last_error = error
                tried += 1
                log.warning("no usable chain to step %d: %s", target, error)
                if tried == 1:  # the newest step is unreachable: fall back to older published steps
                    listed = {s for k in self.store.list("manifest/") if (s := step_of(k)) is not None}
                    targets = sorted((s for s in listed if s < target), reverse=True)[:8]
        raise ChainError(f"{self.store.url}: no consistent chain from step {current_step}: {last_error}")

    def _download(self, anchor_entry: Entry | None, chain: list[Entry]) -> list[Delta]:
        bar = _progress(len(chain) + (anchor_entry is not None), "pull")
        out = []
        try:
            if anchor_entry is not None:
                out.append(self._file(anchor_entry.anchor, anchor_entry.step, "anchor"))
                if bar is not None:
                    bar.update()
            for entry in chain:
                delta = self._file(entry.delta, entry.step, "delta")
                if delta.base_step is not None and delta.base_step != entry.base_step:
                    raise IntegrityError(f"{entry.delta['key']}: base step {delta.base_step} differs from its entry")
                delta.step, delta.base_step = entry.step, entry.base_step
                out.append(delta)
                if bar is not None:
                    bar.update()
        finally:
            if bar is not None:
                bar.close()
        return out

    # -- applying -----------------------------------------------------------------------------------------------------
    def pull(self, state: Any, *, until: int | None = None) -> int:
        """Brings ``state`` (a mapping of tensors, modified in place) to the newest step and returns that step.
        Each delta is applied all-or-nothing; when ``state`` holds every published tensor, its digest is checked
        against the manifest, and a mismatch re-syncs from the newest anchor before raising IntegrityError."""
        deltas = self.fetch(self.step, until=until)
        if not deltas:
            if self.step is None:
                raise ChainError(f"{self.store.url}: nothing to pull")
            return self.step
        self._apply_all(state, deltas)
        if self._verify(state):
            return self.step
        log.warning("state digest mismatch at step %d; re-syncing from the newest anchor", self.step)
        self._apply_all(state, self.fetch(None, until=self.step))
        if not self._verify(state):
            raise IntegrityError(f"state digest at step {self.step} does not match the manifest after a re-sync")
        return self.step

    def _apply_all(self, state: Any, deltas: list[Delta]) -> None:
        for delta in deltas:
            delta.apply_(state)
            if delta.is_anchor:
                self._names = delta.names
            self.step = delta.step

    def _verify(self, state: Any) -> bool:
        if self.step is None or self._names is None or not isinstance(state, Mapping):
            return True
        if any(name not in state for name in self._names):
            return True  # a partial state (a shard) cannot be checked against the whole-state digest
        return state_digest({name: state[name] for name in self._names}) == self.entry(self.step).state_digest


def log_entries(store: str | os.PathLike[str] | Store, *, signing_key: bytes | str | None = None) -> list[Entry]:
    """Every readable manifest entry of a store, oldest first."""
    subscriber = Subscriber(store, signing_key=signing_key, retries=1)
    steps = sorted({s for k in subscriber.store.list("manifest/") if (s := step_of(k)) is not None})
    return [subscriber.entry(step) for step in steps]


def verify_store(store: str | os.PathLike[str] | Store, *, signing_key: bytes | str | None = None) -> list[str]:
    """Checks every entry's signature, every file's digest and that each delta's base is published or retained;
    returns the problems found (empty when all is well)."""
    subscriber = Subscriber(store, signing_key=signing_key, retries=1)
    problems = []
    steps = sorted({s for k in subscriber.store.list("manifest/") if (s := step_of(k)) is not None})
    for step in steps:
        try:
            entry = subscriber.entry(step)
            for ref, kind in ((entry.delta, "delta"), (entry.anchor, "anchor")):
                if ref is not None:
                    subscriber._file(ref, step, kind)
            if entry.delta is not None and entry.base_step not in steps and step != steps[0]:
                problems.append(f"step {step}: its base step {entry.base_step} is not in the store")
        except DeltaSyncError as error:
            problems.append(f"step {step}: {error}")
    latest = None
    try:
        latest = subscriber.latest_step()
    except DeltaSyncError as error:
        problems.append(f"{LATEST_KEY}: {error}")
    if latest is not None and latest not in steps:
        problems.append(f"{LATEST_KEY} names step {latest}, which has no entry")
    return problems


__all__ = ["Entry", "Publisher", "Subscriber", "log_entries", "verify_store"]
