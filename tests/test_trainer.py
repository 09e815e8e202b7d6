"""The trainer side: ds.torch.Mirror (one-pass compare-and-update, chunked staging), attach() on the optimizer, the
transformers Trainer callback, all checked bit for bit against the model's bf16 weights."""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch

import deltasync_rs as ds
import deltasync_rs.torch as ds_torch
from deltasync_rs._core import MirrorDiff, base_identity
from deltasync_rs.errors import BaseMismatchError
from deltasync_rs.store import LocalStore
from tests.helpers import completion_threads

STEPS = 20


def tiny_gpt2(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def train_step(model, optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (4, 32), generator=generator)
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def bf16(model) -> dict[str, torch.Tensor]:
    return {
        name: t.detach().to(torch.bfloat16) if t.is_floating_point() else t.detach().clone()
        for name, t in model.state_dict().items()
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same(actual, expected) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        assert actual[name].dtype == expected[name].dtype, name
        assert torch.equal(bits(actual[name]), bits(expected[name])), name


def replica_of(mirror: ds_torch.Mirror) -> dict[str, torch.Tensor]:
    """An inference-side copy with the source's names; tied names share memory, as in the model."""
    own = {name: t.clone() for name, t in mirror.tensors.items()}
    own.update({alias: own[first] for alias, first in mirror.aliases.items()})
    return own


def test_twenty_adamw_steps_replay_bit_exact():
    """fp32 masters, AdamW at lr 1e-6: after every step, the deltas applied in sequence give model.to(bf16)."""
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    mirror = ds_torch.Mirror(model, chunk_bytes=20_000)  # several chunks for the embedding
    assert mirror.aliases == {"lm_head.weight": "transformer.wte.weight"}
    replica = replica_of(mirror)
    previous = bf16(model)
    assert_same(replica, previous)
    densities = []
    for step in range(1, STEPS + 1):
        train_step(model, optimizer, seed=step)
        delta = mirror.step(step)
        assert (delta.step, delta.base_step) == (step, step - 1 if step > 1 else None)
        delta.apply_(replica)
        current = bf16(model)
        assert_same(replica, current)
        assert_same(mirror.state_dict(), current)
        # The one-pass kernel gives the very file ds.diff of the state dict gives (the tied name's record a copy).
        reference = ds.diff(previous, current, step=step, base_step=delta.base_step)
        assert delta.to_bytes() == reference.to_bytes()
        assert delta.num_changed > 0
        densities.append(delta.num_changed / delta.num_elements)
        previous = current
    print("density per step:", " ".join(f"{d:.3%}" for d in densities))
    assert all(0 < d < 0.5 for d in densities)


@pytest.mark.parametrize("chunk_bytes", [64, 1000, 64 << 20])
@pytest.mark.parametrize("values", ["diff", "abs"])
def test_mirror_chunks_dtypes_and_in_place_sources(chunk_bytes, values):
    torch.manual_seed(1)
    state = {
        "master": torch.randn(37, 29),  # fp32, cast through the staging buffer
        "half": torch.randn(1000).to(torch.bfloat16),  # already shipped dtype: read in place
        "counts": torch.arange(50, dtype=torch.int64),  # not floating: keeps its dtype
        "empty": torch.empty(0, 3),
        "strided": torch.randn(20, 30).t(),  # not contiguous
        # fp8 weights keep their dtype, as `deltasync publish --dtype` keeps them: cast to bf16 they were refused by
        # every fp8 target (found by an adversarial helper)
        "fp8": torch.randn(40).to(torch.float8_e4m3fn),
    }
    mirror = ds_torch.Mirror(state, chunk_bytes=chunk_bytes, values=values)
    assert mirror.tensors["counts"].dtype == torch.int64 and mirror.tensors["half"].dtype == torch.bfloat16
    assert mirror.tensors["fp8"].dtype == torch.float8_e4m3fn
    # 1-byte floats no file holds are cast, as before (they were refused once fp8 was kept)
    assert ds_torch.shipped_dtype(torch.float8_e4m3fnuz, torch.bfloat16) == torch.bfloat16
    replica = {n: t.clone() for n, t in mirror.tensors.items()}
    for step in range(3):
        before = {n: t.clone() for n, t in mirror.tensors.items()}
        state["master"].add_(torch.randn(37, 29) * 1e-2 * (step % 2))
        state["half"][::7] += 1
        state["counts"][step] += 5
        state["strided"].mul_(1.001)
        state["fp8"].view(torch.uint8)[step::9] += 1
        delta = mirror.step(step)
        expected = {
            n: (t.to(torch.bfloat16) if t.is_floating_point() and t.element_size() > 1 else t).contiguous()
            for n, t in state.items()
        }
        assert_same(mirror.tensors, expected)
        assert (
            delta.to_bytes()
            == ds.diff(before, expected, values=values, step=step, base_step=delta.base_step).to_bytes()
        )
        delta.apply_(replica)
        assert_same(replica, expected)
    assert mirror.staging_nbytes <= chunk_bytes  # one staging buffer on the CPU, used for the cast only


def test_mirror_rejects_a_changed_model_naming_the_tensor():
    state = {"w": torch.zeros(4)}
    mirror = ds_torch.Mirror(state)
    state["w"] = torch.zeros(5)
    with pytest.raises(ds.DeltaSyncError, match="'w'"):
        mirror.step(1)
    with pytest.raises(ds.DeltaSyncError, match="floating"):
        ds_torch.Mirror(state, dtype=torch.int8)


def test_core_mirror_diff_rejects_bad_chunks():
    from deltasync_rs._core import MirrorDiff

    builder = MirrorDiff("diff")
    mirror, new = np.zeros(8, np.uint8), np.ones(8, np.uint8)
    with pytest.raises(ds.DeltaSyncError, match="begin"):
        builder.update(mirror, new, 0)
    builder.begin("w", "BF16", [4])
    with pytest.raises(ds.DeltaSyncError, match="overlap"):
        builder.update(mirror, mirror, 0)
    with pytest.raises(ds.DeltaSyncError, match="'w'|\"w\""):
        builder.update(mirror[:4], new[:6], 0)
    with pytest.raises(ds.DeltaSyncError, match="read-only"):
        builder.update(np.frombuffer(bytes(8), np.uint8), new, 0)
    builder.update(mirror[4:], new[4:], 2)
    with pytest.raises(ds.DeltaSyncError, match="out of order"):
        builder.update(mirror[:4], new[:4], 0)
    with pytest.raises(ds.DeltaSyncError, match="still open"):
        builder.take()
    builder.finish(None)  # a shard: no whole mirror, so the streams are kept even where dense is no larger
    raw = builder.take()
    assert raw.tensors() == [("w", "BF16", [4], 2, "varint", "diff", 8)]  # two escapes of 0x0101 and two gaps
    assert list(mirror) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_core_mirror_advance_refuses_a_mirror_sharing_memory_and_checks_many_in_one_sort():
    """A mirror is written while every entry's new bytes are read, side by side: one that overlaps another entry's
    mirror, another entry's new bytes or its own is refused, naming a tensor involved, before anything is written.
    The check sorts the spans once (it compared every pair: a quarter of `Mirror.step`'s time at 64,000 tensors)."""
    from deltasync_rs._core import MirrorDiff

    memory = np.zeros(64, np.uint8)
    ones = np.ones(8, np.uint8)
    layouts = {
        "another entry's new bytes": [("a", memory[0:8], ones), ("b", memory[16:24], memory[4:12])],
        "another entry's mirror": [("a", memory[0:8], ones), ("b", memory[6:14], ones)],
        "its own new bytes": [("a", memory[0:8], ones), ("b", memory[16:24], memory[20:28])],
    }
    for what, entries in layouts.items():
        with pytest.raises(ds.DeltaSyncError, match=r"tensor \"[ab]\": its mirror overlaps other memory"):
            MirrorDiff("diff").advance([(name, "BF16", [4], m, n) for name, m, n in entries])
        assert not memory.any(), what  # nothing written
    # New bytes shared by entries are only read: allowed.
    MirrorDiff("diff").advance([("a", "BF16", [4], memory[0:8], ones), ("b", "BF16", [4], memory[8:16], ones)])
    assert memory[:16].all() and not memory[16:].any()
    n = 20_000
    mirrors, new = np.zeros(2 * n, np.uint8), np.ones(2 * n, np.uint8)
    MirrorDiff("diff").advance(
        [(f"t{i}", "BF16", [1], mirrors[2 * i : 2 * i + 2], new[2 * i : 2 * i + 2]) for i in range(n)]
    )
    assert mirrors.all()


def test_mirror_advance_is_all_or_nothing():
    mirror = ds.Mirror({"a": np.zeros(4, np.float32), "b": np.zeros(3, np.float32)}, step=0)
    with pytest.raises(ds.BaseMismatchError, match="'b'"):
        mirror.advance({"a": np.ones(4, np.float32), "b": np.ones(2, np.float32)}, step=1)
    assert not mirror.tensors["a"].any() and mirror.step == 0
    delta = mirror.advance({"a": np.ones(4, np.float32), "b": np.zeros(3, np.float32)}, step=1)
    assert (delta.num_changed, delta.step, delta.base_step) == (4, 1, 0) and mirror.tensors["a"].all()


def test_the_callback_checks_its_arguments_when_made(tmp_path):
    """A string for the publisher failed at the first step of training with an AttributeError, `enabled="no"` (true)
    published, a bad dtype or chunk size waited for on_train_begin (found by an adversarial helper)."""
    pytest.importorskip("transformers")
    from deltasync_rs.integrations import DeltaSyncCallback

    with ds.Publisher(str(tmp_path / "s")) as publisher:
        for kwargs, message in [
            (dict(publisher="store/"), "publisher must be a deltasync_rs.Publisher"),
            (dict(publisher=publisher, enabled="no"), "enabled must be True or False"),
            (dict(publisher=publisher, dtype="bf16"), "dtype must be a floating-point torch.dtype"),
            (dict(publisher=publisher, dtype=torch.int8), "dtype must be a floating-point torch.dtype"),
            (dict(publisher=publisher, chunk_bytes=8), "chunk_bytes must be at least 64"),
        ]:
            with pytest.raises(ds.DeltaSyncError, match=message):
                DeltaSyncCallback(**kwargs)
        DeltaSyncCallback(None)  # the other ranks of an FSDP2 run may pass None


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2", None])
def test_sync_every_is_an_integer_of_at_least_one_for_attach_and_the_callback(bad):
    """Both ways of publishing from training refuse a bad ``sync_every`` alike, before anything is attached."""
    pytest.importorskip("transformers")
    from deltasync_rs.integrations import DeltaSyncCallback

    model = tiny_gpt2(seed=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    hooks = dict(optimizer._optimizer_step_post_hooks)
    with pytest.raises(ds.DeltaSyncError, match="sync_every must be an integer of at least 1"):
        ds_torch.attach(optimizer, model, None, sync_every=bad)
    assert dict(optimizer._optimizer_step_post_hooks) == hooks
    with pytest.raises(ds.DeltaSyncError, match="sync_every must be an integer of at least 1"):
        DeltaSyncCallback(None, sync_every=bad)


@pytest.mark.parametrize("sync_every", [1, 3])
def test_attach_publishes_to_a_store_and_a_subscriber_pulls_bit_exact(tmp_path, sync_every):
    model = tiny_gpt2(seed=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    publisher = ds.Publisher(LocalStore(tmp_path / "store"), anchor_every=4)
    attachment = ds_torch.attach(optimizer, model, publisher, sync_every=sync_every, chunk_bytes=50_000)
    subscriber = ds.Subscriber(LocalStore(tmp_path / "store"))
    replica = replica_of(attachment.mirror)
    for step in range(1, 10):
        train_step(model, optimizer, seed=100 + step)
        if step % sync_every == 0:
            publisher.flush()
            assert subscriber.pull(replica) == step
            assert_same(replica, bf16(model))
    # Steps after the last publish are not lost: the next publish carries them all.
    publisher.flush()
    assert attachment.published_step == 9 // sync_every * sync_every
    attachment.sync()
    publisher.flush()
    assert subscriber.pull(replica) == 9
    assert_same(replica, bf16(model))
    assert not ds.sync.verify_store(LocalStore(tmp_path / "store"))

    # Detached: optimizer steps do no deltasync work at all.
    attachment.detach()
    attachment.mirror.step = lambda *a, **k: pytest.fail("the mirror ran after detach()")
    train_step(model, optimizer, seed=999)
    assert attachment.steps == 9
    publisher.close()


def test_a_subscriber_whose_target_unties_what_the_trainer_ties_gets_both_names_written(tmp_path):
    """Tied weights are published once, under the first name: a subscriber holding lm_head.weight as a tensor of
    its own (an engine that unties it) kept its first value forever, silently, since the store never named it
    (found by two adversarial helpers). Every entry lists the tied names now; the pull writes them, and refuses an
    alias of another dtype or shape before writing anything."""
    model = tiny_gpt2(seed=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    publisher = ds.Publisher(LocalStore(tmp_path / "store"), anchor_every=3, background=False)
    attachment = ds_torch.attach(optimizer, model, publisher)
    assert attachment.mirror.aliases == {"lm_head.weight": "transformer.wte.weight"}
    subscriber, fresh = ds.Subscriber(LocalStore(tmp_path / "store")), ds.Subscriber(LocalStore(tmp_path / "store"))
    untied = {name: torch.zeros_like(t) for name, t in bf16(model).items()}  # lm_head.weight: memory of its own
    for step in range(1, 5):
        train_step(model, optimizer, seed=200 + step)
        assert subscriber.pull(untied) == step
        assert_same(untied, bf16(model))
    entry = ds.Subscriber(LocalStore(tmp_path / "store")).entry(4)
    assert entry.aliases == {"lm_head.weight": "transformer.wte.weight"}
    # A checkpoint published later by another publisher (deltasync publish of save_pretrained's files, which leave
    # the tie out) keeps the store's ties; a target made in inference mode is written there too.
    attachment.detach()
    publisher.close()
    train_step(model, optimizer, seed=299)
    checkpoint = {name: t for name, t in bf16(model).items() if name != "lm_head.weight"}
    with ds.Publisher(LocalStore(tmp_path / "store"), background=False) as later:
        later.publish(5, checkpoint)
    assert ds.Subscriber(LocalStore(tmp_path / "store")).entry(5).aliases == entry.aliases
    with torch.inference_mode():
        served = {name: torch.zeros_like(t) for name, t in bf16(model).items()}
    assert subscriber.pull(untied) == 5 and ds.Subscriber(LocalStore(tmp_path / "store")).pull(served) == 5
    assert_same(untied, bf16(model))
    assert_same(served, bf16(model))
    wrong = {name: torch.zeros_like(t) for name, t in bf16(model).items()}
    wrong["lm_head.weight"] = torch.zeros(3, 64, dtype=torch.bfloat16)
    with pytest.raises(ds.BaseMismatchError, match="lm_head.weight"):
        fresh.pull(wrong)
    assert not any(bool(t.any()) for n, t in wrong.items() if t.is_floating_point())


def test_a_mirror_steps_delta_names_a_tied_tensor_under_every_name(tmp_path):
    """``ds.torch.Mirror.step()`` ships a tied tensor once; its delta named only the first name, so applying it to
    a state dict cloned tensor by tensor, or publishing it to a publisher holding both names, left lm_head stale,
    silently (found by an adversarial helper). The delta lists every name in the model's order now, as ds.diff of
    the state dict does, with the same bytes per record; a tied target writes the memory once."""
    model = tiny_gpt2(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    mirror = ds_torch.Mirror(model, step=0)
    assert mirror.aliases == {"lm_head.weight": "transformer.wte.weight"}
    before = bf16(model)
    untied = {name: t.clone() for name, t in before.items()}
    publisher = ds.Publisher(LocalStore(tmp_path / "store"), background=False)
    publisher.publish(0, {name: t.clone() for name, t in before.items()})
    train_step(model, optimizer, seed=7)
    delta = mirror.step(1)
    after = bf16(model)
    assert delta.names == list(after)  # every name, in the model's order
    assert ds.load(delta.to_bytes()).to_bytes() == ds.diff(before, after, step=1, base_step=0).to_bytes()
    assert not torch.equal(after["lm_head.weight"], before["lm_head.weight"])
    delta.apply_(untied, check_base=True)
    assert_same(untied, after)
    tied = {name: t.clone() for name, t in before.items()}
    tied["lm_head.weight"] = tied["transformer.wte.weight"]  # a replica tied as the model is
    delta.apply_(tied, check_base=True)
    assert_same(tied, after)
    publisher.publish_delta(1, delta)
    target = {name: torch.zeros_like(t) for name, t in before.items()}
    assert ds.Subscriber(LocalStore(tmp_path / "store")).pull(target) == 1
    assert_same(target, after)
    publisher.close()


def test_attach_takes_wrapped_models_and_acceleratess_optimizer(tmp_path):
    """A model under torch.compile or DataParallel was published under prefixed names (`_orig_mod.`, `module.`) that
    no engine or plain state dict knows; accelerate's AcceleratedOptimizer (which never ran Optimizer.__init__)
    passed attach's check, step 0 was published, then registering the hook raised a bare AttributeError (found by
    an adversarial helper). The wrappers are looked through now."""
    accelerate = pytest.importorskip("accelerate")
    model = tiny_gpt2(seed=8)
    names = list(bf16(model))
    assert list(ds_torch.Mirror(torch.compile(model)).state_dict()) == names
    assert list(ds_torch.Mirror(torch.nn.DataParallel(model)).state_dict()) == names
    accelerator = accelerate.Accelerator(cpu=True)
    wrapped, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-5))
    publisher = ds.Publisher(LocalStore(tmp_path / "store"), background=False)
    attachment = ds_torch.attach(optimizer, wrapped, publisher)
    train_step(model, optimizer, seed=9)
    assert attachment.published_step == 1
    target = {name: torch.zeros_like(t) for name, t in bf16(model).items()}
    assert ds.Subscriber(LocalStore(tmp_path / "store")).pull(target) == 1
    assert_same(target, bf16(model))
    attachment.detach()
    publisher.close()
    with pytest.raises(ds.DeltaSyncError, match="optimizer must be a torch.optim.Optimizer"):
        ds_torch.attach(object(), model, publisher)


def test_attach_after_a_step_that_failed_part_way_publishes_an_anchor(tmp_path, monkeypatch):
    """A mirror step that raises after it wrote part of the new weights into the mirror (a device copy that failed,
    an interrupt) leaves the shared mirror holding part of a step: the next publish is an anchor, not a delta from
    that never-published state, and the subscriber stays bit-exact with the model."""
    model = tiny_gpt2(seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    publisher = ds.Publisher(LocalStore(tmp_path / "store"), anchor_every=100)
    attachment = ds_torch.attach(optimizer, model, publisher)
    subscriber = ds.Subscriber(LocalStore(tmp_path / "store"))
    replica = replica_of(attachment.mirror)
    real = ds_torch.MirrorDiff

    class FailingPartWay:
        """Compares (and writes into the mirror) the first few chunks of a step, then raises; whole tensors
        advanced together (the mirror's path for tensors of the shipped dtype) fail after the first half."""

        def __init__(self, *args):
            self.builder, self.updates = real(*args), 0

        def __getattr__(self, name):
            return getattr(self.builder, name)

        def update(self, *args):
            self.updates += 1
            if self.updates > 3:
                raise RuntimeError("interrupted part way through the mirror's step")
            self.builder.update(*args)

        def advance(self, entries):
            self.builder.advance(entries[: len(entries) // 2])
            raise RuntimeError("interrupted part way through the mirror's step")

    train_step(model, optimizer, seed=1)
    with monkeypatch.context() as patch:
        patch.setattr(ds_torch, "MirrorDiff", FailingPartWay)
        with pytest.raises(RuntimeError, match="interrupted part way"):
            train_step(model, optimizer, seed=2)
    for seed in (3, 4):
        train_step(model, optimizer, seed=seed)
    publisher.flush()
    entries = ds.sync.log_entries(LocalStore(tmp_path / "store"))
    assert [(e.step, e.delta is not None, e.anchor is not None) for e in entries] == [
        (0, False, True),
        (1, True, False),
        (3, False, True),  # after the failed step 2: an anchor alone
        (4, True, False),
    ]
    assert subscriber.pull(replica) == 4
    assert_same(replica, bf16(model))
    publisher.close()


def test_attach_after_resume_shares_the_mirror(tmp_path):
    model = tiny_gpt2(seed=3)
    store = LocalStore(tmp_path / "store")
    first = ds.Publisher(store, background=False)
    untied = {n: t for n, t in bf16(model).items() if n != "lm_head.weight"}  # tied weights are shipped once
    first.publish(5, untied)
    first.close()

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    publisher = ds.Publisher(store, background=False)
    with pytest.raises(ds.DeltaSyncError, match="last published state"):
        other = tiny_gpt2(seed=4)
        publisher.resume(untied, step=5)
        ds_torch.attach(torch.optim.AdamW(other.parameters()), other, publisher)
    attachment = ds_torch.attach(optimizer, model, publisher)
    train_step(model, optimizer, seed=7)
    assert publisher.step == 6
    replica = replica_of(attachment.mirror)
    replica = {n: torch.zeros_like(t) for n, t in replica.items()}
    replica["lm_head.weight"] = replica["transformer.wte.weight"]
    assert ds.Subscriber(store).pull(replica) == 6
    assert_same(replica, bf16(model))


def test_attach_at_a_start_step_the_store_holds_as_the_model_resumes_there(tmp_path):
    """A trainer restarted from its step-2 weights attaches with start_step=2 to a store holding steps 0-3: the
    publisher resumes at 2 (the weights checked against step 2's entry), step 3 is removed, the next optimizer step
    is published as 3 and a replica pulls it bit-exact. Weights the store does not hold as step 2 are refused."""
    model = tiny_gpt2(seed=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    store = LocalStore(tmp_path / "store")
    attachment = ds_torch.attach(optimizer, model, ds.Publisher(store, background=False))
    saved = {}
    for step in range(1, 4):
        train_step(model, optimizer, seed=step)
        saved[step] = {n: t.detach().clone() for n, t in model.state_dict().items()}
    attachment.detach()
    attachment.publisher.close()

    restarted = tiny_gpt2(seed=3)
    with pytest.raises(ds.IntegrityError, match="holds step 2 as another state"):
        ds_torch.attach(torch.optim.AdamW(restarted.parameters()), restarted, ds.Publisher(store), start_step=2)
    assert [e.step for e in ds.sync.log_entries(store)] == [0, 1, 2, 3]  # nothing removed
    restarted.load_state_dict(saved[2])
    optimizer = torch.optim.AdamW(restarted.parameters(), lr=1e-3)
    publisher = ds.Publisher(store, background=False)
    attachment = ds_torch.attach(optimizer, restarted, publisher, start_step=2)
    assert publisher.step == 2 and [e.step for e in ds.sync.log_entries(store)] == [0, 1, 2]
    train_step(restarted, optimizer, seed=99)
    assert publisher.step == 3
    replica = {n: torch.zeros_like(t) for n, t in bf16(restarted).items() if n != "lm_head.weight"}
    assert ds.Subscriber(store).pull(replica) == 3
    assert_same(replica, {n: t for n, t in bf16(restarted).items() if n != "lm_head.weight"})
    publisher.close()


def test_attach_at_step_0_resumes_where_the_store_holds_only_step_0_as_the_model(tmp_path):
    """A trainer that stopped right after attach published step 0, run again unchanged: nothing to leave, so it
    resumes (it was refused as a step not after the store's newest). A store with later steps is left alone."""
    model = tiny_gpt2(seed=3)
    store = LocalStore(tmp_path / "store")
    ds_torch.attach(torch.optim.AdamW(model.parameters()), model, ds.Publisher(store, background=False)).detach()
    publisher = ds.Publisher(store, background=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ds_torch.attach(optimizer, model, publisher)
    assert publisher.step == 0
    train_step(model, optimizer, seed=1)
    publisher.close()
    assert [e.step for e in ds.sync.log_entries(store)] == [0, 1]
    with pytest.raises(ds.DeltaSyncError, match="not after the last published step 1"):
        ds_torch.attach(torch.optim.AdamW(model.parameters()), model, ds.Publisher(store, background=False))


def test_attach_sync_publishes_the_step_it_is_given(tmp_path):
    """``Attachment.sync(step)`` publishes the weights as that step (the Trainer callback passes its global step);
    without one, as the step the hook would have given them. A step not after the last published one is refused."""
    model = tiny_gpt2(seed=6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    store = LocalStore(tmp_path / "store")
    with ds.Publisher(store) as publisher:
        attachment = ds_torch.attach(optimizer, model, publisher, sync_every=100)
        train_step(model, optimizer, seed=1)
        assert attachment.sync() == 1  # base 0 + one optimizer step seen
        train_step(model, optimizer, seed=2)
        assert attachment.sync(10) == 10
        with pytest.raises(ds.DeltaSyncError, match="not after the last published step"):
            attachment.sync(9)
        publisher.flush()
        assert [e.step for e in ds.sync.log_entries(store)] == [0, 1, 10]
        train_step(model, optimizer, seed=3)
        attachment.sync(11)
    replica = replica_of(attachment.mirror)
    for tensor in replica.values():
        tensor.zero_()
    assert ds.Subscriber(store).pull(replica) == 11
    assert_same(replica, bf16(model))


def test_attach_sync_at_a_published_step_refuses_weights_changed_since(tmp_path):
    """``sync()`` at the step the hook just published returns it while the weights are as published; an edit made
    after the optimizer's step (a clamp) cannot go out as that step again: an error, never a silent no-op."""
    model = tiny_gpt2(seed=6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    store = LocalStore(tmp_path / "store")
    with ds.Publisher(store) as publisher:
        attachment = ds_torch.attach(optimizer, model, publisher)
        train_step(model, optimizer, seed=1)
        assert attachment.sync() == 1  # the hook published step 1 and nothing changed since
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight.clamp_(-0.01, 0.01)
        with pytest.raises(
            ds.DeltaSyncError, match=r"step 1 is published already.*'transformer\.h\.0\.mlp\.c_fc\.weight'"
        ):
            attachment.sync()
        assert attachment.sync(2) == 2
    replica = {name: torch.zeros_like(t) for name, t in replica_of(attachment.mirror).items()}
    replica["lm_head.weight"] = replica["transformer.wte.weight"]
    assert ds.Subscriber(store).pull(replica) == 2
    assert_same(replica, bf16(model))


def test_attach_refuses_a_model_whose_tensors_changed_since_it_was_attached(tmp_path):
    """Weights tied at attach are shipped once; untied later, or with a tensor added, the mirror would ship stale
    or no values for them: the next step is refused, naming the tensor, before anything moves."""
    for change, match in [
        (lambda m: setattr(m.lm_head, "weight", torch.nn.Parameter(m.lm_head.weight.detach().clone())), "lm_head"),
        (lambda m: m.register_parameter("extra", torch.nn.Parameter(torch.ones(3))), "extra"),
    ]:
        model = tiny_gpt2(seed=7)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with ds.Publisher(LocalStore(tmp_path / match), background=False) as publisher:
            attachment = ds_torch.attach(optimizer, model, publisher)
            assert attachment.mirror.aliases == {"lm_head.weight": "transformer.wte.weight"}
            change(model)
            before = {name: t.clone() for name, t in attachment.mirror.tensors.items()}
            with pytest.raises(ds.DeltaSyncError, match=match):
                train_step(model, optimizer, seed=1)
            assert publisher.step == 0
            assert_same(attachment.mirror.tensors, before)


@pytest.mark.parametrize("kind", ["meta", "sparse"])
def test_tensors_no_delta_holds_are_refused_by_name_by_every_mirror(tmp_path, kind):
    good = torch.ones(4, 4, dtype=torch.bfloat16)
    bad = torch.empty(4, 4, dtype=torch.bfloat16, device="meta") if kind == "meta" else good.to_sparse()
    with pytest.raises(ds.DeltaSyncError, match="'x'"):
        ds.Publisher(tmp_path, background=False).publish(0, {"w": good, "x": bad})
    with pytest.raises(ds.DeltaSyncError, match="'x'"):
        ds_torch.Mirror({"w": good, "x": bad})
    with pytest.raises(ds.DeltaSyncError, match="'x'"):
        ds.Mirror({"w": good, "x": bad})


def test_attach_and_the_torch_mirror_refuse_arguments_of_the_wrong_kind(tmp_path):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1)
    publisher = ds.Publisher(tmp_path, background=False)
    hooks = dict(optimizer._optimizer_step_post_hooks)
    for args, match in [
        ((optimizer, model, str(tmp_path)), "publisher must be"),
        ((None, model, publisher), "optimizer must be"),
        ((model, optimizer, publisher), "optimizer must be"),
        ((optimizer, "model", publisher), "model must be"),
    ]:
        with pytest.raises(ds.DeltaSyncError, match=match):
            ds_torch.attach(*args)
    assert dict(optimizer._optimizer_step_post_hooks) == hooks and publisher.step is None
    for options, match in [({"chunk_bytes": "64"}, "chunk_bytes"), ({"dtype": "bf16"}, "dtype")]:
        with pytest.raises(ds.DeltaSyncError, match=match):
            ds_torch.Mirror(model, **options)


@pytest.mark.parametrize("codec", ["compact", "context"])
def test_attach_leaves_the_encoding_to_the_upload_thread_and_publishes_the_mirror_step_bytes(
    tmp_path, monkeypatch, codec
):
    """The optimizer hook returns once the mirror moved: the delta's encoding waits for the publisher's upload
    thread, which makes it from the mirror before the next step may move it. The published bytes are those the
    mirror's own step gives (a second mirror stepped alongside, its tensors cast chunk by chunk)."""
    completed_on = completion_threads(monkeypatch, "_Deferred")
    model = tiny_gpt2(seed=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    store = LocalStore(tmp_path / "store")
    publisher = ds.Publisher(store, anchor_every=100, codec=codec)
    attachment = ds_torch.attach(optimizer, model, publisher, chunk_bytes=50_000)
    # The publisher ships the tied lm_head once (its entries name the tie); so does a twin without that name.
    shipped = {n: t for n, t in model.state_dict(keep_vars=True).items() if n != "lm_head.weight"}
    twin = ds_torch.Mirror(shipped, torch.bfloat16, chunk_bytes=30_000, codec=codec, step=0)
    for step in range(1, 5):
        train_step(model, optimizer, seed=300 + step)
        want = twin.step(step)
        want.aliases = {"lm_head.weight": "transformer.wte.weight"}  # as the file names the tie (format.md §2.2)
        publisher.flush()
        assert store.get(ds.sync.delta_key(step)) == want.to_bytes(), step
    assert completed_on == ["deltasync-publisher"] * 4
    replica = replica_of(attachment.mirror)
    for tensor in replica.values():
        tensor.zero_()
    assert ds.Subscriber(store).pull(replica) == 4
    assert_same(replica, bf16(model))
    publisher.close()


def test_transformers_trainer_callback(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (make setup installs it)")
    from deltasync_rs.integrations import DeltaSyncCallback

    assert ds.integrations.DeltaSyncCallback is DeltaSyncCallback  # imported on first use of the attribute
    model = tiny_gpt2(seed=5)
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 512, (16, 16), generator=generator)]
    publisher = ds.Publisher(LocalStore(tmp_path / "store"), anchor_every=3)
    callback = DeltaSyncCallback(publisher, sync_every=2)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=5,
        per_device_train_batch_size=4,
        learning_rate=1e-4,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback])
    trainer.train()
    publisher.flush()
    entries = ds.sync.log_entries(LocalStore(tmp_path / "store"))
    # Step 5, the last, is not a multiple of sync_every: published as the training ends (it was left out).
    assert [e.step for e in entries] == [0, 2, 4, 5]
    replica = {n: torch.zeros_like(t) for n, t in replica_of(callback.mirror).items()}
    replica["lm_head.weight"] = replica["transformer.wte.weight"]
    assert ds.Subscriber(LocalStore(tmp_path / "store")).pull(replica) == 5
    assert_same(replica, bf16(trainer.model))
    callback.on_step_end(args, trainer.state, None)  # step 5 is odd: nothing to publish
    callback.on_train_end(args, trainer.state, None)  # and no step twice
    trainer.state.global_step = 6
    callback.on_step_end(args, trainer.state, None)  # the steps since 4, published as 6
    publisher.flush()
    replica = replica_of(callback.mirror)
    replica = {n: torch.zeros_like(t) for n, t in replica.items()}
    replica["lm_head.weight"] = replica["transformer.wte.weight"]
    assert ds.Subscriber(LocalStore(tmp_path / "store")).pull(replica) == 6
    assert_same(replica, bf16(trainer.model))

    disabled = DeltaSyncCallback(publisher, enabled=False)
    disabled.on_train_begin(args, trainer.state, None, model=model)
    assert disabled.mirror is None
    publisher.close()


def _train(tmp_path, publisher, callback_resume=True, learning_rate=1e-4, close=True, **kwargs):
    """A transformers Trainer on a tiny GPT-2 (seed 5), saving a checkpoint every 2 steps, publishing every step
    through a DeltaSyncCallback; ``kwargs`` go to ``train`` (``resume_from_checkpoint``)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (make setup installs it)")
    from deltasync_rs.integrations import DeltaSyncCallback

    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 512, (24, 16), generator=generator)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=learning_rate,
        report_to=[],
        save_strategy="steps",
        save_steps=2,
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    callback = DeltaSyncCallback(publisher, resume=callback_resume)
    trainer = transformers.Trainer(model=tiny_gpt2(seed=5), args=args, train_dataset=rows, callbacks=[callback])
    try:
        trainer.train(**kwargs)
    finally:
        if close:
            publisher.close()
    return trainer


def test_the_trainer_callbacks_last_step_holds_the_weights_trained_to_it_with_load_best_model_at_end(tmp_path):
    """The last step, off sync_every, was published in on_train_end, after the Trainer had loaded its best
    checkpoint: the store held the best checkpoint's weights under the last step's number, and a restart from that
    step's checkpoint was refused (found by an adversarial helper). It is published in on_step_end now, from the
    weights trained to it."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (make setup installs it)")
    from deltasync_rs.integrations import DeltaSyncCallback

    class Snapshots(transformers.TrainerCallback):
        def __init__(self):
            self.at = {}

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.at[state.global_step] = bf16(model)

    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 512, (16, 16), generator=generator)]
    publisher = ds.Publisher(LocalStore(tmp_path / "store"), anchor_every=3)
    snapshots = Snapshots()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=7,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=True,  # the worst loss is "best": an early checkpoint
        logging_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=tiny_gpt2(seed=6),
        args=args,
        train_dataset=rows,
        eval_dataset=rows[:8],
        callbacks=[snapshots, DeltaSyncCallback(publisher, sync_every=2)],
    )
    trainer.train()
    publisher.close()
    assert trainer.state.best_model_checkpoint is not None and not trainer.state.best_model_checkpoint.endswith("-7")
    assert [e.step for e in ds.sync.log_entries(LocalStore(tmp_path / "store"))] == [0, 2, 4, 6, 7]
    for step in (6, 7):
        state = {name: torch.zeros_like(t) for name, t in snapshots.at[step].items()}
        state["lm_head.weight"] = state["transformer.wte.weight"]
        assert ds.Subscriber(LocalStore(tmp_path / "store")).pull(state, until=step) == step
        assert_same(state, snapshots.at[step])


def test_the_trainer_callback_publishes_a_last_step_left_out_unless_another_checkpoint_was_loaded(tmp_path):
    """A training stopped off the steps published (a callback stopping it after on_step_end): on_train_end publishes
    the weights trained, unless the Trainer loaded its best checkpoint over them (load_best_model_at_end with a best
    checkpoint: none there, the weights are the trained ones; found by reviewing the callback)."""
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from deltasync_rs.integrations import DeltaSyncCallback

    for best in (None, "out/checkpoint-2"):
        store = LocalStore(tmp_path / f"store-{best is None}")
        model = tiny_gpt2(seed=11)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        publisher = ds.Publisher(store, background=False)
        callback = DeltaSyncCallback(publisher, sync_every=4)
        state = SimpleNamespace(is_world_process_zero=True, global_step=0, best_model_checkpoint=best)
        callback.on_train_begin(None, state, None, model=model)
        for step in (1, 2, 3):
            train_step(model, optimizer, seed=step)
            state.global_step = step
            callback.on_step_end(None, state, SimpleNamespace(should_training_stop=False))
        callback.on_train_end(SimpleNamespace(load_best_model_at_end=True), state, None)
        publisher.close()
        assert [e.step for e in ds.sync.log_entries(store)] == ([0, 3] if best is None else [0])


def test_the_trainer_callback_resumes_where_the_trainer_resumes_from_a_checkpoint(tmp_path):
    """``trainer.train(resume_from_checkpoint=...)`` from the checkpoint of step 4, which the callback published:
    the publisher resumes at step 4 (the model's weights are checked against step 4's entry), the first run's steps
    5 and 6 are removed and published again from the resumed run. Before, the callback published step 4 again and
    was refused as a step not after the store's newest (6)."""
    store = LocalStore(tmp_path / "store")
    first = _train(tmp_path, ds.Publisher(store, anchor_every=3, keep_anchors=3))
    assert [e.step for e in ds.sync.log_entries(store)] == list(range(7))
    held = {n: torch.zeros_like(t) for n, t in bf16(first.model).items() if n != "lm_head.weight"}
    assert ds.Subscriber(store).pull(held) == 6  # a replica at the first run's newest step

    resumed = _train(
        tmp_path,
        ds.Publisher(store, anchor_every=3, keep_anchors=3),
        resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"),
    )
    entries = ds.sync.log_entries(store)
    assert [(e.step, e.anchor is not None) for e in entries] == [
        (0, True), (1, False), (2, False), (3, True), (4, False), (5, False), (6, True)
    ]  # fmt: skip
    state = {n: torch.zeros_like(t) for n, t in bf16(resumed.model).items() if n != "lm_head.weight"}
    assert ds.Subscriber(store).pull(state) == 6
    expected = {n: t for n, t in bf16(resumed.model).items() if n != "lm_head.weight"}
    assert_same(state, expected)
    assert ds.Subscriber(store).pull(held) == 6  # the replica at the old step 6 re-syncs (published again)
    assert_same(held, expected)


def test_the_trainer_callback_kept_across_trainings_says_to_make_a_new_publisher(tmp_path):
    """The same callback and open publisher (a notebook) trained again from the checkpoint of step 4: the publisher
    is at step 6, so it cannot resume; it says so instead of "the shared mirror does not hold the last published
    state"."""
    transformers = pytest.importorskip("transformers")
    store = LocalStore(tmp_path / "store")
    publisher = ds.Publisher(store)
    trainer = _train(tmp_path, publisher, close=False)
    with pytest.raises(ds.DeltaSyncError, match="before this publisher's step 6: .* pass a new Publisher"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    publisher.close()
    assert isinstance(trainer, transformers.Trainer)


def test_the_trainer_callback_kept_for_a_later_checkpoint_says_to_make_a_new_publisher(tmp_path):
    """The same callback and open publisher trained again from a checkpoint saved after its last sync (a step it
    never published): it said "the shared mirror does not hold the last published state" (found by an adversarial
    helper). It says what happened and what to do; the new Publisher it names publishes that step as an anchor."""
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from deltasync_rs.integrations import DeltaSyncCallback

    store = LocalStore(tmp_path / "store")
    model = tiny_gpt2(seed=9)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    publisher = ds.Publisher(store, background=False)
    callback = DeltaSyncCallback(publisher)
    callback.on_train_begin(None, SimpleNamespace(is_world_process_zero=True, global_step=4), None, model=model)
    train_step(model, optimizer, seed=10)  # trained on to step 6 and checkpointed there, never synced
    with pytest.raises(ds.DeltaSyncError, match="starts at step 6, after this publisher's step 4, from weights it"):
        callback.on_train_begin(None, SimpleNamespace(is_world_process_zero=True, global_step=6), None, model=model)
    publisher.close()
    fresh = ds.Publisher(store, background=False)
    DeltaSyncCallback(fresh).on_train_begin(
        None, SimpleNamespace(is_world_process_zero=True, global_step=6), None, model=model
    )
    fresh.close()
    assert [(e.step, e.anchor is not None) for e in ds.sync.log_entries(store)] == [(4, True), (6, True)]
    target = {name: torch.zeros_like(t) for name, t in bf16(model).items()}
    assert ds.Subscriber(store).pull(target) == 6
    assert_same(target, bf16(model))


def test_the_trainer_callback_refuses_a_restart_it_cannot_prove(tmp_path):
    """The store holds step 4 as other weights (another run's), or not at all: nothing is removed, and the
    callback says so; with resume=False the store's newest step refuses it as before."""
    store = LocalStore(tmp_path / "store")
    _train(tmp_path, ds.Publisher(store))
    before = sorted(p.name for p in (tmp_path / "store").rglob("*") if p.is_file())
    other = tmp_path / "other"
    _train(other, ds.Publisher(other / "store"), learning_rate=3e-4)
    with pytest.raises(ds.IntegrityError, match="holds step 4 as another state"):
        _train(tmp_path, ds.Publisher(store), resume_from_checkpoint=str(other / "out" / "checkpoint-4"))
    with pytest.raises(ds.DeltaSyncError, match="not after the last published step 6"):
        _train(
            tmp_path,
            ds.Publisher(store),
            callback_resume=False,
            resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"),
        )
    for path in (tmp_path / "store" / "manifest").glob("*4.json"):
        path.unlink()  # step 4's entry gone (as retention removes old steps)
    with pytest.raises(ds.DeltaSyncError, match="not after the last published step 6"):
        _train(tmp_path, ds.Publisher(store), resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    after = sorted(p.name for p in (tmp_path / "store").rglob("*") if p.is_file())
    assert set(before) - set(after) <= {p for p in before if p.endswith("4.json")}


def test_the_trainer_callback_publishes_an_fsdp2_model_from_every_rank(tmp_path):
    """DeltaSyncCallback on an FSDP2 model, made on every rank with a Publisher each (one script run on every rank):
    every rank diffs its shards and rank 0 joins them, as ds.torch.attach does; the others' publishers are unused.
    Before, rank 0 alone published its own shards under the whole tensors' names."""
    pytest.importorskip("transformers")
    store, whole, raised = _run_fsdp_workers(tmp_path, "compact", "callback")
    entries = ds.sync.log_entries(LocalStore(store))
    # Step 5, not a multiple of sync_every, is the training's last: published when it ends.
    assert [(e.step, e.anchor is not None) for e in entries] == [(0, True), (2, False), (4, False), (5, False)]
    state = {name: torch.zeros_like(t) for name, t in whole.items()}
    assert ds.Subscriber(LocalStore(store)).pull(state, until=4) == 4
    assert_same(state, torch.load(tmp_path / "whole.pt.step4"))
    assert ds.Subscriber(LocalStore(store)).pull(state) == 5
    assert_same(state, whole)


def test_mirror_on_cuda_matches_the_cpu(cuda):
    model = tiny_gpt2(seed=6).to(cuda)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    mirror = ds_torch.Mirror(model, chunk_bytes=10_000)  # many chunks: the double buffer turns over
    assert all(t.is_pinned() for t in mirror.tensors.values())
    replica = replica_of(mirror)
    for step in range(1, 4):
        train_step_cuda = torch.randint(0, 512, (4, 32), device=cuda)
        model(input_ids=train_step_cuda, labels=train_step_cuda).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mirror.step(step).apply_(replica)
        expected = {n: t.cpu() for n, t in bf16(model).items()}
        assert_same(replica, expected)
        assert_same(mirror.state_dict(), expected)
    assert mirror.staging_nbytes == 2 * 10_000


def _proc_status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_mirror_step_peak_memory_is_bounded():
    """Peak resident memory during step() beyond the mirror: staging chunks and the delta, no full-size temporary.
    The fp32 tensor's bf16 cast alone would be 32 MB; the bound allows a third of that plus the delta."""
    torch.manual_seed(0)
    state = {"master": torch.randn(4096, 4096), "half": torch.randn(4096, 4096).to(torch.bfloat16)}
    chunk_bytes = 2 << 20
    mirror = ds_torch.Mirror(state, chunk_bytes=chunk_bytes)
    mirror.step(0)  # allocates the staging buffer
    changed = torch.rand(4096, 4096) < 0.01
    state["master"][changed] *= 1.01
    state["half"][changed] *= 1.01
    del changed
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets the peak (VmHWM) to the current resident size
    before = _proc_status("VmRSS")
    delta = mirror.step(1)
    extra = _proc_status("VmHWM") - before
    print(
        f"peak beyond the mirror: {extra / 1e6:.2f} MB (delta {delta.nbytes / 1e6:.2f} MB, "
        f"staging {mirror.staging_nbytes / 1e6:.2f} MB, mirror {mirror.nbytes / 1e6:.2f} MB)"
    )
    assert mirror.staging_nbytes == chunk_bytes
    assert delta.num_changed > 300_000
    assert extra < (32 << 20) // 3 + delta.nbytes


def test_examples_train_publish_then_pull_and_verify(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    store = tmp_path / "store"
    trained = subprocess.run(
        [
            sys.executable,
            str(root / "examples" / "train_and_publish.py"),
            "--store",
            str(store),
            "--steps",
            "5",
            "--sync-every",
            "2",
            "--anchor-every",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    digest = trained.stdout.strip().splitlines()[-1].split()[-1]
    assert "published step 4" in trained.stdout
    pulled = subprocess.run(
        [sys.executable, str(root / "examples" / "pull_and_verify.py"), "--store", str(store), "--expect", digest],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "pulled step 5: " in pulled.stdout and "bit-exact" in pulled.stdout
    wrong = subprocess.run(
        [sys.executable, str(root / "examples" / "pull_and_verify.py"), "--store", str(store), "--expect", "0" * 32],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert wrong.returncode != 0 and "digest mismatch" in wrong.stderr


def _run_fsdp_workers(tmp_path, codec: str, scenario: str = "ok", expect_output: bool = True):
    """Runs tests/fsdp_workers.py on two gloo ranks; returns (store, the whole trained state, what each rank's
    syncs raised)."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    store, out = tmp_path / "store", tmp_path / "whole.pt"
    subprocess.run(
        [sys.executable, "-m", "tests.fsdp_workers", str(port), str(store), str(out), codec, scenario],
        cwd=root,
        check=True,
        timeout=600,
    )
    raised = [Path(f"{out}.rank{rank}.txt").read_text() for rank in (0, 1)]
    return store, torch.load(out) if expect_output else None, raised


@pytest.mark.parametrize(("scenario", "codec"), [("drift", "compact"), ("fail", "varint")])
def test_fsdp2_a_shard_that_left_the_published_state_is_caught_and_re_anchored(tmp_path, caplog, scenario, codec):
    """A rank's mirror that no longer holds the last published state over its shard (changed behind deltasync's
    back, or torn by a step that raised part way) would make rank 0 join changes made against another state than
    the one it publishes from: subscribers would then agree with the publisher and not with the trainer, silently.
    Each rank sends what its mirror held before the step (hashed by the step's scan); rank 0 checks it against its
    own copy, and on a mismatch publishes that step as an anchor gathered from every rank's mirror. A step that
    raises on one rank raises on every rank (none waits in a collective). The subscriber ends equal to the trainer."""
    store, whole, raised = _run_fsdp_workers(tmp_path, codec, scenario)
    entries = ds.sync.log_entries(LocalStore(store))
    if scenario == "drift":
        assert [e.step for e in entries] == [0, 2, 4, 5]
        assert [e.delta is None for e in entries] == [True, False, True, False]  # step 4: an anchor alone
        assert raised == ["", ""]
    else:
        # Step 4 raised on both ranks; synced again at once, it is an anchor made from both ranks' mirrors.
        assert [e.step for e in entries] == [0, 2, 4, 5]
        assert [e.delta is None for e in entries] == [True, False, True, False]
        assert raised[1] == "step 4: RuntimeError: simulated failure part way through a step"
        assert raised[0].startswith("step 4: DeltaSyncError: step 4 was not published: a step failed: rank 1:")
    state = {name: torch.zeros_like(t) for name, t in whole.items()}
    assert ds.Subscriber(LocalStore(store)).pull(state) == 5
    assert_same(state, whole)
    assert not ds.sync.verify_store(LocalStore(store))


def test_fsdp2_sync_at_a_published_step_refuses_an_edit_on_any_rank_on_every_rank(tmp_path):
    """One rank's shards edited after step 5 was published: ``sync()`` at step 5 raises on both ranks (neither is
    left waiting in a collective), and ``sync(6)`` publishes the edit."""
    store, whole, raised = _run_fsdp_workers(tmp_path, "compact", "edited")
    for report in raised:
        assert "step 5 is published already" in report and "sync(step=6)" in report, report
    assert [e.step for e in ds.sync.log_entries(LocalStore(store))][-2:] == [5, 6]
    state = {name: torch.zeros_like(t) for name, t in whole.items()}
    assert ds.Subscriber(LocalStore(store)).pull(state) == 6
    assert_same(state, whole)


def test_fsdp2_ranks_refuse_together_a_step_behind_or_apart(tmp_path):
    """After sync(6) ahead of the hook's count, the hook's step 4 came back to rank 0 as a base mismatch whose
    re-anchor raised on rank 0 alone, which left rank 1 a step ahead, waiting in its next collective; and ranks that
    synced different steps entered different collectives (gloo's timeout) or had one step published with parts made
    as another (found by an adversarial helper). Every rank raises together now, with nothing published."""
    store, whole, raised = _run_fsdp_workers(tmp_path, "compact", "ahead")
    rank0, rank1 = (report.splitlines() for report in raised)
    assert len(rank0) == len(rank1) == 3, raised
    for report in (rank0, rank1):
        assert report[0].startswith("hook 6: step 6 was not published") or "step 6 is not after" in report[0]
        assert "hook 8: " in report[1] and "step 8" in report[1], report
        assert "synced different steps (rank 0: 12, rank 1: 13)" in report[2]
    assert [e.step for e in ds.sync.log_entries(LocalStore(store))] == [0, 2, 4, 11, 12]
    state = {name: torch.zeros_like(t) for name, t in whole.items()}
    assert ds.Subscriber(LocalStore(store)).pull(state) == 12
    assert_same(state, whole)


def test_fsdp2_a_tied_weight_whose_shard_is_empty_on_a_rank_is_shipped_once(tmp_path):
    """A tied weight of one row: rank 1's shard is empty, so its memory could not show the tie there, the ranks
    disagreed on the names they ship, and the alias was published as uninitialised memory, with a digest to match
    (found by an adversarial helper). Ties are read from the model's parameter objects on every rank now."""
    store, whole, raised = _run_fsdp_workers(tmp_path, "varint", "tied")
    assert raised == ["", ""]
    entries = ds.sync.log_entries(LocalStore(store))
    assert [e.delta is None for e in entries] == [True] + [False] * (len(entries) - 1)  # deltas: the proofs held
    state = {name: torch.zeros_like(t) for name, t in whole.items()}
    state["other.weight"] = state["head.weight"]  # the subscriber's model ties them too
    assert ds.Subscriber(LocalStore(store)).pull(state) == 5
    assert_same(state, whole)


def test_a_tensor_sharded_after_the_mirror_was_made_is_refused_before_the_mirror_moves():
    """A model sharded (fully_shard, distribute_tensor) after its mirror was made: the step copied the tensors
    before the DTensor into the mirror, then raised a bare torch error, and the next delta lacked their changes
    (found by an adversarial helper). Refused first now, naming it."""
    import socket
    import subprocess
    import sys
    import textwrap

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
        dist.init_process_group("gloo", rank=0, world_size=1)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        import deltasync_rs as ds
        from deltasync_rs.torch import Mirror
        mesh = init_device_mesh("cpu", (1,))
        state = {{"a": torch.zeros(64), "b": torch.zeros(8, 8)}}
        mirror = Mirror(state, torch.bfloat16)
        state["a"] += 1
        state["b"] = distribute_tensor(torch.full((8, 8), 2.0), mesh, [Shard(0)])
        try:
            mirror.step(1)
            print("not refused")
        except ds.DeltaSyncError as error:
            print("refused:", error, "| moved:", bool(mirror.tensors["a"].any()), "| step:", mirror.current_step)
        dist.destroy_process_group()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "refused: tensor 'b' is now a DTensor" in done.stdout, done.stdout + done.stderr
    assert "| moved: False | step: None" in done.stdout  # made without a step


def test_fsdp1_is_refused_on_every_rank(tmp_path):
    """An FSDP1 model was taken: its state dict is a collective that rank 0's mirror entered alone (gloo's timeout)
    or holds ShardedTensors (a bare torch error) (found by an adversarial helper)."""
    _, _, raised = _run_fsdp_workers(tmp_path, "varint", "fsdp1", expect_output=False)
    for report in raised:
        assert "FSDP1 (FullyShardedDataParallel), which deltasync does not take" in report, report


@pytest.mark.parametrize("scenario", ["resume", "restart"])
def test_fsdp2_a_resumed_publisher_attaches_again_and_a_misplaced_one_is_refused_on_every_rank(tmp_path, scenario):
    """After a restart, a publisher resumed at the store's step 5 (by hand, or by attach(start_step=5) where the
    store holds step 5 as the gathered weights) attaches to the sharded model again (rank 0 checks that the gathered
    weights are the state it resumed, and publishes nothing for it) and its next publish is a delta from step 5. A
    publisher passed on a rank other than 0 is refused by every rank at once."""
    store, whole, raised = _run_fsdp_workers(tmp_path, "compact", scenario)
    assert raised == ["", ""]
    entries = ds.sync.log_entries(LocalStore(store))
    assert [(e.step, e.base_step, e.anchor is not None) for e in entries] == [
        (0, None, True),
        (2, 0, False),
        (4, 2, False),
        (5, 4, False),
        (7, 5, False),
    ]
    state = {name: torch.zeros_like(t) for name, t in whole.items()}
    assert ds.Subscriber(LocalStore(store)).pull(state) == 7
    assert_same(state, whole)
    if scenario == "restart":
        return
    misuse = tmp_path / "misuse"
    misuse.mkdir()
    _, _, raised = _run_fsdp_workers(misuse, "varint", "misuse", expect_output=False)
    assert raised == ["rank 1: pass the publisher on rank 0 and None on the other ranks"] * 2


def test_publish_shards_refuses_parts_whose_proofs_do_not_hold():
    """publish_shards checks every part's proofs against the state it published, and that they cover all of it,
    before anything is joined or published; every refusal names the tensor."""
    prev = {"w": torch.randn(64).to(torch.bfloat16), "b": torch.randn(8).to(torch.bfloat16)}
    curr = {n: t.clone() for n, t in prev.items()}
    curr["w"].view(torch.int16)[::5] += 1
    with tempfile.TemporaryDirectory() as folder:
        publisher = ds.Publisher(folder, background=False)
        publisher.publish(0, prev)

        def shard(lo: int, hi: int, base: torch.Tensor):
            """A rank's part of w (elements lo..hi, against ``base``) and its proof, made by a sharded mirror."""
            builder = MirrorDiff("diff", "varint")
            builder.begin("w", "BF16", [64])
            mirror = base[lo:hi].clone()
            builder.update(mirror.view(torch.uint8).numpy(), curr["w"][lo:hi].view(torch.uint8).numpy(), lo)
            builder.finish(None)
            raw = builder.take()
            raw.step, raw.base_step = 1, 0
            return ds.Delta(raw), builder.take_shard_bases()

        whole_b = ds.diff({"b": prev["b"]}, {"b": curr["b"]}, codec="varint", step=1, base_step=0)
        (p0, proof0), (p1, proof1) = shard(0, 40, prev["w"]), shard(40, 64, prev["w"])
        assert proof0 == [("w", 0, 40, base_identity(prev["w"][:40].view(torch.uint8).numpy()))]
        drifted = prev["w"].clone()
        drifted.view(torch.int16)[50] += 1
        p1_bad, proof1_bad = shard(40, 64, drifted)
        cases = {
            "drifted": ([p0, p1_bad, whole_b], [proof0, proof1_bad, []], "shard 1 did not start from the last"),
            "a gap at the end": ([p0, whole_b], [proof0, []], "no shard vouches for elements 40 to 64"),
            "a gap at the start": ([p1, whole_b], [proof1, []], "no shard vouches for elements 0 to 40"),
            "no proofs": ([p0, p1, whole_b], None, "no shard vouches for elements 0 to 64"),
            "a foreign tensor": ([p0, p1, whole_b], [proof0, proof1 + [("x", 0, 1, "0" * 16)], []], "'x'"),
        }
        for label, (parts, proofs, message) in cases.items():
            with pytest.raises(BaseMismatchError, match=message):
                publisher.publish_shards(1, parts, proofs=proofs)
            assert publisher.step == 0, label
        publisher.publish_shards(1, [p0, p1, whole_b], proofs=[proof0, proof1, []])
        publisher.close()
        state = {n: t.clone() for n, t in prev.items()}
        assert ds.Subscriber(folder).pull(state) == 1
        assert_same(state, curr)


def _w_and_b_shards(prev, curr, bounds, codec):
    """Each rank's delta from ``prev`` to ``curr`` and its proofs, made by sharded mirrors (``MirrorDiff`` in
    ``codec``): ``w`` cut at ``bounds``, ``b`` held whole by the first rank (which stores it whole where every element
    changed)."""
    parts, proofs = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        builder = MirrorDiff("diff", codec)
        builder.begin("w", "BF16", [bounds[-1]])
        mirror = prev["w"][lo:hi].clone()
        builder.update(mirror.view(torch.uint8).numpy(), curr["w"][lo:hi].view(torch.uint8).numpy(), lo)
        builder.finish(None)
        if lo == 0:
            builder.begin("b", "BF16", [8])
            mirror_b = prev["b"].clone()
            builder.update(mirror_b.view(torch.uint8).numpy(), curr["b"].view(torch.uint8).numpy(), 0)
            builder.finish(mirror_b.view(torch.uint8).numpy())
        raw = builder.take()
        raw.step, raw.base_step = 1, 0
        parts.append(ds.Delta(raw))
        proofs.append(builder.take_shard_bases())
    return parts, proofs


def test_publish_shards_leaves_the_compact_encoding_to_the_upload_thread(tmp_path, monkeypatch):
    """Every rank waits for rank 0's publish_shards: it joins the parts as they are (varint) and applies them to its
    mirror, and the upload thread re-encodes the joined delta in the compact codec. The file is what joining the
    parts in that codec at once makes."""
    from deltasync_rs._core import join_shards

    completed_on = completion_threads(monkeypatch, "_Recode")
    prev = {"w": torch.randn(5000).to(torch.bfloat16), "b": torch.randn(8).to(torch.bfloat16)}
    curr = {n: t.clone() for n, t in prev.items()}
    curr["w"].view(torch.int16)[::7] += 1
    curr["b"].view(torch.int16).add_(1)  # every element: the rank that holds it stores it whole
    parts, proofs = _w_and_b_shards(prev, curr, (0, 3000, 5000), "compact")
    store = LocalStore(tmp_path / "store")
    with ds.Publisher(store) as publisher:
        publisher.publish(0, prev)
        publisher.publish_shards(1, parts, proofs=proofs)
    assert completed_on == ["deltasync-publisher"]
    identities = [("w", base_identity(prev["w"].view(torch.uint8).numpy()))]  # the whole tensor's, which it records
    expected = join_shards([p._raw for p in parts], "compact", identities=identities)
    assert store.get(ds.sync.delta_key(1)) == expected.to_bytes()
    state = {n: t.clone() for n, t in prev.items()}
    assert ds.Subscriber(store).pull(state) == 1
    assert_same(state, curr)


@pytest.mark.parametrize("codec", ["varint", "compact"])
@pytest.mark.parametrize("bounds", [(0, 131072, 300000), (0, 100001, 300000), (0, 131072, 262144, 300000)])
def test_publish_shards_records_each_joined_tensors_base_identity(tmp_path, codec, bounds):
    """A joined shard delta recorded no base identity (no rank holds a whole tensor), so nothing checked that it
    was applied to the state it was made from, and a wrong anchor before it went unseen. The publisher holds the
    state: it records the identity of each whole tensor, from the hashes of the proofs' ranges where they start on
    256 KiB blocks of the tensor (first two bounds: a cut at byte 262144), the tensor hashed otherwise; as `diff` of
    the whole state records them. A tensor a rank stores whole records none."""
    numel = bounds[-1]
    prev = {"w": torch.randn(numel).to(torch.bfloat16), "b": torch.randn(8).to(torch.bfloat16)}
    curr = {n: t.clone() for n, t in prev.items()}
    curr["w"].view(torch.int16)[::97] += 1
    curr["b"].view(torch.int16).add_(1)  # every element: stored whole by the rank that holds it
    parts, proofs = _w_and_b_shards(prev, curr, bounds, "varint")
    store = LocalStore(tmp_path / "store")
    with ds.Publisher(store, codec=codec) as publisher:
        publisher.publish(0, prev)
        publisher.publish_shards(1, parts, proofs=proofs)
    published = ds.load(store.get(ds.sync.delta_key(1)))
    whole = ds.diff(prev, curr, codec=codec)
    bases = {name: published.base_identity(i) for i, name in enumerate(published.names)}
    assert bases == {"w": base_identity(prev["w"].view(torch.uint8).numpy()), "b": None}
    assert bases["w"] == whole.base_identity(whole.names.index("w"))
    drifted = {n: t.clone() for n, t in prev.items()}
    drifted["w"].view(torch.int16)[numel - 1] += 3
    with pytest.raises(BaseMismatchError, match='tensor "w": the target is not the base'):
        published.apply_(drifted, check_base=True)
    state = {n: t.clone() for n, t in prev.items()}
    assert ds.Subscriber(store).pull(state) == 1
    assert_same(state, curr)


@pytest.mark.parametrize("codec", ["varint", "compact", "context"])
def test_fsdp2_two_ranks_publish_one_manifest_and_match_the_unsharded_model(tmp_path, codec):
    """fully_shard on CPU over gloo: each rank diffs its own (uneven) shards; the subscriber matches full_tensor().
    With a compact publisher, rank 0 re-encodes the joined (varint) shards; with a context one, against the whole
    last published state its publisher keeps, recording every tensor's base identity."""
    store, whole, raised = _run_fsdp_workers(tmp_path, codec)
    assert raised == ["", ""]
    entries = ds.sync.log_entries(LocalStore(store))
    assert [e.step for e in entries] == [0, 2, 4, 5]
    assert [e.anchor is not None for e in entries] == [True, False, False, False]  # the pull replays every delta
    assert all(e.num_changed > 0 for e in entries)
    if codec != "varint":
        delta = ds.load(LocalStore(store).get("deltas/step_000000000002.safetensors"))
        assert {"rice", "context"} & {t.positions for t in delta.tensors}
    if codec == "context":
        for step in (2, 4, 5):
            delta = ds.load(LocalStore(store).get(f"deltas/step_{step:012d}.safetensors"))
            assert all(delta.base_identity(i) is not None for i in range(len(delta.tensors)))
    state = {name: torch.zeros_like(t) for name, t in whole.items()}
    assert ds.Subscriber(LocalStore(store)).pull(state) == 5
    assert_same(state, whole)
    assert not ds.sync.verify_store(LocalStore(store))
