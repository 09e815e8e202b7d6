"""``Subscriber.pull_to_file`` (and ``deltasync pull``): a step rebuilt inside the output checkpoint itself, laid out
as safetensors' writer lays it out, with the anchor copied from a local store in one checked read."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import deltasync_rs as ds
from deltasync_rs.manifest import anchor_key, pieces_key
from tests.helpers import counting_store


def _states(steps: int) -> list[dict[str, np.ndarray]]:
    """Mixed dtypes, names out of dtype order, a scalar, an empty tensor; each step changes a few elements."""
    rng = np.random.default_rng(7)
    state = {
        "z.embed": rng.normal(0, 0.02, (64, 48)).astype(ml_dtypes.bfloat16),
        "a.norm": rng.normal(1, 0.1, (48,)).astype(np.float32),
        "m.half": rng.normal(0, 1, (33, 7)).astype(np.float16),
        "b.count": np.arange(10, dtype=np.int32),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=ml_dtypes.bfloat16),
    }
    out = [state]
    for _ in range(steps - 1):
        state = {name: array.copy() for name, array in state.items()}
        for name in ("z.embed", "a.norm", "m.half"):
            flat = state[name].reshape(-1).view(np.uint16 if state[name].itemsize == 2 else np.uint32)
            picked = rng.choice(flat.size, size=max(1, flat.size // 50), replace=False)
            flat[picked] += 1
        state["b.count"][rng.integers(10)] += 1
        out.append(state)
    return out


def _save_file_bytes(state: dict[str, np.ndarray], path) -> bytes:
    save_file(state, str(path))
    return path.read_bytes()


def _publish(root, states, **options) -> None:
    with ds.Publisher(root, background=False, **options) as publisher:
        for step, state in enumerate(states):
            publisher.publish(step, state)


def test_the_file_is_what_save_file_writes_from_every_store(store, tmp_path):
    states = _states(4)
    _publish(store, states, piece_bytes=1024)
    out = tmp_path / "out.safetensors"
    assert ds.Subscriber(store).pull_to_file(out) == 3
    assert out.read_bytes() == _save_file_bytes(states[3], tmp_path / "expected.safetensors")
    for step in (1, 0):  # a delta after the anchor, the anchor alone
        assert ds.Subscriber(store).pull_to_file(out, until=step) == step
        assert out.read_bytes() == _save_file_bytes(states[step], tmp_path / "expected.safetensors")
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_a_local_anchor_is_copied_in_one_checked_read_never_through_a_temporary_file(tmp_path):
    states = _states(3)
    _publish(tmp_path / "store", states, piece_bytes=1024)
    store = counting_store(tmp_path / "store")
    opened = []
    open_local = store.open_local
    store.open_local = lambda key: opened.append(key) or open_local(key)
    out = tmp_path / "out.safetensors"
    assert ds.Subscriber(store).pull_to_file(out) == 2
    assert opened == [anchor_key(0)]
    anchor_size = (tmp_path / "store" / anchor_key(0)).stat().st_size
    assert store.read[anchor_key(0)] == anchor_size  # read once, in place: not also through get_file
    assert out.read_bytes() == _save_file_bytes(states[2], tmp_path / "expected.safetensors")


def test_without_pieces_the_anchor_is_read_as_pull_reads_it(tmp_path):
    states = _states(3)
    _publish(tmp_path / "store", states, piece_bytes=None)
    out = tmp_path / "out.safetensors"
    assert ds.Subscriber(tmp_path / "store").pull_to_file(out) == 2
    assert out.read_bytes() == _save_file_bytes(states[2], tmp_path / "expected.safetensors")


@pytest.mark.parametrize("where", ["header", "data", "last byte"])
def test_a_changed_anchor_byte_is_refused_and_the_output_left_as_it_was(tmp_path, where):
    _publish(tmp_path / "store", _states(1), piece_bytes=1024)
    anchor = tmp_path / "store" / anchor_key(0)
    data = bytearray(anchor.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    at = {"header": 20, "data": header + (len(data) - header) // 2, "last byte": len(data) - 1}[where]
    data[at] ^= 0x01
    anchor.write_bytes(bytes(data))
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"kept")
    with pytest.raises(ds.ChainError, match=f"piece {at // 1024}"):
        ds.Subscriber(tmp_path / "store").pull_to_file(out)
    assert out.read_bytes() == b"kept"
    assert sorted(os.listdir(tmp_path)) == ["out.safetensors", "store"]


def test_a_truncated_anchor_is_refused(tmp_path):
    _publish(tmp_path / "store", _states(1), piece_bytes=1024)
    anchor = tmp_path / "store" / anchor_key(0)
    anchor.write_bytes(anchor.read_bytes()[:-1])
    with pytest.raises(ds.ChainError, match="bytes, its manifest entry says"):
        ds.Subscriber(tmp_path / "store").pull_to_file(tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_a_changed_newest_anchor_falls_back_to_an_older_one(tmp_path):
    states = _states(4)
    _publish(tmp_path / "store", states, piece_bytes=1024, anchor_every=2)
    newest = tmp_path / "store" / anchor_key(2)
    data = bytearray(newest.read_bytes())
    data[-100] ^= 0x10
    newest.write_bytes(bytes(data))
    out = tmp_path / "out.safetensors"
    assert ds.Subscriber(tmp_path / "store").pull_to_file(out) == 3  # anchor 0, then deltas 1, 2 and 3
    assert out.read_bytes() == _save_file_bytes(states[3], tmp_path / "expected.safetensors")


def test_a_rebuilt_state_that_misses_its_digest_writes_nothing(tmp_path, monkeypatch):
    _publish(tmp_path / "store", _states(2), piece_bytes=1024)
    monkeypatch.setattr("deltasync_rs._checkpoint.combine_hashes", lambda hashes: "0" * 32)
    out = tmp_path / "out.safetensors"
    with pytest.raises(ds.IntegrityError, match="does not match the state digest"):
        ds.Subscriber(tmp_path / "store").pull_to_file(out)
    assert not out.exists()
    assert os.listdir(tmp_path) == ["store"]


def test_a_store_without_local_files_and_a_ranged_subscriber_still_write_every_byte(tmp_path):
    """Without a local file the anchor is read as a pull reads it, and read whole even by a subscriber that reads
    anchors by ranges (a tensor-parallel rank's), whose partial anchors would leave unread bytes zero."""
    states = _states(3)
    _publish(tmp_path / "store", states, piece_bytes=1024)

    class Remote(ds.LocalStore):
        def open_local(self, key):
            return None

    first_tensor_only = lambda tensors: [(tensors[0].start, tensors[0].end)]  # noqa: E731
    subscriber = ds.Subscriber(Remote(tmp_path / "store", create=False), anchor_ranges=first_tensor_only)
    out = tmp_path / "out.safetensors"
    assert subscriber.pull_to_file(out) == 2
    assert out.read_bytes() == _save_file_bytes(states[2], tmp_path / "expected.safetensors")


def test_a_delta_naming_a_tensor_the_anchor_lacks_is_refused(tmp_path, monkeypatch):
    states = _states(2)
    _publish(tmp_path / "store", states, piece_bytes=1024)
    extra = {**states[1], "extra": np.ones(3, dtype=np.float32)}
    with ds.Publisher(tmp_path / "store", background=False) as publisher:
        # A store no publisher writes any more (resume refuses a state that is not the published step): made by
        # one whose resume check is fooled.
        digest = ds.Subscriber(tmp_path / "store").entry(1).state_digest
        monkeypatch.setattr("deltasync_rs.publisher.state_digest", lambda state: digest)
        publisher.resume(extra, step=1, copy=True)
        monkeypatch.undo()
        bumped = {**extra, "extra": np.full(3, 2.0, dtype=np.float32)}
        publisher.publish(2, bumped)
    out = tmp_path / "out.safetensors"
    with pytest.raises(ds.ChainError, match="not in the anchor"):
        ds.Subscriber(tmp_path / "store").pull_to_file(out, until=2)
    assert not out.exists()
    # Without a step asked for, the newest step that has a consistent way is written (as pull does), and said.
    assert ds.Subscriber(tmp_path / "store").pull_to_file(out) == 1
    assert out.read_bytes() == _save_file_bytes(states[1], tmp_path / "expected.safetensors")


def test_the_output_is_filled_patched_and_hashed_one_batch_at_a_time(tmp_path, monkeypatch):
    """Only a batch of the output is mapped at a time (so a pull's resident memory is a batch, not the checkpoint),
    every tensor is hashed once for the state digest, and the bytes do not depend on the batch size."""
    import deltasync_rs._checkpoint as checkpoint

    states = _states(3)
    _publish(tmp_path / "store", states, piece_bytes=1024)
    monkeypatch.setattr(checkpoint, "BATCH_BYTES", 2048)
    mapped, hashed = [], []
    arrays, hash_ = checkpoint.CheckpointFile.arrays, checkpoint.CheckpointFile.hash

    def recording_arrays(self, names=None, **options):
        assert not self._maps, "a batch is mapped while another still is"
        mapped.append(sum(self.ranges[n][1] - self.ranges[n][0] for n in names or self.ranges))
        return arrays(self, names, **options)

    monkeypatch.setattr(checkpoint.CheckpointFile, "arrays", recording_arrays)
    monkeypatch.setattr(checkpoint.CheckpointFile, "hash", lambda self, a: hashed.extend(a) or hash_(self, a))
    out = tmp_path / "out.safetensors"
    assert ds.Subscriber(tmp_path / "store").pull_to_file(out) == 2
    assert out.read_bytes() == _save_file_bytes(states[2], tmp_path / "expected.safetensors")
    largest = max(a.nbytes for a in states[2].values())
    assert len(mapped) > 2 and max(mapped) <= max(2048, largest)
    assert sorted(hashed) == sorted(states[2])


def test_a_lost_pieces_sidecar_falls_back_to_the_whole_file_sha256(tmp_path, caplog):
    states = _states(2)
    _publish(tmp_path / "store", states, piece_bytes=1024, whole_sha256=True)
    (tmp_path / "store" / pieces_key(0)).unlink()
    out = tmp_path / "out.safetensors"
    assert ds.Subscriber(tmp_path / "store").pull_to_file(out) == 1
    assert out.read_bytes() == _save_file_bytes(states[1], tmp_path / "expected.safetensors")
    assert "whole-file SHA-256 instead" in caplog.text
    anchor = tmp_path / "store" / anchor_key(0)
    data = bytearray(anchor.read_bytes())
    data[-1] ^= 1
    anchor.write_bytes(bytes(data))
    with pytest.raises(ds.ChainError, match="does not match the digest"):
        ds.Subscriber(tmp_path / "store", retries=1).pull_to_file(out)


def test_a_lost_pieces_sidecar_without_a_whole_file_sha256_is_an_error(tmp_path):
    """An entry of version 2 (the default: no whole-file SHA-256) has nothing else to check its anchor by, so a lost
    sidecar refuses the anchor, naming the sidecar, and the output file is not made."""
    states = _states(2)
    _publish(tmp_path / "store", states, piece_bytes=1024)
    (tmp_path / "store" / pieces_key(0)).unlink()
    out = tmp_path / "out.safetensors"
    with pytest.raises(ds.ChainError, match=r"step_000000000000\.pieces: no such object"):
        ds.Subscriber(tmp_path / "store", retries=1).pull_to_file(out)
    assert not out.exists()
    with pytest.raises(ds.ChainError, match=r"step_000000000000\.pieces: no such object"):
        ds.Subscriber(tmp_path / "store", retries=1).pull({k: np.zeros_like(v) for k, v in states[1].items()})


def test_a_refused_local_anchor_leaves_no_descriptor_open(tmp_path):
    """Both readers of a local anchor (pull's private copy, pull_to_file's output) close every file they opened when
    a piece is refused."""
    states = _states(1)
    _publish(tmp_path / "store", states, piece_bytes=1024)
    anchor = tmp_path / "store" / anchor_key(0)
    data = bytearray(anchor.read_bytes())
    data[-1] ^= 1
    anchor.write_bytes(bytes(data))
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(ds.ChainError, match="do not match its pieces sidecar"):
            ds.Subscriber(tmp_path / "store", retries=1).pull({k: np.zeros_like(v) for k, v in states[0].items()})
        with pytest.raises(ds.ChainError, match="do not match its pieces sidecar"):
            ds.Subscriber(tmp_path / "store", retries=1).pull_to_file(tmp_path / "out.safetensors")
    assert len(os.listdir("/proc/self/fd")) == before


def test_an_output_among_the_local_store_files_being_pulled_is_refused(tmp_path):
    """``deltasync pull -o`` onto one of the store's own files (its only anchor, say) would replace the file it
    is rebuilt from: refused before anything is written, and the store still verifies. Beside them, in the store's
    folder, is allowed."""
    store = tmp_path / "store"
    _publish(store, _states(3), anchor_every=10)
    (tmp_path / "link").symlink_to(store / "anchors")
    anchor = store / anchor_key(0)
    before = anchor.read_bytes()
    for target in (
        anchor,
        store / "manifest" / "x.safetensors",
        tmp_path / "link" / "x.safetensors",
        store / "run.json",
    ):
        with pytest.raises(ds.DeltaSyncError, match="one of the files of the store"):
            ds.Subscriber(store).pull_to_file(target)
    assert anchor.read_bytes() == before and not (store / "manifest" / "x.safetensors").exists()
    assert not ds.sync.verify_store(ds.LocalStore(store))
    assert ds.Subscriber(store).pull_to_file(store / "model.safetensors") == 2
    for bad in (None, 3):
        with pytest.raises(ds.DeltaSyncError, match="path must be"):
            ds.Subscriber(store).pull_to_file(bad)
