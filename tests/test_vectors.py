"""The format's test vectors (tests/vectors, specified in docs/format.md): today's writer must produce exactly these
bytes, and each file must decode to the expected tensors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

import deltasync_rs as ds
from tests.helpers import file_checksum
from tests.vectors import generate

VECTORS = Path(__file__).resolve().parent / "vectors"
INDEX = json.loads((VECTORS / "vectors.json").read_text())


def _int_keys(spec: dict) -> dict:
    """JSON turned the change positions into strings; turn them back."""
    for t in spec["tensors"].values():
        t["changes"] = {int(k): v for k, v in t["changes"].items()}
    return spec


@pytest.mark.parametrize("name", sorted(INDEX))
def test_vector_bytes_are_pinned(name):
    blob = (VECTORS / f"{name}.safetensors").read_bytes()
    assert hashlib.sha256(blob).hexdigest() == INDEX[name]["sha256"]
    delta, _, _ = generate.build(_int_keys(INDEX[name]["spec"]))
    assert delta.to_bytes() == blob, "the writer no longer produces the pinned bytes: see docs/format.md"


@pytest.mark.parametrize("name", sorted(INDEX))
def test_vector_decodes_to_expected(name):
    spec = _int_keys(INDEX[name]["spec"])
    _, base, expected = generate.build(spec)
    path = VECTORS / f"{name}.safetensors"
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["format"] == "deltasync"
    delta = ds.load(path)
    assert delta.step == spec["step"]
    assert delta.aliases == spec.get("aliases", {})
    assert delta.is_anchor == bool(spec.get("anchor"))
    delta.apply_(base)
    for tensor in expected:
        width = expected[tensor].dtype.itemsize
        assert np.array_equal(base[tensor].view(f"u{width}"), expected[tensor].view(f"u{width}")), tensor


def test_worked_example_in_format_doc():
    """docs/format.md walks through bf16_diff byte by byte; keep the two in step."""
    blob = (VECTORS / "bf16_diff.safetensors").read_bytes()
    header_len = int.from_bytes(blob[:8], "little")
    data = blob[8 + header_len :]
    assert data.hex(" ") == "00 04 09 01 ff 80 2c 01"
    doc = (Path(__file__).resolve().parents[1] / "docs" / "format.md").read_text()
    assert "00 04 09" in doc and "01 ff 80 2c 01" in doc
    assert blob[:8].hex(" ") in doc and f"({header_len}: {len(blob[8 : 8 + header_len].rstrip())} bytes of JSON" in doc
    header = blob[8 : 8 + header_len].decode().rstrip()
    # The JSON as the doc prints it: one line per top-level entry, the metadata's tensor list on a line of its own.
    lines = (
        header.replace(',"tensors"', ',\n "tensors"')
        .replace(',"w:pos"', ',\n "w:pos"')
        .replace(',"w:val"', ',\n "w:val"')
    )
    assert lines in doc
    base = ds.load(blob)._raw.base_identity(0)
    assert f'\\"base\\":\\"{base}\\"' in header and f"base identity `{base}`" in doc


def test_compact_example_in_format_doc():
    """docs/format.md §8.1 walks through bf16_compact; keep the two in step."""
    blob = (VECTORS / "bf16_compact.safetensors").read_bytes()
    header_len = int.from_bytes(blob[:8], "little")
    data = blob[8 + header_len :]
    assert data.hex(" ") == "02 ae 59 d9 e3 00 48 a4 03 b2 04 00 01 80 00 00 01 00"
    doc = (Path(__file__).resolve().parents[1] / "docs" / "format.md").read_text()
    assert "02 ae 59 d9 e3 00" in doc and "48 a4 03 b2 04 00" in doc
    codecs = {t.name: (t.positions, t.values) for t in ds.load(blob).tensors}
    assert codecs == {"w": ("rice", "diffbits"), "f": ("varint", "diff")}


def test_packed_example_in_format_doc():
    """docs/format.md §8.2 walks through bf16_packed; keep the two in step."""
    blob = (VECTORS / "bf16_packed.safetensors").read_bytes()
    header_len = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + header_len])
    data = blob[8 + header_len :]
    doc = (Path(__file__).resolve().parents[1] / "docs" / "format.md").read_text()
    section = doc[doc.index("### 8.2") : doc.index("### 8.3")]
    printed = json.loads(section[section.index("```json") + 7 : section.index("```\n\nand the data")])
    assert printed == header and header["__metadata__"]["format_version"] == "2"
    records = slice(*header["__deltasync_records__"]["data_offsets"])
    streams = slice(*header["__deltasync_streams__"]["data_offsets"])
    listing = section[section.index("```\n08") + 4 :]
    listing = listing[: listing.index("```")]
    # Each line of the listing starts with its bytes in hex, then two spaces and what they are.
    dumped = " ".join(line.strip().split("  ")[0] for line in listing.splitlines())
    assert dumped == data[records].hex(" ")
    assert data[: header["layer.1.n"]["data_offsets"][1]].hex(" ") == "ac 40 80 3f" and "`ac 40 80 3f`" in section
    assert data[streams].hex(" ") == "02 ae 59 d9 e3 00 48 a4 03 b2 04 00 01 80 00 00 01 00"
    assert f"The file is {len(blob)} bytes" in section
    delta = ds.load(blob)
    assert delta._raw.packed
    assert [(t.name, t.changed) for t in delta.tensors] == [
        ("layer.0.w", 8),
        ("layer.0.b", 1),
        ("layer.1.n", 1),
        ("layer.1.s", 0),
    ]
    assert [delta.base_identity(i) for i in range(4)] == [
        "8d4e7e6376420f99",
        "8a052c13562c91b9",
        None,
        "577c181a05f23882",
    ]
    named = ds.load(blob)
    named._raw.packed = False
    assert f"named layout takes {len(named.to_bytes()):,}" in section


def test_rans_example_in_format_doc():
    """docs/format.md §8.3 walks through bf16_rans's value stream; keep the two in step."""
    blob = (VECTORS / "bf16_rans.safetensors").read_bytes()
    header_len = int.from_bytes(blob[:8], "little")
    data = blob[8 + header_len :]
    values = "04 20 c0 02 e0 1c 00 40 0d 80 f7 20 a3 e7 ae 05 7e d1 c5 8b 98 a2 a0 00"
    assert data.hex(" ").endswith(values) and len(data) == 33 + 24
    doc = (Path(__file__).resolve().parents[1] / "docs" / "format.md").read_text()
    for line in ("20 c0 02 e0 1c 00 40", "0d 80 f7 20", "a3 e7 ae 05", "7e d1 c5 8b 98 a2 a0 00"):
        assert line in doc
    codecs = {t.name: (t.positions, t.values) for t in ds.load(blob).tensors}
    assert codecs == {"w": ("rice", "rans")}


def test_context_example_in_format_doc():
    """docs/format.md §8.4 walks through bf16_context's position stream; keep the two in step."""
    blob = (VECTORS / "bf16_context.safetensors").read_bytes()
    header_len = int.from_bytes(blob[:8], "little")
    data = blob[8 + header_len :]
    positions = "7f 01 00 00 00 00 00 00 00 06 00 00 00 00 00 00 00 05 06 f0 22"
    assert data.hex(" ").startswith(positions) and len(data) == 21 + 13
    doc = (Path(__file__).resolve().parents[1] / "docs" / "format.md").read_text()
    for line in ("01 00 00 00 00 00 00 00 06 00 00 00 00 00 00 00", "06 f0 22", "21 bytes against 26 in `rice`"):
        assert line in doc
    codecs = {t.name: (t.positions, t.values) for t in ds.load(blob).tensors}
    assert codecs == {"w": ("context", "rans")}
    _, base, expected = generate.build(_int_keys(INDEX["bf16_context"]["spec"]))
    compact = ds.diff(base, expected, codec="compact")
    compact._raw.packed = False
    named = compact.to_bytes()
    header = json.loads(named[8 : 8 + int.from_bytes(named[:8], "little")])
    assert header["w:pos"]["shape"] == [26], "the rice stream the example compares with"


def test_context_classes_example_in_format_doc():
    """docs/format.md §8.5 shows bf16_context_classes's value stream header; keep the two in step."""
    blob = (VECTORS / "bf16_context_classes.safetensors").read_bytes()
    header_len = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + header_len])
    data = blob[8 + header_len :]
    start, end = header["w:val"]["data_offsets"]
    values = data[start:end]
    assert header["w:pos"]["shape"] == [105] and len(values) == 199
    assert values[:9].hex(" ") == "02 01 80 02 94 01 80 02 2a"
    assert values[9:13].hex(" ") == "0c 00 d0 02" and values[9 + 148 :][:6].hex(" ") == "02 00 d0 0a b0 15"
    doc = (Path(__file__).resolve().parents[1] / "docs" / "format.md").read_text()
    for line in ("80 02 94 01         group 0", "80 02 2a            group 1", "02 00 d0 0a b0 15   group 1's"):
        assert line in doc
    assert {t.name: (t.positions, t.values) for t in ds.load(blob).tensors} == {"w": ("context", "rans_classes")}
    _, base, expected = generate.build(_int_keys(INDEX["bf16_context_classes"]["spec"]))
    compact = ds.diff(base, expected, codec="compact")
    compact._raw.packed = False
    named = compact.to_bytes()
    header = json.loads(named[8 : 8 + int.from_bytes(named[:8], "little")])
    assert (header["w:pos"]["shape"], header["w:val"]["shape"]) == ([129], [219]), "the sizes the example compares"


@pytest.mark.parametrize("name", sorted(INDEX))
def test_vector_checksums_follow_the_spec(name):
    """docs/format.md §2.1, computed here from the spec with the xxhash package: every vector (written in memory,
    the anchor too) carries the checksum of its bytes, and a reader refuses it with any byte of its data changed."""
    blob = (VECTORS / f"{name}.safetensors").read_bytes()
    assert (
        file_checksum(blob) == json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])["__metadata__"]["file_xxh3"]
    )
    for at in range(8 + int.from_bytes(blob[:8], "little"), len(blob)):  # every byte of the data section
        damaged = bytearray(blob)
        damaged[at] ^= 0x10
        with pytest.raises(ds.DeltaFormatError, match="damaged"):
            ds.load(bytes(damaged))
