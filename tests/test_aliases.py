"""Tied names in a file's header (docs/format.md §2.2): written, read back, checked, and carried by every file a
Publisher writes, so that a file applied without its manifest entry still says which names it writes under
another's."""

from __future__ import annotations

import json

import numpy as np
import pytest

import deltasync_rs as ds
from deltasync_rs.store import LocalStore
from tests.helpers import reseal


def _states():
    rng = np.random.default_rng(5)
    prev = {"w": rng.integers(0, 1 << 16, 64, dtype=np.uint16), "b": rng.integers(0, 1 << 16, 8, dtype=np.uint16)}
    curr = {name: t.copy() for name, t in prev.items()}
    curr["w"][[1, 9, 40]] += 1
    return prev, curr


def _with_metadata(blob: bytes, key: str, value: str | None) -> bytes:
    """``blob`` with its header's metadata ``key`` set to ``value`` (removed for None), laid out again and sealed."""
    length = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + length])
    if value is None:
        header["__metadata__"].pop(key, None)
    else:
        header["__metadata__"][key] = value
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return reseal(len(text).to_bytes(8, "little") + text + blob[8 + length :])


@pytest.mark.parametrize("codec", ["varint", "compact"])
def test_aliases_round_trip_in_both_layouts(codec):
    prev, curr = _states()
    delta = ds.diff(prev, curr, codec=codec, step=2, base_step=1)
    assert delta.aliases == {}
    delta.aliases = {"head": "w", "other.bias": "b"}
    back = ds.load(delta.to_bytes())
    assert back.aliases == {"head": "w", "other.bias": "b"}
    assert back.metadata == {}  # not caller metadata
    target = {name: t.copy() for name, t in prev.items()}
    back.apply_(target)
    assert all(np.array_equal(target[n], curr[n]) for n in curr)
    # A file without ties has no such key at all (the bytes of the files before it).
    plain = ds.diff(prev, curr, codec=codec, step=2, base_step=1).to_bytes()
    assert b"aliases" not in plain


def test_an_anchor_written_in_one_pass_carries_them(tmp_path):
    _, curr = _states()
    path = tmp_path / "anchor.safetensors"
    path.touch()
    ds.delta.write_anchor_pieces(curr, path, step=4, piece_bytes=1024, whole_sha256=False, aliases={"head": "w"})
    expected = ds.anchor(curr, step=4)
    expected.aliases = {"head": "w"}
    assert path.read_bytes() == expected.to_bytes()
    assert ds.load(path).aliases == {"head": "w"}


@pytest.mark.parametrize(
    ("aliases", "why"),
    [
        ({"w": "b"}, ".w. has a record of its own"),
        ({"head": "head"}, "under its own name"),
        ({"head": "w", "w2": "head"}, "itself an alias"),
        ({"": "w"}, "empty"),
        ({"head": ""}, "empty"),
        ({"head:pos": "w"}, "reserved for delta streams"),
    ],
)
def test_the_writer_refuses_ties_that_are_not_ties(aliases, why):
    prev, curr = _states()
    delta = ds.diff(prev, curr)
    delta.aliases = aliases
    with pytest.raises(ds.DeltaSyncError, match=why):
        delta.to_bytes()


def test_ties_are_not_caller_metadata():
    prev, curr = _states()
    delta = ds.diff(prev, curr)
    with pytest.raises(ds.DeltaSyncError, match="'aliases' is reserved"):
        delta.metadata = {"aliases": "{}"}
    with pytest.raises(ds.DeltaSyncError, match="names must be strings"):
        delta.aliases = {"head": 3}
    with pytest.raises(ds.DeltaSyncError, match="mapping"):
        delta.aliases = [("head", "w")]


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("not json", "not a JSON object of names"),
        ('["head","w"]', "not a JSON object of names"),
        ('{"head":3}', "not a JSON object of names"),
        ("{}", "is empty"),
        ('{"w":"b"}', ".w. has a record of its own"),
        ('{"head":"head"}', "under its own name"),
        ('{"a":"b","b":"w"}', "itself an alias"),
        # A repeated key: readers that keep the first or the last would write the alias from different tensors.
        ('{"head":"w","head":"b"}', "listed twice"),
    ],
)
def test_the_reader_refuses_ties_that_are_not_ties(value, why):
    prev, curr = _states()
    delta = ds.diff(prev, curr, codec="compact")
    delta.aliases = {"head": "w"}
    blob = _with_metadata(delta.to_bytes(), "aliases", value)
    with pytest.raises(ds.DeltaFormatError, match=why):
        ds.load(blob)
    # The same edit with a sound value reads back: the refusal is the value's, not the rewriting's.
    assert ds.load(_with_metadata(delta.to_bytes(), "aliases", '{"x.weight":"b"}')).aliases == {"x.weight": "b"}


def test_every_file_a_publisher_writes_carries_its_ties(tmp_path):
    """The manifest entry lists the ties; each delta and anchor file of the step carries the same, so that a file
    applied on its own (a vLLM worker's explicit path) can refuse a model served untied."""
    prev, curr = _states()
    tied = {"head": "w"}
    with ds.Publisher(LocalStore(tmp_path / "store"), anchor_every=2, background=False) as publisher:
        publisher.publish_shared(0, {n: t.copy() for n, t in prev.items()}, aliases=tied)
        mirror = publisher._mirror.tensors
        for step in (1, 2):

            def advance(step=step):
                before = {n: np.array(t, copy=True) for n, t in mirror.items()}
                for name in mirror:
                    mirror[name][...] = curr[name] if step % 2 else prev[name]
                return ds.diff(before, mirror)

            publisher.publish_shared(step, mirror, advance, aliases=tied)
    subscriber = ds.Subscriber(LocalStore(tmp_path / "store"))
    files = 0
    for step in (0, 1, 2):
        entry = subscriber.entry(step)
        assert entry.aliases == tied
        for ref in (entry.delta, entry.anchor):
            if ref is not None:
                assert ds.load(tmp_path / "store" / ref["key"]).aliases == tied, (step, ref["key"])
                files += 1
    assert files >= 4  # an anchor at 0 and 2, deltas at 1 and 2


@pytest.mark.parametrize("check_base", [False, True])
def test_apply_writes_a_tie_the_state_holds_untied(check_base):
    """A file whose trainer ties ``head`` to ``w`` applied to a state holding ``head`` as an array of its own: both
    are written (before, ``head`` kept its old values, silently); tied memory is written once."""
    prev, curr = _states()
    delta = ds.diff(prev, curr, codec="compact")
    delta.aliases = {"head": "w"}
    loaded = ds.load(delta.to_bytes())
    untied = {name: t.copy() for name, t in prev.items()} | {"head": prev["w"].copy()}
    loaded.apply_(untied, check_base=check_base)
    assert np.array_equal(untied["head"], curr["w"]) and np.array_equal(untied["w"], curr["w"])
    tied = {name: t.copy() for name, t in prev.items()}
    tied["head"] = tied["w"]
    loaded.apply_(tied, check_base=check_base)
    assert np.array_equal(tied["w"], curr["w"])
    # An untied copy that does not hold the base is refused by name when bases are checked, nothing written.
    stale = {name: t.copy() for name, t in prev.items()} | {"head": curr["w"].copy()}
    if check_base:
        before = {name: t.copy() for name, t in stale.items()}
        with pytest.raises(ds.BaseMismatchError, match="head"):
            loaded.apply_(stale, check_base=True)
        assert all(np.array_equal(stale[n], before[n]) for n in stale)
    # One of another shape is refused by name whatever the check.
    with pytest.raises(ds.DeltaSyncError, match="head"):
        loaded.apply_({name: t.copy() for name, t in prev.items()} | {"head": np.zeros(3, np.uint16)})


def test_publish_delta_of_a_tied_delta_onto_a_publisher_that_publishes_the_alias(tmp_path):
    """A delta (made where head is tied to w) relayed to a publisher whose state holds head as a tensor of its own:
    the published file gives head its tensor's record, so the mirror, the entry's digest and every reader of the
    file agree (found by a review: the mirror wrote head, the file dropped the tie, an explicit apply left head
    stale, and a pull failed on the digest)."""
    prev, curr = _states()
    prev["head"], curr["head"] = prev["w"].copy(), curr["w"].copy()
    root = tmp_path / "store"
    with ds.Publisher(LocalStore(root), background=False) as publisher:
        publisher.publish(0, {name: t.copy() for name, t in prev.items()})
        relayed = ds.diff({n: prev[n] for n in ("w", "b")}, {n: curr[n] for n in ("w", "b")})
        relayed.aliases = {"head": "w"}
        publisher.publish_delta(1, relayed)
        assert np.array_equal(publisher._mirror.tensors["head"], curr["head"])
    entry = ds.Subscriber(LocalStore(root)).entry(1)
    assert not entry.aliases
    published = ds.load(root / entry.delta["key"])
    assert "head" in published.names and published.aliases == {}
    explicit = {name: t.copy() for name, t in prev.items()}
    published.apply_(explicit, check_base=True)
    assert ds.state_digest(explicit) == entry.state_digest
    pulled = {name: np.zeros_like(t) for name, t in prev.items()}
    assert ds.Subscriber(LocalStore(root)).pull(pulled) == 1
    assert all(np.array_equal(pulled[n], curr[n]) for n in curr)


def test_publish_delta_keeps_the_ties_a_delta_names(tmp_path):
    """Ties a relayed delta names (its alias not published) are listed by that step and by the later ones, an
    anchor included, so that a subscriber starting from that anchor still writes an untied copy."""
    prev, curr = _states()
    root = tmp_path / "store"
    with ds.Publisher(LocalStore(root), anchor_every=2, background=False) as publisher:
        publisher.publish(0, {name: t.copy() for name, t in prev.items()})
        relayed = ds.diff(prev, curr)
        relayed.aliases = {"head": "w"}
        publisher.publish_delta(1, relayed)
        publisher.publish(2, {name: t.copy() for name, t in prev.items()})  # an anchor step
    subscriber = ds.Subscriber(LocalStore(root))
    for step in (1, 2):
        assert subscriber.entry(step).aliases == {"head": "w"}, step
    assert ds.load(root / subscriber.entry(2).anchor["key"]).aliases == {"head": "w"}
    untied = {name: np.zeros_like(t) for name, t in prev.items()} | {"head": np.zeros_like(prev["w"])}
    assert ds.Subscriber(LocalStore(root)).pull(untied, until=2) == 2
    assert np.array_equal(untied["head"], prev["w"])


def test_a_publisher_refuses_ties_no_file_could_carry(tmp_path):
    prev, _ = _states()
    with ds.Publisher(LocalStore(tmp_path / "store"), background=False) as publisher:
        with pytest.raises(ds.DeltaSyncError, match="reserved for delta streams"):
            publisher.publish_shared(0, {name: t.copy() for name, t in prev.items()}, aliases={"head:pos": "w"})


def test_an_entry_with_a_tie_no_file_could_carry_is_refused_by_its_readers(tmp_path):
    """A manifest entry's ties are written into every file of the step (docs/format.md §2.2), so an entry naming
    one no file may hold (here written by hand into an unsigned store) is malformed: a subscriber refuses the entry,
    naming it, and a publisher reopening the store does not take the tie on (before, every upload failed)."""
    from deltasync_rs.manifest import entry_key
    from tests.helpers import relink

    prev, curr = _states()
    root = tmp_path / "store"
    with ds.Publisher(LocalStore(root), background=False) as publisher:
        publisher.publish_shared(0, {name: t.copy() for name, t in prev.items()}, aliases={"head": "w"})
    entry = json.loads((root / entry_key(0)).read_text())
    assert entry["aliases"] == {"head": "w"}
    entry["aliases"] = {"head:pos": "w"}
    (root / entry_key(0)).write_text(json.dumps(entry))
    relink(root, 0)
    with pytest.raises(
        ds.DeltaFormatError, match=r"step_000000000000\.json: the field aliases: .*reserved for delta streams"
    ):
        ds.Subscriber(LocalStore(root)).entry(0)
    with pytest.raises(ds.DeltaFormatError, match="reserved for delta streams"):
        ds.Subscriber(LocalStore(root)).pull({name: t.copy() for name, t in prev.items()})
    # A publisher reopening the store ignores (and logs) the malformed newest entry, as it does any: it no longer
    # takes the tie on and fails at every upload.
    with ds.Publisher(LocalStore(root), background=False) as publisher:
        publisher.publish_shared(1, {name: t.copy() for name, t in curr.items()})
    assert not ds.Subscriber(LocalStore(root)).entry(1).aliases
    # The same entry with a tie every file may carry is read as before.
    entry["aliases"] = {"head": "w"}
    (root / entry_key(0)).write_text(json.dumps(entry))
    relink(root, 0)
    assert ds.Subscriber(LocalStore(root)).entry(0).aliases == {"head": "w"}


def test_the_cli_apply_writes_a_tie_the_checkpoint_holds_untied(tmp_path):
    """``deltasync apply`` of a tied file onto a checkpoint that holds the alias as a tensor of its own writes it
    (it kept its old values, exit code 0, before)."""
    from safetensors.numpy import load_file

    from deltasync_rs.cli import main

    prev, curr = _states()
    delta = ds.diff(prev, curr, step=1, base_step=0)
    delta.aliases = {"head": "w"}
    delta.save(tmp_path / "d.safetensors")
    ds.anchor(prev | {"head": prev["w"].copy()}, step=0).save(tmp_path / "base.safetensors")
    out = tmp_path / "out.safetensors"
    assert main(["apply", str(tmp_path / "base.safetensors"), str(tmp_path / "d.safetensors"), "-o", str(out)]) == 0
    written = load_file(str(out))
    assert np.array_equal(written["head"], curr["w"]) and np.array_equal(written["w"], curr["w"])


def test_trl_files_name_each_alias_as_a_tensor():
    """TRL's layout has no place for ties: each alias is written as a tensor, so a TRL reader writes it too."""
    from safetensors.numpy import load

    prev, curr = _states()
    delta = ds.diff(prev, curr, values="abs")
    delta.aliases = {"head": "w"}
    blob = delta.to_bytes("trl")
    assert sorted(load(blob)) == ["head.indices", "head.values", "w.indices", "w.values"]
    untied = {name: t.copy() for name, t in prev.items()} | {"head": prev["w"].copy()}
    ds.load(blob).apply_(untied)
    assert np.array_equal(untied["head"], curr["w"])
    assert delta.aliases == {"head": "w"}  # the delta itself is unchanged


def test_a_refused_publish_delta_leaves_the_delta_and_the_ties_as_they_were(tmp_path):
    prev, curr = _states()
    with ds.Publisher(LocalStore(tmp_path / "store"), background=False) as publisher:
        publisher.publish(0, {name: t.copy() for name, t in prev.items()})
        wrong = ds.diff(curr, prev, base_step=0)  # made against another state: refused by its base identities
        wrong.aliases = {"head": "w"}
        with pytest.raises(ds.BaseMismatchError):
            publisher.publish_delta(1, wrong)
        assert wrong.step is None and wrong.aliases == {"head": "w"}
        assert publisher._aliases == {}
