"""Safety checks of ``pull_to_file``, ranged anchor reads and sharded checkpoint indexes that no other test pins: each
test fails if its check is removed. Most anchors here are rewritten as a buggy or hostile publisher of an unsigned
store would write them: the file changed, its pieces sidecar, manifest entry, chain and latest.json made to agree."""

from __future__ import annotations

import errno
import hashlib
import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

import deltasync_rs as ds
from deltasync_rs._ranged import PartialAnchor
from deltasync_rs._sharded import checkpoint_files
from deltasync_rs.manifest import anchor_key, delta_key, entry_key
from tests.helpers import relink, republish_anchor


def _states(steps: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    state = {
        "a.weight": rng.normal(size=(64, 48)).astype(np.float32),
        "b.bias": rng.normal(size=(48,)).astype(np.float32),
    }
    return [{name: array + step for name, array in state.items()} for step in range(steps)]


def _sparse_states(steps: int) -> list[dict[str, np.ndarray]]:
    """States whose steps change a tenth and a seventh of their two tensors: deltas with a base for each."""
    rng = np.random.default_rng(7)
    states = [{"a": rng.normal(size=1000).astype(np.float32), "b": rng.normal(size=500).astype(np.float32)}]
    for step in range(1, steps):
        state = {name: array.copy() for name, array in states[-1].items()}
        state["a"][step::10] += 1
        state["b"][step::7] += 1
        states.append(state)
    return states


def _ranged_state() -> dict[str, np.ndarray]:
    """Two small tensors of one 1 KiB piece each, then a large one: a reader of the first tensors reads little."""
    rng = np.random.default_rng(1)
    return {
        "a": rng.normal(size=256).astype(np.float32),
        "b": rng.normal(size=256).astype(np.float32),
        "z": rng.normal(size=(64, 256)).astype(np.float32),
    }


def _publish(root, states, **options):
    options.setdefault("piece_bytes", 1024)
    with ds.Publisher(root, background=False, **options) as publisher:
        for step, state in enumerate(states):
            publisher.publish(step, state)
    return root


def _anchor(root, step: int = 0) -> tuple[dict, bytes]:
    """The header (as a dict) and the data section of the anchor of ``step``."""
    blob = (root / anchor_key(step)).read_bytes()
    length = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + length]), blob[8 + length :]


def _laid_out(header, data: bytes) -> bytes:
    """A safetensors file of ``header`` (any JSON value) and ``data``, written without a file checksum."""
    if isinstance(header, dict):
        header = {**header, "__metadata__": {k: v for k, v in header["__metadata__"].items() if k != "file_xxh3"}}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data


def _last_tensor(header: dict) -> str:
    return max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])


def _pull_to_file_refuses(root, tmp_path, match: str) -> None:
    """pull_to_file of the store at ``root`` raises ChainError matching ``match`` and writes nothing."""
    out = tmp_path / "out.safetensors"
    with pytest.raises(ds.ChainError, match=match):
        ds.Subscriber(root, retries=1).pull_to_file(out)
    assert sorted(os.listdir(tmp_path)) == ["store"]


def test_a_tensor_spanning_more_bytes_than_its_shape_is_refused(tmp_path):
    """A tensor whose data_offsets span more bytes than its shape needs would be copied past the end of its slot
    in the output (here past the end of the file), and the damaged file renamed into place as a success."""
    root = _publish(tmp_path / "store", _states())
    header, data = _anchor(root)
    last = _last_tensor(header)
    header[last]["data_offsets"][1] += 8
    republish_anchor(root, 0, _laid_out(header, data + b"\xff" * 8))
    _pull_to_file_refuses(root, tmp_path, f"tensor '{last}' takes 200 bytes, not its shape's")


def _trailing(header: dict, data: bytes) -> tuple[dict, bytes]:
    return header, data + b"\0" * 4096


def _gap(header: dict, data: bytes) -> tuple[dict, bytes]:
    """4 KiB of zeros between the first tensor and the second."""
    first = min((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])
    end = header[first]["data_offsets"][1]
    for name, info in header.items():
        if name != "__metadata__" and info["data_offsets"][0] >= end:
            info["data_offsets"] = [offset + 4096 for offset in info["data_offsets"]]
    return header, data[:end] + b"\0" * 4096 + data[end:]


def _overlap(header: dict, data: bytes) -> tuple[dict, bytes]:
    """The last tensor moved onto the last bytes of the one before it (its own bytes dropped)."""
    last = _last_tensor(header)
    start, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [start - (end - start), start]
    return header, data[:start]


@pytest.mark.parametrize(
    "layout, match",
    [
        (_trailing, r"its tensors end at byte \d+ of \d+"),
        (_gap, r"tensor 'b\.bias' starts at byte \d+, not at \d+ where the last ended"),
        (_overlap, r"tensor 'b\.bias' starts at byte \d+, not at \d+ where the last ended"),
    ],
    ids=["trailing bytes", "gap", "overlap"],
)
def test_tensors_that_do_not_tile_the_data_are_refused(tmp_path, layout, match):
    """Bytes after the last tensor or between two lie in no tensor, so no copy checks their pieces: a damaged one
    (a bad sector) would go unnoticed; tensors that overlap share bytes, which safetensors forbids. Each is refused
    before the output is made, even when the state digest in the entry is the overlapping state's."""
    root = _publish(tmp_path / "store", _states())
    header, data = layout(*_anchor(root))
    blob = bytearray(_laid_out(header, data))
    tensors = {n: i for n, i in header.items() if n != "__metadata__"}
    offsets = sorted((i["data_offsets"] for i in tensors.values()), key=lambda o: o[0])
    start = len(blob) - len(data)
    if layout is _gap:
        blob[start + offsets[0][1] + 2048] ^= 0xFF  # damaged after the sidecar was written, in the gap
    elif layout is _trailing:
        blob[-1] ^= 0xFF
    state = {
        n: np.frombuffer(data[i["data_offsets"][0] : i["data_offsets"][1]], np.float32).reshape(i["shape"])
        for n, i in tensors.items()
    }
    republish_anchor(root, 0, _laid_out(header, data), state_digest=ds.state_digest(state))
    (root / anchor_key(0)).write_bytes(bytes(blob))
    _pull_to_file_refuses(root, tmp_path, match)


def test_a_header_over_safetensors_cap_is_refused(tmp_path):
    """safetensors caps a header at 100,000,000 bytes (docs/format.md §1): without the cap pull_to_file reads a
    header of any size the file claims into memory, and accepts a file that pull() refuses."""
    root = _publish(tmp_path / "store", _states(), piece_bytes=1 << 20)
    header, data = _anchor(root)
    header["__metadata__"]["pad"] = "x" * 100_000_100
    republish_anchor(root, 0, _laid_out(header, data))
    _pull_to_file_refuses(root, tmp_path, r"a header of 100000\d{3} bytes does not fit the file")


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("kind", "delta", "not a deltasync anchor"),
        ("step", "7", "the file says step 7, its entry step 0"),
        ("format_version", "3", "format version '3' is not one this reader knows"),
    ],
)
def test_an_anchor_whose_metadata_disagrees_is_refused(tmp_path, field, value, match):
    """A file that says it is a delta, the anchor of another step, or of a format version this reader does not
    know is not read as the anchor of its entry's step (pull() refuses it too)."""
    root = _publish(tmp_path / "store", _states())
    header, data = _anchor(root)
    header["__metadata__"][field] = value
    republish_anchor(root, 0, _laid_out(header, data))
    _pull_to_file_refuses(root, tmp_path, match)


def _unknown_dtype(header: dict) -> dict:
    header["b.bias"]["dtype"] = "Q9"
    return header


def _negative_dimensions(header: dict) -> dict:
    header["b.bias"]["shape"] = [-6, -8]  # 48 elements: the byte count still agrees
    return header


def _not_an_object(header: dict) -> list:
    return []


@pytest.mark.parametrize(
    "edit, reader, match",
    [
        (_unknown_dtype, "pull_to_file", "tensor 'b.bias' has dtype 'Q9', which no state holds"),
        (_negative_dimensions, "pull_to_file", "the header entry of 'b.bias' is malformed"),
        (_not_an_object, "pull_to_file", "the header is not a JSON object"),
        (_not_an_object, "ranged", "the header is not a JSON object"),
    ],
    ids=["unknown dtype", "negative dimensions", "not an object", "not an object, ranged"],
)
def test_a_malformed_header_is_a_format_error_not_a_crash(tmp_path, edit, reader, match):
    """A malformed anchor header is a DeltaSyncError naming the file and what is wrong, so that the subscriber
    tries another way: not a bare KeyError, OverflowError or AttributeError out of the pull."""
    root = _publish(tmp_path / "store", _states())
    header, data = _anchor(root)
    republish_anchor(root, 0, _laid_out(edit(header), data))
    if reader == "pull_to_file":
        _pull_to_file_refuses(root, tmp_path, match)
    else:
        subscriber = ds.Subscriber(root, retries=1, anchor_ranges=lambda tensors: [(0, 8)])
        with pytest.raises(ds.ChainError, match=match):
            subscriber.fetch(None)


def test_posix_fallocate_reporting_a_full_disk_is_a_clean_error(tmp_path, monkeypatch):
    """A full disk must be reported when the output is created: with the error swallowed the file is left sparse
    and a write through its memory map on a really full disk kills the process with SIGBUS, leaving the temporary
    file behind. Simulated by posix_fallocate raising ENOSPC."""
    root = _publish(tmp_path / "store", _states())

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    out = tmp_path / "out.safetensors"
    with pytest.raises(ds.DeltaSyncError, match=r"cannot write a checkpoint of \d+ bytes: .*No space left on device"):
        ds.Subscriber(root, retries=1).pull_to_file(out)
    assert sorted(os.listdir(tmp_path)) == ["store"]


def test_pull_to_file_checks_each_delta_against_the_base_it_patches(tmp_path):
    """The deltas pull_to_file applies to its output are checked against their base identity: a delta applied onto
    a base it was not made against (a wrong anchor in the store) is a BaseMismatchError naming the tensor, before
    anything is written, not a wrong tensor found only by the final digest check."""
    from deltasync_rs._checkpoint import apply_to

    states = _states(2)
    root = _publish(tmp_path / "store", states)
    delta = ds.load(str(root / delta_key(1)))
    arrays = {"a.weight": states[0]["a.weight"] + 2, "b.bias": states[0]["b.bias"].copy()}
    before = {name: array.copy() for name, array in arrays.items()}
    with pytest.raises(ds.BaseMismatchError, match='tensor "a.weight": the target is not the base this delta was made'):
        apply_to([delta], arrays, check_base=True)
    for name, array in arrays.items():
        np.testing.assert_array_equal(array, before[name])
    apply_to([delta], {name: array.copy() for name, array in states[0].items()}, check_base=True)  # the right base


def _applied_to_zeros(deltas, like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    state = {name: np.zeros_like(array) for name, array in like.items()}
    for delta in deltas:
        delta.apply_(state)
    return state


def _assert_holds(state: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    for name, array in expected.items():
        np.testing.assert_array_equal(state[name], array)


def _wrong_newest_anchor(root, states):
    """Anchors at steps 0 and 2, deltas 1 to 3; the anchor of step 2 replaced by step 0's tensors, labelled step 2,
    with everything that vouches for it made to agree: a publisher that wrote a wrong anchor into an unsigned store.
    Delta 3 was made against the real step 2, so it disagrees with that anchor; anchor 0 and deltas 1 to 3 agree."""
    _publish(root, states, anchor_every=2)
    header, data = _anchor(root, 0)
    header["__metadata__"]["step"] = "2"
    republish_anchor(root, 2, _laid_out(header, data))


def test_pull_to_file_takes_an_older_anchor_where_the_newest_disagrees_with_its_deltas(tmp_path):
    """Every base pull_to_file patches comes from the store: a delta that does not fit the newest anchor means that
    anchor is wrong, and the way from an older anchor is taken (it was a BaseMismatchError, with no other way tried,
    though one gave the published step)."""
    states = _states(4)
    root = tmp_path / "store"
    _wrong_newest_anchor(root, states)
    out = tmp_path / "out.safetensors"
    assert ds.Subscriber(root, retries=1).pull_to_file(out) == 3
    save_file(states[3], str(tmp_path / "expected.safetensors"))
    assert out.read_bytes() == (tmp_path / "expected.safetensors").read_bytes()


@pytest.mark.parametrize("where", ["local", "copied"])
def test_a_pull_takes_an_older_anchor_where_the_newest_disagrees_with_its_deltas(tmp_path, where):
    """pull() applied the wrong anchor of step 2 (step 0's tensors), then refused delta 3 as made for another base,
    and the subscriber went on saying it held step 2: a caller that logged the error and served on served step 0's
    weights as step 2's. Then it raised, holding no step, though anchor 0 and deltas 1 to 3 give step 3. Now it takes
    that way: applied from a local store's file ("local"), the apply refuses delta 3 and the way is taken again from
    anchor 0; read into a checked copy ("copied", as from a remote store), the anchor is compared with delta 3's
    bases before anything is applied."""
    states = _states(4)
    root = tmp_path / "store"
    _wrong_newest_anchor(root, states)
    store = ds.LocalStore(root, create=False)
    if where == "copied":
        store.open_local = lambda key: None  # type: ignore[method-assign]  # no file to fill from: a checked copy
    state = {name: np.zeros_like(array) for name, array in states[0].items()}
    subscriber = ds.Subscriber(store, retries=1)
    assert subscriber.pull(state) == 3 and subscriber.step == 3
    _assert_holds(state, states[3])
    # The refused anchor is not taken again: the next pull from scratch goes the same way.
    again = {name: np.zeros_like(array) for name, array in states[0].items()}
    assert ds.Subscriber(store, retries=1).pull(again) == 3


def test_a_pull_whose_only_anchor_its_deltas_disagree_with_holds_no_step(tmp_path):
    """With no other anchor to take, the wrong anchor is an IntegrityError naming it, and the subscriber holds no
    step (the state holds that anchor's tensors)."""
    states = _states(3)
    root = tmp_path / "store"
    _publish(root, states)
    republish_anchor(root, 0, ds.anchor(states[1], step=0).to_bytes())
    state = {name: np.zeros_like(array) for name, array in states[0].items()}
    subscriber = ds.Subscriber(root, retries=1)
    with pytest.raises(ds.IntegrityError, match="was not made against the state the anchor of step 0 gives"):
        subscriber.pull(state)
    assert subscriber.step is None


@pytest.mark.parametrize("ranged", [False, True])
def test_fetch_returns_no_anchor_its_first_delta_was_not_made_against(tmp_path, ranged):
    """fetch() from no step handed over the wrong anchor of step 2 and delta 3, every file matching its entry: a
    caller applying them without a base check (as the vLLM workers do by default) held step 0's weights patched by
    delta 3, reported as step 3. Now the anchor's tensors (those read whole, for an anchor read by ranges) are
    compared with delta 3's base identities before anything is returned, and the way from anchor 0 is taken."""
    states = [{name: array + step for name, array in _ranged_state().items()} for step in range(4)]
    root = tmp_path / "store"
    _wrong_newest_anchor(root, states)
    subscriber = ds.Subscriber(root, retries=1, anchor_ranges=_first_tensor_only if ranged else None)
    deltas = subscriber.fetch(None)
    assert [d.step for d in deltas] == [0, 1, 2, 3]
    assert isinstance(deltas[0], PartialAnchor) == ranged
    if not ranged:
        _assert_holds(_applied_to_zeros(deltas, states[0]), states[3])


def test_fetch_refuses_an_anchor_whose_tensors_do_not_make_its_entrys_state_digest(tmp_path):
    """The newest step's anchor holds step 0's tensors, every file matching its entry, whose state digest is the
    real one's: no delta follows it to compare with, and fetch() handed it over (a vLLM worker applied it as that
    step). Read whole, its tensors' digest is now compared with its entry's, and the way from anchor 0 is taken."""
    states = _states(3)
    root = tmp_path / "store"
    _publish(root, states, anchor_every=2)
    republish_anchor(root, 2, ds.anchor(states[0], step=2).to_bytes())
    deltas = ds.Subscriber(root, retries=1).fetch(None)
    assert [d.step for d in deltas] == [0, 1, 2]
    _assert_holds(_applied_to_zeros(deltas, states[0]), states[2])


def test_a_pull_takes_an_older_anchor_where_the_newest_step_is_a_wrong_anchor(tmp_path):
    """The same store pulled from its local files (the anchor applied straight from its file, never read whole
    first): the state's digest did not match step 2's entry, the re-sync took the same anchor, and the pull raised,
    the subscriber still saying it held step 2 over step 0's weights (a second pull returned 2 at once). An anchor
    that alone misses its entry's digest is now not used again: the way from anchor 0 is taken."""
    states = _states(3)
    root = tmp_path / "store"
    _publish(root, states, anchor_every=2)
    republish_anchor(root, 2, ds.anchor(states[0], step=2).to_bytes())
    state = {name: np.zeros_like(array) for name, array in states[0].items()}
    subscriber = ds.Subscriber(root, retries=1)
    assert subscriber.pull(state) == 2 and subscriber.step == 2
    _assert_holds(state, states[2])


def test_a_pull_that_leaves_a_state_no_entry_vouches_for_holds_no_step(tmp_path):
    """The only anchor is wrong (its entry's digest the real state's): an IntegrityError, and the subscriber holds
    no step, so that a caller that goes on, or pulls again, is not told that the state is at step 0."""
    states = _states(1)
    root = tmp_path / "store"
    _publish(root, states)
    republish_anchor(root, 0, ds.anchor({name: array + 7 for name, array in states[0].items()}, step=0).to_bytes())
    state = {name: np.zeros_like(array) for name, array in states[0].items()}
    subscriber = ds.Subscriber(root, retries=1)
    with pytest.raises(ds.IntegrityError, match="state digest at step 0 does not match"):
        subscriber.pull(state)
    assert subscriber.step is None
    with pytest.raises(ds.ChainError, match="the anchor of step 0 was refused"):
        subscriber.pull(state)
    assert subscriber.step is None


def test_a_re_sync_that_fails_leaves_the_subscriber_holding_no_step(tmp_path):
    """The state changed behind the subscriber's back (no base check), so its digest misses the entry after the
    pull, and the re-sync from an anchor then failed (the store's anchors gone, here made to fail): the subscriber
    went on saying it held the step over the changed weights."""
    states = _sparse_states(3)
    root = tmp_path / "store"
    _publish(root, states)
    subscriber = ds.Subscriber(root, retries=1, check_base=False)
    state = {name: np.zeros_like(array) for name, array in states[0].items()}
    assert subscriber.pull(state, until=1) == 1
    state["a"][0] += 5
    real = subscriber._fetch_to_apply

    def no_anchor_left(current_step, until, **options):
        if current_step is None:
            raise ds.ChainError("the store holds no anchor now")
        return real(current_step, until, **options)

    subscriber._fetch_to_apply = no_anchor_left
    with pytest.raises(ds.ChainError, match="holds no anchor now"):
        subscriber.pull(state)
    assert subscriber.step is None
    # A subscriber at the newest step given a new target, which it cannot bring there: nothing is written into that
    # target, so the step stays that of the state it pulled.
    subscriber = ds.Subscriber(root, retries=1)
    assert subscriber.pull({name: np.zeros_like(array) for name, array in states[0].items()}) == 2
    real = subscriber._fetch_to_apply
    subscriber._fetch_to_apply = no_anchor_left
    target = {name: np.zeros_like(array) for name, array in states[0].items()}
    with pytest.raises(ds.ChainError, match="holds step 2, which the store can no longer rebuild"):
        subscriber.pull(target)
    assert subscriber.step == 2 and not any(array.any() for array in target.values())


def test_an_older_anchors_way_that_fails_after_a_wrong_anchor_was_written_holds_no_step(tmp_path):
    """A subscriber at step 3 whose state drifted re-syncs from the newest anchor (4, wrong: step 0's tensors),
    refuses it after writing it, and the older anchor's way (2, wrong too: a tensor more) is refused before writing
    anything: the re-sync put back the step it held (3), though the state held anchor 4's tensors."""
    states = _sparse_states(6)
    root = tmp_path / "store"
    _publish(root, states, anchor_every=2, keep_anchors=10)
    republish_anchor(root, 2, ds.anchor({**states[2], "c": np.ones(4, np.float32)}, step=2).to_bytes())
    republish_anchor(root, 4, ds.anchor(states[0], step=4).to_bytes())
    subscriber = ds.Subscriber(root, retries=1)
    state = {name: np.zeros_like(array) for name, array in states[0].items()}
    assert subscriber.pull(state, until=1) == 1 and subscriber.pull(state, until=3) == 3
    state["a"][0] += 1
    with pytest.raises(ds.IntegrityError, match="the way from an older anchor, taken after a wrong anchor"):
        subscriber.pull(state)
    assert subscriber.step is None


def test_an_anchor_that_lacks_a_tensor_the_next_delta_was_made_against_is_refused(tmp_path):
    """A wrong anchor of step 2 that holds only one of the two tensors (step 2's own), every file matching its entry:
    fetch() handed it over with delta 3, whose other tensor then applied to whatever the caller held. A tensor the
    delta names with a base must be in the anchor, of the record's dtype and shape: refused, anchor 0's way taken."""
    states = _sparse_states(4)
    root = tmp_path / "store"
    _publish(root, states, anchor_every=2)
    held = {"a": states[2]["a"]}  # and its entry's state digest made to agree
    republish_anchor(root, 2, ds.anchor(held, step=2).to_bytes(), state_digest=ds.state_digest(held))
    assert [d.step for d in ds.Subscriber(root, retries=1).fetch(None)] == [0, 1, 2, 3]


def _republish_delta(root, step: int, blob: bytes) -> None:
    """Replaces the delta of ``step`` by ``blob``, its entry, the chain after it and latest.json made to agree."""
    entry = json.loads((root / entry_key(step)).read_text())
    (root / delta_key(step)).write_bytes(blob)
    entry["delta"].update(size=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    (root / entry_key(step)).write_text(json.dumps(entry))
    relink(root, step)


def test_a_delta_that_fits_no_state_of_its_way_refuses_no_anchor(tmp_path):
    """Delta 5 made against step 3's state, labelled as applying to step 4 (anchors 0 and 3 are right): pull()
    blamed the anchor before it for any delta that did not fit, refused anchors 3 and 0 both for good, and the same
    subscriber could then pull no step at all. Only the delta right after an anchor incriminates it now: this is an
    IntegrityError naming the way, no anchor is refused, and step 4 still pulls."""
    states = _states(6)
    root = tmp_path / "store"
    _publish(root, states, anchor_every=3)
    _republish_delta(root, 5, ds.diff(states[3], states[5], step=5, base_step=4).to_bytes())
    subscriber = ds.Subscriber(root, retries=1)
    state = {name: np.zeros_like(array) for name, array in states[0].items()}
    with pytest.raises(ds.IntegrityError, match="the delta of step 5 was not made against the state the way from"):
        subscriber.pull(state)
    assert subscriber.step is None and not subscriber._refused_anchors
    assert subscriber.pull(state, until=4) == 4
    _assert_holds(state, states[4])


def test_a_numpy_target_that_is_a_strided_view_is_filled(tmp_path):
    """A non-contiguous numpy target (a transposed view) cannot be filled in place from the anchor's file: filled
    through ``reshape(-1)`` (a copy) it would keep its old bytes while the pull reports success or fails."""
    states = _states()
    root = _publish(tmp_path / "store", states)
    target = {"a.weight": np.zeros((48, 64), np.float32).T, "b.bias": np.zeros(48, np.float32)}
    assert not target["a.weight"].flags.c_contiguous
    assert ds.Subscriber(root, retries=1).pull(target) == 0
    for name, array in states[0].items():
        np.testing.assert_array_equal(target[name], array)


def _first_tensor_only(tensors):
    first = min(tensors, key=lambda t: t.start)
    return [(first.start, first.end)]


def test_a_partial_anchor_is_not_applied_to_a_whole_state(tmp_path):
    """An anchor read by ranges holds zeros where it was not read: pull() into a whole state refuses it before
    writing anything, rather than overwriting the caller's weights with those zeros."""
    state = _ranged_state()
    root = _publish(tmp_path / "store", [state])
    target = {name: np.ones_like(array) for name, array in state.items()}
    subscriber = ds.Subscriber(root, retries=1, anchor_ranges=_first_tensor_only)
    with pytest.raises(ds.DeltaSyncError, match="only part of this anchor was read"):
        subscriber.pull(target)
    for name, array in target.items():
        assert (array == 1).all(), name


@pytest.mark.parametrize("start, past", [(0, 64), (-64, 0)], ids=["past the end", "before the start"])
def test_a_span_outside_its_tensor_is_refused(tmp_path, start, past):
    """Bytes asked of a tensor of a partial anchor must lie in that tensor: a wrong shard computation would be given
    the next tensor's bytes (or the header's) as this tensor's."""
    root = _publish(tmp_path / "store", [_ranged_state()])
    first_two = lambda tensors: [(t.start, t.end) for t in sorted(tensors, key=lambda t: t.start)[:2]]  # noqa: E731
    (partial,) = ds.Subscriber(root, anchor_ranges=first_two).fetch(None)
    assert isinstance(partial, PartialAnchor)
    size = 256 * 4
    end = size + past
    with pytest.raises(ds.DeltaSyncError, match=f"bytes {start}..{end} are outside tensor 'a'"):
        partial.tensor_bytes("a", start, end)
    with pytest.raises(ds.DeltaSyncError, match=f"bytes {start}..{end} are outside tensor 'a'"):
        partial.require("a", start, end)


def test_a_bad_range_from_the_ranges_callback_is_blamed_on_the_callback(tmp_path):
    """A range past the end of the file from ``anchor_ranges`` is the caller's bug: a DeltaSyncError saying what was
    asked, not a ChainError or IntegrityError that blames the store."""
    root = _publish(tmp_path / "store", [_ranged_state()])
    size = (root / anchor_key(0)).stat().st_size
    subscriber = ds.Subscriber(root, retries=1, anchor_ranges=lambda tensors: [(size + 4096, size + 8192)])
    with pytest.raises(
        ds.DeltaSyncError, match=f"asked for bytes {size + 4096}..{size + 8192} of a {size}-byte file"
    ) as caught:
        subscriber.fetch(None)
    assert caught.type is ds.DeltaSyncError


def test_a_sharded_index_with_an_empty_weight_map_is_refused(tmp_path):
    """An index whose weight_map is empty (a botched save) would read as an empty state, its shards never looked
    at, and fail later with errors that do not name the index."""
    save_file({"w": np.ones((4, 4), np.float32)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    for path in (tmp_path, index):
        with pytest.raises(ds.DeltaFormatError, match=r"index\.json: its weight_map is not an object naming"):
            checkpoint_files(str(path))
