"""Safety checks of the sync protocol (subscriber.py, publisher.py, manifest.py, store.py) that no other test pins:
each test fails if its check is weakened or removed. Stores are rewritten here as someone who can write to the store
would rewrite them (without the signing key where the store is signed)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

import deltasync_rs as ds
from deltasync_rs.manifest import anchor_key, delta_key, entry_key
from tests.helpers import relink


def _states(steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``steps`` states of two small float32 tensors, each a few elements on from the one before."""
    rng = np.random.default_rng(seed)
    state = {"a": rng.normal(size=64).astype(np.float32), "b": rng.normal(size=32).astype(np.float32)}
    out = []
    for step in range(steps):
        state = {name: array.copy() for name, array in state.items()}
        if step:
            state["a"][step % 64] += 1.0
        out.append(state)
    return out


def _publish(root, states, first: int = 0, **options):
    options.setdefault("background", False)
    with ds.Publisher(root, **options) as publisher:
        for step, state in enumerate(states, start=first):
            publisher.publish(step, state)
    return root


def _zeros(state):
    return {name: np.zeros_like(array) for name, array in state.items()}


def _equal(a, b) -> bool:
    return list(a) == list(b) and all(np.array_equal(a[n].view(np.uint8), b[n].view(np.uint8)) for n in a)


def test_a_new_target_lacking_a_published_tensor_is_not_reported_at_the_step_held(tmp_path):
    """A subscriber at its newest step is handed a new target that lacks one of the published tensors, with nothing
    new to pull: it returned its step without writing a byte into the target (a partial state skips the digest
    check), where a fresh subscriber refuses that very target. Now it is refused the same way, nothing written."""
    states = _states(1)
    root = _publish(tmp_path / "store", states)
    subscriber = ds.Subscriber(root)
    assert subscriber.pull(_zeros(states[0])) == 0
    with pytest.raises(ds.BaseMismatchError):
        ds.Subscriber(root).pull({"a": np.zeros(64, np.float32)})  # a fresh subscriber refuses it
    partial = {"a": np.zeros(64, np.float32)}
    with pytest.raises(ds.BaseMismatchError, match="'b'"):
        subscriber.pull(partial)
    assert not partial["a"].any()


def _rewrite_entry(root, step: int, change) -> None:
    """Entry ``step`` of an unsigned store rewritten by ``change(document)``, with the entries after it and
    latest.json made to name it again (as a buggy or hostile publisher of that store writes them)."""
    path = root / entry_key(step)
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))
    relink(root, step)


def test_a_pieces_sidecar_of_an_unknown_hash_is_an_integrity_error_not_a_type_error(tmp_path):
    """A sidecar whose magic this reader does not know (a later version's hash, or damaged in a store that vouches
    for it): without the magic check the pull crashed with a bare TypeError from the hash call, which no caller
    catching DeltaSyncError (the CLI, the vLLM hook) handles, and no other way was tried."""
    states = _states(1)
    root = _publish(tmp_path / "store", states, piece_bytes=1024)
    sidecar = root / "anchors" / "step_000000000000.pieces"
    raw = b"DSPIECE9" + sidecar.read_bytes()[8:]
    sidecar.write_bytes(raw)

    def change(document):
        document["anchor"]["pieces"]["sha256"] = hashlib.sha256(raw).hexdigest()

    _rewrite_entry(root, 0, change)
    target = _zeros(states[0])
    with pytest.raises(ds.DeltaSyncError, match="not a pieces sidecar"):
        ds.Subscriber(root, retries=1).pull(target)
    assert not target["a"].any()
    with pytest.raises(ds.DeltaSyncError, match="not a pieces sidecar"):
        ds.Subscriber(root, retries=1).pull_to_file(tmp_path / "out.safetensors")


KEY = b"helper53-test-key"


def test_a_non_ascii_signature_is_a_bad_signature_not_a_type_error(tmp_path):
    """Someone without the key puts an entry above the run's steps (and a pointer naming it) whose signature holds
    non-ASCII characters: hmac.compare_digest raises TypeError on such a str, which no reader catches. Without the
    ASCII check every subscriber of the signed store crashed with it instead of skipping the entry as forged."""
    states = _states(3)
    root = _publish(tmp_path / "store", states, signing_key=KEY)
    forged = json.loads((root / entry_key(2)).read_text())
    forged.update(step=7, signature="\u00e9" * 64)
    (root / entry_key(7)).write_text(json.dumps(forged))
    target = _zeros(states[0])
    assert ds.Subscriber(root, signing_key=KEY, retries=1).pull(target) == 2
    assert _equal(target, states[2])
    pointer = json.loads((root / "latest.json").read_text())
    (root / "latest.json").write_text(json.dumps({**pointer, "signature": "\u00e9" * 64}))
    target = _zeros(states[0])
    assert ds.Subscriber(root, signing_key=KEY, retries=1).pull(target) == 2
    assert _equal(target, states[2])


def test_a_signed_entry_copied_under_a_later_step_s_key_does_not_hold_readers_back(tmp_path):
    """Someone without the key copies the signed entry of step 1 to manifest/step_9.json (a valid signature, of this
    run). Without the check that an entry's step is its key's, it was taken as the newest entry, for step 1: fresh
    subscribers pulled step 1's weights instead of step 3's, and kept doing so however many steps the publisher
    went on to publish below 9 (the pointer's disagreement only logged)."""
    states = _states(6)
    root = _publish(tmp_path / "store", states[:4], signing_key=KEY)
    (root / entry_key(9)).write_bytes((root / entry_key(1)).read_bytes())
    target = _zeros(states[0])
    assert ds.Subscriber(root, signing_key=KEY, retries=1).pull(target) == 3
    assert _equal(target, states[3])
    with ds.Publisher(root, background=False, signing_key=KEY) as publisher:
        publisher.publish(4, states[4])
        publisher.publish(5, states[5])
    target = _zeros(states[0])
    assert ds.Subscriber(root, signing_key=KEY, retries=1).pull(target) == 5
    assert _equal(target, states[5])


def test_verify_reports_a_pointer_naming_a_step_whose_entry_is_gone(tmp_path):
    """The newest step's entry removed from the store (a pointer left naming it): without the check that the pointer
    names no step beyond the newest verified entry, verify() reported nothing at all, although the store's newest
    published step can no longer be pulled by anyone."""
    states = _states(3)
    root = _publish(tmp_path / "store", states, signing_key=KEY)
    (root / entry_key(2)).unlink()
    (root / delta_key(2)).unlink()
    problems = ds.Subscriber(root, signing_key=KEY, retries=1).verify()
    assert any("latest.json names step 2" in problem for problem in problems), problems


class _RemoteStore(ds.LocalStore):
    """A local folder read as a remote store is: no object is opened in place, so anchors are downloaded into a
    private temporary file and checked there."""

    def open_local(self, key):
        return None


def _swap_anchor(root, step: int, state) -> None:
    """The anchor of ``step`` replaced, by someone without the key, by a well-formed anchor of ``state`` (another
    state of the same tensors: the same size), leaving the signed entry and its pieces sidecar as they are."""
    forged = ds.anchor(state, step=step).to_bytes()
    path = root / anchor_key(step)
    assert len(forged) == path.stat().st_size
    path.write_bytes(forged)


def test_a_downloaded_anchor_is_checked_piece_by_piece_against_the_signed_sidecar(tmp_path):
    """From a store whose anchors are downloaded (S3, GCS, a Hugging Face Bucket), an anchor that a writer without
    the key replaced by another state's: the entry (version 2) has no whole-file SHA-256, so the pieces are the only
    check. Without it fetch handed the forged anchor on as verified (and pull_to_file wrote it out, caught only by
    the state digest)."""
    states = _states(2)
    root = _publish(tmp_path / "store", states[:1], signing_key=KEY, piece_bytes=1024)
    _swap_anchor(root, 0, {name: array + 1 for name, array in states[0].items()})
    subscriber = ds.Subscriber(_RemoteStore(root, create=False), signing_key=KEY, retries=1)
    with pytest.raises(ds.DeltaSyncError, match="do not match its pieces sidecar"):
        subscriber.fetch(None)


def test_an_anchor_file_its_entry_does_not_name_is_passed_over(tmp_path):
    """An anchor file left beside a step whose entry names none (a publisher killed between an anchor and its entry,
    whose step was then published again as a delta; or a file put there by someone without the key): ways are
    planned from the anchors/ listing, and without the check that the entry names an anchor the way from it was
    downloaded as one, an AssertionError that stopped every fresh subscriber instead of taking the anchor before."""
    states = _states(4)
    root = _publish(tmp_path / "store", states, signing_key=KEY)
    (root / anchor_key(2)).write_bytes((root / anchor_key(0)).read_bytes())
    target = _zeros(states[0])
    assert ds.Subscriber(root, signing_key=KEY, retries=1).pull(target) == 3
    assert _equal(target, states[3])
    ds.Subscriber(root, signing_key=KEY, retries=1).pull_to_file(tmp_path / "out.safetensors")


def test_verify_reports_an_entry_put_back_from_a_history_the_run_left(tmp_path):
    """A publisher resumed at step 1 publishes steps 2 and 3 again; someone without the key puts the first history's
    signed entry and delta of step 2 back (both verify, and are of this run). Subscribers refuse that chain (the
    link of step 3 names the other entry 2), but without the link check verify() called the store sound."""
    states, other = _states(4), _states(4, seed=1)
    root = _publish(tmp_path / "store", states, signing_key=KEY)
    old_entry, old_delta = (root / entry_key(2)).read_bytes(), (root / delta_key(2)).read_bytes()
    with ds.Publisher(root, background=False, signing_key=KEY) as publisher:
        publisher.resume(states[1], step=1)
        publisher.publish(2, other[2])
        publisher.publish(3, other[3])
    (root / entry_key(2)).write_bytes(old_entry)
    (root / delta_key(2)).write_bytes(old_delta)
    problems = ds.Subscriber(root, signing_key=KEY, retries=1).verify()
    assert any("step 3" in problem and "base_entry_sha256" in problem for problem in problems), problems


def test_a_publisher_without_the_key_refuses_a_signed_store(tmp_path, monkeypatch):
    """A trainer restarted without DELTASYNC_SIGNING_KEY on a signed store: without the check it published its
    steps unsigned and reported success, and every subscriber with the key refused them (logged only) and stayed at
    the last signed step: the steps were lost to every reader while the publisher said they were published."""
    monkeypatch.delenv("DELTASYNC_SIGNING_KEY", raising=False)
    states = _states(3)
    root = _publish(tmp_path / "store", states[:2], signing_key=KEY)
    with pytest.raises(ds.IntegrityError, match="no signing key"):
        _publish(root, states[2:], first=2)


def test_a_publisher_that_reads_a_young_run_id_of_a_store_without_atomic_creates_reads_it_again(tmp_path, monkeypatch):
    """On a store that cannot create atomically (the Hugging Face Bucket store) publishers opening it together each
    write run.json. One that read another's young run.json just before a third publisher's write landed kept the
    run id it read, without reading again after the pause: every entry it then published named a run that run.json
    does not, and every subscriber refused its steps."""
    import deltasync_rs.publisher as publisher_module
    from deltasync_rs.manifest import run_document

    monkeypatch.setattr(publisher_module, "RUN_SETTLE_SECONDS", 0.01)

    class Racing(ds.LocalStore):
        atomic_create = False
        overwritten = False

        def get_small(self, key, max_bytes):
            data = super().get_small(key, max_bytes)
            if key == "run.json" and not self.overwritten:  # another rank's run.json lands right after this read
                self.overwritten = True
                self.put(key, run_document(None))
            return data

    root = tmp_path / "store"
    ds.LocalStore(root).put("run.json", run_document(None))  # a rank that started a moment before
    store = Racing(root, create=False)
    states = _states(2)
    with ds.Publisher(store, background=False) as publisher:
        assert publisher.run == json.loads((root / "run.json").read_text())["run"]
        publisher.publish(0, states[0])
    target = _zeros(states[0])
    assert ds.Subscriber(root, retries=1).pull(target) == 0
    assert _equal(target, states[0])
