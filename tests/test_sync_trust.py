"""The sync protocol under attack and failure: replayed and disagreeing pointers, entries spliced from another run
or past a republished step, empty keys, oversized and malformed documents, and a Publisher's own lifecycle."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import deltasync_rs as ds
from deltasync_rs.cli import main
from deltasync_rs.manifest import MAX_DOCUMENT_BYTES, latest_document, parse_document
from deltasync_rs.sync import LATEST_KEY, RUN_KEY, anchor_key, delta_key, entry_key
from tests.helpers import assert_states_equal, reseal, subscriber_reads_malformed
from tests.test_sync import _fresh, _publish_run, _state, _train_step

KEY = "s3cret"
REPO = Path(__file__).resolve().parents[1]


def _publish(store, steps, *, seed=0, key=KEY, pointers=None):
    """Publishes steps 0..steps-1 of a run whose states differ by ``seed``; returns the states published."""
    state = _state(seed)
    history = {}
    with ds.Publisher(store, anchor_every=100, signing_key=key, background=False) as publisher:
        for step in range(steps):
            _train_step(state, step + 100 * seed)
            publisher.publish(step, state)
            history[step] = {k: v.clone() for k, v in state.items()}
            if pointers is not None:
                pointers[step] = store.get(LATEST_KEY)
    return history


def test_a_replayed_older_pointer_never_rolls_a_subscriber_back(tmp_path):
    store = ds.LocalStore(tmp_path)
    pointers = {}
    history = _publish(store, 4, pointers=pointers)
    store.put(LATEST_KEY, pointers[1])  # a replay of a genuine, signed, older pointer
    fresh = ds.Subscriber(store, signing_key=KEY)
    replica = _fresh(history[3])
    assert fresh.pull(replica) == 3
    assert_states_equal(replica, history[3])
    # With the newer entries gone too, a subscriber at step 3 stays there rather than move back to step 1.
    store.delete([entry_key(2), entry_key(3)])
    assert fresh.pull(replica) == 3
    assert_states_equal(replica, history[3])


def test_a_pointer_that_disagrees_with_the_entries_is_logged_and_not_followed(tmp_path, caplog):
    store, other = ds.LocalStore(tmp_path / "a"), ds.LocalStore(tmp_path / "b")
    history = _publish(store, 4)
    _publish(other, 8, seed=1)
    store.put(LATEST_KEY, other.get(LATEST_KEY))  # signed with the same key, for another run's step 7
    subscriber = ds.Subscriber(store, signing_key=KEY)
    with caplog.at_level(logging.ERROR, logger="deltasync_rs.sync"):
        assert subscriber.pull(_fresh(history[3])) == 3
    assert any("latest.json" in r.getMessage() and "run" in r.getMessage() for r in caplog.records)

    caplog.clear()
    run = json.loads(store.get(RUN_KEY))["run"]
    store.put(LATEST_KEY, latest_document(3, b"not the entry", run, KEY.encode()))
    with caplog.at_level(logging.ERROR, logger="deltasync_rs.sync"):
        assert ds.Subscriber(store, signing_key=KEY).latest_step() == 3
    assert any("entry_sha256 does not match" in r.getMessage() for r in caplog.records)
    assert any("entry_sha256" in p for p in ds.sync.verify_store(store, signing_key=KEY))


def test_entries_spliced_from_another_run_with_the_same_key_are_refused(tmp_path):
    store, other = ds.LocalStore(tmp_path / "a"), ds.LocalStore(tmp_path / "b")
    history = _publish(store, 4)
    _publish(other, 6, seed=1)
    for key in (entry_key(4), delta_key(4), entry_key(5), delta_key(5), LATEST_KEY):
        store.put(key, other.get(key))
    subscriber = ds.Subscriber(store, signing_key=KEY)
    replica = _fresh(history[3])
    assert subscriber.pull(replica) == 3
    assert_states_equal(replica, history[3])
    with pytest.raises(ds.IntegrityError, match=r"manifest/step_000000000004\.json: belongs to run"):
        subscriber.entry(4)


@pytest.mark.parametrize("key", [KEY, None])
@pytest.mark.parametrize("new_steps", [2, 4, 6])
def test_a_store_emptied_and_published_into_again_is_a_loud_error_for_a_subscriber_of_the_old_run(
    tmp_path, key, new_steps
):
    """A trainer restarted from scratch into the same (emptied) store: a subscriber that followed the old run must
    not go on reporting its old step as the store's newest, whether the new run has fewer, as many or more steps."""
    store = ds.LocalStore(tmp_path / "store")
    history = _publish(store, 4, key=key)
    subscriber = ds.Subscriber(store, signing_key=key)
    replica = _fresh(history[0])
    assert subscriber.pull(replica) == 3
    old_run = subscriber.run
    for name in store.list():
        store.delete([name])
    new_history = _publish(store, new_steps, seed=1, key=key)
    new_run = json.loads(store.get(RUN_KEY))["run"]
    assert new_run != old_run
    for call in (lambda: subscriber.pull(replica), subscriber.latest_step, lambda: subscriber.fetch(3)):
        with pytest.raises(ds.RunChangedError, match=f"holds run {new_run!r}.*not run {old_run!r}.*step 3") as caught:
            call()
        assert isinstance(caught.value, ds.IntegrityError)
    assert subscriber.step == 3
    assert_states_equal(replica, history[3])  # nothing of the new run was written into it
    assert ds.Subscriber(store, signing_key=key).pull(replica) == new_steps - 1
    assert_states_equal(replica, new_history[new_steps - 1])


def test_resuming_at_an_older_step_leaves_the_later_history_and_subscribers_follow_the_new_one(tmp_path, caplog):
    """A trainer restarted from an older checkpoint: resume(step=4) on a store at step 9. The later steps are of a
    history the run leaves: removed at resume (subscribers took the old step 9 for the newest, and retention removed
    the new run's anchors as older than it). A subscriber that held the old step 3, republished since, re-syncs."""
    store = ds.LocalStore(tmp_path)
    state, old = _state(0), {}
    with ds.Publisher(store, anchor_every=3, keep_anchors=1, signing_key=KEY, background=False) as publisher:
        for step in range(10):
            _train_step(state, step)
            publisher.publish(step, state)
            old[step] = {k: v.clone() for k, v in state.items()}
    behind = ds.Subscriber(store, signing_key=KEY)
    at_9 = _fresh(old[9])
    assert behind.pull(at_9) == 9
    state, new = {k: v.clone() for k, v in old[9].items()}, {}
    with ds.Publisher(store, anchor_every=3, keep_anchors=1, signing_key=KEY, background=False) as publisher:
        with caplog.at_level(logging.WARNING, logger="deltasync_rs.sync"):
            publisher.resume(state, step=9)  # at the newest step: nothing to leave
        assert not any("removing" in r.getMessage() for r in caplog.records)
    pulled = ds.Subscriber(store, signing_key=KEY)
    at_4 = _fresh(old[9])
    # Back to step 4 of a run whose step 4 the store no longer has (retention removed it): resumed without an entry.
    with ds.Publisher(store, anchor_every=3, keep_anchors=1, signing_key=KEY, background=False) as publisher:
        state = {k: v.clone() for k, v in old[4].items()}
        with caplog.at_level(logging.WARNING, logger="deltasync_rs.sync"):
            publisher.resume(state, step=4)
        assert any("removing the later step the store holds (9)" in r.getMessage() for r in caplog.records)
        assert ds.sync.log_entries(store) == [] and LATEST_KEY not in store.list()
        for step in (5, 6, 7):
            _train_step(state, 500 + step)
            publisher.publish(step, state)
            new[step] = {k: v.clone() for k, v in state.items()}
            assert pulled.pull(at_4) == step
            assert_states_equal(at_4, new[step])
    # Step 5 an anchor (step 4 has no entry left), kept: retention counts no anchor after the step just published.
    assert [e.step for e in ds.sync.log_entries(store)] == [5, 6, 7]
    assert not ds.sync.verify_store(store, signing_key=KEY)
    # The subscriber that held the old step 9 stays there (a subscriber never moves back) until the new run passes
    # it, then re-syncs from the new run's anchor.
    assert behind.pull(at_9) == 9
    with ds.Publisher(store, anchor_every=3, keep_anchors=1, signing_key=KEY, background=False) as publisher:
        publisher.resume(state, step=7)
        for step in (8, 9, 10):
            _train_step(state, 500 + step)
            publisher.publish(step, state)
    assert behind.pull(at_9) == 10
    assert_states_equal(at_9, state)


def test_a_resume_that_fails_part_way_changes_nothing_of_the_publisher_and_can_be_made_again(tmp_path):
    """The removal of later steps fails (a store error): the publisher is left un-resumed (it was left resumed, with
    the later steps still there, and refused a second resume). A resume that cannot check its state removes nothing
    when the state is a later step's (a wrong step number), nor on an entry that did not read."""
    store = ds.LocalStore(tmp_path)
    history = _publish(store, 5)
    publisher = ds.Publisher(store, signing_key=KEY, background=False)
    real_delete, calls = store.delete, []

    def failing_once(keys):
        calls.append(keys)
        if len(calls) == 1:
            raise ds.StoreError("a delete that failed")
        real_delete(keys)

    publisher.store.delete = failing_once
    with pytest.raises(ds.StoreError, match="a delete that failed"):
        publisher.resume(history[1], step=1)
    assert publisher.step is None
    publisher.resume(history[1], step=1)
    assert [e.step for e in ds.sync.log_entries(store)] == [0, 1]
    publisher.close()

    other = ds.LocalStore(tmp_path / "other")
    history = _publish(other, 5)
    other.delete([entry_key(2)])
    with pytest.raises(ds.IntegrityError, match="the state is the one published as step 4; resume at that step"):
        ds.Publisher(other, signing_key=KEY, background=False).resume(history[4], step=2)
    other.put(entry_key(1), b"{not json")
    with pytest.raises(ds.DeltaSyncError, match=r"resume\(state, step=1\): its entry did not read"):
        ds.Publisher(other, signing_key=KEY, background=False, retries=1).resume(history[1], step=1)
    assert [e for e in other.list("manifest/")] == [entry_key(s) for s in (0, 1, 3, 4)]


def test_resume_refuses_a_state_that_is_not_the_published_step(tmp_path):
    store = ds.LocalStore(tmp_path)
    history = _publish(store, 3)
    wrong = {k: v.clone() for k, v in history[2].items()}
    wrong["layer.weight"].view(-1)[0] += 1
    publisher = ds.Publisher(store, signing_key=KEY, background=False)
    with pytest.raises(
        ds.IntegrityError, match=r"resume\(state, step=2\): the state is not the one published as step 2"
    ):
        publisher.resume(wrong, step=2)
    assert publisher.step is None and [e.step for e in ds.sync.log_entries(store)] == [0, 1, 2]
    # What the message advises works (it advised publishing the state without resume at its own step, 2, which
    # publish refuses for being no later than the store's newest, advising resume: found by a helper).
    with pytest.raises(ds.IntegrityError, match=r"as a step after the store's newest \(2;") as refused:
        ds.Publisher(store, signing_key=KEY, background=False).resume(wrong, step=1)
    assert "nothing was changed" in str(refused.value)
    publisher.resume(history[2], step=2)
    publisher.publish(3, wrong)
    publisher.close()
    replica = _fresh(wrong)
    assert ds.Subscriber(store, signing_key=KEY).pull(replica) == 3
    assert_states_equal(replica, wrong)


def test_a_subscriber_holding_a_step_published_again_re_syncs_at_once(tmp_path, caplog):
    """resume(step=1) on a store at step 3, and steps 2 and 3 published again with other weights: a subscriber that
    held the old step 3 pulls the new step 3 (it reported the old one, with only a log line, before), and the new
    step 4 on the next pull (it raised ChainErrors for two pulls before, from entries cached of the old history)."""
    store = ds.LocalStore(tmp_path)
    old = _publish(store, 4)
    subscriber = ds.Subscriber(store, signing_key=KEY)
    replica = _fresh(old[3])
    assert subscriber.pull(replica) == 3
    fetcher = ds.Subscriber(store, signing_key=KEY)  # one that applies what fetch returns itself
    fetched = _fresh(old[3])
    for delta in fetcher.fetch(None):
        delta.apply_(fetched)
    state, new = {k: v.clone() for k, v in old[1].items()}, {}
    with ds.Publisher(store, anchor_every=100, signing_key=KEY, background=False) as publisher:
        publisher.resume(state, step=1)
        for step in (2, 3, 4):
            _train_step(state, 300 + step)
            publisher.publish(step, state)
            new[step] = {k: v.clone() for k, v in state.items()}
            if step == 3:
                with caplog.at_level(logging.WARNING, logger="deltasync_rs.sync"):
                    assert subscriber.pull(replica) == 3
                assert_states_equal(replica, new[3])
                assert any("published again" in r.getMessage() for r in caplog.records)
                deltas = fetcher.fetch(3)
                assert deltas[0].is_anchor and deltas[-1].step == 3
                for delta in deltas:
                    delta.apply_(fetched)
                assert_states_equal(fetched, new[3])
    assert subscriber.pull(replica) == 4
    assert_states_equal(replica, new[4])


def test_a_step_published_again_is_seen_through_until_and_a_pointer_left_behind(tmp_path):
    """``pull(until=u)`` at or below the step held re-syncs a held step published again (it kept the old weights);
    a publisher stopped between an entry and its pointer, resumed at that entry, sets the pointer to it, and a
    subscriber holding the step as it was before re-syncs."""
    store = ds.LocalStore(tmp_path)
    old = _publish(store, 5)
    holders = {until: ds.Subscriber(store, signing_key=KEY) for until in (3, 2)}
    replicas = {until: _fresh(old[3]) for until in holders}
    for until, holder in holders.items():
        assert holder.pull(replicas[until], until=3) == 3
    state = _published_again(store, old[1], at=1, steps=(2, 3), seed=700)
    for until, holder in holders.items():
        assert holder.pull(replicas[until], until=until) == 3
        assert_states_equal(replicas[until], state)
    # A pointer one step behind its newest entry (the publisher was stopped between the two writes).
    lagging = ds.Subscriber(store, signing_key=KEY)
    held = _fresh(state)
    assert lagging.pull(held) == 3
    again = _fresh(state)
    assert ds.Subscriber(store, signing_key=KEY).pull(again, until=2) == 2
    with ds.Publisher(store, anchor_every=100, signing_key=KEY, background=False) as publisher:
        publisher.resume({k: v.clone() for k, v in again.items()}, step=2)
        pointer = store.get(LATEST_KEY)  # names step 2
        _train_step(again, 900)
        publisher.publish(3, again)
    store.put(LATEST_KEY, pointer)  # as if stopped before writing the pointer of the new step 3
    assert lagging.pull(held) == 3
    assert_states_equal(held, again)


def test_until_at_a_held_step_published_again_and_gone_is_an_error(tmp_path):
    """The held step 3 published again and already removed by retention: ``pull(until=3)`` cannot rebuild it, and
    says so (it returned the old weights before); a pull to the newest step goes on."""
    store = ds.LocalStore(tmp_path)
    state = _state(0)
    with ds.Publisher(store, anchor_every=1, keep_anchors=1, background=False) as publisher:
        for step in range(4):
            _train_step(state, step)
            publisher.publish(step, state)
        previous = {k: v.clone() for k, v in state.items()}
    subscriber = ds.Subscriber(store)
    replica = _fresh(state)
    assert subscriber.pull(replica) == 3
    state = _published_again(
        store, _pulled_by_hand(previous), at=2, steps=(3, 4), seed=900, anchor_every=1, keep_anchors=1, signing_key=None
    )
    with pytest.raises(ds.ChainError, match="step 3, held here, was published again since and is no longer in"):
        subscriber.pull(replica, until=3)
    assert_states_equal(replica, previous)
    assert subscriber.pull(replica) == 4
    assert_states_equal(replica, state)


def _published_again(store, base, *, at, steps, seed, **options):
    """A publisher resumed at step ``at`` from ``base`` (the state published as ``at``) publishes ``steps`` again,
    each a training step on from the one before (``seed`` + step); returns the last state."""
    state = {k: v.clone() for k, v in base.items()}
    with ds.Publisher(store, background=False, **{"anchor_every": 100, "signing_key": KEY, **options}) as publisher:
        publisher.resume(state, step=at)
        for step in steps:
            _train_step(state, seed + step)
            publisher.publish(step, state)
    return state


def _pulled_by_hand(step3):
    """A state for step 2 that is not step 3's (the store keeps no entry of step 2 to check it against)."""
    state = {k: v.clone() for k, v in step3.items()}
    state["layer.weight"].view(-1)[:4] += 1
    return state


def test_a_chain_cannot_be_spliced_past_a_republished_step(tmp_path):
    """A publisher resumed at step 1 republishes steps 2 and 3; the first run's entry 2 put back in the store must
    not be replayed before the second run's step 3, although both are signed, of this run, and name step 2."""
    store = ds.LocalStore(tmp_path)
    history = _publish(store, 4)
    first_entry, first_delta = store.get(entry_key(2)), store.get(delta_key(2))
    _published_again(store, history[1], at=1, steps=(2, 3), seed=50)
    store.put(entry_key(2), first_entry)
    store.put(delta_key(2), first_delta)
    subscriber = ds.Subscriber(store, signing_key=KEY)
    with pytest.raises(ds.ChainError, match="base_entry_sha256 differs"):
        subscriber.fetch(1, until=3)
    assert [d.step for d in subscriber.fetch(1)] == [2]  # the first run's own chain still leads to its step 2


@pytest.mark.parametrize("key", ["", b""])
def test_empty_signing_keys_are_errors(tmp_path, key):
    with pytest.raises(ds.DeltaSyncError, match="empty"):
        ds.Publisher(tmp_path, signing_key=key)
    with pytest.raises(ds.DeltaSyncError, match="empty"):
        ds.Subscriber(tmp_path, signing_key=key)


def test_a_set_but_empty_key_variable_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTASYNC_SIGNING_KEY", "")
    with pytest.raises(ds.DeltaSyncError, match="DELTASYNC_SIGNING_KEY is set but empty"):
        ds.Publisher(tmp_path)
    with pytest.raises(ds.DeltaSyncError, match="DELTASYNC_SIGNING_KEY is set but empty"):
        ds.Subscriber(tmp_path)


def test_deeply_nested_and_oversized_documents_are_format_errors(tmp_path):
    with pytest.raises(ds.DeltaFormatError, match="unbalanced brackets"):  # never closed: deep and cut short
        parse_document(b"[" * MAX_DOCUMENT_BYTES, LATEST_KEY, "deltasync-latest")
    with pytest.raises(ds.DeltaFormatError, match="nested"):
        parse_document(b"[" * 1000 + b"]" * 1000, LATEST_KEY, "deltasync-latest")
    with pytest.raises(ds.DeltaFormatError, match="nested"):
        parse_document(b'{"a":' * 40 + b"1" + b"}" * 40, LATEST_KEY, "deltasync-latest")
    brackets_in_strings = json.dumps({"format": "deltasync-latest", "version": 1, "pad": "[[[[" * 100}).encode()
    assert parse_document(brackets_in_strings, LATEST_KEY, "deltasync-latest")["pad"].startswith("[[[[")

    store = ds.LocalStore(tmp_path)
    history = _publish(store, 2, key=None)
    store.put(LATEST_KEY, b"[" * 100_000 + b"]" * 100_000)
    assert ds.Subscriber(store).pull(_fresh(history[1])) == 1  # the bad pointer is logged, the entries used
    with ds.Publisher(store, background=False) as publisher:  # and a publisher does not crash on it either
        assert publisher.step is None
    store.put(entry_key(1), b"{" * 100_000)
    store.put(entry_key(0), b" " * (MAX_DOCUMENT_BYTES + 1))
    with pytest.raises(ds.DeltaSyncError) as caught:
        ds.Subscriber(store, retries=1).pull(_fresh(history[1]))
    assert not isinstance(caught.value, RecursionError)
    store.put(RUN_KEY, b"[" * 100_000)
    with pytest.raises(ds.DeltaFormatError, match="run.json"):
        ds.Publisher(store)
    # A document cut short says so, not that it nests too deep.
    store.put(RUN_KEY, b'{"format": "deltasync-run", "version": 1, "run": "ab')
    with pytest.raises(ds.DeltaFormatError, match=r"run\.json: not valid JSON: unbalanced brackets"):
        ds.Publisher(store)


@pytest.mark.parametrize(
    "field, value",
    [
        ("anchor", "x"),
        ("delta", 3),
        ("step", "1"),
        ("base_step", True),
        ("created", "now"),
        ("run", 7),
        ("base_entry_sha256", "zz"),
        ("num_changed", -1),
    ],
)
def test_every_malformed_entry_field_is_a_format_error(tmp_path, capsys, field, value):
    store = ds.LocalStore(tmp_path)
    _publish(store, 2, key=None)
    entry = json.loads(store.get(entry_key(1)))
    entry[field] = value
    store.put(entry_key(1), json.dumps(entry).encode())
    with pytest.raises(ds.DeltaFormatError, match=rf"manifest/step_000000000001\.json.*{field}"):
        ds.Subscriber(store).entry(1)
    assert main(["verify", "--store", str(tmp_path)]) == 1
    assert "step 1" in capsys.readouterr().out


def test_an_entry_version_says_which_anchor_checks_it_may_leave_out(tmp_path):
    """Version 1 entries name every file with its whole-file SHA-256; version 2 (what a publisher writes for an
    anchor with pieces, by default) lets an anchor with a pieces sidecar go without one, and nothing else: a delta,
    or an anchor without a sidecar, still needs it. Other versions are refused by number (docs/format.md §10)."""
    store = ds.LocalStore(tmp_path)
    history = _publish(store, 2, key=None)
    anchor_entry, delta_entry = (json.loads(store.get(entry_key(step))) for step in (0, 1))
    assert anchor_entry["version"] == 2 and "sha256" not in anchor_entry["anchor"]
    assert delta_entry["version"] == 1 and "sha256" in delta_entry["delta"]
    cases = [
        (0, {"version": 1}, r"\(anchor\): the field 'sha256' is missing"),
        (0, {"anchor": {k: v for k, v in anchor_entry["anchor"].items() if k != "pieces"}}, "'sha256' is missing"),
        (1, {"version": 2, "delta": {k: v for k, v in delta_entry["delta"].items() if k != "sha256"}}, "'sha256'"),
        (0, {"version": 3}, "unsupported version 3"),
        (0, {"version": True}, "unsupported version True"),
        (1, {"version": 2.0}, "unsupported version 2.0"),
    ]
    for step, change, message in cases:
        original = store.get(entry_key(step))
        store.put(entry_key(step), json.dumps(json.loads(original) | change).encode())
        with pytest.raises(ds.DeltaFormatError, match=rf"manifest/step_00000000000{step}\.json.*{message}"):
            ds.Subscriber(store).entry(step)
        store.put(entry_key(step), original)
    # A delta entry may say version 2 (it changes nothing for it), and both versions replay.
    store.put(entry_key(1), json.dumps(delta_entry | {"version": 2}).encode())
    replica = _fresh(history[1])
    assert ds.Subscriber(store).pull(replica) == 1
    assert_states_equal(replica, history[1])


def test_a_publisher_with_a_key_verifies_the_pointer_it_reads_back(tmp_path, caplog):
    store = ds.LocalStore(tmp_path)
    history = _publish(store, 3)
    store.put(LATEST_KEY, json.dumps({"format": "deltasync-latest", "version": 1, "step": 999999999999}).encode())
    with caplog.at_level(logging.ERROR, logger="deltasync_rs.sync"):
        with ds.Publisher(store, signing_key=KEY, background=False) as publisher:
            with pytest.raises(ds.DeltaSyncError, match="after the last published step 2"):
                publisher.publish(2, history[2])
            publisher.publish(3, history[2])
    assert any("not signed" in r.getMessage() for r in caplog.records)
    assert ds.Subscriber(store, signing_key=KEY).latest_step() == 3


def test_publish_after_close_is_an_error(tmp_path):
    publisher = ds.Publisher(tmp_path)
    publisher.publish(0, _state())
    publisher.close()
    with pytest.raises(ds.DeltaSyncError, match="closed"):
        publisher.publish(1, _state())
    publisher.flush()  # returns: nothing is pending
    publisher.close()
    assert ds.Subscriber(tmp_path).latest_step() == 0


def test_flush_returns_when_the_upload_thread_is_gone(tmp_path):
    publisher = ds.Publisher(tmp_path, max_pending=4)
    publisher.publish(0, _state())
    publisher.flush()
    publisher._queue.put(None)  # the upload thread stops, as if it had died
    publisher._worker.join(timeout=10)
    publisher._queue.put((1, None, None, "", 0))
    outcome = []

    def flush():
        try:
            publisher.flush()
        except ds.DeltaSyncError as error:
            outcome.append(error)

    waiter = threading.Thread(target=flush, daemon=True)
    waiter.start()
    waiter.join(timeout=10)
    assert not waiter.is_alive(), "flush() hangs"
    assert outcome and "upload thread stopped" in str(outcome[0])
    with pytest.raises(ds.DeltaSyncError, match="upload thread stopped"):
        publisher.publish(1, _state())
    with pytest.raises(ds.DeltaSyncError, match="upload thread stopped"):
        publisher.flush(timeout=1)


def test_pending_uploads_reach_the_store_at_interpreter_exit(tmp_path):
    script = textwrap.dedent(f"""
        import time
        import torch
        import deltasync_rs as ds

        class SlowStore(ds.LocalStore):
            def put(self, key, data):
                time.sleep(0.2)
                super().put(key, data)

        state = {{"w": torch.zeros(64, 16)}}
        publisher = ds.Publisher(SlowStore({str(tmp_path)!r}), max_pending=4)
        publisher.publish(0, state)
        state["w"][0, 0] = 1.0
        publisher.publish(1, state)
        # no close(): the interpreter exits with both uploads pending
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert ds.Subscriber(tmp_path).latest_step() == 1
    assert ds.sync.verify_store(tmp_path) == []


def test_lost_uploads_at_exit_are_reported(tmp_path):
    script = textwrap.dedent(f"""
        import time
        import torch
        import deltasync_rs as ds

        class StuckStore(ds.LocalStore):
            def put_file(self, key, path):  # anchors upload from a file
                if key.startswith("anchors/"):
                    time.sleep(600)
                super().put_file(key, path)

        # The queue full too (max_pending=1): a finalizer that waited on it hung the exit for as long as the upload.
        publisher = ds.Publisher(StuckStore({str(tmp_path)!r}), exit_timeout=0.5, max_pending=1)
        publisher.publish(0, {{"w": torch.zeros(4)}})
        publisher.publish(1, {{"w": torch.ones(4)}})
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert "not everything it published reached the store" in done.stderr
    assert "2 upload(s) still pending" in done.stderr


def test_a_publisher_dropped_without_close_uploads_what_it_queued_and_is_freed(tmp_path):
    """Its upload thread held it (a bound method) and waited forever: every publisher dropped without close() kept
    its thread and its copy of the state (found by an adversarial helper). The thread holds a publisher only while
    one of its jobs is queued: the jobs queued are uploaded, then the publisher is freed and its thread ends."""
    import gc
    import time
    import weakref

    class SlowStore(ds.LocalStore):
        def put(self, key, data):
            time.sleep(0.05)
            super().put(key, data)

    state = {"w": np.zeros((64, 16), dtype=np.float32)}
    publisher = ds.Publisher(SlowStore(tmp_path), max_pending=4)
    for step in range(3):
        state["w"][step, 0] = 1.0
        publisher.publish(step, state)
    thread, freed = publisher._worker, weakref.ref(publisher)
    del publisher  # with uploads pending
    deadline = time.monotonic() + 30
    while (freed() is not None or thread.is_alive()) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert freed() is None and not thread.is_alive()
    assert ds.Subscriber(tmp_path).latest_step() == 2
    target = {"w": np.zeros((64, 16), dtype=np.float32)}
    assert ds.Subscriber(tmp_path).pull(target) == 2
    assert np.array_equal(target["w"], state["w"])


def test_a_subscriber_keeps_a_bounded_number_of_entries(tmp_path):
    store = ds.LocalStore(tmp_path)
    history = _publish(store, 90, key=None)
    subscriber = ds.Subscriber(store)
    assert subscriber.pull(_fresh(history[89])) == 89
    assert len(subscriber._entries) <= 64


def test_a_missing_step_is_an_error_naming_it(tmp_path, capsys):
    store = ds.LocalStore(tmp_path)
    _publish(store, 3, key=None)
    with pytest.raises(ds.ChainError, match="step 7 is not published"):
        ds.Subscriber(store).fetch(None, until=7)
    assert main(["pull", "--store", str(tmp_path), "-o", str(tmp_path / "out.safetensors"), "--step", "7"]) == 1
    assert "step 7" in capsys.readouterr().err
    assert not (tmp_path / "out.safetensors").exists()
    store.delete([entry_key(1)])
    with pytest.raises(ds.ChainError, match="step 1"):
        ds.Subscriber(store).fetch(None, until=1)


def test_verify_fails_on_an_empty_store(tmp_path, capsys):
    assert ds.sync.verify_store(tmp_path) == ["the store holds no published step"]
    assert main(["verify", "--store", str(tmp_path)]) == 1
    assert "no published step" in capsys.readouterr().out


def test_cli_pull_checks_the_state_digest(tmp_path, capsys):
    store = ds.LocalStore(tmp_path / "store")
    history = _publish(store, 2, key=None)
    # An unsigned store rewritten consistently: a different delta for step 1, with its size and digest in the entry.
    forged = ds.diff(history[0], _state(seed=5), step=1, base_step=0).to_bytes()
    store.put(delta_key(1), forged)
    entry = json.loads(store.get(entry_key(1)))
    entry["delta"].update(size=len(forged), sha256=hashlib.sha256(forged).hexdigest())
    store.put(entry_key(1), json.dumps(entry).encode())
    output = tmp_path / "out.safetensors"
    assert main(["pull", "--store", str(tmp_path / "store"), "-o", str(output)]) == 1
    assert "state digest" in capsys.readouterr().err
    assert not output.exists()


def test_readers_never_create_a_mistyped_store(tmp_path, capsys):
    typo = tmp_path / "no-such-store"
    for argv in (
        ["log", "--store", str(typo)],
        ["verify", "--store", str(typo)],
        ["pull", "--store", str(typo), "-o", str(tmp_path / "out.safetensors")],
    ):
        assert main(argv) == 1
        assert f"{typo}: no such store folder" in capsys.readouterr().err
    with pytest.raises(ds.StoreError, match="no such store folder"):
        ds.Subscriber(typo).pull(_state())
    assert not typo.exists()


def test_a_link_planted_in_the_store_never_lets_publishing_or_retention_reach_outside(tmp_path):
    store = ds.LocalStore(tmp_path / "store")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "step_000000000000.safetensors"
    victim.write_bytes(b"not the store's")
    history = _publish(store, 1, key=None)
    with ds.Publisher(store, anchor_every=1, keep_anchors=1, background=False) as publisher:
        publisher.resume(history[0], step=0)
        (tmp_path / "store" / "anchors" / "step_000000000000.safetensors").unlink()
        (tmp_path / "store" / "anchors" / "step_000000000000.pieces").unlink()
        (tmp_path / "store" / "anchors").rmdir()
        (tmp_path / "store" / "anchors").symlink_to(elsewhere)
        with pytest.raises(ds.StoreError, match="symbolic link"):
            publisher.publish(1, history[0])  # an anchor is due, then retention of step 0's anchor
    assert sorted(p.name for p in elsewhere.iterdir()) == [victim.name] and victim.read_bytes() == b"not the store's"


def test_a_store_written_before_run_ids_reads_unsigned_and_moves_on_with_an_anchor(tmp_path):
    store = ds.LocalStore(tmp_path)
    history = _publish(store, 3, key=None)
    store.delete([RUN_KEY])
    for step in range(3):  # what an older publisher wrote: no run, no base entry hash
        entry = json.loads(store.get(entry_key(step)))
        del entry["run"], entry["base_entry_sha256"]
        store.put(entry_key(step), json.dumps(entry).encode())
    store.put(
        LATEST_KEY,
        json.dumps(
            {
                "format": "deltasync-latest",
                "version": 1,
                "step": 2,
                "entry_sha256": hashlib.sha256(store.get(entry_key(2))).hexdigest(),
            }
        ).encode(),
    )
    replica = _fresh(history[2])
    assert ds.Subscriber(store).pull(replica) == 2
    assert_states_equal(replica, history[2])
    with pytest.raises(ds.IntegrityError):
        ds.Subscriber(store, signing_key=KEY).pull(_fresh(history[2]))
    with ds.Publisher(store, background=False) as publisher:
        publisher.resume(history[2], step=2)
        publisher.publish(3, history[2])
    assert ds.Subscriber(store).entry(3).anchor is not None
    fresh = _fresh(history[2])
    assert ds.Subscriber(store).pull(fresh) == 3
    assert_states_equal(fresh, history[2])


def test_one_corrupted_read_of_an_unsigned_run_id_does_not_stick(tmp_path):
    store = ds.LocalStore(tmp_path)
    history = _publish(store, 2, key=None)

    class OneBadRunRead(ds.LocalStore):
        bad_reads = 1

        def get_small(self, key, max_bytes):
            data = super().get_small(key, max_bytes)
            if key == RUN_KEY and self.bad_reads:
                self.bad_reads -= 1
                run = json.loads(data)["run"]
                data = data.replace(run.encode(), ("0" if run[0] != "0" else "1").encode() + run[1:].encode())
            return data

    replica = _fresh(history[1])
    assert ds.Subscriber(OneBadRunRead(tmp_path), retry_delay=0).pull(replica) == 1
    assert_states_equal(replica, history[1])


@pytest.mark.parametrize("later_anchor", [True, False])
def test_a_stream_the_apply_finds_malformed_sends_the_pull_around_it(tmp_path, caplog, later_anchor):
    """A pull leaves the check of the deltas' bit-packed streams to the apply: a malformed one is found there, with
    nothing of its delta written; the pull then reads the way on again with every file checked first, and takes a
    way around the bad file (a later anchor) as a refused download does, or fails loudly at the step before it."""
    store = ds.LocalStore(tmp_path / "store")
    history = _publish_run(store, 5, anchor_every=3 if later_anchor else 100)
    subscriber = ds.Subscriber(store)
    replica = _fresh(history[0])
    assert subscriber.pull(replica, until=1) == 1
    malformed = subscriber_reads_malformed(hashlib.sha256(store.get(delta_key(2))).hexdigest())
    with malformed as seen, caplog.at_level(logging.WARNING, logger="deltasync_rs"):
        if later_anchor:  # anchors at 0 and 3: from 3 the way to 4 does not need step 2's delta
            assert subscriber.pull(replica) == 4
            assert_states_equal(replica, history[4])
        else:
            with pytest.raises((ds.ChainError, ds.DeltaFormatError)):
                subscriber.pull(replica)
            assert_states_equal(replica, history[1])  # nothing of step 2 written
    assert seen["deferred"] == 1 and seen["checked"] >= 1, seen
    assert "again with every stream checked first" in caplog.text


def test_the_way_around_a_malformed_stream_continues_from_the_entry_the_last_file_applied_was_verified_against(
    tmp_path,
):
    """A pull that applied step 2's delta and found step 3's stream malformed reads the way on from step 2 with the
    entry step 2's file was verified against, not one read again from the store: there (its cache of 64 entries
    evicted on a long way, the step published again meanwhile) the entry could be another's, and the way on
    would be linked to a history the state does not hold."""
    import dataclasses

    store = ds.LocalStore(tmp_path / "store")
    history = _publish_run(store, 6, anchor_every=100)
    subscriber = ds.Subscriber(store)
    replica = _fresh(history[0])
    assert subscriber.pull(replica, until=1) == 1
    verified = subscriber.entry(2)
    real = subscriber.entry

    def published_again_once_found_malformed(step: int):
        entry = real(step)
        if step == 2 and seen["deferred"]:
            return dataclasses.replace(entry, sha256="0" * 64)  # what a cache miss would read after a republish
        return entry

    subscriber.entry = published_again_once_found_malformed
    with subscriber_reads_malformed(hashlib.sha256(store.get(delta_key(3))).hexdigest()) as seen:
        with pytest.raises((ds.ChainError, ds.DeltaFormatError)):
            subscriber.pull(replica)
    assert seen["deferred"] == 1 and seen["checked"] >= 1, seen
    assert_states_equal(replica, history[2])  # step 2 written, nothing of step 3
    assert subscriber.step == 2 and subscriber._at.sha256 == verified.sha256


def test_a_removal_stopped_part_way_leaves_a_history_without_gaps_and_a_resume_at_an_unreachable_step_anchors(
    tmp_path, caplog
):
    """resume(step=1) on a store at step 5 stops after removing one entry: the newest went first, so the entries
    left (0-4) are still reached from the anchor and a restart at step 4 continues with deltas (before, the oldest
    went first: entries 3 and 4 stayed with 2 gone, a restart at 4 was accepted and its steps reached no subscriber
    until the next anchor). And a resume at a step whose way back to an anchor is cut all the same publishes an
    anchor next (found by an adversarial helper)."""
    store = ds.LocalStore(tmp_path)
    history = _publish(store, 6)
    publisher = ds.Publisher(store, signing_key=KEY, background=False)
    real_delete = store.delete

    def one_then_fail(keys):
        real_delete(keys[:1])
        raise ds.StoreError("stopped")

    publisher.store.delete = one_then_fail
    with pytest.raises(ds.StoreError, match="stopped"):
        publisher.resume(history[1], step=1)
    publisher.close()
    del store.delete
    assert [e.step for e in ds.sync.log_entries(store)] == [0, 1, 2, 3, 4]
    state = {k: v.clone() for k, v in history[4].items()}
    with ds.Publisher(store, anchor_every=100, signing_key=KEY, background=False) as publisher:
        publisher.resume(state, step=4)
        _train_step(state, 900)
        publisher.publish(5, state)
    assert ds.sync.log_entries(store)[-1].anchor is None  # a delta: step 4 is reached from the anchor
    replica = _fresh(state)
    assert ds.Subscriber(store, signing_key=KEY).pull(replica) == 5
    assert_states_equal(replica, state)

    store.delete([entry_key(2)])  # the way from step 5 back to the anchor cut
    with ds.Publisher(store, anchor_every=100, signing_key=KEY, background=False) as publisher:
        with caplog.at_level(logging.WARNING, logger="deltasync_rs.sync"):
            publisher.resume(state, step=5)
        _train_step(state, 901)
        publisher.publish(6, state)
    assert "step 5 cannot be reached from an anchor" in caplog.text
    assert ds.sync.log_entries(store)[-1].anchor is not None
    replica = _fresh(state)
    assert ds.Subscriber(store, signing_key=KEY).pull(replica) == 6
    assert_states_equal(replica, state)


def test_a_step_another_publisher_published_meanwhile_is_not_written_over(tmp_path):
    """Two publishers on one store, both at step 0, both publishing step 1: the second is refused, with the first's
    files and entry left as they were (both said "published" before, and the second's files replaced the first's).
    A subscriber pulls the first's step 1 bit-exact (found by an adversarial helper)."""
    store = ds.LocalStore(tmp_path)
    history = _publish(store, 1)
    first = ds.Publisher(store, signing_key=KEY, background=False)
    second = ds.Publisher(store, signing_key=KEY, background=False)
    ours, theirs = ({k: v.clone() for k, v in history[0].items()} for _ in range(2))
    _train_step(ours, 1)
    _train_step(theirs, 2)
    first.resume(history[0], step=0)
    second.resume(history[0], step=0)
    first.publish(1, ours)
    listed = {k: store.get(k) for k in store.list("manifest/") + store.list("deltas/")}
    with pytest.raises(ds.DeltaSyncError, match="step 1 was published meanwhile by another publisher"):
        second.publish(1, theirs)
    assert {k: store.get(k) for k in store.list("manifest/") + store.list("deltas/")} == listed
    replica = _fresh(ours)
    assert ds.Subscriber(store, signing_key=KEY).pull(replica) == 1
    assert_states_equal(replica, ours)
    first.close()
    second.close()


def test_the_cli_refuses_a_step_published_after_it_read_the_store_s_newest(tmp_path, capsys, monkeypatch):
    """`deltasync publish` read step 0 as the newest and rebuilt it; meanwhile another publisher published step 1.
    It refuses, and step 1 stays (its resume at step 0 removed step 1 as a history left before, and both commands
    said they published; found by an adversarial helper)."""
    from safetensors.torch import save_file

    import deltasync_rs.cli as cli

    store = tmp_path / "store"
    history = _publish(ds.LocalStore(store), 1, key=None)
    ckpt = tmp_path / "ckpt.safetensors"
    later = {k: v.clone() for k, v in history[0].items()}
    _train_step(later, 5)
    save_file(later, ckpt)
    rebuild = cli._rebuild

    def another_publisher_meanwhile(subscriber, url, until=None):
        rebuilt = rebuild(subscriber, url, until)
        with ds.Publisher(store, background=False) as other:
            other.resume(history[0], step=0)
            other.publish(1, later)
        return rebuilt

    monkeypatch.setattr(cli, "_rebuild", another_publisher_meanwhile)
    assert main(["publish", str(ckpt), "--store", str(store), "--step", "2"]) == 1
    assert "step 0 is no longer the store's newest: step 1 was published meanwhile" in capsys.readouterr().err
    assert [e.step for e in ds.sync.log_entries(str(store))] == [0, 1]


def test_a_subscriber_holding_a_step_the_store_left_says_so_once_and_holds_it(tmp_path, caplog):
    """resume(step=1) on a store at step 3 removes steps 2 and 3: a subscriber at step 3 holds it (moving back on
    entries gone is what a rollback of a signed store would ask) but says so, once; the next step published past
    it brings it onto the new history."""
    store = ds.LocalStore(tmp_path)
    old = _publish(store, 4)
    subscriber = ds.Subscriber(store, signing_key=KEY)
    replica = _fresh(old[3])
    assert subscriber.pull(replica) == 3
    state = {k: v.clone() for k, v in old[1].items()}
    with ds.Publisher(store, anchor_every=100, signing_key=KEY, background=False) as publisher:
        publisher.resume(state, step=1)
        _train_step(state, 700)
        publisher.publish(2, state)
        with caplog.at_level(logging.WARNING, logger="deltasync_rs.sync"):
            assert subscriber.pull(replica) == 3
            assert subscriber.pull(replica) == 3
        assert caplog.text.count("step 3, held here, is no longer in the store") == 1
        for step in (3, 4):
            _train_step(state, 700 + step)
            publisher.publish(step, state)
    assert subscriber.pull(replica) == 4
    assert_states_equal(replica, state)


def test_documents_that_would_take_hours_or_a_traceback_are_format_errors(tmp_path, capsys):
    """Found by an adversarial helper: a store document of a quote and 500,000 escaped quotes took the nesting
    check hours (a string that never closes was tried again from each quote inside it), even with a signing key,
    since the check comes before the signature; an entry whose `created` is 1e300 made `deltasync log` print a
    traceback."""
    import deltasync_rs.manifest as manifest

    (tmp_path / "latest.json").write_bytes(b'"' + b'\\"' * ((MAX_DOCUMENT_BYTES - 1) // 2))
    # In a process of its own: the regular expression engine holds the GIL, so no thread could time it out.
    check = textwrap.dedent(
        """
        import sys
        import deltasync_rs as ds
        from deltasync_rs.manifest import parse_document
        try:
            parse_document(open(sys.argv[1], "rb").read(), "latest.json", "deltasync-latest")
        except ds.DeltaFormatError as error:
            print(error)
        """
    )
    parsed = subprocess.run(
        [sys.executable, "-c", check, str(tmp_path / "latest.json")], capture_output=True, text=True, timeout=120
    )
    assert "not valid JSON" in parsed.stdout, parsed.stderr
    (tmp_path / "latest.json").unlink()
    store = ds.LocalStore(tmp_path)
    _publish(store, 1, key=None)
    document = json.loads(store.get(entry_key(0)))
    document["created"] = 1e300
    store.put(entry_key(0), json.dumps(document).encode())
    assert main(["log", "--store", str(tmp_path)]) == 1
    assert "the field 'created' is not a Unix time" in capsys.readouterr().err
    assert manifest._YEAR_10000 == 253402300800


def test_a_subscriber_re_reads_a_newest_entry_no_pointer_confirms(tmp_path):
    """Found by an adversarial helper: resume at step 5, which the store never held (the pointer goes), then step 6
    published again with other weights and its pointer write failing: a subscriber holding the old step 6 reported
    it, with the old weights, until a later step came (its cached entry 6 was never read again)."""
    store = ds.LocalStore(tmp_path)
    state = _state(0)
    with ds.Publisher(store, anchor_every=100, signing_key=KEY, background=False) as publisher:
        for step in (0, 2, 4, 6):
            _train_step(state, step)
            publisher.publish(step, state)
    subscriber = ds.Subscriber(store, signing_key=KEY)
    replica = _fresh(state)
    assert subscriber.pull(replica) == 6
    restarted = {k: v.clone() for k, v in state.items()}
    _train_step(restarted, 55)
    publisher = ds.Publisher(store, anchor_every=100, signing_key=KEY, background=False)
    publisher.resume(restarted, step=5)  # no entry of step 5: the pointer is removed
    _train_step(restarted, 66)
    real_put = store.put

    def no_pointer(key, data):
        if key == LATEST_KEY:
            raise ds.StoreError("the pointer write failed")
        real_put(key, data)

    store.put = no_pointer
    with pytest.raises(ds.StoreError, match="the pointer write failed"):
        publisher.publish(6, restarted)
    del store.put
    publisher.close()
    assert subscriber.pull(replica) == 6
    assert_states_equal(replica, restarted)


def test_the_cli_s_resume_at_the_newest_leaves_later_files_without_entries(tmp_path):
    """`deltasync publish` resumes at the newest step it read; a later step's files without an entry are another
    publisher's being written (or a stopped one's): left alone, where they were removed as a history left."""
    store = ds.LocalStore(tmp_path)
    history = _publish(store, 2)
    orphan = delta_key(2)
    store.put(orphan, b"another publisher's step 2, being written")
    publisher = ds.Publisher(store, signing_key=KEY, background=False)
    publisher._continue({k: v.clone() for k, v in history[1].items()}, 1)
    publisher.close()
    assert store.get(orphan) == b"another publisher's step 2, being written"


@pytest.mark.parametrize("replayed", [1, 2])
def test_a_replayed_pointer_does_not_hide_a_held_step_published_again(tmp_path, replayed):
    """Found by an adversarial helper: a subscriber at step 1, step 1 published again after a resume at 0, and an
    older signed pointer (of step 1, or of step 2, which the store no longer has) put back: the subscriber reported
    step 1 with the old weights (the pointer matched the entry it had cached, so it was never read again)."""
    store = ds.LocalStore(tmp_path)
    pointers = {}
    old = _publish(store, 3, pointers=pointers)
    subscriber = ds.Subscriber(store, signing_key=KEY)
    replica = _fresh(old[1])
    assert subscriber.pull(replica, until=1) == 1
    state = _published_again(store, old[0], at=0, steps=(1,), seed=4242)
    store.put(LATEST_KEY, pointers[replayed])
    assert subscriber.pull(replica) == 1
    assert_states_equal(replica, state)


def test_pull_until_after_a_resume_reads_cached_entries_again(tmp_path):
    """Found by an adversarial helper: a subscriber that had read entries 2 and 3 (pull_to_file(until=3)) kept
    them after a resume at 1 published 2-4 again: every pull(until=3) walked the old entries and failed their
    files' checks, a ChainError each time, while a fresh subscriber pulled step 3."""
    store = ds.LocalStore(tmp_path)
    old = _publish(store, 5)
    subscriber = ds.Subscriber(store, signing_key=KEY, retry_delay=0)
    replica = _fresh(old[1])
    assert subscriber.pull(replica, until=1) == 1
    subscriber.pull_to_file(tmp_path.parent / f"{tmp_path.name}.safetensors", until=3)
    _published_again(store, old[1], at=1, steps=(2, 3, 4), seed=500)
    fresh = _fresh(old[1])
    assert ds.Subscriber(store, signing_key=KEY).pull(fresh, until=3) == 3
    assert subscriber.pull(replica, until=3) == 3
    assert_states_equal(replica, fresh)


def test_a_held_step_of_a_store_left_empty_is_said_once(tmp_path, caplog):
    """A resume at a step retention removed empties the store of its later steps: a subscriber holding one of them
    says so once (it said nothing: the warning needed a newest step)."""
    store = ds.LocalStore(tmp_path)
    old = _publish(store, 3)
    subscriber = ds.Subscriber(store, signing_key=KEY)
    replica = _fresh(old[2])
    assert subscriber.pull(replica) == 2
    store.delete([LATEST_KEY] + [entry_key(step) for step in (2, 1, 0)])  # what such a resume removes
    with caplog.at_level(logging.WARNING, logger="deltasync_rs.sync"):
        assert subscriber.pull(replica) == 2
        assert subscriber.pull(replica) == 2
    assert caplog.text.count("step 2, held here, is no longer in the store, which holds no step") == 1


def test_an_object_larger_than_its_entry_says_is_refused_before_it_is_read_whole(tmp_path):
    """Someone who can write to the store but lacks the key puts a huge object where a delta or an anchor was: the
    subscriber read all of it (into memory for a delta, into TMPDIR for an anchor) before the size check refused it,
    so a few hundred GB exhausted memory or disk (found by an adversarial helper). No more than the signed entry's
    size is taken now (a copy's one block beyond it)."""
    from collections import Counter

    from deltasync_rs.store import COPY_BYTES, Store

    class Remote(Store):
        """A store that is not a local folder (its files are not copied by the kernel), counting what it gives."""

        def __init__(self, inner):
            self.inner, self.url, self.taken = inner, f"remote+{inner.url}", Counter()

        def put(self, key, data):
            self.inner.put(key, data)

        def get(self, key):
            data = self.inner.get(key)
            self.taken[key] = max(self.taken[key], len(data))
            return data

        def get_small(self, key, max_bytes):
            data = self.inner.get_small(key, max_bytes)
            self.taken[key] = max(self.taken[key], len(data))
            return data

        def get_file(self, key, out):
            taken, counted = self.taken, Counter()

            class Counted:
                def write(self, data):
                    counted[key] += len(data)
                    taken[key] = max(taken[key], counted[key])  # the most one read took
                    return out.write(data)

            return self.inner.get_file(key, Counted())

        def list(self, prefix=""):
            return self.inner.list(prefix)

        def delete(self, keys):
            self.inner.delete(keys)

    inner = ds.LocalStore(tmp_path / "store")
    state = {"w": np.arange(4096, dtype=np.float32)}
    with ds.Publisher(inner, anchor_every=2, keep_anchors=5, signing_key=b"k" * 32, background=False) as publisher:
        for step in range(3):
            state["w"][step] += 1
            publisher.publish(step, state)
    reader = ds.Subscriber(inner, signing_key=b"k" * 32)
    sizes = {
        key: reader.entry(step).delta["size"] if "deltas/" in key else reader.entry(step).anchor["size"]
        for step, key in ((1, delta_key(1)), (2, anchor_key(2)))
    }
    huge = 3 * COPY_BYTES
    for key in sizes:
        (tmp_path / "store" / key).write_bytes(b"\0" * huge)
    remote = Remote(inner)
    target = {"w": np.zeros(4096, dtype=np.float32)}
    try:
        ds.Subscriber(remote, signing_key=b"k" * 32).pull(target)
    except ds.ChainError:
        pass  # nothing but step 0 is left whole
    for key, size in sizes.items():
        assert remote.taken[key] <= size + COPY_BYTES, (key, remote.taken[key])  # old: every byte


def test_entries_that_never_verify_above_the_runs_steps_do_not_stop_readers(tmp_path, caplog):
    """Sixteen junk entries numbered above every real step, written by someone without the key, stayed the
    "newest" forever (retention never reaches above the run's steps): every pull of the signed store raised
    (found by an adversarial helper). A reader now follows the signed latest.json's step when the newest listed
    entries do not verify, and the publisher goes on above its own steps."""
    key = b"k" * 32
    store = ds.LocalStore(tmp_path / "store")
    state, history = _state(), {}
    publisher = ds.Publisher(store, anchor_every=2, signing_key=key, background=False)
    for step in range(3):
        _train_step(state, step)
        publisher.publish(step, state)
        history[step] = {k: v.clone() for k, v in state.items()}
    for i in range(20):
        store.put(entry_key(10**11 + i), b"{}")
    replica = _fresh(state)
    assert ds.Subscriber(store, signing_key=key).pull(replica) == 2
    assert_states_equal(replica, history[2])
    assert "do not verify; step 2, which latest.json names, does" in caplog.text
    _train_step(state, 3)
    publisher.publish(3, state)
    publisher.close()
    assert ds.Subscriber(store, signing_key=key).pull(replica) == 3
    assert_states_equal(replica, state)


def test_max_age_refuses_a_store_put_back_to_an_earlier_copy(tmp_path, monkeypatch, capsys):
    """Signatures bind documents, not time: an earlier copy of a signed store put back by someone without the key
    verifies, and a new subscriber follows it. With max_age, a store whose newest step was published longer ago than
    that is refused (StaleStoreError, nothing written): the rollback lasts no longer than max_age."""
    import shutil

    key = b"k" * 32
    root = tmp_path / "store"
    state, history = _state(), {}
    with ds.Publisher(root, anchor_every=2, signing_key=key, background=False) as publisher:
        for step in range(4):
            _train_step(state, step)
            publisher.publish(step, state)
            history[step] = {k: v.clone() for k, v in state.items()}
            if step == 1:
                shutil.copytree(root, tmp_path / "copy")
    shutil.rmtree(root)
    shutil.copytree(tmp_path / "copy", root)  # the earlier copy, put back
    replica = _fresh(state)
    assert ds.Subscriber(root, signing_key=key, max_age=60).pull(replica) == 1  # fresh: followed
    later = time.time() + 120
    monkeypatch.setattr("deltasync_rs.subscriber.time.time", lambda: later)
    target = _fresh(state)
    with pytest.raises(
        ds.StaleStoreError, match="its newest step, 1, was published 1[0-9]{2} s ago, more than max_age"
    ):
        ds.Subscriber(root, signing_key=key, max_age=60).pull(target)
    assert all(not t.any() for t in target.values())
    assert ds.Subscriber(root, signing_key=key, max_age=600).pull(target) == 1
    assert_states_equal(target, history[1])
    monkeypatch.setenv("DELTASYNC_SIGNING_KEY", key.decode())
    capsys.readouterr()
    assert main(["pull", "--store", str(root), "-o", str(tmp_path / "out.safetensors"), "--max-age", "60"]) == 1
    assert "more than max_age=60 s" in capsys.readouterr().err and not (tmp_path / "out.safetensors").exists()
    for bad in (0, -1, True, "60", float("nan")):
        with pytest.raises(ds.DeltaSyncError, match="max_age must be a number of seconds"):
            ds.Subscriber(root, max_age=bad)


def test_max_age_holds_when_the_newest_steps_files_are_gone(tmp_path, monkeypatch):
    """The newest step fresh, its delta removed by someone without the key: the pull fell back to an older step,
    published an hour ago, under max_age=60 (found by reviewing max_age). An older step is taken only when it was
    published within max_age; else StaleStoreError, nothing written."""
    key = b"k" * 32
    root = tmp_path / "store"
    now = time.time()
    clock = [now - 3600]
    monkeypatch.setattr("deltasync_rs.publisher.time.time", lambda: clock[0])
    state = {"w": np.zeros(64, dtype=np.float32)}
    with ds.Publisher(root, anchor_every=100, signing_key=key, background=False) as publisher:
        for step in range(4):
            if step == 3:
                clock[0] = now
            state["w"][step] = step + 1
            publisher.publish(step, state)
    monkeypatch.undo()
    (root / delta_key(3)).unlink()
    replica = {"w": np.zeros(64, dtype=np.float32)}
    with pytest.raises(ds.StaleStoreError, match="step 2, the newest older one, was published more than max_age=60"):
        ds.Subscriber(root, signing_key=key, max_age=60).pull(replica)
    assert not replica["w"].any()
    assert ds.Subscriber(root, signing_key=key, max_age=7200).pull(replica) == 2  # within it: taken, as before


def test_verify_of_a_signed_store_without_its_key_says_its_signatures_went_unchecked(tmp_path, capsys, monkeypatch):
    """`deltasync verify` of a signed store without DELTASYNC_SIGNING_KEY printed "every entry, signature and file
    digest checks out" with its signatures forged (found by a helper checking the docs): they were never checked.
    Now that is a problem, unless asked for with --without-signatures, and the message says what was checked."""
    monkeypatch.delenv("DELTASYNC_SIGNING_KEY", raising=False)
    _publish_run(tmp_path, 3, signing_key=KEY, background=False)
    for key in (RUN_KEY, LATEST_KEY):  # signatures forged, the rest untouched
        document = json.loads((tmp_path / key).read_bytes())
        document["signature"] = "0" * 64
        (tmp_path / key).write_text(json.dumps(document))
    problems = ds.sync.verify_store(tmp_path)
    assert len(problems) == 1 and "signed, but no signing key is set" in problems[0], problems
    assert main(["verify", "--store", str(tmp_path)]) == 1
    assert "signatures were not checked" in capsys.readouterr().out
    assert ds.sync.verify_store(tmp_path, signatures=False) == []
    assert main(["verify", "--store", str(tmp_path), "--without-signatures"]) == 0
    assert "its signatures were not checked" in capsys.readouterr().out
    # With the key, the forged signatures are found.
    monkeypatch.setenv("DELTASYNC_SIGNING_KEY", KEY)
    assert main(["verify", "--store", str(tmp_path)]) == 1
    assert "bad signature" in capsys.readouterr().out
    # A signature stripped from run.json and latest.json, the entries still signed: still a signed store.
    monkeypatch.delenv("DELTASYNC_SIGNING_KEY")
    for key in (RUN_KEY, LATEST_KEY):
        document = json.loads((tmp_path / key).read_bytes())
        del document["signature"]
        (tmp_path / key).write_text(json.dumps(document))
    assert main(["verify", "--store", str(tmp_path)]) == 1
    assert "signatures were not checked" in capsys.readouterr().out
    # An unsigned store: nothing to check without a key, and a problem with one unless --without-signatures.
    _publish_run(tmp_path / "unsigned", 2, background=False)
    monkeypatch.setenv("DELTASYNC_SIGNING_KEY", KEY)
    assert main(["verify", "--store", str(tmp_path / "unsigned")]) == 1
    assert "not signed, but a signing key is set" in capsys.readouterr().out
    assert main(["verify", "--store", str(tmp_path / "unsigned"), "--without-signatures"]) == 0
    assert "DELTASYNC_SIGNING_KEY" not in os.environ
    monkeypatch.delenv("DELTASYNC_SIGNING_KEY", raising=False)
    assert main(["verify", "--store", str(tmp_path / "unsigned")]) == 0
    assert "(an unsigned store)" in capsys.readouterr().out


# Checks that no test pinned: mutation testing (each check removed in turn, the tests run) found them surviving.


def _published_numpy(store, steps, **options):
    w, history = np.zeros(256, dtype=np.float32), {}
    with ds.Publisher(store, anchor_every=100, background=False, **options) as publisher:
        for step in range(steps):
            w[step * 7 : step * 7 + 5] += 1
            publisher.publish(step, {"w": w})
            history[step] = w.copy()
    return history


def test_a_delta_file_swapped_under_its_signed_entry_is_refused(tmp_path):
    """The other tampering tests re-sign or rewrite the entry; here only the file changes (one bit of a value,
    still a well-formed delta of the same size): fetch must refuse it, not hand it on as verified."""
    store = ds.LocalStore(tmp_path)
    _published_numpy(store, 4, signing_key=KEY)
    raw = bytearray(store.get(delta_key(2)))
    raw[-1] ^= 0x01
    raw = bytearray(reseal(bytes(raw)))  # the file's checksum is no signature: a tamperer makes it right
    ds.load(bytes(raw))
    store.put(delta_key(2), bytes(raw))
    with pytest.raises(ds.DeltaSyncError, match="digest|SHA-256|sha256"):
        ds.Subscriber(store, signing_key=KEY, retries=1).fetch(1)


def test_fetch_from_a_step_published_again_starts_from_an_anchor(tmp_path):
    """A subscriber fetched step 2; the publisher resumed at step 1 and published another step 2 and a step 3.
    fetch(2) must not hand over step 3's delta alone (made against the new step 2): applied without a base check,
    as fetch's callers may, it gave weights never published."""
    store = ds.LocalStore(tmp_path)
    w = np.zeros(64, dtype=np.float32)
    subscriber = ds.Subscriber(store, signing_key=KEY)
    with ds.Publisher(store, anchor_every=100, signing_key=KEY, background=False) as publisher:
        for step in range(3):
            w[step] += 1
            publisher.publish(step, {"w": w})
    held = {"w": np.zeros(64, dtype=np.float32)}
    for delta in subscriber.fetch(None):
        delta.apply_(held)
    again = np.zeros(64, dtype=np.float32)
    again[:2] = 1
    with ds.Publisher(store, anchor_every=100, signing_key=KEY, background=False) as publisher:
        publisher.resume({"w": again}, step=1)
        again[40] += 5
        publisher.publish(2, {"w": again})
        again[50] += 5
        publisher.publish(3, {"w": again})
    deltas = subscriber.fetch(2)
    assert deltas[0].is_anchor, [(d.step, d.is_anchor) for d in deltas]
    for delta in deltas:
        delta.apply_(held)
    assert np.array_equal(held["w"].view(np.uint32), again.view(np.uint32))


def test_a_state_that_misses_its_digest_even_from_the_anchor_is_an_integrity_error(tmp_path):
    """Entries whose state digest their files do not make (an unsigned store rewritten): the re-sync from the
    anchor cannot reach it either, and the pull must raise, not report the step."""
    import dataclasses

    from deltasync_rs.manifest import Entry

    store = ds.LocalStore(tmp_path)
    _published_numpy(store, 2)
    other = ds.state_digest({"w": np.full(256, 7, dtype=np.float32)})
    previous = None
    for step in range(2):
        entry = Entry.parse(store.get(entry_key(step)), entry_key(step), None)
        entry = dataclasses.replace(entry, state_digest=other, base_entry_sha256=previous or entry.base_entry_sha256)
        blob = entry.to_json(None)
        store.put(entry_key(step), blob)
        previous = hashlib.sha256(blob).hexdigest()
    store.delete([LATEST_KEY])
    with pytest.raises(ds.IntegrityError):
        ds.Subscriber(store, retries=1).pull({"w": np.zeros(256, dtype=np.float32)})


def test_an_entry_based_on_its_own_step_is_a_format_error():
    """Followed back from a store without run ids (where links are not checked), it would loop on itself."""
    from deltasync_rs.manifest import Entry

    document = {
        "format": "deltasync-manifest",
        "version": 1,
        "step": 5,
        "base_step": 5,
        "delta": {"key": delta_key(5), "size": 1, "sha256": "0" * 64},
        "anchor": None,
        "state_digest": "0" * 64,
        "num_changed": 0,
        "num_elements": 1,
        "created": 1.0,
    }
    with pytest.raises(ds.DeltaFormatError, match="base step 5 is not before step 5"):
        Entry.parse(json.dumps(document).encode(), entry_key(5), None)


def test_retention_counts_no_anchor_of_a_later_step(tmp_path):
    """An anchor and entry of a later step in the store (another history's): with keep_anchors=1 it must not count
    as the newest anchor, which made retention remove the step just published."""
    other = ds.LocalStore(tmp_path / "other")
    with ds.Publisher(other, background=False) as publisher:
        publisher.publish(50, {"w": np.ones(8, dtype=np.float32)})
    store = ds.LocalStore(tmp_path / "store")
    w = np.zeros(8, dtype=np.float32)
    with ds.Publisher(store, anchor_every=2, keep_anchors=1, background=False) as publisher:
        publisher.publish(0, {"w": w})
        for key in (anchor_key(50), entry_key(50)):
            store.put(key, other.get(key))
        w[1] = 1
        publisher.publish(1, {"w": w})
        w[2] = 2
        publisher.publish(2, {"w": w})
    from deltasync_rs.manifest import listed_steps

    assert listed_steps(store) == [2, 50]  # 0 and 1 removed, 2 kept (its anchor is the newest counted)


def test_a_step_whose_entry_another_writer_created_first_is_not_published(tmp_path):
    class Racing(ds.LocalStore):
        def create(self, key, data):
            if key == entry_key(1):  # another writer's entry lands first
                super().create(key, data.replace(b'"num_changed"', b'"num_changed" ', 1))
                return False
            return super().create(key, data)

    store = Racing(tmp_path)
    w = np.zeros(8, dtype=np.float32)
    publisher = ds.Publisher(store, anchor_every=100, background=False, retries=1)
    publisher.publish(0, {"w": w})
    w[0] = 1
    with pytest.raises(ds.DeltaSyncError):
        publisher.publish(1, {"w": w})


@pytest.mark.parametrize("check", ["step", "base step"])
def test_a_delta_file_of_another_step_filed_under_an_entry_is_refused_by_each_check(tmp_path, check):
    """Step 1's delta filed as step 2's, its entry rewritten to match (an unsigned store): both the file's step
    and its base step disagree with the entry, and each check must refuse it alone (mutation testing found that
    removing either one passed every test, the other catching it)."""
    import dataclasses

    from deltasync_rs.manifest import Entry, file_ref

    store = ds.LocalStore(tmp_path)
    _published_numpy(store, 3)
    blob = bytearray(store.get(delta_key(1)))
    if check == "base step":  # the file's own step made the entry's, so only its base step tells
        header_end = 8 + int.from_bytes(blob[:8], "little")
        header = blob[8:header_end].replace(b'"step":"1"', b'"step":"2"')
        assert len(header) == header_end - 8
        blob[8:header_end] = header
        blob = bytearray(reseal(bytes(blob)))  # as a writer of that header would have sealed it
    store.put(delta_key(2), bytes(blob))
    entry = Entry.parse(store.get(entry_key(2)), entry_key(2), None)
    store.put(entry_key(2), dataclasses.replace(entry, delta=file_ref(delta_key(2), bytes(blob))).to_json(None))
    store.delete([LATEST_KEY])
    message = "the file says step 1, its entry step 2" if check == "step" else "base step 0 differs from its entry"
    with pytest.raises(ds.DeltaSyncError, match=message):
        ds.Subscriber(store, retries=1).fetch(1)
