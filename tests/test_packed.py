"""The packed layout (docs/format.md §4.1): every compact writing path writes it, any safetensors reader opens it,
it applies bit for bit, and a step of many small tensors no longer pays a header record per tensor."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open

import deltasync_rs as ds
from deltasync_rs._core import RawDelta, join_shards
from deltasync_rs.cli import main
from deltasync_rs.mirror import Mirror
from tests.test_compact import _states

PACKED = {"__deltasync_records__", "__deltasync_streams__"}


def _header(blob: bytes) -> dict:
    return json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])


def _small_tensors(count: int = 40, seed: int = 1) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Many small bf16 tensors (as bit patterns), a few elements of each moved by one in their bit pattern."""
    rng = np.random.default_rng(seed)
    prev = {
        f"model.layers.{i // 4}.{['q', 'k', 'v', 'o'][i % 4]}_proj.weight": rng.integers(
            0x3C00, 0x3F00, (64, 48), dtype=np.uint16
        )
        for i in range(count)
    }
    curr = {name: a.copy() for name, a in prev.items()}
    for a in curr.values():
        a.flat[rng.choice(a.size, size=3, replace=False)] += 1
    return prev, curr


@pytest.mark.parametrize("values", ["diff", "abs"])
def test_compact_diff_is_packed_opens_anywhere_and_applies_bit_exact(tmp_path, values):
    prev, curr = _states()
    delta = ds.diff(prev, curr, values=values, codec="compact", step=2, base_step=1)
    blob = delta.to_bytes()
    header = _header(blob)
    assert header["__metadata__"]["format_version"] == "2" and "tensors" not in header["__metadata__"]
    path = tmp_path / "d.safetensors"
    delta.save(path)
    assert path.read_bytes() == blob
    with safe_open(str(path), framework="numpy") as f:
        assert set(f.keys()) == PACKED | {t.name for t in delta.tensors if t.positions == "all"}
        assert f.get_tensor("__deltasync_records__").dtype == np.uint8
    loaded = ds.load(blob)
    assert loaded._raw.packed and loaded.to_bytes() == blob
    assert loaded.tensors == delta.tensors and loaded.num_changed == delta.num_changed
    target = {name: a.copy() for name, a in prev.items()}
    loaded.apply_(target, check_base=True)
    for name in curr:
        assert np.array_equal(target[name], curr[name]), name
    # Decoded the same as the named layout's file of the same delta.
    named = ds.load(blob)
    named._raw.packed = False
    assert _header(named.to_bytes())["__metadata__"]["format_version"] == "1"
    for index in range(len(loaded)):
        assert ds.load(named.to_bytes())._raw.decode(index) == loaded._raw.decode(index)


def test_varint_deltas_and_anchors_stay_version_1():
    prev, curr = _states()
    assert _header(ds.diff(prev, curr).to_bytes())["__metadata__"]["format_version"] == "2"  # compact, the default
    for delta in (ds.anchor(curr), ds.diff(prev, curr, codec="varint")):
        header = _header(delta.to_bytes())
        assert header["__metadata__"]["format_version"] == "1" and not PACKED & set(header)
    compact_anchor = ds.anchor(curr)
    compact_anchor._raw.packed = True
    assert compact_anchor.to_bytes() == ds.anchor(curr).to_bytes()


def test_every_compact_writer_packs():
    prev, curr = _states()
    expected = ds.diff(prev, curr, codec="compact", step=1).to_bytes()
    mirror = Mirror({name: a.copy() for name, a in prev.items()})
    assert mirror.advance(curr, step=1, codec="compact").to_bytes() == expected
    assert Mirror({name: a.copy() for name, a in prev.items()}).advance(curr, step=1)._raw.packed
    assert not Mirror({name: a.copy() for name, a in prev.items()}).advance(curr, step=1, codec="varint")._raw.packed
    sparse = [name for name in prev if name != "small"]  # shard parts are never stored whole
    shard = ds.diff({n: prev[n] for n in sparse}, {n: curr[n] for n in sparse}, codec="varint")._raw
    assert join_shards([shard], "compact").packed and not join_shards([shard], "varint").packed
    assert join_shards([shard]).packed  # compact is the default


def test_many_small_tensors_pay_no_record_per_tensor():
    prev, curr = _small_tensors()
    compact = ds.diff(prev, curr, codec="compact")
    named = ds.load(compact.to_bytes())
    named._raw.packed = False
    packed_size, named_size = len(compact.to_bytes()), len(named.to_bytes())
    per_tensor = (packed_size - compact.nbytes) / len(compact)
    assert per_tensor < 50 < 200 < (named_size - compact.nbytes) / len(compact)


def test_a_tensor_stored_whole_reports_its_real_count(tmp_path, capsys):
    prev = {"w": np.arange(6, dtype=np.uint16), "big": np.zeros(1000, dtype=np.uint16)}
    curr = {"w": prev["w"] + np.array([900, 900, 900, 900, 900, 0], dtype=np.uint16), "big": prev["big"].copy()}
    curr["big"][7] = 1
    for codec in ("varint", "compact"):
        delta = ds.diff(prev, curr, codec=codec)
        infos = {t.name: t for t in delta.tensors}
        assert infos["w"].positions == "all" and infos["w"].changed == 5 and infos["w"].density == 5 / 6
        assert delta.num_changed == 6
        path = tmp_path / f"{codec}.safetensors"
        delta.save(path)
        assert ds.load(path).num_changed == 6
        assert main(["inspect", str(path), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["num_changed"] == 6 and report["tensors"][0]["changed"] == 5
        assert report["packed"] == (codec == "compact") == (delta._raw.format_version == "2")
        assert main(["inspect", str(path)]) == 0
        assert ("packed layout (format version 2)" in capsys.readouterr().out.splitlines()[0]) == (codec == "compact")
    # Anchors know no base: every element counts.
    assert ds.anchor(curr).num_changed == 1006


def test_a_truncated_or_corrupt_packed_file_is_a_format_error():
    prev, curr = _small_tensors(count=3)
    blob = ds.diff(prev, curr, codec="compact").to_bytes()
    for cut in range(0, len(blob), 7):
        with pytest.raises(ds.DeltaFormatError):
            ds.load(blob[:cut])
    for at in range(0, len(blob), 3):
        broken = bytearray(blob)
        broken[at] ^= 0x5A
        try:
            RawDelta.from_bytes(bytes(broken))
        except ds.DeltaFormatError:
            pass


def _v(n: int) -> bytes:
    out = b""
    while True:
        out += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return out


def _packed_file(positions: str, values: str, changed: int, lengths: tuple[int, int], streams: bytes) -> bytes:
    """A version 2 file of one BF16 record `w` of shape [8], written by hand from docs/format.md §4.1."""
    from tests.test_malformed import craft, u8

    table = ["BF16", positions, values]
    names = _v(len(table)) + b"".join(_v(len(t)) + t.encode() for t in table)
    record = _v(0) + _v(1) + b"w" + _v(0) + _v(1) + _v(2) + bytes([1]) + _v(1) + _v(8) + _v(changed)
    records = names + _v(1) + record + _v(lengths[0]) + _v(lengths[1])
    metadata = {"format": "deltasync", "format_version": "2", "kind": "delta"}
    return craft(metadata, {"__deltasync_records__": u8(records), "__deltasync_streams__": u8(streams)})


# rans values of one token at frequency 4096 and both states at 2^23: a valid stream of any number of values.
_ONE_TOKEN = bytes([1, 0, 0x80, 0x20]) + (1 << 23).to_bytes(4, "little") * 2


@pytest.mark.parametrize(
    "positions, values, changed, lengths, streams, message",
    [
        ("rice", "diffbits", 0, (1, 0), b"\x00", "changes nothing, yet has streams of 1 and 0 bytes"),
        ("varint", "rans", 0, (0, 12), _ONE_TOKEN, "changes nothing, yet has streams of 0 and 12 bytes"),
        ("context", "rans", 0, (17, 0), bytes([127]) + bytes(16), "changes nothing, yet has streams of 17"),
        ("all", "diff", 8, (1, 8), b"\x00" + bytes([1] * 8), "positions 'all' with a position stream"),
    ],
)
def test_packed_records_with_streams_they_cannot_have_are_refused(
    positions, values, changed, lengths, streams, message
):
    """A record that changes nothing has no streams, and positions `all` no position stream (§4): such streams,
    though each valid on its own (a Rice stream of `k` alone, a one-token `rans` table), were taken (found by an
    independent decoder written from docs/format.md)."""
    with pytest.raises(ds.DeltaFormatError, match=message):
        ds.load(_packed_file(positions, values, changed, lengths, streams))


def test_handmade_packed_records_without_those_streams_load():
    unchanged = ds.load(_packed_file("rice", "diffbits", 0, (0, 0), b""))
    assert unchanged.num_changed == 0
    whole_differences = ds.load(_packed_file("all", "diff", 8, (0, 8), bytes([1] * 8)))
    import torch

    target = torch.zeros(8, dtype=torch.bfloat16)
    whole_differences.apply_({"w": target})
    assert target.view(torch.int16).tolist() == [1] * 8
