"""Shared test helpers: bit-level equality, state copies, and scenarios run in another virtualenv."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    """The tensor's bit patterns as an integer tensor/array, so NaN payloads and -0.0 compare exactly."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t).view(f"u{t.dtype.itemsize}") if t.dtype.itemsize > 0 else t
    return t.detach().cpu().contiguous().view(INT_VIEW[t.element_size()])


def assert_bits_equal(a, b, name=""):
    if isinstance(a, np.ndarray):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert np.array_equal(bits(a), bits(b)), f"{name}: bit patterns differ"
    else:
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(bits(a), bits(b)), f"{name}: bit patterns differ"


def assert_states_equal(a, b):
    assert list(a) == list(b)
    for name in a:
        assert_bits_equal(a[name], b[name], name)


def clone_state(state):
    return {k: (v.copy() if isinstance(v, np.ndarray) else v.clone()) for k, v in state.items()}


def run_scenario(python, setup: str, script: str, *args: str, timeout: int, logs=None, **environment: str) -> dict:
    """Runs ``tests/<script>`` with another virtualenv's ``python`` (skipped, naming the ``make`` target ``setup``,
    when it is missing) and returns the JSON of its last ``RESULT`` line; on failure, prints the end of its output
    and of every ``*.log`` under ``logs``, and fails the test."""
    if not Path(python).exists():
        pytest.skip(f"no environment at {python}: run `make {setup}`")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONUNBUFFERED="1", **environment)
    env.pop("VLLM_TARGET_DEVICE", None)  # the CPU build knows its platform
    process = subprocess.run(
        [str(python), str(root / "tests" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=root,
    )
    results = [line for line in process.stdout.splitlines() if line.startswith("RESULT ")]
    if process.returncode != 0 or not results:
        sys.stderr.write(process.stdout[-20000:] + process.stderr[-20000:])
        for log in sorted(Path(logs).glob("*.log")) if logs is not None else []:
            sys.stderr.write(f"--- {log.name}\n" + log.read_text(errors="replace")[-5000:])
        pytest.fail(f"{script} {' '.join(args)} failed (rc {process.returncode}); its output is above")
    return json.loads(results[-1].removeprefix("RESULT "))


def counting_store(root):
    """A LocalStore over an existing folder that counts, in its ``read`` Counter, the bytes each key gave through
    every read method (whole, small, to a file, by range, opened to be read in place)."""
    from collections import Counter

    import deltasync_rs as ds

    class Counting(ds.LocalStore):
        def get(self, key):
            data = super().get(key)
            self.read[key] += len(data)
            return data

        def get_small(self, key, max_bytes):
            data = super().get_small(key, max_bytes)
            self.read[key] += len(data)
            return data

        def get_file(self, key, out):
            done = super().get_file(key, out)
            self.read[key] += done
            return done

        def get_range(self, key, start, length):
            data = super().get_range(key, start, length)
            self.read[key] += len(data)
            return data

        def open_local(self, key):  # opened to be read in place: every reader of it reads it whole
            file = super().open_local(key)
            self.read[key] += os.fstat(file.fileno()).st_size
            return file

    store = Counting(root, create=False)
    store.read = Counter()
    return store


def file_checksum(blob: bytes) -> str:
    """The checksum a delta file's ``file_xxh3`` must hold (docs/format.md §2.1), written here from the spec: the
    base identity (§3.1) of the whole file with the value's 16 digits read as ``0``."""
    import xxhash

    value = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])["__metadata__"]["file_xxh3"]
    pattern = f'"file_xxh3":"{value}"'.encode()
    assert blob.count(pattern) == 1
    at = blob.index(pattern) + len(b'"file_xxh3":"')
    zeroed = blob[:at] + b"0" * 16 + blob[at + 16 :]
    blocks = range(0, len(zeroed), 1 << 18)
    hashes = b"".join(xxhash.xxh3_64_intdigest(zeroed[i : i + (1 << 18)]).to_bytes(8, "little") for i in blocks)
    return f"{xxhash.xxh3_64_intdigest(hashes):016x}"


def reseal(blob: bytes) -> bytes:
    """``blob`` (a delta file changed by a test) with its checksum made right again, as a writer that made those
    bytes would have written it: so that the change meets the check a test aims at, not the checksum. A file
    without one is given back as it is."""
    length = int.from_bytes(blob[:8], "little")
    metadata = json.loads(blob[8 : 8 + length]).get("__metadata__") or {}
    if "file_xxh3" not in metadata:
        return blob
    pattern = f'"file_xxh3":"{metadata["file_xxh3"]}"'.encode()
    at = blob.index(pattern) + len(b'"file_xxh3":"')
    zeroed = blob[:at] + b"0" * 16 + blob[at + 16 :]
    return zeroed[:at] + file_checksum(zeroed).encode() + zeroed[at + 16 :]


def without_checksum(blob: bytes) -> bytes:
    """``blob`` without its file checksum (docs/format.md §2.1), byte for byte as a writer that writes none lays it
    out: an older writer's delta, or an anchor laid out in memory (``ds.anchor(...).to_bytes()``) as a publisher
    streams it into its store, whose header is written before the tensors."""
    length = int.from_bytes(blob[:8], "little")
    header = blob[8 : 8 + length].rstrip(b" ")
    value = json.loads(header)["__metadata__"]["file_xxh3"]
    entry = f'"file_xxh3":"{value}"'.encode()
    header = header.replace(entry + b",", b"") if entry + b"," in header else header.replace(b"," + entry, b"")
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + blob[8 + length :]


def malformed_for_the_apply(blob: bytes) -> bytes:
    """``blob`` with one of its last bytes changed so that it loads with check="apply" (the streams' headers are
    sound) but a full check refuses it: a stream only the apply finds malformed. The checksum is made right (as
    by a writer that wrote that stream), or the load would refuse the file before any stream is looked at."""
    import deltasync_rs as ds

    for back in range(1, 256):
        bad = bytearray(blob)
        bad[-back] ^= 0xFF
        bad = bytearray(reseal(bytes(bad)))
        try:
            ds.load(bytes(bad))
        except ds.DeltaFormatError:
            try:
                ds.load(bytes(bad), check="apply")
            except ds.DeltaFormatError:
                continue
            return bytes(bad)
    raise AssertionError("no change of the last bytes that only the apply finds")


@contextlib.contextmanager
def subscriber_reads_malformed(sha256: str) -> Iterator[dict[str, int]]:
    """While open, the subscriber reads the file whose SHA-256 is ``sha256`` as ``malformed_for_the_apply`` of it:
    a file that matches its manifest entry although the publisher wrote a malformed stream (the change is made after
    the digest check). Yields how many times it was read with the check left to the apply ("deferred") and with
    every check at load ("checked")."""
    import deltasync_rs.subscriber as subscriber_module

    real_load, seen = subscriber_module.load, {"deferred": 0, "checked": 0}

    def load(source, *, check="load", **options):
        if isinstance(source, (bytes, bytearray, memoryview)) and hashlib.sha256(source).hexdigest() == sha256:
            seen["deferred" if check == "apply" else "checked"] += 1
            source = malformed_for_the_apply(bytes(source))
        return real_load(source, check=check, **options)

    subscriber_module.load = load
    try:
        yield seen
    finally:
        subscriber_module.load = real_load


def completion_threads(monkeypatch, kind: str) -> list[str]:
    """The names of the threads that complete each deferred delta (``kind``: "_Deferred" or "_Recode", in
    deltasync_rs.delta), recorded in the list returned, in order."""
    import threading

    import deltasync_rs.delta as delta_module

    cls = getattr(delta_module, kind)
    names: list[str] = []
    complete = cls.complete

    def recording(self, tensors):
        names.append(threading.current_thread().name)
        return complete(self, tensors)

    monkeypatch.setattr(cls, "complete", recording)
    return names


def piece_hashes(data: bytes, piece: int, algorithm: str = "blake3") -> bytes:
    """Each piece's hash, by an implementation other than the core's (hashlib's SHA-256, the blake3 package)."""
    import blake3

    hash_ = (lambda b: hashlib.sha256(b).digest()) if algorithm == "sha256" else (lambda b: blake3.blake3(b).digest())
    return b"".join(hash_(data[i : i + piece]) for i in range(0, len(data), piece))


def republish_anchor(root: Path, step: int, blob: bytes, state_digest: str | None = None) -> None:
    """Replaces the anchor of ``step`` in the local store at ``root`` by ``blob`` with everything that vouches for it
    made to agree, as a buggy or hostile publisher of an unsigned store would: its pieces sidecar, its manifest
    entry (and ``state_digest`` there, when given), the entries chained after it and latest.json."""
    from deltasync_rs.manifest import PIECES_MAGICS, entry_key, pieces_document

    root = Path(root)
    entry = json.loads((root / entry_key(step)).read_text())
    ref = entry["anchor"]
    sidecar = root / ref["pieces"]["key"]
    algorithm = PIECES_MAGICS[sidecar.read_bytes()[:8]]
    piece = ref["pieces"]["piece_bytes"]
    pieces = pieces_document(len(blob), piece, piece_hashes(blob, piece, algorithm), algorithm)
    (root / ref["key"]).write_bytes(blob)
    sidecar.write_bytes(pieces)
    ref["size"] = len(blob)
    if "sha256" in ref:
        ref["sha256"] = hashlib.sha256(blob).hexdigest()
    ref["pieces"].update(size=len(pieces), sha256=hashlib.sha256(pieces).hexdigest())
    if state_digest is not None:
        entry["state_digest"] = state_digest
    (root / entry_key(step)).write_text(json.dumps(entry))
    relink(root, step)


def relink(root: Path, step: int) -> None:
    """After entry ``step`` of the local store at ``root`` was rewritten: the entries after it name it (and each
    other) again by SHA-256, and latest.json names its step's entry again, as the publisher would have written them."""
    import deltasync_rs as ds
    from deltasync_rs.manifest import entry_key, listed_steps

    root = Path(root)

    def sha256(s: int) -> str:
        return hashlib.sha256((root / entry_key(s)).read_bytes()).hexdigest()

    for step_after in [s for s in listed_steps(ds.LocalStore(root, create=False)) if s > step]:
        successor = json.loads((root / entry_key(step_after)).read_text())
        if successor.get("base_step") is not None:
            successor["base_entry_sha256"] = sha256(successor["base_step"])
        (root / entry_key(step_after)).write_text(json.dumps(successor))
    latest = json.loads((root / "latest.json").read_text())
    latest["entry_sha256"] = sha256(latest["step"])
    (root / "latest.json").write_text(json.dumps(latest))


def without_base(blob: bytes, name: str) -> bytes:
    """``blob`` (a delta file) with tensor ``name``'s record holding no ``base`` identity (docs/format.md §3), as a
    writer that recorded none for it lays it out (``join_shards`` without the publisher's state, an older writer);
    its checksum made right again."""
    length = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + length])
    records = json.loads(header["__metadata__"]["tensors"])
    assert any(record["name"] == name and record.pop("base", None) for record in records), name
    header["__metadata__"]["tensors"] = json.dumps(records, separators=(",", ":"))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return reseal(len(raw).to_bytes(8, "little") + raw + blob[8 + length :])
