"""Base identities through the bindings (docs/format.md §3): the record field, `RawDelta.check_base` and
`_core.base_identity`, checked against the pure-Python definition."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

import deltasync_rs as ds
from deltasync_rs import _core

BLOCK = 1 << 18


def reference(data: bytes) -> str:
    """The definition of docs/format.md §3, as written there."""
    hashes = b"".join(
        xxhash.xxh3_64_intdigest(data[i : i + BLOCK]).to_bytes(8, "little") for i in range(0, len(data), BLOCK)
    )
    return f"{xxhash.xxh3_64_intdigest(hashes):016x}"


@pytest.mark.parametrize("size", [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
def test_identity_matches_the_definition(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    assert _core.base_identity(data) == reference(data.tobytes())
    assert _core.base_identity(data.tobytes()) == reference(data.tobytes())


def test_identity_of_a_torch_tensor():
    torch = pytest.importorskip("torch")
    t = torch.arange(100_000, dtype=torch.float32).to(torch.bfloat16)
    assert _core.base_identity(t) == reference(t.view(torch.int16).numpy().tobytes())
    with pytest.raises(ds.DeltaSyncError, match="not contiguous"):
        _core.base_identity(t.reshape(1000, 100).t())


def _bytes(a: np.ndarray) -> np.ndarray:
    """The bytes of an array, as the bindings take them (`Delta.apply_` passes the same views)."""
    return a.reshape(-1).view(np.uint8)


def _delta(values: str = "diff", codec: str = "varint"):
    old = {"w": np.arange(300_000, dtype=np.float32), "b": np.zeros(4, dtype=np.float32)}
    new = {name: a.copy() for name, a in old.items()}
    new["w"][::1000] += 1
    new["b"][:] = 1  # every element: stored whole
    return old, new, ds.diff(old, new, values=values, codec=codec)._raw


@pytest.mark.parametrize(("values", "codec"), [("diff", "varint"), ("abs", "varint"), ("diff", "compact")])
def test_check_base_refuses_a_second_application(values, codec):
    old, new, raw = _delta(values, codec)
    names = [t[0] for t in raw.tensors()]
    w, b = names.index("w"), names.index("b")
    assert raw.base_identity(w) == reference(old["w"].tobytes())
    assert raw.base_identity(b) is None, "a tensor stored whole applies to any base"
    raw.check_base([(w, _bytes(old["w"])), (b, _bytes(old["b"]))])
    with pytest.raises(ds.BaseMismatchError, match=r'tensor "w".*applied already'):
        raw.check_base([(b, _bytes(new["b"])), (w, _bytes(new["w"]))])
    flipped = _bytes(old["w"]).copy()
    flipped[12345] ^= 1
    with pytest.raises(ds.BaseMismatchError, match="base identity"):
        raw.check_base([(w, flipped)])
    with pytest.raises(ds.BaseMismatchError):
        raw.check_base([(w, _bytes(old["w"])[:-4])])
    with pytest.raises(ds.DeltaSyncError, match="no tensor number"):
        raw.check_base([(len(names), _bytes(old["w"]))])


def test_the_field_survives_a_file_and_old_files_still_load():
    old, _, raw = _delta()
    loaded = _core.RawDelta.from_bytes(raw.to_bytes())
    assert [loaded.base_identity(i) for i in range(len(loaded))] == [raw.base_identity(i) for i in range(len(raw))]
    assert len(loaded.tensors()[0]) == 7, "tensors() tuples keep their seven fields"


def test_the_mirror_records_the_base_of_whole_tensors_only():
    old = np.arange(200_000, dtype=np.uint16)
    new = old.copy()
    new[::97] += 1
    mirror = old.copy()
    builder = _core.MirrorDiff("diff")
    builder.begin("w", "U16", [200_000])
    for start in range(0, 200_000, 33_333):
        end = min(start + 33_333, 200_000)
        builder.update(_bytes(mirror[start:end]), _bytes(new[start:end]), start)
    builder.finish(_bytes(mirror))
    # A shard: elements [100, 200) of a larger tensor.
    part = old[:100].copy()
    builder.begin("s", "U16", [1000])
    builder.update(_bytes(part), _bytes(new[:100]), 100)
    builder.finish(None)
    raw = builder.take()
    assert raw.base_identity(0) == reference(old.tobytes())
    assert raw.base_identity(1) is None
    raw.check_base([(0, _bytes(old))])
    with pytest.raises(ds.BaseMismatchError):
        raw.check_base([(0, _bytes(mirror))])


@pytest.mark.parametrize("bad", ['"0123456789ABCDEF"', '"0123456789abcde"', '"0123456789abcdeg"', "5", "null"])
def test_a_malformed_base_is_a_format_error(bad):
    _, _, raw = _delta()
    blob = raw.to_bytes()
    header_len = int.from_bytes(blob[:8], "little")
    header = blob[8 : 8 + header_len].decode().rstrip()
    identity = raw.base_identity([t[0] for t in raw.tensors()].index("w"))
    field = f'\\"base\\":\\"{identity}\\"'
    assert field in header
    broken = header.replace(field, '\\"base\\":' + bad.replace('"', '\\"')).encode()
    broken += b" " * (-len(broken) % 8)
    with pytest.raises(ds.DeltaFormatError):
        ds.load(len(broken).to_bytes(8, "little") + broken + blob[8 + header_len :])


def test_range_identities_are_each_ranges_base_identity():
    """range_identities hashes many byte ranges in one call (publish_shards' check of FSDP2 proofs): each is the
    base identity of that range's bytes; a range past its buffer is refused, naming it."""
    from deltasync_rs._core import base_identity, range_identities

    torch = pytest.importorskip("torch")
    data = np.arange(700_000, dtype=np.uint32).view(np.uint8)
    tensor = torch.arange(1000, dtype=torch.int16)
    ranges = [(data, 0, 0), (data, 3, 5), (data, 1, 600_000), (data, 0, data.size), (tensor, 10, 1990)]
    want = [base_identity(data[:0]), base_identity(data[3:8]), base_identity(data[1:600_001]), base_identity(data)]
    want.append(base_identity(tensor.view(torch.uint8)[10:2000].clone()))
    assert range_identities(ranges) == want
    assert range_identities([]) == []
    with pytest.raises(ds.DeltaSyncError, match="range 1 of range_identities: bytes 10..2001 of a buffer of 2000"):
        range_identities([(tensor, 0, 1), (tensor, 10, 1991)])
