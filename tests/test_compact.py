"""The compact codec on every writing path: the one-pass mirror (MirrorDiff, ds.Mirror, ds.torch.Mirror), the
Publisher, attach and the CLI give the bytes ds.diff(codec="compact") gives, and subscribers rebuild them bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import deltasync_rs as ds
import deltasync_rs.torch as ds_torch
from deltasync_rs import _arrays
from deltasync_rs._core import MirrorDiff
from deltasync_rs.cli import main
from deltasync_rs.mirror import Mirror
from deltasync_rs.store import LocalStore
from tests.test_trainer import assert_same, bf16, replica_of, tiny_gpt2, train_step

COMPACT = {"rice", "diffbits", "rans"}


def _states(seed: int = 5) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Tensors of widths 1, 2, 4 and 8 over several scan tasks, with sparse ±1/±2 steps (where compact wins), a
    dense patch and differences that need the escape."""
    rng = np.random.default_rng(seed)
    prev = {
        "u8": rng.integers(0, 256, 300_001, dtype=np.uint8),
        "bf16": rng.integers(0, 1 << 15, 600_007, dtype=np.uint16).view(np.int16),
        "f32": rng.standard_normal(70_001).astype(np.float32),
        "i64": rng.integers(-1 << 40, 1 << 40, 5003, dtype=np.int64),
        "small": rng.integers(0, 100, 6, dtype=np.int16),
    }
    curr = {name: a.copy() for name, a in prev.items()}
    for name, a in curr.items():
        if name == "small":
            continue
        bits = a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.itemsize])
        picked = rng.choice(bits.size, size=max(1, bits.size // 100), replace=False)
        bits[picked] += rng.choice(np.array([1, 2, 1, 2, 77], dtype=bits.dtype), size=picked.size)
        bits[picked[::9]] -= np.array(3, dtype=bits.dtype)
        bits[: min(64, bits.size)] ^= np.array(0x40, dtype=bits.dtype)
    curr["small"][:5] += 1000  # 5 of 6 changed, with differences that need the escape: stored whole
    return prev, curr


def _chunked(prev, curr, values: str, codec: str, chunk: int) -> ds.Delta:
    builder = MirrorDiff(values, codec)
    mirrors = {name: a.copy() for name, a in prev.items()}
    for name, new in curr.items():
        mirror = mirrors[name]
        flat_mirror, flat_new = mirror.view(np.uint8), new.view(np.uint8)
        dtype_name, shape = _arrays.describe(new, name)
        builder.begin(name, dtype_name, list(shape))
        step = chunk * new.itemsize
        for start in range(0, flat_mirror.size, step):
            builder.update(flat_mirror[start : start + step], flat_new[start : start + step], start // new.itemsize)
        builder.finish(flat_mirror)
    for name in curr:
        assert np.array_equal(mirrors[name], curr[name])
    return ds.Delta(builder.take())


@pytest.mark.parametrize("values", ["diff", "abs"])
def test_mirror_advance_and_chunks_equal_diff_compact(values):
    prev, curr = _states()
    reference = ds.diff(prev, curr, values=values, codec="compact", step=1, base_step=0)
    codecs = {(t.positions, t.values) for t in reference.tensors}
    assert ("rice", "diffbits") in codecs or values == "abs"
    assert ("all", "abs") in codecs  # the 6-element tensor
    mirror = Mirror(prev, step=0)
    delta = mirror.advance(curr, step=1, values=values, codec="compact")
    assert delta.to_bytes() == reference.to_bytes()
    assert delta.to_bytes() == mirror_default(prev, curr, values)  # compact is the default
    assert delta.to_bytes() != ds.diff(prev, curr, values=values, codec="varint", step=1, base_step=0).to_bytes()
    for chunk in (1_000, 4_099, 262_147, 1 << 22):
        raw = _chunked(prev, curr, values, "compact", chunk)
        raw.step, raw.base_step = 1, 0
        assert raw.to_bytes() == reference.to_bytes(), chunk
    with pytest.raises(ds.DeltaSyncError, match="codec"):
        Mirror(prev, step=0).advance(curr, step=1, codec="rice")


def mirror_default(prev, curr, values):
    return Mirror(prev, step=0).advance(curr, step=1, values=values).to_bytes()


@pytest.mark.parametrize("chunk_bytes", [998, 9_998, 64 << 20])
@pytest.mark.parametrize("values", ["diff", "abs"])
def test_torch_mirror_step_compact_equals_diff_compact(chunk_bytes, values):
    torch.manual_seed(1)
    state = {
        "master": torch.randn(370, 290),  # fp32, cast through the staging buffer
        "half": torch.randn(100_000).to(torch.bfloat16),  # read in place
        "counts": torch.arange(5000, dtype=torch.int64),
        "ints": torch.arange(3000, dtype=torch.int32),
        "bytes": torch.zeros(2000, dtype=torch.uint8),
    }
    mirror = ds_torch.Mirror(state, chunk_bytes=chunk_bytes, values=values, codec="compact")
    replica = {n: t.clone() for n, t in mirror.tensors.items()}
    for step in range(3):
        before = {n: t.clone() for n, t in mirror.tensors.items()}
        state["master"].view(-1)[::97] += 1e-2
        state["half"].view(torch.int16)[::53] += 1
        state["counts"][::31] += 2
        state["ints"][::17] -= 1
        state["bytes"][::13] += 1
        delta = mirror.step(step)
        expected = {n: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous() for n, t in state.items()}
        assert_same(mirror.tensors, expected)
        reference = ds.diff(before, expected, values=values, codec="compact", step=step, base_step=delta.base_step)
        assert delta.to_bytes() == reference.to_bytes()
        assert any(t.positions == "rice" for t in delta.tensors)
        delta.apply_(replica)
        assert_same(replica, expected)


def test_publisher_compact_pulls_bit_exact_with_rice_files(tmp_path):
    prev, curr = _states()
    later = {name: a.copy() for name, a in curr.items()}
    later["bf16"].view(np.uint16)[::211] += np.uint16(1)
    store = LocalStore(tmp_path / "store")
    with ds.Publisher(store, codec="compact", background=False) as publisher:
        assert publisher.codec == "compact"
        for step, state in enumerate((prev, curr, later)):
            publisher.publish(step, state)
    for step in (1, 2):
        delta = ds.load(store.get(f"deltas/step_{step:012d}.safetensors"))
        assert {t.positions for t in delta.tensors} & COMPACT and {t.values for t in delta.tensors} & COMPACT
    replica = {name: np.zeros_like(a) for name, a in prev.items()}
    assert ds.Subscriber(store).pull(replica) == 2
    for name in later:
        assert replica[name].tobytes() == later[name].tobytes(), name
    with pytest.raises(ds.DeltaSyncError, match="codec"):
        ds.Publisher(tmp_path / "other", codec="rice")


def test_attach_with_a_compact_publisher_replays_adamw_bit_exact(tmp_path):
    model = tiny_gpt2(seed=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    store = LocalStore(tmp_path / "store")
    publisher = ds.Publisher(store, anchor_every=100, codec="compact")
    attachment = ds_torch.attach(optimizer, model, publisher, chunk_bytes=50_000)
    assert attachment.mirror.codec == "compact"
    subscriber = ds.Subscriber(store)
    replica = replica_of(attachment.mirror)
    for step in range(1, 5):
        train_step(model, optimizer, seed=100 + step)
        publisher.flush()
        assert subscriber.pull(replica) == step
        assert_same(replica, bf16(model))
        delta = ds.load(store.get(f"deltas/step_{step:012d}.safetensors"))
        assert ("rice", "diffbits") in {(t.positions, t.values) for t in delta.tensors}
    publisher.close()
    assert not ds.sync.verify_store(store)


def test_cli_publish_codec_compact_then_pull(tmp_path, capsys):
    g = torch.Generator().manual_seed(3)
    prev = {"w": torch.randn(256, 64, generator=g).to(torch.bfloat16), "b": torch.randn(64, generator=g)}
    curr = {n: t.clone() for n, t in prev.items()}
    curr["w"].view(torch.int16).view(-1)[::37] += 1
    curr["b"].view(torch.int32)[::5] -= 1
    paths = [tmp_path / "prev.safetensors", tmp_path / "curr.safetensors"]
    save_file(prev, paths[0])
    save_file(curr, paths[1])
    store = tmp_path / "store"
    for step, path in enumerate(paths):
        assert main(["publish", str(path), "--store", str(store), "--step", str(step), "--codec", "compact"]) == 0
    delta = ds.load((store / "deltas" / "step_000000000001.safetensors").read_bytes())
    assert ("rice", "diffbits") in {(t.positions, t.values) for t in delta.tensors}
    assert main(["pull", "--store", str(store), "-o", str(tmp_path / "pulled.safetensors")]) == 0
    capsys.readouterr()
    assert_same(load_file(tmp_path / "pulled.safetensors"), curr)
