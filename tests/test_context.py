"""The `context` position codec (docs/format.md §5.2): positions coded per class of the base element's exponent.

Round trips onto every kind of target, the base check that comes with it (a wrong base is refused, never decoded),
all-or-nothing on failure, malformed streams, and the writers and readers that refuse it by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deltasync_rs as ds

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def _step(seed: int, shape: tuple[int, ...], dtype: torch.dtype, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A base of magnitudes spread over many binades and one step of a constant size, so that small weights change
    far more often than large ones, as on real training steps."""
    g = torch.Generator().manual_seed(seed)
    magnitudes = torch.rand(shape, generator=g) * 2.0 ** -torch.randint(0, 14, shape, generator=g).float()
    base = (magnitudes * torch.sign(torch.randn(shape, generator=g))).to(dtype)
    new = (base.float() + lr * torch.sign(torch.randn(shape, generator=g))).to(dtype)
    return base, new


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _state(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> tuple[dict, dict]:
    prev, curr = {}, {}
    for i, shape in enumerate([(64, 96), (300,), (17, 5, 3)]):
        prev[f"w{i}"], curr[f"w{i}"] = _step(seed + i, shape, dtype, 3e-5)
    return prev, curr


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(_bits(a[k]), _bits(b[k])) for k in b)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31),
    dtype=st.sampled_from(sorted(DTYPES)),
    rows=st.integers(0, 40),
    cols=st.integers(1, 70),
    lr=st.sampled_from([1e-5, 1e-4, 1e-3, 1e-2]),
)
def test_roundtrips_bit_exactly(seed, dtype, rows, cols, lr):
    prev, curr = _step(seed, (rows, cols), DTYPES[dtype], lr)
    delta = ds.load(ds.diff({"w": prev}, {"w": curr}, codec="context").to_bytes())
    compact = ds.diff({"w": prev}, {"w": curr}, codec="compact")
    assert delta.num_changed == compact.num_changed
    target = {"w": prev.clone()}
    delta.apply_(target)
    assert torch.equal(_bits(target["w"]), _bits(curr))
    if delta.tensors[0].positions == "context":
        # Chosen only where smaller than compact's positions.
        assert delta.nbytes < compact.nbytes
        positions, values = delta.decoded(0, base=prev)
        compact_positions, compact_values = compact.decoded(0)
        assert torch.equal(positions, compact_positions)
        assert torch.equal(values, compact_values)  # differences, whether coded by class (rans_classes) or not


def test_smaller_than_compact_on_magnitude_dependent_steps():
    prev, curr = _state()
    context, compact = ds.diff(prev, curr, codec="context"), ds.diff(prev, curr, codec="compact")
    assert {t.positions for t in context.tensors} == {"context"}
    assert len(context.to_bytes()) < 0.9 * len(compact.to_bytes())
    # The large tensor's values are coded by class too (docs/format.md §6.3), smaller than compact's one table.
    assert context.tensors[0].values == "rans_classes"
    context._raw.packed = compact._raw.packed = False
    sizes = [ds.load(d.to_bytes()).tensors[0].nbytes for d in (context, compact)]
    assert sizes[0] < sizes[1]


@pytest.mark.parametrize("kind", ["numpy", "torch", "torch strided", "numpy strided", "single tensor"])
def test_every_cpu_target_kind(kind):
    prev, curr = _state(3)
    blob = ds.diff(prev, curr, codec="context").to_bytes()
    if kind == "single tensor":
        target = prev["w0"].clone()
        ds.load(ds.diff(prev["w0"], curr["w0"], codec="context").to_bytes()).apply_(target)
        assert torch.equal(_bits(target), _bits(curr["w0"]))
        return
    if kind.startswith("numpy"):
        import ml_dtypes

        target = {k: _bits(v).numpy().view(ml_dtypes.bfloat16).copy() for k, v in prev.items()}
        if kind == "numpy strided":
            target = {k: np.asfortranarray(v) for k, v in target.items()}
            assert not target["w0"].flags.c_contiguous
        ds.load(blob).apply_(target)
        assert all(np.array_equal(target[k].view(np.int16), _bits(curr[k]).numpy()) for k in curr)
        return
    if kind == "torch strided":
        # Transposed storage: the target is a non-contiguous view, written through torch index ops.
        target = {k: v.clone().T.contiguous().T if v.dim() == 2 else v.clone() for k, v in prev.items()}
        assert not target["w0"].is_contiguous()
    else:
        target = {k: v.clone() for k, v in prev.items()}
    ds.load(blob).apply_(target)
    assert _equal(target, curr)


def test_a_wrong_base_is_refused_and_nothing_is_written():
    prev, curr = _state(5)
    delta = ds.load(ds.diff(prev, curr, codec="context").to_bytes())
    target = {k: v.clone() for k, v in prev.items()}
    target["w2"].view(-1)[0] = 7.0  # one tensor's base differs: the whole apply is refused
    before = {k: v.clone() for k, v in target.items()}
    with pytest.raises(ds.BaseMismatchError, match="w2"):
        delta.apply_(target)
    assert _equal(target, before)
    # Applied once, then a second time: the base no longer matches.
    target = {k: v.clone() for k, v in prev.items()}
    delta.apply_(target)
    with pytest.raises(ds.BaseMismatchError):
        delta.apply_(target)
    assert _equal(target, curr)


def test_decoding_without_the_base_says_what_is_missing():
    prev, curr = _state(6)
    delta = ds.diff(prev, curr, codec="context")
    with pytest.raises(ds.DeltaSyncError, match="context"):
        delta.decoded(0)
    with pytest.raises(ds.BaseMismatchError):
        delta.decoded(0, base=curr["w0"])


def _flip_each_byte(prev: torch.Tensor, delta: ds.Delta, stream: str) -> tuple[int, int, list[dict]]:
    """Flips every byte of ``delta``'s stream ``stream`` (``w:pos`` or ``w:val``, the named layout) in turn, then
    loads and applies each broken file onto a copy of ``prev``: a refused apply must leave the target untouched.
    Returns how many were refused, the stream's length and the file's records."""
    import json

    delta._raw.packed = False  # the named layout: the stream is its own tensor, easy to find
    blob = bytearray(delta.to_bytes())
    start = 8 + int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:start])
    begin, end = header[stream]["data_offsets"]
    refused = 0
    for at in range(start + begin, start + end):
        bad = bytearray(blob)
        bad[at] ^= 0x5A
        try:
            broken = ds.load(bytes(bad))
        except ds.DeltaSyncError:
            refused += 1
            continue
        target = {"w": prev.clone()}
        try:
            broken.apply_(target)
        except ds.DeltaSyncError:
            refused += 1
            assert torch.equal(_bits(target["w"]), _bits(prev)), f"byte {at}: a refused apply wrote"
    return refused, end - begin, json.loads(header["__metadata__"]["tensors"])


def test_malformed_streams_never_write_or_crash():
    """Every byte of a context position stream flipped in turn: the load or the apply refuses it with the target
    untouched, or (where the flip still decodes to valid positions) the apply writes a different valid change."""
    prev, curr = _step(11, (48, 40), torch.bfloat16, 1e-3)
    refused, length, records = _flip_each_byte(prev, ds.diff({"w": prev}, {"w": curr}, codec="context"), "w:pos")
    assert records[0]["positions"] == "context"
    assert refused > length // 2


def test_malformed_class_values_never_write_or_crash():
    """Every byte of a `rans_classes` value stream (docs/format.md §6.3) flipped in turn: the load or the apply
    refuses it with the target untouched, or the apply writes some change (a flip inside a low bit still decodes)."""
    prev, curr = _step(11, (48, 40), torch.bfloat16, 1e-3)
    refused, length, records = _flip_each_byte(prev, ds.diff({"w": prev}, {"w": curr}, codec="context"), "w:val")
    assert records[0]["values"] == "rans_classes"
    assert refused > length // 2


def test_class_values_need_context_positions():
    """A record that pairs `rans_classes` values with other positions is refused when loaded, by name."""
    import json

    prev, curr = _step(11, (48, 40), torch.bfloat16, 1e-3)
    delta = ds.diff({"w": prev}, {"w": curr}, codec="context")
    delta._raw.packed = False
    blob = bytearray(delta.to_bytes())
    start = 8 + int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:start])
    records = json.loads(header["__metadata__"]["tensors"])
    records[0]["positions"] = "rice"
    header["__metadata__"]["tensors"] = json.dumps(records)
    del header["__metadata__"]["file_xxh3"]  # a file without a checksum, as older writers wrote
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with pytest.raises(ds.DeltaSyncError, match="rans_classes"):
        ds.load(len(text).to_bytes(8, "little") + text + bytes(blob[start:]))


def test_records_without_what_context_needs_are_rejected():
    """A context record must carry a base identity, a shape and a float dtype (docs/format.md §5.2)."""
    import json

    prev, curr = _step(12, (32, 32), torch.bfloat16, 1e-3)
    delta = ds.diff({"w": prev}, {"w": curr}, codec="context")
    delta._raw.packed = False
    blob = delta.to_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    records = json.loads(header["__metadata__"]["tensors"])
    del header["__metadata__"]["file_xxh3"]  # a file without a checksum, as older writers wrote
    # (a record without its `shape` key is refused before any codec is looked at; `null` is an unknown shape)
    for field, value in (("base", ...), ("shape", None), ("dtype", "I16")):
        changed = [dict(records[0])]
        if value is ...:
            del changed[0][field]
        else:
            changed[0][field] = value
        header["__metadata__"]["tensors"] = json.dumps(changed)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with pytest.raises(ds.DeltaSyncError, match="context"):
            ds.load(len(text).to_bytes(8, "little") + text + blob[8 + n :])


def test_writers_refuse_it_where_they_cannot_know_the_base(tmp_path):
    """A mirror recovers the base of a changed element from its difference, so values="abs" is refused; a join of
    shard deltas sees no whole tensor unless it is given the bases; TRL files cannot hold it."""
    prev, curr = _state(7)
    with pytest.raises(ds.DeltaSyncError, match='values="diff"'):
        ds.Publisher(tmp_path / "store", codec="context", values="abs")
    mirror = ds.Mirror()
    mirror.reset(prev, step=0)
    with pytest.raises(ds.DeltaSyncError, match='values="diff"'):
        mirror.advance(curr, step=1, values="abs", codec="context")
    from deltasync_rs._core import join_shards

    with pytest.raises(ds.DeltaSyncError, match="context"):
        join_shards([ds.diff(prev, curr, codec="varint")._raw], "context")
    abs_delta = ds.diff(prev, curr, values="abs", codec="context")
    assert "context" in {t.positions for t in abs_delta.tensors}
    with pytest.raises(ds.DeltaSyncError, match="TRL"):
        abs_delta.save(tmp_path / "trl.safetensors", format="trl")


def test_shard_joins_given_the_bases_write_the_bytes_of_diff(tmp_path):
    """join_shards(..., "context", bases) codes the joined positions against the whole bases, as ds.diff does, and
    records their identities; a Publisher joins against the last state it published (publish_shards)."""
    from deltasync_rs._core import join_shards
    from deltasync_rs.delta import Delta

    prev, curr = _state(8)
    shard = ds.diff(prev, curr, codec="varint")._raw  # one shard holding everything: positions in the whole space
    joined = Delta(join_shards([shard], "context", [(n, t) for n, t in prev.items()]))
    assert joined.to_bytes() == ds.diff(prev, curr, codec="context").to_bytes()
    assert {t.positions for t in joined.tensors} == {"context"}
    with pytest.raises(ds.DeltaSyncError, match="'w1'|\"w1\""):
        join_shards([shard], "context", [(n, t) for n, t in prev.items() if n != "w1"])
    with pytest.raises(ds.DeltaSyncError, match="bytes"):
        join_shards([shard], "context", [(n, t.reshape(-1)[1:]) for n, t in prev.items()])
    with pytest.raises(ds.DeltaSyncError, match="context"):
        join_shards([shard], "compact", [(n, t) for n, t in prev.items()])

    with ds.Publisher(tmp_path / "store", codec="context", background=False) as publisher:
        publisher.publish(0, prev)
        late = ds.load(ds.diff(prev, curr, codec="varint", step=3, base_step=2).to_bytes())
        with pytest.raises(ds.BaseMismatchError, match="starts at step 2.*step 0"):
            publisher.publish_shards(3, [late])  # the shards moved on without the publisher: refused, not applied
        publisher.publish_shards(1, [ds.load(ds.diff(prev, curr, codec="varint", step=1, base_step=0).to_bytes())])
    stored = ds.load((tmp_path / "store" / "deltas" / "step_000000000001.safetensors").read_bytes())
    assert {t.positions for t in stored.tensors} == {"context"}
    replica = {k: torch.zeros_like(v) for k, v in prev.items()}
    assert ds.Subscriber(tmp_path / "store").pull(replica) == 1
    assert _equal(replica, curr)


def test_mirrors_write_the_bytes_of_diff():
    """The one-pass mirror kernel overwrites the base as it compares; it codes context positions from the new bits
    and the differences, and gives ds.diff's bytes."""
    prev, curr = _state(13)
    mirror = ds.Mirror()
    mirror.reset(prev, step=0)
    delta = mirror.advance(curr, step=1, codec="context")
    assert {t.positions for t in delta.tensors} == {"context"}
    assert delta.to_bytes() == ds.diff(prev, curr, codec="context", step=1, base_step=0).to_bytes()
    import deltasync_rs.torch as dst

    model = {k: v.float().clone() for k, v in prev.items()}
    trainer = dst.Mirror(model, torch.bfloat16, codec="context", step=0, chunk_bytes=4096)
    for name in model:
        model[name].copy_(curr[name].float())
    stepped = trainer.step(1)
    assert stepped.to_bytes() == ds.diff(prev, curr, codec="context", step=1, base_step=0).to_bytes()


def test_publisher_to_subscriber(tmp_path):
    """Publisher(codec="context") through a store to a fresh Subscriber and to one that follows every step."""
    g = torch.Generator().manual_seed(21)
    state = {f"w{i}": _step(30 + i, (64, 80), torch.bfloat16, 1e-5)[0] for i in range(3)}
    history = []
    follower = {k: v.clone() for k, v in state.items()}
    subscriber = ds.Subscriber(tmp_path / "store")
    with ds.Publisher(tmp_path / "store", codec="context", anchor_every=100, background=False) as publisher:
        for step in range(5):
            for name, tensor in state.items():
                noise = torch.randn(tensor.shape, generator=g).sign() * 1e-5
                state[name] = (tensor.float() + noise).to(torch.bfloat16)
            publisher.publish(step, state)
            history.append({k: v.clone() for k, v in state.items()})
            assert subscriber.pull(follower) == step
            assert _equal(follower, state)
    stored = sorted(p.name for p in (tmp_path / "store").rglob("*.safetensors"))
    deltas = [ds.load(p) for p in (tmp_path / "store").rglob("*.safetensors") if not ds.load(p).is_anchor]
    assert deltas and all("context" in {t.positions for t in d.tensors} for d in deltas), stored
    fresh = {k: torch.zeros_like(v) for k, v in state.items()}
    assert ds.Subscriber(tmp_path / "store").pull(fresh) == 4
    assert _equal(fresh, history[-1])


def test_cli_diff_and_apply(tmp_path, capsys):
    """`deltasync diff --codec context` then `deltasync apply`: the base is always checked for context tensors, even
    with --no-check-base."""
    from safetensors.torch import load_file, save_file

    from deltasync_rs.cli import main

    prev, curr = _state(9)
    prev_path, curr_path = str(tmp_path / "prev.safetensors"), str(tmp_path / "curr.safetensors")
    save_file(prev, prev_path)
    save_file(curr, curr_path)
    delta_path, out = str(tmp_path / "d.safetensors"), str(tmp_path / "out.safetensors")
    assert main(["diff", prev_path, curr_path, "-o", delta_path, "--codec", "context"]) == 0
    assert {t.positions for t in ds.load(delta_path).tensors} == {"context"}
    assert main(["apply", prev_path, delta_path, "-o", out]) == 0
    assert _equal(load_file(out), curr)
    # Against the new state (a second application): refused even without the optional check, nothing written.
    assert main(["apply", curr_path, delta_path, "-o", out, "--no-check-base"]) != 0
    assert "base" in capsys.readouterr().err
    assert _equal(load_file(out), curr), "a refused apply left its output as it was"
    trl = ["--codec", "context", "--values", "abs", "--format", "trl"]
    assert main(["diff", prev_path, curr_path, "-o", str(tmp_path / "t"), *trl]) != 0
    assert "--codec context" in capsys.readouterr().err
