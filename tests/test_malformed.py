"""Hostile and broken inputs: every one gives DeltaFormatError (never a crash), and no target is touched."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import deltasync_rs as ds
from tests.helpers import assert_bits_equal, malformed_for_the_apply, reseal, without_checksum


def craft(metadata: dict | None, tensors: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    """A safetensors file written by hand, so that its contents can be anything at all."""
    header, data, offset = {}, b"", 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, (dtype, shape, payload) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(payload)]}
        data += payload
        offset += len(payload)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + data


def record(name="w", dtype="BF16", shape=(8,), changed=2, positions="varint", values="diff"):
    return {
        "name": name,
        "dtype": dtype,
        "shape": list(shape) if shape is not None else None,
        "changed": changed,
        "positions": positions,
        "values": values,
    }


def meta(*records, **extra):
    base = {"format": "deltasync", "format_version": "1", "kind": "delta", "tensors": json.dumps(list(records))}
    base.update(extra)
    return base


def u8(payload: bytes):
    return ("U8", [len(payload)], payload)


# A valid file: positions 1 and 4 (gaps 1, 2), differences +1 and -1.
VALID = craft(meta(record()), {"w:pos": u8(bytes([1, 2])), "w:val": u8(bytes([1, 0xFF]))})


# The same changes in the compact codec: k = 0, gaps 1 and 2 as bits 1,0 and 1,1,0; values +1, -1 as bits 0,0 and 0,1.
VALID_COMPACT = craft(
    meta(record(positions="rice", values="diffbits")), {"w:pos": u8(bytes([0x00, 0x0D])), "w:val": u8(bytes([0x08]))}
)


def compact(pos: bytes, val: bytes = bytes([0x08]), **fields) -> bytes:
    return craft(meta(record(positions="rice", values="diffbits", **fields)), {"w:pos": u8(pos), "w:val": u8(val)})


# The same changes with rans values: two entries of 2048 for tokens 1 (-1) and 2 (+1), and the states 0x01000800, which
# decodes +1 (value 0), and 0x01000000, which decodes -1 (value 1); both end at 2^23 with no byte to read.
RANS_VALUES = bytes([0x02, 0x00, 0x80, 0x10, 0x80, 0x10, 0x00, 0x08, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01])


def rans(val: bytes = RANS_VALUES, **fields) -> bytes:
    return craft(meta(record(values="rans", **fields)), {"w:pos": u8(bytes([1, 2])), "w:val": u8(val)})


def test_the_handmade_rans_file_is_valid():
    delta = ds.load(rans())
    assert [(t.positions, t.values) for t in delta.tensors] == [("varint", "rans")]
    target = torch.zeros(8, dtype=torch.bfloat16)
    delta.apply_(target)
    assert target.view(torch.int16).tolist() == [0, 1, 0, 0, -1, 0, 0, 0]


def _within(seconds: float, call):
    """``call()``'s result or error, failing the test if it is still running after ``seconds`` (left running in a
    daemon thread: the core releases the GIL while it decodes)."""
    import threading

    out: dict = {}

    def run():
        try:
            out["value"] = call()
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            out["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still decoding after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


# A `rans` table of one token (0: a difference of 0x8000) at frequency 4096, both states 2^23: every value decodes from
# no bits at all, so the stream holds any number of them. And one of tokens 0 and 1 at 4095 and 1: a value takes
# about 1/2840 of a bit.
FREE_RANS = bytes([0x00, 0x80, 0x20]) + (1 << 23).to_bytes(4, "little") * 2
NEAR_FREE_RANS = bytes([0x01, 0xFF, 0x1F, 0x01]) + (1 << 23).to_bytes(4, "little") * 2


@pytest.mark.parametrize("check", ["load", "apply"])
def test_declared_counts_no_stream_can_hold_are_refused_at_once(check):
    """A 400-byte file declaring 2^50 changes kept every load decoding for days: its `rans` values take no bits,
    and the loader decoded the declared count before it looked at the positions, or at any target. The positions
    bound the count (a `varint` code takes a byte, a `rice` code a bit) and a `rans` stream bounds it by its table;
    a stream of values that take no bits is checked without decoding them (found by an adversarial helper)."""
    huge = 1 << 50
    varint = craft(
        meta(record(shape=(huge,), changed=huge, values="rans")), {"w:pos": u8(b"\x00"), "w:val": u8(FREE_RANS)}
    )
    with pytest.raises(ds.DeltaFormatError, match="position stream of 1 bytes cannot hold"):
        _within(30, lambda: ds.load(varint, check=check))
    rice = craft(
        meta(record(shape=(huge,), changed=huge, positions="rice", values="rans")),
        {"w:pos": u8(b"\x00\x00"), "w:val": u8(FREE_RANS)},
    )
    with pytest.raises(ds.DeltaFormatError, match="position stream of 2 bytes cannot hold"):
        _within(30, lambda: ds.load(rice, check=check))
    near = craft(
        meta(record(shape=(huge,), changed=huge, positions="all", values="rans")), {"w:val": u8(NEAR_FREE_RANS)}
    )
    with pytest.raises(ds.DeltaFormatError, match="value stream of 12 bytes cannot hold"):
        _within(30, lambda: ds.load(near, check=check))
    free = craft(meta(record(shape=(huge,), changed=huge, positions="all", values="rans")), {"w:val": u8(FREE_RANS)})
    delta = _within(30, lambda: ds.load(free, check=check))  # valid: 2^50 sign flips
    target = torch.arange(8, dtype=torch.int16).view(torch.bfloat16)
    with pytest.raises(ds.BaseMismatchError):
        delta.apply_(target)
    assert target.view(torch.int16).tolist() == list(range(8))
    small = craft(meta(record(changed=8, positions="all", values="rans")), {"w:val": u8(FREE_RANS)})
    _within(30, lambda: ds.load(small, check=check)).apply_(target)
    assert target.view(torch.int16).tolist() == [i - (1 << 15) for i in range(8)]  # token 0: 0x8000, a sign flip


def test_small_hostile_files_are_refused_in_time_and_memory_in_proportion_to_them():
    """Found by an adversarial helper: a TRL patch of 30,000 empty pairs and one stray tensor took minutes to name
    the stray (each name was looked up against every pair); `Delta.decoded` of a record declaring 2^60 free values
    panicked on a size that wrapped; the no-base read of a `context` record declaring 2^40 changes aborted the
    process allocating 8 TB. Each is now a DeltaSyncError."""
    header = {"__metadata__": {"format": "sparse_weight_patch", "sparse": "True"}}
    for i in range(30_000):
        header[f"t{i}.indices"] = {"dtype": "I32", "shape": [0], "data_offsets": [0, 0]}
        header[f"t{i}.values"] = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    header["stray"] = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with pytest.raises(ds.DeltaFormatError, match='tensor "stray" is not part of an index/value pair'):
        _within(60, lambda: ds.load(struct.pack("<Q", len(encoded)) + encoded))

    wide = craft(
        meta(record(dtype="U64", shape=(1 << 60,), changed=1 << 60, positions="all", values="rans")),
        {"w:val": u8(FREE_RANS)},
    )
    with pytest.raises(ds.DeltaSyncError, match="do not fit in memory"):
        ds.load(wide)._raw.decode(0)
    # One class listed by its unchanged elements (none), so any count passes without the base.
    positions = bytes([127, 1]) + bytes(15)
    context = craft(
        meta(
            dict(record(shape=(1 << 40,), changed=1 << 40, positions="context", values="rans"), base="0123456789abcdef")
        ),
        {"w:pos": u8(positions), "w:val": u8(FREE_RANS)},
    )
    with pytest.raises(ds.DeltaSyncError, match="do not fit in memory"):
        ds.load(context)._raw.context_parts(0)


def test_a_target_with_a_lazy_negation_bit_is_refused_by_name():
    """A view whose memory holds the negated values (``complex.conj().imag``) raised torch's own RuntimeError at
    apply; written in place it would take the new bits negated."""
    target = torch.randn(8, dtype=torch.complex64).conj().imag
    assert target.is_neg()
    base = target.clone()
    new = base.clone()
    new[0] += 1
    with pytest.raises(ds.DeltaSyncError, match="target of tensor 'w': a view with torch's lazy negation"):
        ds.diff({"w": base}, {"w": new}).apply_({"w": target})
    assert torch.equal(target, base)


def test_the_handmade_compact_file_is_valid():
    delta = ds.load(VALID_COMPACT)
    assert [(t.positions, t.values) for t in delta.tensors] == [("rice", "diffbits")]
    target = torch.zeros(8, dtype=torch.bfloat16)
    delta.apply_(target)
    assert target.view(torch.int16).tolist() == [0, 1, 0, 0, -1, 0, 0, 0]


def test_the_handmade_file_is_valid():
    delta = ds.load(VALID)
    target = torch.zeros(8, dtype=torch.bfloat16)
    delta.apply_(target)
    assert target.view(torch.int16).tolist() == [0, 1, 0, 0, -1, 0, 0, 0]


CASES = {
    "empty": b"",
    "short prefix": b"\x08\x00\x00",
    "huge header length": struct.pack("<Q", 1 << 40) + b"{}",
    "header past the end": struct.pack("<Q", 100) + b"{}",
    "header not json": struct.pack("<Q", 8) + b"not json",
    "no metadata": craft(None, {"w:pos": u8(b"\x00")}),
    "unknown format": craft({"format": "other"}, {}),
    "future version": craft(meta(record(), format_version="2"), {}),
    "no tensors list": craft({"format": "deltasync", "format_version": "1", "kind": "delta"}, {}),
    "tensors not json": craft(meta(record(), tensors="[{"), {}),
    "tensors wrong types": craft(meta(record(), tensors=json.dumps([{"name": 3}])), {}),
    "unknown position codec": craft(
        meta(record(positions="zigzag")), {"w:pos": u8(b"\x01\x02"), "w:val": u8(b"\x01\x01")}
    ),
    "unknown value codec": craft(meta(record(values="xor")), {"w:pos": u8(b"\x01\x02"), "w:val": u8(b"\x01\x01")}),
    "unknown dtype": craft(meta(record(dtype="F4")), {"w:pos": u8(b"\x01\x02"), "w:val": u8(b"\x01\x01")}),
    "shape overflows": craft(
        meta(record(shape=(1 << 62, 1 << 10))), {"w:pos": u8(b"\x01\x02"), "w:val": u8(b"\x01\x01")}
    ),
    "position out of range": craft(meta(record()), {"w:pos": u8(bytes([1, 9])), "w:val": u8(b"\x01\x01")}),
    "position stream truncated varint": craft(
        meta(record()), {"w:pos": u8(bytes([1, 0x80])), "w:val": u8(b"\x01\x01")}
    ),
    "position varint overflow": craft(
        meta(record(shape=(1 << 40,))), {"w:pos": u8(bytes([0xFF] * 11)), "w:val": u8(b"\x01\x01")}
    ),
    "too few positions": craft(meta(record(changed=3)), {"w:pos": u8(bytes([1, 2])), "w:val": u8(b"\x01\x01\x01")}),
    "trailing position bytes": craft(meta(record()), {"w:pos": u8(bytes([1, 2, 0])), "w:val": u8(b"\x01\x01")}),
    "too few values": craft(meta(record()), {"w:pos": u8(bytes([1, 2])), "w:val": u8(b"\x01")}),
    "escape without payload": craft(meta(record()), {"w:pos": u8(bytes([1, 2])), "w:val": u8(b"\x01\x80\x01")}),
    "trailing value bytes": craft(meta(record()), {"w:pos": u8(bytes([1, 2])), "w:val": u8(b"\x01\x01\x01")}),
    "abs values of the wrong length": craft(
        meta(record(values="abs")), {"w:pos": u8(bytes([1, 2])), "w:val": u8(b"\x01\x01\x01")}
    ),
    "more changes than elements": craft(
        meta(record(shape=(1,))), {"w:pos": u8(bytes([0, 0])), "w:val": u8(b"\x01\x01")}
    ),
    "stream of the wrong dtype": craft(meta(record()), {"w:pos": ("I8", [2], bytes([1, 2])), "w:val": u8(b"\x01\x01")}),
    "stream not 1-d": craft(meta(record()), {"w:pos": ("U8", [1, 2], bytes([1, 2])), "w:val": u8(b"\x01\x01")}),
    "missing value stream": craft(meta(record()), {"w:pos": u8(bytes([1, 2]))}),
    "missing position stream": craft(meta(record()), {"w:val": u8(b"\x01\x01")}),
    "unlisted tensor": craft(meta(record()), {"w:pos": u8(bytes([1, 2])), "w:val": u8(b"\x01\x01"), "x": u8(b"\x00")}),
    "duplicate names": craft(meta(record(), record()), {"w:pos": u8(bytes([1, 2])), "w:val": u8(b"\x01\x01")}),
    "dense with wrong stored shape": craft(
        meta(record(changed=8, positions="all", values="abs"), kind="anchor"), {"w": ("BF16", [4, 2], bytes(16))}
    ),
    "dense with wrong stored dtype": craft(
        meta(record(changed=8, positions="all", values="abs"), kind="anchor"), {"w": ("F16", [8], bytes(16))}
    ),
    "dense with a wrong count": craft(
        meta(record(changed=7, positions="all", values="abs"), kind="anchor"), {"w": ("BF16", [8], bytes(16))}
    ),
    "dense without shape": craft(
        meta(record(shape=None, changed=8, positions="all", values="abs"), kind="anchor"),
        {"w": ("BF16", [8], bytes(16))},
    ),
    "all positions with a position stream": craft(
        meta(record(changed=8, positions="all")), {"w:pos": u8(b"\x00"), "w:val": u8(bytes(8))}
    ),
    "all positions with an empty position stream": craft(
        meta(record(changed=8, positions="all")), {"w:pos": u8(b""), "w:val": u8(bytes([1] * 8))}
    ),
    "a record without its shape": craft(
        meta({k: v for k, v in record().items() if k != "shape"}),
        {"w:pos": u8(bytes([1, 2])), "w:val": u8(b"\x01\x01")},
    ),
    "anchor kind on a sparse delta": craft(
        meta(record(), kind="anchor"), {"w:pos": u8(bytes([1, 2])), "w:val": u8(b"\x01\x01")}
    ),
    "step not a number": craft(meta(record(), step="x"), {"w:pos": u8(bytes([1, 2])), "w:val": u8(b"\x01\x01")}),
    "rice parameter over 56": compact(bytes([57, 0x0D])),
    "rice stream holds only k": compact(bytes([0x00])),
    "empty rice stream": compact(b""),
    "rice unary run without end": compact(bytes([0x00, 0xFF, 0xFF])),
    "rice escape cut short": compact(bytes([0x00] + [0xFF] * 8 + [0x01])),
    "rice position out of range": compact(bytes([0x00, 0x7F, 0x00])),
    # two codes, then the three zero padding bits read as three gaps of 0: five positions for six changes
    "rice too few codes": compact(bytes([0x00, 0x0D]), val=bytes([0x00, 0x00]), changed=6, shape=(100,)),
    "rice trailing byte": compact(bytes([0x00, 0x0D, 0x00])),
    "rice non-zero padding": compact(bytes([0x00, 0x8D])),
    "rice more changes than elements": compact(bytes([0x00, 0x00]), shape=(1,)),
    "diffbits empty": compact(bytes([0x00, 0x0D]), val=b""),
    "diffbits escape byte cut short": compact(bytes([0x00, 0x0D]), val=bytes([0x03])),
    "diffbits escape payload cut short": compact(bytes([0x00, 0x0D]), val=bytes([0x0C, 0x08])),
    "diffbits trailing byte": compact(bytes([0x00, 0x0D]), val=bytes([0x08, 0x00])),
    "diffbits non-zero padding": compact(bytes([0x00, 0x0D]), val=bytes([0x18])),
    "rans empty": rans(b""),
    "rans table over the tokens of the width": rans(bytes([64]) + RANS_VALUES[1:]),
    "rans frequencies under 4096": rans(bytes([0x02, 0x00, 0x80, 0x10, 0x7F]) + RANS_VALUES[6:]),
    "rans frequency not in its shortest form": rans(bytes([0x02, 0x00, 0x80, 0x10, 0xFF, 0x00]) + RANS_VALUES[6:]),
    "rans table ending with a zero": rans(bytes([0x03]) + RANS_VALUES[1:6] + bytes([0x00]) + RANS_VALUES[6:]),
    "rans table cut short": rans(RANS_VALUES[:4]),
    "rans state cut short": rans(RANS_VALUES[:8]),
    "rans state below 2^23": rans(RANS_VALUES[:6] + bytes([0xFF, 0xFF, 0x7F, 0x00]) + RANS_VALUES[10:]),
    "rans state from 2^31": rans(RANS_VALUES[:6] + bytes([0x00, 0x00, 0x00, 0x80]) + RANS_VALUES[10:]),
    "rans second state below 2^23": rans(RANS_VALUES[:10] + bytes([0xFF, 0xFF, 0x7F, 0x00])),
    "rans second state cut short": rans(RANS_VALUES[:12]),
    "rans trailing byte": rans(RANS_VALUES + bytes([0x00])),
    "rans not ending in the initial state": craft(
        meta(record(values="rans", changed=1)), {"w:pos": u8(bytes([1])), "w:val": u8(RANS_VALUES)}
    ),
    # token 1 of frequency 1 leaves x = 2048, and the two bytes renormalisation needs are missing
    "rans ends inside a renormalisation": rans(
        bytes([0x02, 0x00, 0x01, 0xFF, 0x1F, 0x00, 0x00, 0x80, 0x00, 0x00, 0x00, 0x80, 0x00])
    ),
    "rice stream missing": craft(meta(record(positions="rice", values="diffbits")), {"w:val": u8(bytes([0x08]))}),
    "offsets overlap": VALID[:8] + VALID[8:].replace(b'"data_offsets": [2, 4]', b'"data_offsets": [1, 3]'),
}


@pytest.mark.parametrize("name", list(CASES))
def test_malformed_file_is_a_format_error(name, tmp_path):
    blob = CASES[name]
    target = torch.arange(8, dtype=torch.int16).view(torch.bfloat16)
    before = target.clone()
    with pytest.raises(ds.DeltaFormatError):
        ds.load(blob).apply_(target)
    path = tmp_path / "bad.safetensors"
    path.write_bytes(blob)
    with pytest.raises(ds.DeltaFormatError, match="bad.safetensors"):
        ds.load(path)
    assert_bits_equal(target, before)


def _small_delta(codec: str = "varint") -> tuple[bytes, dict, dict]:
    rng = np.random.default_rng(3)
    prev = {
        "a": torch.from_numpy(rng.standard_normal((16, 8)).astype(np.float32)).bfloat16(),
        "b": torch.from_numpy(rng.standard_normal(5).astype(np.float32)),
        "c": torch.zeros(3, dtype=torch.uint8),
    }
    curr = {k: v.clone() for k, v in prev.items()}
    curr["a"].view(torch.int16).view(-1)[::5] += 1
    curr["a"].view(torch.int16).view(-1)[7] += 300  # an escaped difference
    curr["b"][2] = -0.0
    curr["c"][:] = torch.tensor([1, 2, 3], dtype=torch.uint8)  # all change: stored whole
    curr["a"].view(torch.int16).view(-1)[1::9] -= 2
    return ds.diff(prev, curr, step=2, base_step=1, codec=codec).to_bytes(), prev, curr


@pytest.mark.parametrize("check", ["load", "apply"])
@pytest.mark.parametrize("codec", ["varint", "compact"])
def test_every_truncation_is_rejected_and_target_untouched(codec, check):
    blob, prev, curr = _small_delta(codec)
    target = {k: v.clone() for k, v in prev.items()}
    for cut in range(len(blob)):
        with pytest.raises(ds.DeltaFormatError):
            ds.load(blob[:cut], check=check).apply_(target)
    for name in prev:
        assert_bits_equal(target[name], prev[name], name)
    ds.load(blob).apply_(target)
    for name in prev:
        assert_bits_equal(target[name], curr[name], name)


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from(["varint", "compact"]))
def test_corrupted_bytes_never_crash(data, codec):
    blob, prev, curr = _small_delta(codec)
    corrupted = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(blob) - 1))
        corrupted[at] = data.draw(st.integers(0, 255))
    target = {k: v.clone() for k, v in prev.items()}
    try:
        delta = ds.load(bytes(corrupted))
    except ds.DeltaFormatError:
        for name in prev:
            assert_bits_equal(target[name], prev[name], name)
        return
    # A corrupted value byte can still decode; applying must stay in bounds or be refused cleanly.
    try:
        delta.apply_(target)
    except ds.DeltaSyncError:
        for name in prev:
            assert_bits_equal(target[name], prev[name], name)


def _several_compact_tensors() -> tuple[bytes, dict, dict]:
    """A compact delta of five tensors with `rice` positions and `rans` or `diffbits` values (whose checks can wait
    for the apply), with base identities, and a tensor stored whole."""
    g = torch.Generator().manual_seed(5)
    prev = {f"t{i}": torch.randn(3000 + 517 * i, generator=g).bfloat16() for i in range(5)}
    prev["whole"] = torch.randn(4, generator=g).bfloat16()
    curr = {k: v.clone() for k, v in prev.items()}
    for i in range(5):
        bits = curr[f"t{i}"].view(torch.int16)
        picked = torch.randperm(bits.numel(), generator=g)[: bits.numel() // (20 + 10 * i)]
        bits[picked] += torch.randint(-2, 3, (picked.numel(),), generator=g, dtype=torch.int16) | 1
    curr["whole"] += 1
    return ds.diff(prev, curr, step=3, base_step=2).to_bytes(), prev, curr


def test_a_compact_delta_has_tensors_whose_check_waits_for_the_apply():
    blob, prev, curr = _several_compact_tensors()
    delta = ds.load(blob, check="apply")
    assert {(t.positions, t.values) for t in delta.tensors[:5]} <= {("rice", "rans"), ("rice", "diffbits")}
    for check_base in (False, True):
        target = {k: v.clone() for k, v in prev.items()}
        delta.apply_(target, check_base=check_base)
        for name in prev:
            assert_bits_equal(target[name], curr[name], name)
    with pytest.raises(ds.DeltaSyncError, match='check must be "load" or "apply"'):
        ds.load(blob, check="later")
    assert delta.to_bytes() == blob


def test_streams_left_to_the_apply_are_checked_before_they_are_written_again(tmp_path):
    """A delta loaded with check="apply" whose stream only a full check refuses: every reader of that stream
    refuses it (apply_, decoded, to_bytes, save), none writes a file that holds it."""
    blob, prev, _ = _several_compact_tensors()
    delta = ds.load(malformed_for_the_apply(blob), check="apply")
    target = {k: v.clone() for k, v in prev.items()}
    with pytest.raises(ds.DeltaFormatError, match="tensor"):
        delta.apply_(target)
    for name in prev:
        assert_bits_equal(target[name], prev[name], name)
    with pytest.raises(ds.DeltaFormatError, match="tensor"):
        for index in range(len(delta.tensors)):
            delta.decoded(index)
    with pytest.raises(ds.DeltaFormatError, match="tensor"):
        delta.to_bytes()
    with pytest.raises(ds.DeltaFormatError, match="tensor"):
        delta.save(tmp_path / "again.safetensors")
    assert not (tmp_path / "again.safetensors").exists()


@settings(max_examples=300, deadline=None)
@given(st.data(), st.booleans())
def test_checks_left_to_the_apply_end_as_checks_at_load(data, check_base):
    """Bytes flipped anywhere: a delta loaded with check="apply" is refused exactly when the same bytes loaded with
    every check up front are (at load or by apply_), with the target left as it was, every change taken back from
    every tensor written before the malformed stream was found; else both give the same state."""
    blob, prev, curr = _several_compact_tensors()
    corrupted = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 3))):
        corrupted[data.draw(st.integers(0, len(blob) - 1))] ^= data.draw(st.integers(1, 255))

    def outcome(check: str):
        target = {k: v.clone() for k, v in prev.items()}
        try:
            ds.load(bytes(corrupted), check=check).apply_(target, check_base=check_base)
        except ds.DeltaSyncError as error:
            for name in prev:
                assert_bits_equal(target[name], prev[name], name)
            return type(error)
        return {name: t.view(torch.int16).clone() if t.dtype == torch.bfloat16 else t for name, t in target.items()}

    eager, deferred = outcome("load"), outcome("apply")
    if isinstance(eager, dict) and isinstance(deferred, dict):
        for name in eager:
            assert torch.equal(eager[name], deferred[name]), name
    else:
        assert eager == deferred or (
            # A malformed stream found at load under one and at apply under the other: a format error either way,
            # unless the base check (which the apply makes before the stream is read to its end) spoke first.
            {eager, deferred} <= {ds.DeltaFormatError, ds.BaseMismatchError}
        ), (eager, deferred)


@pytest.mark.parametrize("name", ["__metadata__", "w:pos", "w:val"])
def test_reserved_tensor_names_are_refused_when_writing(name):
    """`__metadata__` is the safetensors header's own key and `:pos`/`:val` name delta streams: a tensor by that
    name used to make an unreadable file. diff, anchor and the mirror refuse it, naming the tensor."""
    prev = {name: np.zeros(4, np.float32)}
    curr = {name: np.ones(4, np.float32)}
    with pytest.raises(ds.DeltaSyncError, match=f'"{name}"'):
        ds.diff(prev, curr)
    with pytest.raises(ds.DeltaSyncError, match=f'"{name}"'):
        ds.anchor(curr)
    with pytest.raises(ds.DeltaSyncError, match=f'"{name}"'):
        ds.Mirror(prev, step=0).advance(curr, step=1)


def _with_header(blob: bytes, header: bytes) -> bytes:
    """``blob`` with its safetensors header replaced (the data section kept)."""
    (length,) = struct.unpack("<Q", blob[:8])
    return struct.pack("<Q", len(header)) + header + blob[8 + length :]


def test_what_readers_take_beyond_what_writers_write():
    """docs/format.md says readers take a header without the writers' padding, and check a base identity on a
    record stored whole (writers record none) where they check bases, anchors included."""
    state = {"w": np.arange(4, dtype=np.float32)}
    blob = ds.anchor(state).to_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = blob[8 : 8 + length]
    unpadded = header.rstrip(b" ")
    if len(unpadded) % 8 == 0:
        unpadded += b" "  # a length the writer never pads to
    loaded = ds.load(reseal(_with_header(blob, unpadded)))  # as a writer of that header would have sealed it
    target = {"w": np.zeros(4, dtype=np.float32)}
    loaded.apply_(target)
    assert np.array_equal(target["w"], state["w"])

    document = json.loads(header)
    records = json.loads(document["__metadata__"]["tensors"])
    records[0]["base"] = "0000000000000000"  # no state has this identity
    document["__metadata__"]["tensors"] = json.dumps(records)
    del document["__metadata__"]["file_xxh3"]  # a file without a checksum, as older writers wrote
    based = ds.load(_with_header(blob, json.dumps(document).encode()))
    target = {"w": np.zeros(4, dtype=np.float32)}
    with pytest.raises(ds.BaseMismatchError, match="'w'|\"w\""):
        based.apply_(target, check_base=True)
    assert not target["w"].any()
    based.apply_(target)  # without the check it applies to any base, as a whole tensor does
    assert np.array_equal(target["w"], state["w"])


@pytest.mark.parametrize("codec", ["varint", "compact", "context"])
def test_a_damaged_delta_file_is_refused_where_it_used_to_apply_other_weights(tmp_path, codec):
    """docs/format.md §2.1: random one-byte changes to a delta's data section. Without the checksum (the same file
    with its key taken out, as older writers wrote it) a fair share of them load and apply cleanly, to other weights
    than the writer's; with it, every one is refused by ds.load and by `deltasync apply`, which leaves its output
    unwritten."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(5)
    prev = {f"layer.{i}.w": torch.randn(64, 96, generator=g).to(torch.bfloat16) for i in range(3)}
    curr = {}
    for name, tensor in prev.items():
        changed = tensor.clone()
        changed.view(torch.int16)[torch.rand(tensor.shape, generator=g) < 0.02] += 1
        curr[name] = changed
    blob = ds.diff(prev, curr, codec=codec).to_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    unchecked = without_checksum(blob)
    assert reseal(unchecked) == unchecked  # no checksum left to make right

    def outcome(file: bytes) -> str:
        try:
            delta = ds.load(file)
        except ds.DeltaFormatError:
            return "refused"
        target = {name: t.clone() for name, t in prev.items()}
        try:
            delta.apply_(target)
        except ds.DeltaSyncError:
            return "refused"
        same = all(torch.equal(target[n].view(torch.int16), curr[n].view(torch.int16)) for n in curr)
        return "right" if same else "wrong"

    rng = np.random.default_rng(9)
    silent = 0
    for _ in range(60):
        at, flip = int(rng.integers(0, len(blob) - 8 - length)), int(rng.integers(1, 256))
        damaged, old = bytearray(blob), bytearray(unchecked)
        damaged[8 + length + at] ^= flip
        old[len(unchecked) - (len(blob) - 8 - length) + at] ^= flip
        assert outcome(bytes(damaged)) == "refused"
        silent += outcome(bytes(old)) == "wrong"
    assert silent >= 5, f"only {silent} of 60 changes went through unchecked files: the test lost its point"

    base = tmp_path / "base.safetensors"
    save_file(prev, str(base))
    damaged = bytearray(blob)
    damaged[-1] ^= 0x01
    (tmp_path / "d.safetensors").write_bytes(bytes(damaged))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltasync_rs.cli",
            "apply",
            str(base),
            str(tmp_path / "d.safetensors"),
            "-o",
            str(tmp_path / "out.safetensors"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0 and "damaged" in done.stderr, done.stderr
    assert not (tmp_path / "out.safetensors").exists()
