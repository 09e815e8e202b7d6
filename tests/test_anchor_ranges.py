"""Anchor pieces and ranged anchor reads (docs/format.md §10, anchor pieces): the sidecar the Publisher writes, the
checks a reader makes before it keeps a byte, and compatibility with entries that have no pieces."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import deltasync_rs as ds
from deltasync_rs._ranged import PartialAnchor
from deltasync_rs.delta import write_anchor_pieces
from deltasync_rs.manifest import PIECES_HEADER_BYTES, Entry, anchor_key, entry_key, pieces_key
from tests.conftest import s3_store
from tests.helpers import counting_store, piece_hashes


def _state() -> dict[str, torch.Tensor]:
    """Made by arithmetic alone (no random generator), so its anchor's bytes are the same everywhere."""

    def values(rows: int, cols: int, seed: int) -> torch.Tensor:
        index = torch.arange(rows * cols, dtype=torch.float64)
        return (((index * (0.37 + seed)) % 5.0) - 2.5).reshape(rows, cols)

    state = {f"layer{i}.weight": values(96, 40 + 8 * i, i).to(torch.bfloat16) for i in range(5)}
    return state | {"norm.weight": values(1, 40, 9).reshape(40).to(torch.float32)}


def _published(tmp_path, piece_bytes=1024, state=None, piece_hash="blake3", whole_sha256=False):
    root = tmp_path / "store"
    options = {"piece_bytes": piece_bytes, "piece_hash": piece_hash, "whole_sha256": whole_sha256}
    with ds.Publisher(root, background=False, **options) as publisher:
        publisher.publish(3, state or _state())
    return root


def _first_tensor_only(tensors):
    return [(tensors[0].start, tensors[0].end)]


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_pieces_are_the_hash_of_each_piece_of_the_file(tmp_path, algorithm):
    path = tmp_path / "anchor"
    path.write_bytes(b"")
    state = _state()
    for piece in (1 << 10, 1 << 12, 1 << 20):
        size, sha256, digest, hashes = write_anchor_pieces(state, path, step=1, piece_bytes=piece, piece_hash=algorithm)
        data = path.read_bytes()
        assert data == ds.anchor(state, step=1).to_bytes() and size == len(data)
        assert sha256 == hashlib.sha256(data).hexdigest() and digest == ds.state_digest(state)
        assert hashes == piece_hashes(data, piece, algorithm)
        # Without the whole-file SHA-256 (protocol 2's default): the same file and pieces, no SHA-256.
        path.write_bytes(b"longer than the anchor is not" * 1000)
        options = {"step": 1, "piece_bytes": piece, "piece_hash": algorithm, "whole_sha256": False}
        assert write_anchor_pieces(state, path, **options) == (size, None, digest, hashes)
        assert path.read_bytes() == data
    with pytest.raises(ds.DeltaSyncError, match="needs pieces"):
        write_anchor_pieces(state, path, piece_bytes=0, whole_sha256=False)
    for bad in (0x300, 512, 3 << 10, 2 << 30):
        with pytest.raises(ds.DeltaSyncError, match="power of two"):
            write_anchor_pieces(state, path, piece_bytes=bad)
    with pytest.raises(ds.DeltaSyncError, match="power of two"):
        ds.Publisher(tmp_path / "s", piece_bytes=1000)


@pytest.mark.parametrize(
    "algorithm, magic, pinned",
    [
        ("sha256", b"DSPIECE1", "202dc2665f2abe717abbc7b35d6945ac5e351ca48823cb6393d4e681b27170ed"),
        ("blake3", b"DSPIECE2", "ef64ab1ed83b1a5d2bbdb1d5dcc43d35e741afe2048ca078971365953786ac19"),
    ],
)
def test_sidecar_layout_is_pinned(tmp_path, algorithm, magic, pinned):
    """The sidecar's bytes: a magic naming the hash (b"DSPIECE1": SHA-256, b"DSPIECE2": BLAKE3), the anchor's size
    and the piece size as u64 LE, then one hash per piece. The digest pins the whole chain (anchor bytes, piece cut,
    hash, layout) for this state."""
    root = _published(tmp_path, piece_hash=algorithm)
    entry = json.loads((root / entry_key(3)).read_bytes())
    anchor = (root / anchor_key(3)).read_bytes()
    sidecar = (root / pieces_key(3)).read_bytes()
    assert entry["anchor"]["pieces"] == {
        "key": pieces_key(3),
        "size": len(sidecar),
        "sha256": hashlib.sha256(sidecar).hexdigest(),
        "piece_bytes": 1024,
    }
    assert sidecar[:8] == magic
    assert int.from_bytes(sidecar[8:16], "little") == len(anchor)
    assert int.from_bytes(sidecar[16:24], "little") == 1024
    assert sidecar[PIECES_HEADER_BYTES:] == piece_hashes(anchor, 1024, algorithm)
    assert hashlib.sha256(sidecar).hexdigest() == pinned


def test_ranged_read_reads_only_the_pieces_it_needs_and_verifies_them(tmp_path):
    root = _published(tmp_path)
    store = counting_store(root)
    (delta,) = ds.Subscriber(store, anchor_ranges=_first_tensor_only).fetch(None)
    assert isinstance(delta, PartialAnchor) and delta.is_anchor and delta.step == 3
    size = (root / anchor_key(3)).stat().st_size
    assert store.read[anchor_key(3)] == delta.covered_bytes < size / 2
    first = delta.names[0]
    expected = ds.anchor(_state()).to_bytes()
    header_end = 8 + int.from_bytes(expected[:8], "little")
    begin, end = json.loads(expected[8:header_end])[first]["data_offsets"]
    assert delta.tensor_bytes(first, 0, end - begin) == expected[header_end + begin : header_end + end]
    last, (last_begin, last_end) = max(delta._offsets.items(), key=lambda item: item[1][0])
    with pytest.raises(ds.IntegrityError, match="not read and verified"):
        delta.require(last, last_end - last_begin - 2, last_end - last_begin)
    for refused in (lambda: delta.apply_(_state()), lambda: delta.to_bytes(), lambda: delta.save(tmp_path / "x")):
        with pytest.raises(ds.DeltaSyncError, match="only part of this anchor"):
            refused()
    # decoded() of a tensor not read gave its unread bytes as zeros (found by an adversarial helper); of one read
    # whole, its values.
    with pytest.raises(ds.IntegrityError, match=f"tensor {last!r} were not read and verified"):
        delta.decoded(delta.names.index(last))
    positions, values = delta.decoded(delta.names.index(first))
    assert positions is None and torch.equal(
        values.view(torch.uint8),
        torch.frombuffer(bytearray(expected[header_end + begin : header_end + end]), dtype=torch.uint8),
    )


def test_a_reader_that_needs_nearly_everything_reads_the_anchor_whole(tmp_path):
    root = _published(tmp_path)
    store = counting_store(root)
    (delta,) = ds.Subscriber(store, anchor_ranges=lambda tensors: [(t.start, t.end) for t in tensors]).fetch(None)
    assert not isinstance(delta, PartialAnchor)
    state = {k: torch.zeros_like(v) for k, v in _state().items()}
    delta.apply_(state)
    assert all(torch.equal(state[k], v) for k, v in _state().items())


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_a_needed_piece_is_refused(tmp_path):
    root = _published(tmp_path)
    _flip(root / anchor_key(3), (root / anchor_key(3)).stat().st_size // 8)
    with pytest.raises(ds.ChainError, match="do not match its pieces sidecar"):
        ds.Subscriber(root, retries=1, anchor_ranges=lambda ts: [(0, max(t.end for t in ts) // 2)]).fetch(None)
    # a byte the reader does not need is not its concern: a full read checks every piece and catches it
    with pytest.raises(ds.ChainError, match="do not match its pieces sidecar"):
        ds.Subscriber(root, retries=1).fetch(None)


def test_a_whole_pull_checks_the_pieces_in_parallel_or_the_whole_file_without_them(tmp_path, monkeypatch, caplog):
    """A whole anchor is checked against its pieces sidecar (every piece hashed, on every core; from a local store
    in place, then filled into the target straight from the store's file, each group checked again, with no
    temporary copy), not by one SHA-256 of the whole file on one core; without a readable sidecar, by the
    whole-file SHA-256 in the entry."""
    import deltasync_rs._checkpoint as checkpoint_module

    whole_file_hashes = []
    real = hashlib.file_digest
    monkeypatch.setattr(hashlib, "file_digest", lambda *a, **k: whole_file_hashes.append(1) or real(*a, **k))
    pieced, filled = [], []
    real_pieces, real_fill = checkpoint_module.file_piece_hashes, checkpoint_module.fill_checked_pieces
    monkeypatch.setattr(checkpoint_module, "file_piece_hashes", lambda *a: pieced.append(a[1:]) or real_pieces(*a))
    monkeypatch.setattr(checkpoint_module, "fill_checked_pieces", lambda *a: filled.append(a[1:4]) or real_fill(*a))
    monkeypatch.setattr(checkpoint_module, "copy_checked_pieces", None)  # no temporary copy of a local anchor
    state = _state()
    root = _published(tmp_path, state=state, whole_sha256=True)
    size = (root / anchor_key(3)).stat().st_size
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    assert ds.Subscriber(root).pull(target) == 3
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert (pieced, filled, whole_file_hashes) == ([(1024, "blake3")], [(size, 1024, "blake3")], [])
    (root / pieces_key(3)).unlink()  # a lost sidecar: the whole-file SHA-256 still checks the anchor
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    assert ds.Subscriber(root).pull(target) == 3
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert (len(pieced), len(filled), whole_file_hashes) == (1, 1, [1])
    assert "whole-file SHA-256 instead" in caplog.text
    _flip(root / anchor_key(3), 100)
    with pytest.raises(ds.ChainError, match="does not match the digest"):
        ds.Subscriber(root, retries=1).pull({k: torch.zeros_like(v) for k, v in state.items()})


def test_a_rewritten_sidecar_is_refused_by_the_signed_entry(tmp_path):
    root = _published(tmp_path)
    anchor = root / anchor_key(3)
    _flip(anchor, anchor.stat().st_size // 8)
    data = anchor.read_bytes()
    sidecar = bytearray((root / pieces_key(3)).read_bytes())
    sidecar[PIECES_HEADER_BYTES:] = piece_hashes(data, 1024)
    (root / pieces_key(3)).write_bytes(bytes(sidecar))
    with pytest.raises(ds.ChainError, match="pieces: content does not match"):
        ds.Subscriber(root, retries=1, anchor_ranges=_first_tensor_only).fetch(None)
    problems = ds.Subscriber(root).verify()
    assert problems and "does not match" in problems[0]


def test_verify_checks_the_pieces_against_the_anchor(tmp_path):
    root = _published(tmp_path)
    assert ds.Subscriber(root).verify() == []
    # a publisher bug: a sidecar that the entry names correctly but that does not describe the anchor
    entry_path = root / entry_key(3)
    document = json.loads(entry_path.read_bytes())
    sidecar = bytearray((root / pieces_key(3)).read_bytes())
    sidecar[-1] ^= 1
    (root / pieces_key(3)).write_bytes(bytes(sidecar))
    document["anchor"]["pieces"]["sha256"] = hashlib.sha256(sidecar).hexdigest()
    entry_path.write_text(json.dumps(document))
    (root / "latest.json").unlink()
    problems = ds.Subscriber(root).verify()
    assert problems and "do not match its pieces sidecar" in problems[0]


def test_verify_reads_a_local_stores_anchor_in_place(tmp_path, monkeypatch):
    """An audit writes nothing, so it checks a local store's anchor (header, every piece, the whole-file SHA-256)
    in the store's own file: no temporary copy; other stores' anchors still go through one."""
    import deltasync_rs.subscriber as subscriber_module

    root = _published(tmp_path)
    copies = []
    real = subscriber_module.Subscriber._checked_copy
    monkeypatch.setattr(
        subscriber_module.Subscriber, "_checked_copy", lambda self, *a, **k: copies.append(1) or real(self, *a, **k)
    )
    assert ds.Subscriber(root).verify() == []
    assert copies == []
    _flip(root / anchor_key(3), 100)
    problems = ds.Subscriber(root, retries=1).verify()
    assert problems and "do not match its pieces sidecar" in problems[0] and copies == []


def test_verify_checks_the_whole_file_sha256_too(tmp_path):
    """A reader may take either check (a pull now takes the pieces), so an auditor takes both: an anchor whose
    sidecar and entry describe its pieces but whose whole-file SHA-256 in the entry does not match is a problem."""
    root = _published(tmp_path, whole_sha256=True)
    anchor = root / anchor_key(3)
    _flip(anchor, anchor.stat().st_size // 8)
    data = anchor.read_bytes()
    sidecar = bytearray((root / pieces_key(3)).read_bytes())
    sidecar[PIECES_HEADER_BYTES:] = piece_hashes(data, 1024)
    (root / pieces_key(3)).write_bytes(bytes(sidecar))
    entry_path = root / entry_key(3)
    document = json.loads(entry_path.read_bytes())
    document["anchor"]["pieces"]["sha256"] = hashlib.sha256(sidecar).hexdigest()
    entry_path.write_text(json.dumps(document))
    (root / "latest.json").unlink()
    problems = ds.Subscriber(root).verify()
    assert problems and "does not match the digest in its manifest entry" in problems[0]


def test_entries_without_pieces_still_load_and_pull_whole(tmp_path):
    root = _published(tmp_path, piece_bytes=None)
    assert not (root / pieces_key(3)).exists()
    entry = json.loads((root / entry_key(3)).read_bytes())
    # Without pieces the whole-file SHA-256 is the anchor's only check: always written, so the entry is version 1.
    assert "pieces" not in entry["anchor"] and "sha256" in entry["anchor"] and entry["version"] == 1
    store = counting_store(root)
    (delta,) = ds.Subscriber(store, anchor_ranges=_first_tensor_only).fetch(None)
    assert not isinstance(delta, PartialAnchor)
    assert store.read[anchor_key(3)] == (root / anchor_key(3)).stat().st_size


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: p.update(key="anchors/step_000000000004.pieces"), "names"),
        (lambda p: p.update(piece_bytes=1000), "power of two"),
        (lambda p: p.update(piece_bytes=True), "not a integer"),
        (lambda p: p.update(size=p["size"] + 32), "one hash per piece"),
        (lambda p: p.update(sha256="00"), "hex SHA-256"),
        (lambda p: p.pop("sha256"), "missing"),
    ],
)
def test_malformed_pieces_references_are_refused(tmp_path, change, message):
    root = _published(tmp_path)
    document = json.loads((root / entry_key(3)).read_bytes())
    change(document["anchor"]["pieces"])
    with pytest.raises(ds.DeltaFormatError, match=message):
        Entry.parse(json.dumps(document).encode(), entry_key(3), None)


def test_retention_removes_old_sidecars(tmp_path):
    root = tmp_path / "store"
    state = _state()
    with ds.Publisher(root, anchor_every=1, keep_anchors=1, piece_bytes=1024, background=False) as publisher:
        for step in range(3):
            state["norm.weight"] += 1
            publisher.publish(step, state)
    assert ds.LocalStore(root).list("anchors/") == [pieces_key(2), anchor_key(2)]


def test_ranged_reads_over_s3(tmp_path, s3_url, s3_endpoint):
    local = _published(tmp_path)
    store = s3_store(s3_url, s3_endpoint)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        store.put(str(path.relative_to(local)), path.read_bytes())
    (delta,) = ds.Subscriber(store, anchor_ranges=_first_tensor_only).fetch(None)
    assert isinstance(delta, PartialAnchor) and delta.covered_bytes < (local / anchor_key(3)).stat().st_size / 2
    shutil.rmtree(local)


@pytest.fixture
def servers(monkeypatch):
    """What this process knows of servers' byte ranges, forgotten before and after the test (every memory://
    store is one server)."""
    from deltasync_rs import store as stores

    monkeypatch.setattr(stores, "_IGNORE_RANGES", set())
    monkeypatch.setattr(stores, "_HONOUR_RANGES", set())
    return stores


def test_a_server_that_ignores_byte_ranges_gets_the_anchor_read_whole_once(tmp_path, caplog, servers, monkeypatch):
    """An S3-compatible server that ignores the Range header sends the whole object for every ranged read: each
    was refused as "ends before byte ..." (it sent more, not less), and every anchor, then the pull, failed
    (found by an adversarial helper). The reader says so, reads the anchor whole once, and the store reads anchors
    whole from then on. It finds out with a one-byte read of the small pieces sidecar, not of the anchor, which
    such a server would send whole into memory (a 140 GB anchor at 70B)."""
    from deltasync_rs.store import FsspecStore

    url = f"memory://ranges-{os.getpid()}-{id(tmp_path)}/run"
    store = FsspecStore(url)
    with ds.Publisher(store, background=False, piece_bytes=1024, whole_sha256=False) as publisher:
        publisher.publish(3, _state())
    real = store.fs.cat_file
    whole_reads = []

    def ignoring_ranges(path, start=None, end=None, **kwargs):
        whole_reads.append(path)
        return real(path, **kwargs)

    monkeypatch.setattr(store.fs, "cat_file", ignoring_ranges)  # fsspec shares one memory filesystem
    (delta,) = ds.Subscriber(store, anchor_ranges=_first_tensor_only).fetch(None)
    assert not isinstance(delta, PartialAnchor) and delta.step == 3
    state = {k: torch.zeros_like(v) for k, v in _state().items()}
    delta.apply_(state)
    assert all(torch.equal(state[k], v) for k, v in _state().items())
    assert "the server ignores byte ranges; reading the anchor whole" in caplog.text
    # The probe of the sidecar found it out: no read of the anchor into memory; one whole read (get_file).
    assert store.supports_ranges is False and not [p for p in whole_reads if p.endswith(anchor_key(3))]
    assert [p for p in whole_reads if p.endswith(pieces_key(3))], whole_reads
    # A store made later on the same server (a vLLM worker makes one per pull) reads anchors whole at once.
    assert FsspecStore(url).supports_ranges is False


def test_a_server_is_probed_for_byte_ranges_once(tmp_path, servers):
    """A server that honours ranges costs one probe (a byte of a sidecar) per process, not one per anchor read."""
    stores = servers
    url = f"memory://probe-{os.getpid()}-{id(tmp_path)}/run"
    store = stores.FsspecStore(url)
    with ds.Publisher(store, background=False, piece_bytes=1024, anchor_every=1, whole_sha256=False) as publisher:
        publisher.publish(3, _state())
        publisher.publish(4, {k: v + 1 for k, v in _state().items()})
    probes = []
    real = store.check_ranges

    def counted(key):
        probes.append((key, store._server in stores._HONOUR_RANGES))
        return real(key)

    store.check_ranges = counted
    for step in (3, 4):
        (delta,) = ds.Subscriber(store, anchor_ranges=_first_tensor_only).fetch(None, until=step)
        assert isinstance(delta, PartialAnchor) and delta.step == step
    assert [known for _, known in probes] == [False, True], probes
    assert probes[0][0] == pieces_key(3) and store._server in stores._HONOUR_RANGES


def test_documents_of_a_server_that_ignores_ranges_are_capped_by_their_listed_size(tmp_path, servers, monkeypatch):
    """get_small caps a document's read with a ranged read: a server that ignores ranges sent a hostile 64 MiB
    `latest.json` whole into memory before the 1 MiB cap refused it, at every read (found by a review). The first
    such answer marks the server; from then on the listed size is asked first."""
    store = servers.FsspecStore(f"memory://cap-{os.getpid()}-{id(tmp_path)}/run")
    store.put("latest.json", b"x" * (4 << 20))
    real = store.fs.cat_file
    read = []

    def ignoring_ranges(path, start=None, end=None, **kwargs):
        data = real(path, **kwargs)
        read.append(len(data))
        return data

    monkeypatch.setattr(store.fs, "cat_file", ignoring_ranges)
    with pytest.raises(servers.TooLargeError):
        store.get_small("latest.json", 1 << 20)
    assert read == [4 << 20] and store._server in servers._IGNORE_RANGES  # found out by that answer
    with pytest.raises(servers.TooLargeError):
        servers.FsspecStore(store.url).get_small("latest.json", 1 << 20)
    assert read == [4 << 20]  # refused by its listed size, not read again
    store.put("small.json", b"{}")
    assert store.get_small("small.json", 1 << 20) == b"{}"


def test_what_is_learnt_of_a_servers_ranges_is_kept_per_way_of_reaching_it():
    """Stores whose options may point s3fs at different servers (a profile, a session, an endpoint) do not share
    what one of them learnt of its server's byte ranges (the key held the bucket and the endpoint option only)."""
    from deltasync_rs.store import FsspecStore

    one, other = FsspecStore("memory://models/run", profile="a"), FsspecStore("memory://models/run", profile="b")
    assert one._server != other._server and one._server == FsspecStore("memory://models/run", profile="a")._server


def test_an_oversized_object_in_an_anchors_place_is_refused_before_a_remote_copy(tmp_path):
    """A store that keeps no local file (S3, HF) copies an anchor to a temporary file first: an object far larger
    than its entry says must be refused as it is copied (`get_file(max_bytes=)`), not after it filled the disk
    (a check no test pinned: mutation testing)."""
    copied = []

    class Remote(ds.LocalStore):
        def open_local(self, key):
            return None

        def get_file(self, key, out, max_bytes=None):
            try:
                copied.append((key, super().get_file(key, out, max_bytes=max_bytes)))
            except ds.StoreError:
                copied.append((key, out.tell()))
                raise
            return copied[-1][1]

    root = tmp_path / "store"
    with ds.Publisher(root, background=False) as publisher:
        publisher.publish(0, _state())
    with open(root / anchor_key(0), "r+b") as f:
        f.truncate(64 << 20)
    with pytest.raises(ds.DeltaSyncError):
        ds.Subscriber(Remote(root), retries=1).pull({k: torch.zeros_like(v) for k, v in _state().items()})
    assert copied and all(n < 1 << 20 for _, n in copied), copied


def test_a_sidecar_of_another_piece_size_than_its_entry_is_refused():
    from deltasync_rs.manifest import Pieces, pieces_document

    raw = pieces_document(100_000, 65_536, bytes(64))  # two pieces of 64 KiB
    anchor = {
        "key": anchor_key(1),
        "size": 100_000,
        "pieces": {"key": pieces_key(1), "size": len(raw), "sha256": "0" * 64, "piece_bytes": 50_000},  # two too
    }
    with pytest.raises(ds.IntegrityError):
        Pieces.parse(raw, anchor)


def test_an_anchor_that_carries_a_checksum_is_read_by_ranges_and_filled(tmp_path):
    """docs/format.md §2.1: an anchor a publisher streams carries the file checksum, as one laid out in memory
    (``ds.anchor(...).to_bytes()``) does. The ranged and filled readers load a stand-in of the anchor (its checked
    header, zeros for its tensors) for the tensors' metadata: that stand-in's checksum cannot match, and the sound
    anchor was refused as damaged (found by an adversarial helper); its pieces are what those readers check."""
    from deltasync_rs.delta import load_stand_in

    root = _published(tmp_path)
    sealed = (root / anchor_key(3)).read_bytes()
    assert "file_xxh3" in json.loads(sealed[8 : 8 + int.from_bytes(sealed[:8], "little")])["__metadata__"]
    assert sealed == ds.anchor(_state(), step=3).to_bytes()

    state = {name: torch.zeros_like(t) for name, t in _state().items()}
    assert ds.Subscriber(root, retries=1).pull(state) == 3
    for name, tensor in _state().items():
        assert torch.equal(state[name].view(torch.uint8), tensor.view(torch.uint8)), name
    (partial,) = ds.Subscriber(root, retries=1, anchor_ranges=_first_tensor_only).fetch(None)
    assert isinstance(partial, PartialAnchor) and partial.covered_bytes < len(sealed) / 2
    # The stand-in itself: refused with its checksum, loaded without.
    header_end = 8 + int.from_bytes(sealed[:8], "little")
    stand_in = tmp_path / "stand_in"
    stand_in.write_bytes(sealed[:header_end] + bytes(len(sealed) - header_end))
    with pytest.raises(ds.DeltaFormatError, match="damaged"):
        ds.load(stand_in, mmap=True)
    assert [t.name for t in load_stand_in(stand_in).tensors] == [t.name for t in ds.load(sealed).tensors]


def _rows(name, first, last):
    """anchor_ranges for a reader of rows ``first .. last`` of tensor ``name`` (a row split) and nothing else."""

    def needed(tensors):
        (tensor,) = [t for t in tensors if t.name == name]
        row = (tensor.end - tensor.start) // tensor.shape[0]
        return [(tensor.start + first * row, tensor.start + last * row)]

    return needed


@pytest.mark.parametrize("shape, split", [((1000, 700), 503), ((1024, 512), 512), ((300, 64), 150)])
def test_readers_that_each_hold_rows_of_a_tensor_find_its_base_identity_together(tmp_path, shape, split):
    """Two tensor-parallel readers of a row-split tensor each read their own rows; from the hashes of the 256 KiB
    blocks each holds whole and the bytes of a block cut by their boundary (none when the boundary falls between
    blocks), both find the tensor's base identity, which neither could alone."""
    from deltasync_rs._core import base_identity
    from deltasync_rs._ranged import fragment_plan, fragments, held_tensors, split_identities

    rows, cols = shape
    big = (torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) * 0.001).to(torch.bfloat16)
    state = _state() | {"big.weight": big}
    root = _published(tmp_path, piece_bytes=4096, state=state)
    readers = [
        ds.Subscriber(root, anchor_ranges=_rows("big.weight", *span)).fetch(None)[0]
        for span in ((0, split), (split, rows))
    ]
    assert all(isinstance(reader, PartialAnchor) for reader in readers)
    names = ["big.weight", "layer0.weight"]
    held = [held_tensors(reader, names) for reader in readers]
    assert all(h["big.weight"] is not None for h in held)
    plan = fragment_plan(held)
    nbytes = rows * cols * 2
    cut = split * cols * 2
    if cut % (1 << 18) == 0:
        assert plan == []
    else:
        # the block the boundary falls in, from both readers (the bytes each verified reach past the boundary)
        assert {block for _, _, block, _, _ in plan} == {cut >> 18} and {s for s, *_ in plan} <= {0, 1}
    sent = [fragments(reader, plan, rank) for rank, reader in enumerate(readers)]
    identities, conflicts = split_identities(held, plan, sent)
    expected = base_identity(big.contiguous().view(torch.uint8).numpy().tobytes())
    assert identities == {"big.weight": expected} and conflicts == []
    assert sum(len(data) for part in sent for data in part.values()) <= min(nbytes, 1 << 18)  # one block at most
    # One reader alone holds too little: the tensor cannot be checked (no identity, no conflict).
    assert split_identities(held[:1], fragment_plan(held[:1]), sent[:1]) == ({}, [])
    # A reader that read the tensor whole checks it alone: nothing to combine.
    whole = ds.Subscriber(root).fetch(None)[0]
    assert held_tensors(whole, names) == {"big.weight": None, "layer0.weight": None}
    assert split_identities([held[0], held_tensors(whole, names)], [], [{}, {}]) == ({}, [])
    # Hashes of other bytes (a wrong anchor's) make another identity; readers that hash a block differently hold
    # different bytes of the anchor: a conflict, no identity.
    part = held[0]["big.weight"]
    if part.hashes:
        forged = part._replace(hashes=tuple((first, bytes(len(run))) for first, run in part.hashes))
        assert split_identities([{"big.weight": forged}, held[1]], plan, sent)[0]["big.weight"] != expected
        everyone = [held[0], held[1], {"big.weight": forged}]
        assert split_identities(everyone, fragment_plan(everyone), [*sent, {}]) == ({}, ["big.weight"])


def _makespan(plan, cuts) -> int:
    """What hashing in ``plan``'s turns costs: over the turns, the most bytes any reader hashes in that turn."""
    total = 0
    for turn in plan:
        per_reader: dict[int, int] = {}
        for name, index in turn:
            rank, start, end = cuts[name][index]
            per_reader[rank] = per_reader.get(rank, 0) + end - start
        total += max(per_reader.values())
    return total


@given(
    readers=st.integers(1, 6),
    tensors=st.lists(
        st.lists(st.tuples(st.integers(0, 5), st.integers(1, 1 << 20)), min_size=0, max_size=6), max_size=40
    ),
)
@settings(max_examples=300, deadline=None)
def test_the_turns_of_a_digest_made_in_parts_hash_each_segment_once_in_order(readers, tensors):
    """Every segment of every tensor is hashed once, a tensor's segments in consecutive turns in their order (each
    goes on from the state the one before handed on); tensors start in at most 4 turns per reader; tensors no
    reader covers (None) or with no bytes are not in it; and the plan does not depend on the order of ``cuts``."""
    from deltasync_rs._ranged import hash_turns

    cuts: dict[str, list[tuple[int, int, int]] | None] = {}
    for i, parts in enumerate(tensors):
        at, cut = 0, []
        for rank, size in parts:
            cut.append((rank % readers, at, at + size))
            at += size
        cuts[f"t{i}"] = cut
    cuts["unread"] = None
    plan = hash_turns(cuts, readers)
    assert plan == hash_turns(dict(reversed(cuts.items())), readers)
    where: dict[str, list[int]] = {}
    for turn, pairs in enumerate(plan):
        assert pairs, "a turn with nothing to hash"
        for name, index in pairs:
            assert len(where.setdefault(name, [])) == index
            where[name].append(turn)
    assert set(where) == {name for name, cut in cuts.items() if cut}
    for name, turns in where.items():
        assert turns == list(range(turns[0], turns[0] + len(cuts[name])))
    assert len({turns[0] for turns in where.values()}) <= 4 * readers


@pytest.mark.parametrize("readers", [2, 4, 8])
def test_readers_hash_their_rows_side_by_side_not_one_after_another(readers):
    """Row-split tensors cut into one segment per reader, in rank order (vLLM's shards): with every tensor started
    in the first turn, reader r would hash only in turn r, so the digest took ``readers`` times one reader's share.
    Staggered, every reader hashes in most turns: the plan costs little more than one reader's share."""
    from deltasync_rs._ranged import hash_turns

    rows = [1 << 20, 3 << 19, 1 << 18]  # bytes per reader of three kinds of tensor (q/k/v, gate/up, norms)
    cuts = {
        f"layer{layer}.{kind}": [(r, r * size, (r + 1) * size) for r in range(readers)]
        for layer in range(24)
        for kind, size in enumerate(rows)
    }
    share = 24 * sum(rows)  # one reader's bytes
    plan = hash_turns(cuts, readers)
    assert _makespan(plan, cuts) <= share * (1 + (readers - 1) / (4 * readers)) * 1.05
    assert _makespan([[pair for turn in plan for pair in turn if pair[1] == r] for r in range(readers)], cuts) == (
        readers * share
    )
    assert len(plan) <= 5 * readers - 1


def test_readers_that_disagree_on_a_tensors_size_conflict():
    """Readers whose parts of one tensor have different sizes read different anchors: a conflict, no identity."""
    from deltasync_rs._ranged import HeldTensor, differently_sized, split_identities

    everyone = [
        {"t": HeldTensor(1 << 20, ((0, 1 << 19),), ())},
        {"t": HeldTensor(1 << 21, (((1 << 19), 1 << 21),), ())},
    ]
    assert split_identities(everyone, [], [{}, {}]) == ({}, ["t"])
    assert differently_sized(everyone) == ["t"] and differently_sized(everyone[:1]) == []


def test_a_fragment_of_the_wrong_length_is_refused():
    """A reader that sends more or fewer bytes of a fragment than the plan names is refused, not hashed."""
    from deltasync_rs._ranged import HeldTensor, split_identities
    from deltasync_rs.errors import IntegrityError

    block = 1 << 18
    everyone = [
        {"t": HeldTensor(2 * block, ((0, block + 10),), ())},
        {"t": HeldTensor(2 * block, ((block + 10, 2 * block),), ())},
    ]
    plan = [(0, "t", 1, block, block + 10), (1, "t", 1, block + 10, 2 * block)]
    good = [{("t", block): bytes(10)}, {("t", block + 10): bytes(block - 10)}]
    split_identities(everyone, plan, good)  # the right lengths: no error
    for sent in ([{("t", block): bytes(11)}, good[1]], [{("t", block): bytes(9)}, good[1]]):
        with pytest.raises(IntegrityError, match="sent no bytes"):
            split_identities(everyone, plan, sent)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 5000),
    st.lists(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 800)), max_size=6), min_size=1, max_size=4),
)
def test_segments_found_by_a_sweep_are_those_of_the_plain_rule(nbytes, readers):
    """_ranged.segments sweeps the intervals in order (a column split holds one per row): the same segments as the
    plain rule, at each point the interval begun there that reaches furthest, the lowest reader among equals."""
    from deltasync_rs._ranged import HeldTensor, segments

    everyone = []
    for intervals in readers:
        spans = sorted({(min(start, nbytes), min(start + length, nbytes)) for start, length in intervals})
        disjoint, end = [], 0
        for start, stop in spans:
            if start >= end and stop > start:
                disjoint.append((start, stop))
                end = stop
        everyone.append({"t": HeldTensor(nbytes, tuple(disjoint), ())})
    cut: list | None = []
    at = 0
    while at < nbytes:
        reach = [
            (stop, -rank)
            for rank, held in enumerate(everyone)
            for start, stop in held["t"].intervals
            if start <= at < stop
        ]
        if not reach:
            cut = None
            break
        stop, rank = max(reach)
        cut.append((-rank, at, stop))
        at = stop
    assert segments(everyone) == {"t": cut}


#: A point of a tensor: an eighth of the way along it, give or take a few bytes (block boundaries and cuts in them).
_EIGHTHS = st.tuples(st.integers(0, 8), st.integers(-3, 3))


@settings(max_examples=100, deadline=None)
@example(4 * 262144, [[((0, 0), (8, 0))], [((0, 3), (1, 0))]], None)  # one holds every block, one part of one
@example(4 * 262144, [[((0, 0), (8, 0))], [((0, 3), (1, 0))]], (1, 0.0))  # the part's holder alone is off
@example(1000, [[((0, 0), (3, 0))], [((0, 0), (3, 0))], [((3, 0), (8, 0))]], (1, 0.0))  # replicas, one block
@given(
    st.integers(1, 4 * 262144 + 5),
    st.lists(
        st.lists(st.tuples(_EIGHTHS, _EIGHTHS), min_size=1, max_size=4),
        min_size=2,
        max_size=4,
    ),
    st.one_of(st.none(), st.tuples(st.integers(0, 3), st.floats(0, 1))),
)
def test_holders_of_live_slices_check_every_holders_bytes(nbytes, readers, corrupt):
    """_ranged.held_fragment_plan / held_identities (check_base at TP > 1): from slices that may overlap (replicas),
    the tensor's identity where every holder holds the right bytes and together they hold all; never the right
    identity where one holder's byte is wrong, whoever else holds that element."""
    import numpy as np

    from deltasync_rs import _core
    from deltasync_rs._ranged import BLOCK_BYTES, HeldTensor, held_fragment_plan, held_identities

    truth = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    layouts = []
    for intervals in readers:
        points = [
            min(max(eighth * nbytes // 8 + off, 0), nbytes) for eighth, off in (a for pair in intervals for a in pair)
        ]
        spans = sorted({tuple(sorted(points[i : i + 2])) for i in range(0, len(points), 2)})
        disjoint, end = [], 0
        for start, stop in spans:
            if start >= end and stop > start:
                disjoint.append((start, stop))
                end = stop
        layouts.append(disjoint)
    own = [truth.copy() for _ in layouts]
    wrong = False
    if corrupt is not None and corrupt[0] < len(layouts) and layouts[corrupt[0]]:
        start, stop = layouts[corrupt[0]][int(corrupt[1] * (len(layouts[corrupt[0]]) - 1))]
        own[corrupt[0]][start + (stop - start) // 2] ^= 1
        wrong = True
    everyone = []
    for rank, intervals in enumerate(layouts):
        runs = []
        for start, stop in intervals:
            first = -(-start // BLOCK_BYTES)
            end = -(-nbytes // BLOCK_BYTES) if stop == nbytes else stop // BLOCK_BYTES
            if end > first:
                runs.append(
                    (first, bytes(_core.block_hashes(own[rank][first * BLOCK_BYTES : min(end * BLOCK_BYTES, nbytes)])))
                )
        everyone.append({"t": HeldTensor(nbytes, tuple(intervals), tuple(runs))} if intervals else {})
    plan = held_fragment_plan(everyone)
    sent = [
        {(name, start): own[rank][start:end].tobytes() for r, name, _, start, end in plan if r == rank}
        for rank in range(len(layouts))
    ]
    identities, conflicts, uncovered = held_identities(everyone, plan, sent)
    expected = _core.base_identity_from_blocks(bytes(_core.block_hashes(truth)), b"")
    covered = np.zeros(nbytes, dtype=bool)
    for intervals in layouts:
        for start, stop in intervals:
            covered[start:stop] = True
    if not any(everyone):
        assert (identities, conflicts, uncovered) == ({}, [], [])
    elif wrong:
        assert identities.get("t") != expected
    elif covered.all():
        assert identities == {"t": expected} and not conflicts and not uncovered
    else:
        assert uncovered == ["t"] and not identities
