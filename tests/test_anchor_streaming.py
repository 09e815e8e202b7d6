"""Anchors at scale: written straight from the publisher's mirror into a file and uploaded from it, pulled into a
temporary file, hashed on the way and applied through a memory map (issue 16)."""

from __future__ import annotations

import hashlib
import json
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import deltasync_rs as ds
import deltasync_rs.publisher as publisher_module
from deltasync_rs.delta import load, write_anchor_file
from deltasync_rs.manifest import pieces_key
from deltasync_rs.sync import anchor_key, entry_key, verify_store
from tests.helpers import assert_states_equal, clone_state


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(300, 64, generator=g).bfloat16(),
        "layer.weight": torch.randn(64, 64, generator=g),
        "norm.weight": torch.ones(64).bfloat16(),
        "counts": np.arange(100, dtype=np.int32),
    }


def _fresh(like):
    return {k: np.zeros_like(v) if isinstance(v, np.ndarray) else torch.zeros_like(v) for k, v in like.items()}


def _change(state, step):
    for t in state.values():
        flat = t.reshape(-1) if isinstance(t, np.ndarray) else t.view(-1)
        flat[step % flat.shape[0]] += 1


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """TMPDIR for the code under test, so a leftover temporary file can be seen."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_streamed_anchor_is_byte_identical_to_to_bytes(tmp_path):
    state = _state()
    path = tmp_path / "anchor.safetensors"
    path.write_bytes(b"longer old content that the write truncates" * 100)
    state["lm_head.weight"] = state["embed.weight"]  # tied: one memory, two names
    state["empty"] = torch.zeros(0, 8).bfloat16()
    state["embed.T"] = state["embed.weight"].view(64, 300).contiguous()  # a copy of the same bytes, another shape
    state["embed.flat"] = state["embed.weight"].view(-1)  # the same memory as another shape
    size, sha256, digest = write_anchor_file(state, path, step=12, metadata={"origin": "test"})
    expected = ds.anchor(state, step=12, metadata={"origin": "test"}).to_bytes()
    assert path.read_bytes() == expected
    assert (size, sha256) == (len(expected), hashlib.sha256(expected).hexdigest())
    assert digest == ds.state_digest(state)  # hashed in the same pass


def test_early_writeback_changes_no_byte_and_the_publisher_asks_for_it(tmp_path, monkeypatch):
    """The kernel's writeback started during the pass (every 64 MiB, on a thread of the core's) writes the same
    file as the pass without it; the publisher asks for it, since its store makes the file durable next."""
    from deltasync_rs.delta import write_anchor_pieces

    rng = np.random.default_rng(5)
    state = {
        f"t{i}": torch.from_numpy(rng.integers(0, 1 << 16, 24 << 20, dtype=np.uint16).view(np.int16)) for i in range(4)
    }
    written = {}
    for early in (True, False):
        path = tmp_path / f"anchor-{early}.safetensors"
        path.touch()
        written[early] = write_anchor_pieces(state, path, step=3, piece_bytes=1 << 20, early_writeback=early)
    assert written[True] == written[False]
    assert (tmp_path / "anchor-True.safetensors").read_bytes() == (tmp_path / "anchor-False.safetensors").read_bytes()
    assert written[True][0] > 192 << 20  # three writeback ranges of 64 MiB at least

    asked = []
    real = publisher_module.write_anchor_pieces

    def recording(tensors, path, **options):
        asked.append(options.get("early_writeback"))
        return real(tensors, path, **options)

    monkeypatch.setattr(publisher_module, "write_anchor_pieces", recording)
    with ds.Publisher(tmp_path / "store", background=False) as publisher:
        publisher.publish(0, _state())
    assert asked == [True]


def test_streamed_anchor_refuses_a_bad_state_before_writing(tmp_path):
    path = tmp_path / "anchor.safetensors"
    path.write_bytes(b"kept")
    with pytest.raises(ds.DeltaSyncError):
        write_anchor_file({"x:pos": torch.zeros(4)}, path)
    with pytest.raises(ds.DeltaSyncError):
        write_anchor_file({"x": torch.zeros(4)}, path, step=-1)
    assert path.read_bytes() == b"kept"


def test_mapped_load_applies_like_a_loaded_one(tmp_path):
    state = _state()
    path = tmp_path / "anchor.safetensors"
    ds.anchor(state, step=3).save(path)
    mapped = load(path, mmap=True)
    assert mapped.is_anchor and mapped.step == 3 and mapped.names == load(path).names
    target = _fresh(state)
    mapped.apply_(target)
    assert_states_equal(target, state)
    path.unlink()  # the mapping keeps the bytes of a file unlinked after loading
    again = _fresh(state)
    mapped.apply_(again)
    assert_states_equal(again, state)


def test_a_bad_mapped_file_is_a_format_error(tmp_path):
    path = tmp_path / "anchor.safetensors"
    blob = bytearray(ds.anchor(_state()).to_bytes())
    path.write_bytes(bytes(blob[: len(blob) // 2]))
    with pytest.raises(ds.DeltaFormatError):
        load(path, mmap=True)


@pytest.mark.parametrize(("background", "whole_sha256"), [(True, False), (False, False), (True, True)])
def test_published_anchor_equals_the_in_memory_anchor_and_leaves_no_temp_files(
    tmp_path, private_tmp, background, whole_sha256
):
    """The anchor file is the in-memory anchor's bytes; its entry has the whole-file SHA-256 only when asked for
    (then the entry is version 1, which every reader reads; else version 2: docs/format.md §10)."""
    state = _state()
    store = ds.LocalStore(tmp_path / "store")
    with ds.Publisher(store, anchor_every=2, background=background, whole_sha256=whole_sha256) as publisher:
        for step in range(4):
            _change(state, step)
            publisher.publish(step, state)
            if step == 2:
                expected = ds.anchor(state, step=2).to_bytes()
    stored = (tmp_path / "store" / anchor_key(2)).read_bytes()
    assert stored == expected
    entry = json.loads((tmp_path / "store" / entry_key(2)).read_bytes())
    pieces = entry["anchor"].pop("pieces")  # docs/format.md §10, anchor pieces (tests/test_anchor_ranges.py)
    assert pieces["key"] == pieces_key(2)
    assert entry["anchor"] == {"key": anchor_key(2), "size": len(expected)} | (
        {"sha256": hashlib.sha256(expected).hexdigest()} if whole_sha256 else {}
    )
    assert entry["version"] == (1 if whole_sha256 else 2)
    assert json.loads((tmp_path / "store" / entry_key(1)).read_bytes())["version"] == 1  # a delta only
    assert not [p for p in (tmp_path / "store").rglob(".deltasync-*")]
    assert list(private_tmp.iterdir()) == []


def test_anchor_upload_from_a_file_on_every_store(store, private_tmp):
    state = _state()
    with ds.Publisher(store, anchor_every=3) as publisher:
        for step in range(5):
            _change(state, step)
            publisher.publish(step, state)
            if step == 3:
                expected = ds.anchor(state, step=3).to_bytes()
    assert store.get(anchor_key(3)) == expected
    replica = _fresh(state)
    assert ds.Subscriber(store).pull(replica) == 4
    assert_states_equal(replica, state)
    assert list(private_tmp.iterdir()) == []


def test_piece_options_set_while_an_anchor_is_written_apply_from_the_next(tmp_path, monkeypatch):
    """The upload thread reads the pieces options once per anchor: set from the training thread while the file is
    being written, they cannot leave an anchor whose reference, sidecar and hashes disagree (hashed in 1 KiB pieces
    of BLAKE3 but described as none, or as SHA-256), or a reference with neither a whole-file hash nor pieces."""
    real = publisher_module.write_anchor_pieces
    publisher = ds.Publisher(tmp_path / "store", piece_bytes=1024, background=False)

    def write_then_change_options(tensors, path, **options):
        written = real(tensors, path, **options)
        publisher.piece_bytes, publisher.piece_hash = None, "sha256"
        return written

    monkeypatch.setattr(publisher_module, "write_anchor_pieces", write_then_change_options)
    state = _state()
    with publisher:
        publisher.publish(0, state)
    entry = json.loads((tmp_path / "store" / entry_key(0)).read_bytes())
    assert entry["version"] == 2 and entry["anchor"]["pieces"]["piece_bytes"] == 1024
    assert (tmp_path / "store" / pieces_key(0)).read_bytes()[:8] == b"DSPIECE2"  # BLAKE3, as hashed
    replica = _fresh(state)
    assert ds.Subscriber(tmp_path / "store").pull(replica) == 0
    assert_states_equal(replica, state)
    assert verify_store(tmp_path / "store") == []


def test_the_next_publish_waits_for_the_anchor_file(tmp_path, monkeypatch):
    """The upload thread reads the mirror while it writes the anchor: a publish right after must not change the
    mirror before that file is written, or the anchor would hold bits of the next step."""
    started, release = threading.Event(), threading.Event()
    real = publisher_module.write_anchor_pieces

    def slow_write(tensors, path, **options):
        started.set()
        assert release.wait(10)
        return real(tensors, path, **options)

    monkeypatch.setattr(publisher_module, "write_anchor_pieces", slow_write)
    state = _state()
    first = clone_state(state)
    store = ds.LocalStore(tmp_path / "store")
    with ds.Publisher(store, anchor_every=100) as publisher:
        publisher.publish(0, state)
        assert started.wait(10)
        _change(state, 1)
        waiter = threading.Thread(target=publisher.publish, args=(1, state))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive()  # waiting for the anchor file, the mirror untouched
        release.set()
        waiter.join(10)
    assert store.get(anchor_key(0)) == ds.anchor(first, step=0).to_bytes()
    replica = _fresh(state)
    assert ds.Subscriber(store).pull(replica) == 1
    assert_states_equal(replica, state)


def test_the_state_digest_of_a_delta_step_is_made_off_the_callers_thread(tmp_path, monkeypatch):
    """publish() returns once the delta is made: the state digest (a read of the whole state) is made in the upload
    thread, from the mirror, and the next publish waits for it before it changes the mirror."""
    started, release = threading.Event(), threading.Event()
    threads = []
    real = publisher_module.state_digest

    def slow_digest(tensors):
        threads.append(threading.current_thread().name)
        if len(threads) == 1:
            started.set()
            assert release.wait(10)
        return real(tensors)

    monkeypatch.setattr(publisher_module, "state_digest", slow_digest)
    state = _state()
    store = ds.LocalStore(tmp_path / "store")
    with ds.Publisher(store, anchor_every=100) as publisher:
        publisher.publish(0, state)  # an anchor: its digest comes from the anchor's own pass
        publisher.flush()
        _change(state, 1)
        step_1 = clone_state(state)
        publisher.publish(1, state)  # returns while the digest waits
        assert started.wait(10)
        _change(state, 2)
        waiter = threading.Thread(target=publisher.publish, args=(2, state))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive()  # waiting for the digest of step 1, the mirror untouched
        release.set()
        waiter.join(10)
        publisher.flush()
    assert threads == ["deltasync-publisher"] * 2
    for step, want in ((1, step_1), (2, state)):
        replica = _fresh(state)
        assert ds.Subscriber(store).pull(replica, until=step) == step  # checks the entry's digest
        assert_states_equal(replica, want)


def test_a_failed_anchor_write_is_reported_cleaned_up_and_re_anchored(tmp_path, private_tmp, monkeypatch):
    calls = []
    real = publisher_module.write_anchor_pieces

    def failing_once(tensors, path, **options):
        calls.append(path)
        if len(calls) == 1:
            Path(path).write_bytes(b"half an anchor")
            raise OSError("disk full")
        return real(tensors, path, **options)

    monkeypatch.setattr(publisher_module, "write_anchor_pieces", failing_once)
    state = _state()
    store = ds.LocalStore(tmp_path / "store")
    publisher = ds.Publisher(store, anchor_every=100)
    publisher.publish(0, state)
    with pytest.raises(ds.DeltaSyncError, match="disk full"):
        publisher.flush()
    assert not Path(calls[0]).exists()
    _change(state, 1)
    publisher.publish(1, state)  # does not hang on the mirror, and anchors again
    publisher.close()
    assert store.list("anchors/") == [pieces_key(1), anchor_key(1)]
    assert not [p for p in (tmp_path / "store").rglob(".deltasync-*")]
    replica = _fresh(state)
    assert ds.Subscriber(store).pull(replica) == 1
    assert_states_equal(replica, state)


def _one_anchor_store(tmp_path):
    state = _state()
    store = ds.LocalStore(tmp_path / "store")
    with ds.Publisher(store, anchor_every=100, background=False) as publisher:
        publisher.publish(0, state)
    return state, store, tmp_path / "store" / anchor_key(0)


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend"])
def test_a_pull_from_a_damaged_anchor_is_refused_and_leaves_the_target_unchanged(tmp_path, private_tmp, damage):
    state, store, path = _one_anchor_store(tmp_path)
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        blob[-5] ^= 0x40  # inside the data: the safetensors file stays valid, only the hash can tell
    elif damage == "truncate":
        del blob[-100:]
    else:
        blob += b"\0" * 4096
    path.write_bytes(bytes(blob))
    replica = {k: v.clone() if isinstance(v, torch.Tensor) else v.copy() for k, v in _fresh(state).items()}
    before = clone_state(replica)
    with pytest.raises(ds.ChainError, match="does not match|do not match its pieces sidecar|its manifest entry says"):
        ds.Subscriber(store, retry_delay=0).pull(replica)
    assert_states_equal(replica, before)
    assert list(private_tmp.iterdir()) == []


@pytest.mark.parametrize("whole_sha256", [False, True])
def test_a_damaged_anchor_file_read_directly_is_refused(tmp_path, whole_sha256):
    """A publisher's anchor carries the file checksum (docs/format.md §2.1), written after the data where no
    whole-file SHA-256 is taken in the same pass, computed before it where one is. A byte changed in the data of the
    file in the store folder (a copy, a backup, a bad disk) was applied, as other weights, by anything that read the
    file itself rather than through a Subscriber: it is refused as damaged."""
    state = _state()
    store = ds.LocalStore(tmp_path / "store")
    with ds.Publisher(store, background=False, whole_sha256=whole_sha256) as publisher:
        publisher.publish(0, state)
    path = tmp_path / "store" / anchor_key(0)
    sound = path.read_bytes()
    assert sound == ds.anchor(state, step=0).to_bytes()
    replica = _fresh(state)
    load(path, mmap=True).apply_(replica)
    assert_states_equal(replica, state)
    damaged = bytearray(sound)
    damaged[-5] ^= 0x40  # a value of the last tensor: a sound safetensors file, other weights
    path.write_bytes(bytes(damaged))
    for read in (lambda: load(path), lambda: load(path, mmap=True), lambda: load(bytes(damaged))):
        with pytest.raises(ds.DeltaFormatError, match="damaged"):
            read()
    # What the old reader did with it: without the key, the same bytes load and apply other weights.
    from tests.helpers import without_checksum

    def raw(tensor):
        return (
            tensor.tobytes() if isinstance(tensor, np.ndarray) else tensor.view(-1).view(torch.uint8).numpy().tobytes()
        )

    other = _fresh(state)
    load(without_checksum(bytes(damaged))).apply_(other)
    assert [name for name in state if raw(other[name]) != raw(state[name])]


_PEAK = r"""
import json, sys, torch, deltasync_rs as ds

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

how, source, shapes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
target = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in shapes.items()}
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
before = status("VmRSS")
if how == "pull":
    ds.Subscriber(source).pull(target)
else:
    ds.load(source, mmap=True).apply_(target)
print(status("VmHWM") - before)
"""


def _large_state(seed: int) -> tuple[dict[str, tuple[int, int]], dict[str, torch.Tensor]]:
    """256 MB of random bf16 bits in 32 tensors, and their shapes."""
    g = torch.Generator().manual_seed(seed)
    shapes = {f"layers.{i}.weight": (2048, 2048) for i in range(32)}
    state = {
        name: torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=g).view(torch.bfloat16)
        for name, shape in shapes.items()
    }
    return shapes, state


def _peak_beyond_target(how: str, source, shapes) -> int:
    """Peak resident bytes, beyond a zeroed target of ``shapes``, of a fresh process that fills it: ``"pull"``
    from the store at ``source``, or ``"load"``: ``ds.load(source, mmap=True).apply_``."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _PEAK, how, str(source), json.dumps(shapes)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    return int(run.stdout.split()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resets the peak through /proc")
def test_checking_a_mapped_anchors_checksum_holds_little_of_it(tmp_path):
    """``ds.load(path, mmap=True)`` of a 256 MB anchor that carries the file checksum, then ``apply_``: the checksum
    reads the whole file before the apply, a window at a time, dropping the mapping's pages after each, so the peak
    beyond the target stays small (hashing the whole mapping at once held all of it)."""
    shapes, state = _large_state(1)
    path = tmp_path / "anchor.safetensors"
    path.touch()
    write_anchor_file(state, path, step=0)
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    assert "file_xxh3" in header["__metadata__"]
    del state
    peak = _peak_beyond_target("load", path, shapes)
    assert peak < 64 << 20, peak


def test_pull_streams_the_anchor_to_a_file(tmp_path, private_tmp, monkeypatch):
    """The anchor is never read whole into memory: the subscriber uses get_file, not get."""
    state, store, _ = _one_anchor_store(tmp_path)

    def no_whole_reads(key):
        raise AssertionError(f"{key} read whole into memory")

    monkeypatch.setattr(store, "get", no_whole_reads)
    replica = _fresh(state)
    assert ds.Subscriber(store).pull(replica) == 0
    assert_states_equal(replica, state)
    assert list(private_tmp.iterdir()) == []
    assert verify_store(store) == []


def test_a_failed_anchor_upload_removes_its_file(tmp_path, private_tmp):
    class Unreachable(ds.LocalStore):
        def put_file(self, key, path):
            raise ds.StoreError(f"{key}: connection reset")

    store = Unreachable(tmp_path / "store")
    publisher = ds.Publisher(store, retries=2)
    publisher.publish(0, _state())
    with pytest.raises(ds.DeltaSyncError, match="connection reset"):
        publisher.flush()
    publisher.close()
    assert not [p for p in (tmp_path / "store").rglob(".deltasync-*")]
    assert store.list("anchors/") == [] and store.list("manifest/") == []


def test_a_resumed_publisher_streams_its_first_anchor(tmp_path, private_tmp):
    """resume() without the step's entry makes the next publish an anchor, written from the resumed mirror."""
    state = _state()
    store = ds.LocalStore(tmp_path / "store")
    with ds.Publisher(store, anchor_every=100) as publisher:
        publisher.resume(state, step=5)
        _change(state, 6)
        publisher.publish(6, state)
    assert store.get(anchor_key(6)) == ds.anchor(state, step=6).to_bytes()
    assert list(private_tmp.iterdir()) == []


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="resets the peak through /proc")
def test_a_fresh_pull_holds_little_beyond_its_target(tmp_path, private_tmp):
    """Peak resident memory of a fresh pull of a 256 MB anchor beyond the target: the download is a file, checked
    piece by piece through small reads and applied through a mapping whose pages are dropped as they are copied, so
    no step holds the anchor (checking the pieces through a mapping of the whole file held all of it)."""
    shapes, state = _large_state(0)
    store = tmp_path / "store"
    with ds.Publisher(store, background=False) as publisher:
        publisher.publish(0, state)
    del state
    peak = _peak_beyond_target("pull", store, shapes)
    assert peak < 64 << 20, peak


def test_a_tensor_named_with_the_packed_layouts_prefix_but_not_reserved_is_pulled(tmp_path):
    """docs/format.md §4 reserves `__deltasync_records__` and `__deltasync_streams__`, and the writer refuses just
    those: a tensor named `__deltasync_x` was published, then every pull of a local store refused its anchor as
    a delta's stream (found by an adversarial helper). Names the writer refuses stay refused."""
    state = {"__deltasync_x": torch.arange(10, dtype=torch.float32), "w": torch.ones(3, dtype=torch.bfloat16)}
    with ds.Publisher(tmp_path / "store", background=False) as publisher:
        publisher.publish(0, state)
        state["__deltasync_x"][3] += 1
        publisher.publish(1, state)
    pulled = {name: torch.zeros_like(t) for name, t in state.items()}
    assert ds.Subscriber(tmp_path / "store").pull(pulled) == 1
    assert all(torch.equal(pulled[name], state[name]) for name in state)
    with pytest.raises(ds.DeltaSyncError, match="__deltasync_records__"):
        ds.Publisher(tmp_path / "other", background=False).publish(0, {"__deltasync_records__": torch.ones(2)})
