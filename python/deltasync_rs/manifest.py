"""docs/format.md §10 as code: store keys, signing keys and signatures, capped depth-safe JSON documents, manifest
entries, the `latest.json` pointer and the store's run id (`run.json`)."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ._core import alias_problem, piece_hash
from .errors import DeltaFormatError, DeltaSyncError, IntegrityError, shown
from .store import Store

MANIFEST_FORMAT = "deltasync-manifest"
LATEST_FORMAT = "deltasync-latest"
RUN_FORMAT = "deltasync-run"
#: The sync protocol version of ``run.json``, ``latest.json`` and of a manifest entry every reader reads.
PROTOCOL_VERSION = 1
#: The version of a manifest entry whose anchor has no whole-file SHA-256 (its pieces sidecar checks it): readers
#: before it refuse such an entry by its version (docs/format.md §10, §11).
PIECES_ONLY_VERSION = 2
LATEST_KEY = "latest.json"
RUN_KEY = "run.json"
MAX_DOCUMENT_BYTES = 1 << 20
MAX_DEPTH = 32
#: Step numbers are written with at least 12 digits (zero-padded), up to 20 for steps up to 2**64 - 1: a key with
#: more than 12 digits and a leading zero is not one a publisher writes.
_STEP_KEY = re.compile(r"^(manifest|deltas|anchors)/step_(\d{12}|[1-9]\d{12,19})\.(json|safetensors|pieces)$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def entry_key(step: int) -> str:
    return f"manifest/step_{step:012d}.json"


def delta_key(step: int) -> str:
    return f"deltas/step_{step:012d}.safetensors"


def anchor_key(step: int) -> str:
    return f"anchors/step_{step:012d}.safetensors"


def pieces_key(step: int) -> str:
    """The key of an anchor's pieces sidecar (docs/format.md §10, anchor pieces)."""
    return f"anchors/step_{step:012d}.pieces"


#: The first bytes of a pieces sidecar, naming the hash of its pieces; then the anchor's size and the piece size
#: (u64 LE each), then the hashes, 32 bytes each.
PIECES_MAGICS = {b"DSPIECE1": "sha256", b"DSPIECE2": "blake3"}
PIECE_HASHES = {hash_: magic for magic, hash_ in PIECES_MAGICS.items()}
PIECES_HEADER_BYTES = 24
#: The hash of each piece the Publisher records by default: BLAKE3 (DSPIECE2), since sidecars were added.
DEFAULT_PIECE_HASH = "blake3"
#: The piece size the Publisher records by default, and the range a reader accepts (powers of two).
DEFAULT_PIECE_BYTES = 1 << 18
MIN_PIECE_BYTES = 1 << 10
MAX_PIECE_BYTES = 1 << 30


def pieces_size(anchor_size: int, piece_bytes: int) -> int:
    """The size in bytes of the sidecar of an anchor of ``anchor_size`` bytes cut in ``piece_bytes`` pieces."""
    return PIECES_HEADER_BYTES + 32 * -(-anchor_size // piece_bytes)


def check_piece_bytes(piece_bytes: int, where: str) -> int:
    if (
        isinstance(piece_bytes, bool)
        or not isinstance(piece_bytes, int)
        or not MIN_PIECE_BYTES <= piece_bytes <= MAX_PIECE_BYTES
        or piece_bytes & (piece_bytes - 1)
    ):
        raise DeltaFormatError(
            f"{where}: piece size {shown(piece_bytes)} is not a power of two from {MIN_PIECE_BYTES} to {MAX_PIECE_BYTES}"
        )
    return piece_bytes


def check_piece_hash(piece_hash: str, where: str) -> str:
    if not isinstance(piece_hash, str) or piece_hash not in PIECE_HASHES:
        raise DeltaSyncError(f"{where}: piece hash {shown(piece_hash)} is not one of {sorted(PIECE_HASHES)}")
    return piece_hash


def pieces_document(anchor_size: int, piece_bytes: int, hashes: bytes, piece_hash: str = DEFAULT_PIECE_HASH) -> bytes:
    """The sidecar of an anchor: magic (naming ``piece_hash``), its size and the piece size (u64 LE), then each
    piece's hash."""
    if len(hashes) != 32 * -(-anchor_size // piece_bytes):
        raise DeltaSyncError(f"{len(hashes) // 32} piece hashes for {anchor_size} bytes in pieces of {piece_bytes}")
    magic = PIECE_HASHES[check_piece_hash(piece_hash, "pieces sidecar")]
    return magic + anchor_size.to_bytes(8, "little") + piece_bytes.to_bytes(8, "little") + hashes


@dataclass(frozen=True)
class Pieces:
    """An anchor's pieces sidecar, read and checked: the anchor's size, the piece size, the hash its magic names
    ("sha256" or "blake3") and each piece's hash."""

    size: int
    piece_bytes: int
    hashes: bytes
    algorithm: str = DEFAULT_PIECE_HASH

    @classmethod
    def parse(cls, raw: bytes, anchor: Mapping[str, Any]) -> Pieces:
        """The sidecar ``raw`` of the anchor ``anchor`` (its entry's reference, with ``pieces``): the caller has
        checked ``raw`` against the reference's size and SHA-256; this checks that it describes that anchor."""
        ref = anchor["pieces"]
        key = ref["key"]
        piece_hash = PIECES_MAGICS.get(bytes(raw[:8]))
        if len(raw) < PIECES_HEADER_BYTES or piece_hash is None:
            raise IntegrityError(f"{key}: not a pieces sidecar (or one of a later version: its magic is {raw[:8]!r})")
        size = int.from_bytes(raw[8:16], "little")
        piece_bytes = int.from_bytes(raw[16:24], "little")
        if size != anchor["size"] or piece_bytes != ref["piece_bytes"]:
            raise IntegrityError(f"{key}: describes {size} bytes in pieces of {piece_bytes}, not its anchor")
        if len(raw) != pieces_size(size, piece_bytes):
            raise IntegrityError(f"{key}: {len(raw)} bytes, not one hash per piece")
        return cls(size, piece_bytes, bytes(raw[PIECES_HEADER_BYTES:]), piece_hash)

    @property
    def count(self) -> int:
        return len(self.hashes) // 32

    def span(self, index: int) -> tuple[int, int]:
        """The byte range [start, end) of piece ``index`` in the anchor."""
        start = index * self.piece_bytes
        return start, min(start + self.piece_bytes, self.size)

    def mismatch(self, index: int, key: str) -> IntegrityError:
        """The error for piece ``index`` of the anchor ``key`` not matching the sidecar."""
        start, end = self.span(index)
        return IntegrityError(f"{key}: bytes {start}..{end} (piece {index}) do not match its pieces sidecar")

    def check(self, index: int, data: bytes | memoryview, key: str) -> None:
        """Raises IntegrityError unless ``data`` is piece ``index`` of the anchor ``key``."""
        start, end = self.span(index)
        if len(data) != end - start or piece_hash(data, self.algorithm) != self.hashes[32 * index : 32 * index + 32]:
            raise self.mismatch(index, key)

    def check_all(self, hashes: bytes, key: str) -> None:
        """Raises IntegrityError unless ``hashes`` (every piece's hash of a file of the anchor's size, in order)
        are the sidecar's, naming the first piece that differs."""
        if hashes == self.hashes:
            return
        for index in range(self.count):
            if hashes[32 * index : 32 * index + 32] != self.hashes[32 * index : 32 * index + 32]:
                raise self.mismatch(index, key)
        raise IntegrityError(f"{key}: {len(hashes) // 32} pieces, its pieces sidecar lists {self.count}")


def step_of(key: str) -> int | None:
    match = _STEP_KEY.match(key)
    step = int(match.group(2)) if match else None
    return step if step is not None and step < 2**64 else None


def listed_steps(store: Store) -> list[int]:
    """The steps that have a manifest entry in the store, oldest first."""
    return sorted({s for k in store.list("manifest/") if (s := step_of(k)) is not None})


def resolve_signing_key(key: bytes | str | None) -> bytes | None:
    """The HMAC key: ``key``, else ``DELTASYNC_SIGNING_KEY``, else None (unsigned). An empty key is an error, so
    a variable that is set but empty never turns verification off without a word."""
    if key is None:
        key = os.environ.get("DELTASYNC_SIGNING_KEY")
        if key is None:
            return None
        if not key:
            raise DeltaSyncError("DELTASYNC_SIGNING_KEY is set but empty: set a key, or unset it to work unsigned")
    if isinstance(key, str):
        key = key.encode()
    elif isinstance(key, (bytes, bytearray, memoryview)):
        key = bytes(key)
    else:
        raise DeltaSyncError(f"signing_key must be bytes or str, not {type(key).__name__}")
    if not key:
        raise DeltaSyncError("signing_key is empty: pass a key, or None to work unsigned")
    return key


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
    # compare_digest raises TypeError on a str with non-ASCII characters: such a signature is simply wrong.
    if not (signature.isascii() and hmac.compare_digest(signature, expected)):
        raise IntegrityError(f"{what} has a bad signature")


# A JSON string, read possessively so that no input backtracks; brackets inside strings do not nest. One that never
# closes runs to the end of the document (a lone backslash included): every quote that starts a string is then read
# once, where a string that could fail would be tried again from each quote inside it (quadratic: a 1 MiB document
# of `\"` took hours).
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.?)*+(?:"|\Z)', re.DOTALL)
_INNERMOST = re.compile(rb"\[[^\[\]{}]*\]|\{[^\[\]{}]*\}")
_BRACKET = re.compile(rb"[\[\]{}]")


#: The Unix time of 10000-01-01: an entry's `created` is below it (time.localtime refuses larger ones).
_YEAR_10000 = 253402300800


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def parse_document(
    raw: bytes, key: str, expected_format: str, versions: tuple[int, ...] = (PROTOCOL_VERSION,)
) -> dict[str, Any]:
    """A manifest document's JSON object: at most MAX_DOCUMENT_BYTES, nested at most MAX_DEPTH deep (checked before
    parsing, so no input reaches the parser's recursion limit), with the expected `format` and one of `versions`."""
    if len(raw) > MAX_DOCUMENT_BYTES:
        raise DeltaFormatError(f"{key}: larger than {MAX_DOCUMENT_BYTES} bytes")
    # Each pass removes the innermost bracket pairs: whatever is left after MAX_DEPTH passes nests deeper.
    skeleton = _JSON_STRING.sub(b'""', raw)
    for _ in range(MAX_DEPTH):
        skeleton, removed = _INNERMOST.subn(b"", skeleton)
        if not removed:
            # Brackets left that no pass could pair: a document cut short (or otherwise not JSON), not a deep one.
            if _BRACKET.search(skeleton):
                raise DeltaFormatError(f"{key}: not valid JSON: unbalanced brackets (a truncated document?)")
            break
    if _BRACKET.search(skeleton):
        raise DeltaFormatError(f"{key}: not JSON nested at most {MAX_DEPTH} deep")
    try:
        document = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as error:
        raise DeltaFormatError(f"{key}: not valid JSON: {error}") from None
    if not isinstance(document, dict) or document.get("format") != expected_format:
        raise DeltaFormatError(f"{key}: not a {expected_format} document")
    version = document.get("version")
    if type(version) is not int or version not in versions:
        known = ("versions " if len(versions) > 1 else "version ") + " and ".join(str(v) for v in versions)
        raise DeltaFormatError(
            f"{key}: unsupported version {version!r} (this reader knows {known}; a later deltasync-rs may have "
            "written it: upgrade the reader)"
        )
    return document


def _field(
    document: Mapping[str, Any], name: str, kind: type | tuple[type, ...], key: str, optional: bool = False
) -> Any:
    if name not in document:
        raise DeltaFormatError(f"{key}: the field {name!r} is missing")
    value = document[name]
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise DeltaFormatError(f"{key}: the field {name!r} is {shown(value)}, not a {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({int: "integer", float: "number", str: "string", dict: "JSON object"}[k] for k in kinds)


def _optional_count(document: Mapping[str, Any], name: str, key: str) -> int | None:
    value = _field(document, name, int, key, optional=True)
    if value is not None and not 0 <= value < 2**64:
        raise DeltaFormatError(f"{key}: the field {name!r} is {value}, outside 0 to 2**64-1")
    return value


def _count(document: Mapping[str, Any], name: str, key: str) -> int:
    value = _optional_count(document, name, key)
    if value is None:
        raise DeltaFormatError(f"{key}: the field {name!r} is null, not an integer")
    return value


def _aliases(document: Mapping[str, Any], key: str) -> dict[str, str] | None:
    """The optional ``aliases`` field: tied names the state holds as one tensor, each to the name it is published
    under (which is no alias itself)."""
    if "aliases" not in document:
        return None
    aliases = _field(document, "aliases", dict, key)
    for alias, name in aliases.items():
        if not isinstance(name, str) or not name or not alias or alias == name or name in aliases:
            raise DeltaFormatError(f"{key}: the field 'aliases' maps {alias!r} to {name!r}, not to a published name")
    # The names every file of the step carries too (docs/format.md §2.2): one no file may hold would make every
    # upload of a publisher that takes the ties on fail, and mean nothing to a reader.
    problem = alias_problem(aliases)
    if problem is not None:
        raise DeltaFormatError(f"{key}: the field {problem}")
    return dict(aliases)


def _hex_digest(document: Mapping[str, Any], name: str, key: str, optional: bool = False) -> str | None:
    value = _field(document, name, str, key, optional)
    if value is not None and not _HEX64.match(value):
        raise DeltaFormatError(f"{key}: the field {name!r} is not a lowercase hex SHA-256")
    return value


def _run_id(document: Mapping[str, Any], key: str) -> str | None:
    value = _field(document, "run", str, key, optional=True) if "run" in document else None
    if value is not None and not _RUN_ID.match(value):
        raise DeltaFormatError(f"{key}: the field 'run' is not 32 lowercase hex digits")
    return value


def _file_ref(document: Mapping[str, Any], name: str, expected_key: str, key: str) -> dict[str, Any] | None:
    ref = _field(document, name, dict, key, optional=True)
    if ref is None:
        return None
    where = f"{key} ({name})"
    if _field(ref, "key", str, where) != expected_key:
        raise DeltaFormatError(f"{where}: names {ref['key']!r}, not {expected_key!r}")
    _count(ref, "size", where)
    # From version 2 an anchor with a pieces sidecar may go without its whole-file SHA-256: the signed entry binds
    # the sidecar and the sidecar every piece. Without a sidecar the whole-file SHA-256 is the only check.
    pieces_only = name == "anchor" and "pieces" in ref and document["version"] >= PIECES_ONLY_VERSION
    if "sha256" in ref or not pieces_only:
        _hex_digest(ref, "sha256", where)
    if name == "anchor" and "pieces" in ref:
        pieces = _field(ref, "pieces", dict, where)
        step = step_of(expected_key)
        assert step is not None
        where = f"{where} (pieces)"
        if _field(pieces, "key", str, where) != pieces_key(step):
            raise DeltaFormatError(f"{where}: names {pieces['key']!r}, not {pieces_key(step)!r}")
        piece_bytes = check_piece_bytes(_count(pieces, "piece_bytes", where), where)
        if _count(pieces, "size", where) != pieces_size(ref["size"], piece_bytes):
            raise DeltaFormatError(f"{where}: the size {pieces['size']} is not that of one hash per piece")
        _hex_digest(pieces, "sha256", where)
    return ref


def file_ref(key: str, blob: bytes) -> dict[str, Any]:
    return {"key": key, "size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}


def check_run(found: str | None, expected: str | None, key: str) -> None:
    if found != expected:
        raise IntegrityError(f"{key}: belongs to run {shown(found)}, not to this store's run {expected!r} ({RUN_KEY})")


@dataclass(frozen=True)
class Entry:
    """One manifest entry: a published step, its files, the digest of the state it produces, the run it belongs to
    and the SHA-256 of its base step's entry. ``sha256`` is that of the entry's own bytes (not a field of it)."""

    step: int
    base_step: int | None
    delta: dict[str, Any] | None
    anchor: dict[str, Any] | None
    state_digest: str
    num_changed: int
    num_elements: int
    created: float
    run: str | None = None
    base_entry_sha256: str | None = None
    aliases: dict[str, str] | None = None
    sha256: str = field(default="", compare=False)

    @classmethod
    def parse(cls, raw: bytes, key: str, signing_key: bytes | None) -> Entry:
        """The entry in ``raw`` (read from ``key``), checked field by field and by signature; the caller checks
        its run with :func:`check_run`."""
        document = parse_document(raw, key, MANIFEST_FORMAT, (PROTOCOL_VERSION, PIECES_ONLY_VERSION))
        verify_signature(document, signing_key, key)
        step = _count(document, "step", key)
        if entry_key(step) != key:
            raise DeltaFormatError(f"{key}: the entry is for step {step}")
        try:
            created = float(_field(document, "created", (int, float), key))
        except OverflowError:
            created = math.inf
        if not math.isfinite(created) or not 0 <= created < _YEAR_10000:
            raise DeltaFormatError(
                f"{key}: the field 'created' is not a Unix time (a finite number from 0 to year 9999)"
            )
        entry = cls(
            step=step,
            base_step=_optional_count(document, "base_step", key),
            delta=_file_ref(document, "delta", delta_key(step), key),
            anchor=_file_ref(document, "anchor", anchor_key(step), key),
            state_digest=_field(document, "state_digest", str, key),
            num_changed=_count(document, "num_changed", key),
            num_elements=_count(document, "num_elements", key),
            created=created,
            run=_run_id(document, key),
            base_entry_sha256=(
                _hex_digest(document, "base_entry_sha256", key, optional=True)
                if "base_entry_sha256" in document
                else None
            ),
            aliases=_aliases(document, key),
            sha256=hashlib.sha256(raw).hexdigest(),
        )
        if entry.delta is None and entry.anchor is None:
            raise DeltaFormatError(f"{key}: the entry names no file")
        if entry.delta is not None and entry.base_step is None:
            raise DeltaFormatError(f"{key}: a delta entry needs a base step")
        if entry.base_step is not None and entry.base_step >= step:
            raise DeltaFormatError(f"{key}: base step {entry.base_step} is not before step {step}")
        return entry

    def to_json(self, signing_key: bytes | None) -> bytes:
        """The entry's document, signed with ``signing_key``: version 1, or 2 when its anchor has no whole-file
        SHA-256 (so readers that need one refuse the entry by its version rather than by a missing field)."""
        pieces_only = self.anchor is not None and "sha256" not in self.anchor
        document = {
            "format": MANIFEST_FORMAT,
            "version": PIECES_ONLY_VERSION if pieces_only else PROTOCOL_VERSION,
            "step": self.step,
            "base_step": self.base_step,
            "delta": self.delta,
            "anchor": self.anchor,
            "state_digest": self.state_digest,
            "num_changed": self.num_changed,
            "num_elements": self.num_elements,
            "created": self.created,
            "run": self.run,
            "base_entry_sha256": self.base_entry_sha256,
        }
        if self.aliases:
            document["aliases"] = dict(self.aliases)
        return json.dumps(sign(document, signing_key), indent=1, sort_keys=True).encode()


class Pointer(NamedTuple):
    """What `latest.json` claims: the newest step, the SHA-256 of its entry's bytes, and the run."""

    step: int
    entry_sha256: str
    run: str | None


def latest_document(step: int, entry_blob: bytes, run: str | None, signing_key: bytes | None) -> bytes:
    document = {
        "format": LATEST_FORMAT,
        "version": PROTOCOL_VERSION,
        "step": step,
        "run": run,
        "entry_sha256": hashlib.sha256(entry_blob).hexdigest(),
    }
    return json.dumps(sign(document, signing_key), sort_keys=True).encode()


def parse_latest(raw: bytes, signing_key: bytes | None) -> Pointer:
    document = parse_document(raw, LATEST_KEY, LATEST_FORMAT)
    verify_signature(document, signing_key, LATEST_KEY)
    digest = _hex_digest(document, "entry_sha256", LATEST_KEY)
    if digest is None:
        raise DeltaFormatError(f"{LATEST_KEY}: the field 'entry_sha256' is null")
    return Pointer(_count(document, "step", LATEST_KEY), digest, _run_id(document, LATEST_KEY))


def run_document(signing_key: bytes | None) -> bytes:
    """A new `run.json`: a random run id that every entry of this store will carry."""
    document = {"format": RUN_FORMAT, "version": PROTOCOL_VERSION, "run": secrets.token_hex(16), "created": time.time()}
    return json.dumps(sign(document, signing_key), sort_keys=True).encode()


def parse_run(raw: bytes, signing_key: bytes | None) -> str:
    document = parse_document(raw, RUN_KEY, RUN_FORMAT)
    verify_signature(document, signing_key, RUN_KEY)
    run = _run_id(document, RUN_KEY)
    if run is None:
        raise DeltaFormatError(f"{RUN_KEY}: the field 'run' is missing")
    return run


__all__ = [
    "LATEST_KEY",
    "MAX_DEPTH",
    "MAX_DOCUMENT_BYTES",
    "RUN_KEY",
    "DEFAULT_PIECE_BYTES",
    "DEFAULT_PIECE_HASH",
    "PIECES_ONLY_VERSION",
    "PROTOCOL_VERSION",
    "Entry",
    "Pieces",
    "Pointer",
    "anchor_key",
    "delta_key",
    "entry_key",
    "listed_steps",
    "parse_latest",
    "pieces_document",
    "pieces_key",
    "parse_run",
    "check_run",
    "check_piece_bytes",
    "check_piece_hash",
    "file_ref",
    "latest_document",
    "run_document",
    "resolve_signing_key",
    "step_of",
]
