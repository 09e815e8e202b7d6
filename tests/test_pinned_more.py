"""Safety checks of delta.py, _identity.py, _context.py, mirror.py, torch.py and integrations/trl.py that no other test
pins: each test fails if its check is weakened or removed (found by mutation testing)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deltasync_rs as ds
import deltasync_rs.delta as delta_module
from tests.helpers import assert_states_equal


def _fortran_states(names: str = "abc") -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Two states of 8x8 float32 tensors laid out column-major (so every reader stages a row-major copy of them),
    every element of the second one on from the first."""
    rng = np.random.default_rng(11)
    prev = {name: np.asfortranarray(rng.normal(size=(8, 8)).astype(np.float32)) for name in names}
    curr = {name: np.asfortranarray(array + 1) for name, array in prev.items()}
    return prev, curr


def test_staged_batches_hand_each_tensor_to_the_core_once(monkeypatch):
    """Host copies are handed to the core in batches of about ``_STAGING_BYTES``; a batch that was not emptied after
    its flush handed its tensors over again: ``diff`` refused the delta, and ``Mirror.advance`` raised after it had
    written every tensor's new bits into the mirror, its step unchanged, so the next delta lost this step's
    changes. Every batch here holds one tensor."""
    monkeypatch.setattr(delta_module, "_STAGING_BYTES", 64)
    prev, curr = _fortran_states()

    delta = ds.diff(prev, curr)
    assert delta.names == ["a", "b", "c"] and delta.num_changed == 3 * 64
    target = {name: np.ascontiguousarray(array) for name, array in prev.items()}
    delta.apply_(target, check_base=True)
    assert_states_equal(target, {name: np.ascontiguousarray(array) for name, array in curr.items()})

    mirror = ds.Mirror(prev, step=0)
    stepped = mirror.advance(curr, step=1)
    assert (stepped.names, stepped.num_changed, mirror.step) == (["a", "b", "c"], 3 * 64, 1)
    assert ds.anchor(curr).names == ["a", "b", "c"]


def test_diff_refuses_a_tensor_only_prev_holds():
    """A tensor of ``prev`` that ``curr`` lacks was dropped from the delta without a word, where one only in
    ``curr`` is refused: a tensor removed from the model went unreported, and the target kept its old weights."""
    prev, curr = _fortran_states("ab")
    with pytest.raises(ds.BaseMismatchError, match=r"only in prev \['b'\]"):
        ds.diff(prev, {"a": curr["a"]})


def test_an_anchor_without_a_whole_file_sha256_needs_pieces(tmp_path):
    """``whole_sha256=False`` with ``piece_bytes=0`` wrote an anchor with neither a SHA-256 nor piece hashes to check
    it by (``(size, None, digest, b"")``): a file nothing can vouch for."""
    path = tmp_path / "anchor.safetensors"
    path.write_bytes(b"")
    with pytest.raises(ds.DeltaSyncError, match="needs pieces"):
        delta_module.write_anchor_pieces({"a": np.ones(8, np.float32)}, path, piece_bytes=0, whole_sha256=False)
    assert path.read_bytes() == b""


def test_a_shared_mirror_refuses_an_array_it_cannot_write_in_place():
    """A column-major (or strided) array given to ``Mirror.share``: its flat bytes are a copy, so each advance wrote
    the new bits into that copy and the mirror kept the old state while its step moved on; the next delta was then
    made against that stale state."""
    base = np.asfortranarray(np.arange(16, dtype=np.float32).reshape(4, 4))
    mirror = ds.Mirror()
    with pytest.raises(ds.DeltaSyncError, match="'a': a shared mirror must be a contiguous CPU tensor"):
        mirror.share({"a": base}, step=0)
    with pytest.raises(ds.DeltaSyncError, match="'b': a shared mirror must be a contiguous CPU tensor"):
        mirror.share({"a": np.zeros(4, np.float32), "b": np.zeros(8, np.float32)[::2]}, step=0)
    assert mirror.is_empty and mirror.step is None


def test_sharded_context_readers_refuse_a_base_whose_changes_fall_in_other_value_groups():
    """Three elements of the base moved to other binades: the workers' bases give the record's number of changes in
    all, but not per value group (``rans_classes``). Without the per-group check each change took its value by its
    group's count before it, and the workers wrote other changes' values (or indexed past the values)."""
    from deltasync_rs import _context, _write
    from tests.test_context_sharded import _blocks, _regions, _staged_error, _step

    prev, curr = _step(3, (96, 160), torch.bfloat16, 3e-3)
    delta = ds.diff({"w": prev}, {"w": curr}, codec="context")
    assert (delta.tensors[0].positions, delta.tensors[0].values) == ("context", "rans_classes")
    assert len(_context.read_parts(delta._raw, 0).values) > 1
    wrong = prev.clone()
    for at, binades in [(9783, -20), (7851, -40), (4143, -40)]:
        wrong.view(-1)[at] *= 2.0**binades
    regions = _regions(wrong, _blocks(96, 160, [48], []))
    held = [_write.Writes(delta._raw).context_held(0, region) for region in regions]
    _staged_error(delta, regions, held, ds.BaseMismatchError, "value group 0 holds .*is this the delta's base")


def test_a_lazily_negated_device_tensor_is_hashed_by_value(monkeypatch):
    """The device path (here run on the CPU) viewed a lazily negated tensor (``torch._neg_view``) as bytes without
    resolving the negation: torch's bare RuntimeError ("negative bit set") escaped from ``state_digest`` and from the
    base check of a device target, instead of the hashes of the values the tensor holds."""
    from deltasync_rs import _identity
    from deltasync_rs._core import base_identity

    monkeypatch.setattr(_identity, "TORCH_ON_CPU", True)
    monkeypatch.setattr(_identity, "HOST_BELOW", 0)
    monkeypatch.setattr(_identity, "STATE_HOST_BELOW", 0)
    memory = torch.randn(1 << 17, generator=torch.Generator().manual_seed(5))  # two whole 256 KiB blocks
    negated = torch._neg_view(memory)
    assert negated.is_neg()
    values = negated.resolve_neg()
    assert _identity.base_identity(negated) == base_identity(values.view(torch.uint8).numpy())
    assert ds.state_digest({"w": negated}) == ds.state_digest({"w": values})


def test_a_mirror_shared_read_only_refuses_to_advance_before_it_writes(monkeypatch):
    """A mirror shared with ``read_only=True`` (a mapped checkpoint) beside writable arrays: without the check made
    before the scan, the first batch of tensors was written into the mirror before the read-only one refused, and the
    mirror was left between two steps at its old step number."""
    monkeypatch.setattr(delta_module, "_STAGING_BYTES", 64)  # a batch per tensor: "a" is written before "b" is read
    prev, curr = _fortran_states("ab")
    shared = {name: np.ascontiguousarray(array) for name, array in prev.items()}
    shared["b"].flags.writeable = False
    mirror = ds.Mirror()
    mirror.share(shared, step=0, read_only=True)
    with pytest.raises(ds.DeltaSyncError) as refused:
        mirror.advance(curr, step=1)
    assert mirror.step == 0
    assert_states_equal(shared, {name: np.ascontiguousarray(array) for name, array in prev.items()})
    assert "holds read-only arrays" in str(refused.value)


def test_mirror_advance_refuses_a_state_that_lacks_one_of_its_tensors():
    """A state without one of the mirror's tensors was advanced over the others: the delta left it out and the mirror
    kept it, as if it had not changed, where a state with a tensor the mirror lacks is refused."""
    prev, curr = _fortran_states("ab")
    mirror = ds.Mirror(prev, step=0)
    with pytest.raises(ds.BaseMismatchError, match=r"only in the mirror \['b'\]"):
        mirror.advance({"a": curr["a"]}, step=1)
    assert mirror.step == 0
    assert_states_equal(dict(mirror.tensors), {name: np.ascontiguousarray(a) for name, a in prev.items()})


def test_mirror_apply_checks_the_base_of_a_delta_made_elsewhere():
    """``Mirror.apply`` (``Publisher.publish_delta``) of a delta made from other weights at the mirror's step: without
    the base check it was written over the mirror, which then held neither state, and every later anchor with it."""
    prev, _ = _fortran_states("ab")
    other = {name: array * 2 for name, array in prev.items()}
    curr = {name: array.copy() for name, array in other.items()}
    curr["a"][0, :3] += 1  # a few changes: positions and values, which only the base they were made against takes
    delta = ds.diff(other, curr, step=1, base_step=0)
    assert delta.base_identity(0) is not None and delta.num_changed == 3
    _refused_by_a_mirror_at_step_0(prev, delta, "not the base this delta was made for")


def test_mirror_apply_refuses_a_delta_from_another_step_that_records_no_base():
    """A delta that records no base identity (a TRL patch) starting at another step than the mirror's: its step is
    all there is to check, and without that check its new values were written over a state they do not follow."""
    prev, curr = _fortran_states("ab")
    later = {name: array + 5 for name, array in curr.items()}
    patch = ds.load(ds.diff(curr, later, values="abs").to_bytes(format="trl"))
    assert patch.base_identity(0) is None
    patch.base_step, patch.step = 1, 2
    _refused_by_a_mirror_at_step_0(prev, patch, "delta starts at step 1 but the mirror is at step 0")


def _refused_by_a_mirror_at_step_0(prev: dict[str, np.ndarray], delta: ds.Delta, match: str) -> None:
    """``Mirror.apply`` of ``delta`` onto a mirror of ``prev`` at step 0 is refused, and the mirror is as it was."""
    mirror = ds.Mirror(prev, step=0)
    with pytest.raises(ds.BaseMismatchError, match=match):
        mirror.apply(delta)
    assert mirror.step == 0
    assert_states_equal(dict(mirror.tensors), {name: np.ascontiguousarray(a) for name, a in prev.items()})


def test_the_torch_mirror_refuses_a_model_that_lost_a_tensor_naming_it():
    """A tensor removed from the model since the mirror was made: a bare KeyError escaped from the step."""
    import deltasync_rs.torch as ds_torch

    source = {"a": torch.zeros(8), "b": torch.zeros(4)}
    mirror = ds_torch.Mirror(source, step=0)
    del source["b"]
    source["a"] += 1
    with pytest.raises(ds.DeltaSyncError, match=r"tensors \['b'\] of the mirror are gone from the model"):
        mirror.step(1)
    assert mirror.current_step == 0 and not mirror.tensors["a"].float().any()


def test_the_torch_mirror_refuses_a_tensor_whose_shipped_dtype_changed():
    """An fp8 weight (shipped as fp8) that the model now holds in bf16, same shape: without the dtype check the step
    cast the new bf16 weights down to fp8 on their way into the mirror and shipped the rounded values as the step."""
    import deltasync_rs.torch as ds_torch

    source = {"w": torch.full((16,), 0.5).to(torch.float8_e4m3fn)}
    mirror = ds_torch.Mirror(source, step=0)
    assert mirror.tensors["w"].dtype == torch.float8_e4m3fn
    source["w"] = torch.full((16,), 0.3).to(torch.bfloat16)  # 0.3 has no fp8 e4m3 value
    with pytest.raises(ds.DeltaSyncError, match="'w': the model now holds torch.bfloat16"):
        mirror.step(1)
    assert mirror.current_step == 0
    assert torch.equal(mirror.tensors["w"].float(), torch.full((16,), 0.5))


def test_the_trl_transfer_mirrors_weights_already_in_the_shipped_dtype_by_copy(tmp_path):
    """A model trained in bf16 (the shipped dtype) on the CPU: its tensors reach the first sync as they are, and a
    mirror made of them without a copy is the model's own memory: every later sync then raised (the core refuses a
    mirror that overlaps the weights it is compared with) and the server kept the first weights. No other test
    syncs weights that need no cast."""
    from deltasync_rs.integrations.trl import DeltaSyncWeightTransfer
    from tests.test_trl_transfer import Engine, Server, export, make_model, sync

    model = make_model().to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = Engine({name: torch.zeros_like(t) for name, t in export(model).items()})
    server = Server(engine)
    publisher = ds.Publisher(tmp_path / "store", anchor_every=100)
    try:
        transfer = DeltaSyncWeightTransfer(publisher, server.url, timeout=5.0, update_timeout=30.0)
        transfer.init_weight_transfer()
        sync(transfer, model)
        assert_states_equal(engine.state, export(model))
        for _ in range(2):
            model(torch.randn(8, 64, dtype=torch.bfloat16)).float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            sync(transfer, model)
            assert_states_equal(engine.state, export(model))
        assert transfer.server_step == 2
    finally:
        server.stop()
        publisher.close()


def _transfer(tmp_path, model):
    """A stand-in vLLM server holding zeros of ``model``'s weights, a publisher and a transfer to that server."""
    from deltasync_rs.integrations.trl import DeltaSyncWeightTransfer
    from tests.test_trl_transfer import Engine, Server, export

    engine = Engine({name: torch.zeros_like(t) for name, t in export(model).items()})
    server = Server(engine)
    publisher = ds.Publisher(tmp_path / "store", anchor_every=100)
    transfer = DeltaSyncWeightTransfer(publisher, server.url, timeout=5.0, update_timeout=30.0)
    return engine, server, publisher, transfer


def test_a_first_trl_sync_whose_publish_fails_keeps_no_mirror(tmp_path, monkeypatch):
    """The first sync copied the weights into the mirror and then its publish raised (a store out of reach): a
    mirror kept from it was published by the next sync as that step's anchor, and the weights that sync streamed
    were never read, so the server got the failed sync's weights."""
    from tests.test_trl_transfer import export, make_model, sync, train_step

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, server, publisher, transfer = _transfer(tmp_path, model)
    real = publisher.publish_shared

    def out_of_reach_once(*args, **kwargs):
        monkeypatch.setattr(publisher, "publish_shared", real)
        raise ds.StoreError("the store is out of reach")

    monkeypatch.setattr(publisher, "publish_shared", out_of_reach_once)
    try:
        transfer.init_weight_transfer()
        with pytest.raises(ds.StoreError, match="out of reach"):
            sync(transfer, model)
        train_step(model, optimizer)
        sync(transfer, model)
        assert transfer.server_step == 0
        assert_states_equal(engine.state, export(model))
    finally:
        server.stop()
        publisher.close()


def test_a_first_trl_sync_that_sends_a_tensor_twice_is_refused(tmp_path):
    """The first sync refuses a name the iterator yields twice, as every later one does: it kept the last of them
    without a word, and published it."""
    from deltasync_rs.integrations.trl import DeltaSyncWeightTransfer

    with ds.Publisher(tmp_path / "store", background=False) as publisher:
        transfer = DeltaSyncWeightTransfer(publisher, "http://127.0.0.1:9", timeout=1.0)
        with pytest.raises(ds.DeltaSyncError, match="'w' was sent twice in one sync"):
            transfer.send_weights(iter([("w", torch.zeros(4)), ("w", torch.ones(4))]))
        assert transfer.step is None and ds.Subscriber(publisher.store).latest_step() is None


def test_a_later_trl_sync_refuses_a_tensor_of_another_dtype_of_the_same_width(tmp_path):
    """An fp8 weight kept as fp8 e4m3 in the mirror that a later sync sends as fp8 e5m2 (same width, same shape):
    without the dtype check its bit patterns were compared with the mirror's as if they were e4m3 and shipped so."""
    from deltasync_rs.integrations.trl import DeltaSyncWeightTransfer

    with ds.Publisher(tmp_path / "store", background=False) as publisher:
        transfer = DeltaSyncWeightTransfer(publisher, "http://127.0.0.1:9", timeout=1.0)
        transfer.send_weights(iter([("w", torch.full((8,), 0.5).to(torch.float8_e4m3fn))]))  # server out of reach
        with pytest.raises(ds.BaseMismatchError, match="'w': sent as torch.float8_e5m2"):
            transfer.send_weights(iter([("w", torch.full((8,), 0.75).to(torch.float8_e5m2))]))
        assert transfer.step == 0 and ds.Subscriber(publisher.store).latest_step() == 0


def test_attach_without_a_publisher_is_refused_naming_it():
    """``attach(optimizer, model, None)`` of a model that is not sharded (None is for the other ranks of an FSDP2
    run): a bare AttributeError escaped from inside instead."""
    import deltasync_rs.torch as ds_torch

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ds.DeltaSyncError, match="attach needs a publisher"):
        ds_torch.attach(optimizer, model, None)
    assert not optimizer._optimizer_step_post_hooks


def test_assembled_shards_that_leave_part_of_a_tensor_unfilled_are_refused():
    """Rank 0 assembles the whole state from the ranks' shards (a re-anchor): shards that do not cover a tensor
    left the rest of it as ``torch.empty`` memory, published as the weights."""
    import deltasync_rs.torch as ds_torch

    rows = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    first_half = ({"w": rows[:2].clone()}, {"w": ((4, 3), 0)})
    second_half = ({"w": rows[2:].clone()}, {"w": ((4, 3), 6)})
    assert torch.equal(ds_torch._assemble([first_half, second_half])["w"], rows)
    with pytest.raises(ds.DeltaSyncError, match="'w': the ranks' shards hold 6 of its 12 elements"):
        ds_torch._assemble([first_half])


@pytest.mark.parametrize(
    "first, later, error, match",
    [
        ([], None, ds.DeltaSyncError, "the first sync sent no tensors"),
        ([("w", [0.0, 1.0])], None, ds.DeltaSyncError, "'w': expected a torch.Tensor, got list"),
        (
            [("w", torch.zeros(4))],
            [("v", torch.zeros(4)), ("w", torch.ones(4))],
            ds.BaseMismatchError,
            "'v' was not in",
        ),
    ],
    ids=["nothing", "not a tensor", "a new name"],
)
def test_trl_syncs_refuse_what_they_cannot_mirror_naming_it(tmp_path, first, later, error, match):
    """What a sync cannot mirror is refused by name, with nothing published: a new name in a later sync and a value
    that is no tensor raised bare AttributeErrors from inside."""
    from deltasync_rs.integrations.trl import DeltaSyncWeightTransfer

    with ds.Publisher(tmp_path / "store", background=False) as publisher:
        transfer = DeltaSyncWeightTransfer(publisher, "http://127.0.0.1:9", timeout=1.0)
        if later is not None:
            transfer.send_weights(iter(first))  # published; the server is out of reach
            first = later
        with pytest.raises(error, match=match):
            transfer.send_weights(iter(first))
        assert ds.Subscriber(publisher.store).latest_step() == (None if later is None else 0)


def test_a_dtype_of_the_same_width_and_shape_is_refused_by_diff_and_the_mirror():
    """An fp16 tensor whose next state is bf16 (same width, same shape): without the dtype comparison ``diff`` made
    a delta between the two dtypes' bit patterns, and ``Mirror.advance`` wrote bf16 bits into its fp16 copy, whose
    later anchors then held those bits read as fp16."""
    prev = {"w": torch.linspace(-2, 2, 8, dtype=torch.float16)}
    curr = {"w": torch.linspace(-2, 2, 8, dtype=torch.bfloat16) + 1}
    with pytest.raises(ds.BaseMismatchError, match=r"'w': previous is F16\[8\] but current is BF16\[8\]"):
        ds.diff(prev, curr)
    mirror = ds.Mirror(prev, step=0)
    with pytest.raises(ds.BaseMismatchError, match="'w'"):
        mirror.advance(curr, step=1)
    assert mirror.step == 0 and torch.equal(mirror.tensors["w"], prev["w"])


def test_a_torch_mirror_steps_delta_gives_a_tied_name_its_own_tensors_record():
    """A tied name whose tensor is not the first of the delta: its record must be that tensor's, not another's of
    the same shape (a target that holds the names apart took the wrong tensor's changes)."""
    import deltasync_rs.torch as ds_torch

    tied = torch.zeros(4, 4)
    source = {"a": torch.zeros(4, 4), "b": tied, "c": tied}
    mirror = ds_torch.Mirror(source, step=0)
    assert mirror.aliases == {"c": "b"}
    with torch.no_grad():
        source["a"].add_(1.0)
        tied.add_(2.0)
    delta = mirror.step(1)
    assert delta.names == ["a", "b", "c"]
    target = {name: torch.zeros(4, 4, dtype=torch.bfloat16) for name in source}  # the names held apart
    delta.apply_(target, check_base=True)
    assert_states_equal(target, {name: t.to(torch.bfloat16) for name, t in source.items()})


def test_a_later_trl_sync_refuses_a_tensor_of_another_shape_of_the_same_size(tmp_path):
    """A weight first sent as [8, 4] and later as [4, 8] (the same elements, another shape): the shape is part of
    what the server maps each tensor by, so the sync is refused rather than published under the first shape."""
    from deltasync_rs.integrations.trl import DeltaSyncWeightTransfer

    with ds.Publisher(tmp_path / "store", background=False) as publisher:
        transfer = DeltaSyncWeightTransfer(publisher, "http://127.0.0.1:9", timeout=1.0)
        transfer.send_weights(iter([("w", torch.zeros(8, 4))]))  # server out of reach: published, then behind
        with pytest.raises(ds.BaseMismatchError, match=r"'w': sent as torch.bfloat16\[4, 8\], mirrored as"):
            transfer.send_weights(iter([("w", torch.ones(4, 8))]))
        assert transfer.step == 0 and ds.Subscriber(publisher.store).latest_step() == 0
