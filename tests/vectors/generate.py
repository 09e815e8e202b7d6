"""Writes the format test vectors in this folder from the small inputs below.

Run `python tests/vectors/generate.py` only when the format changes on purpose (and change docs/format.md in the
same commit). tests/test_vectors.py checks that today's writer still produces these exact bytes and that the
files decode to the expected tensors.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

import deltasync_rs as ds

HERE = Path(__file__).resolve().parent
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
DTYPES = {
    "BF16": ("bfloat16", 2),
    "F32": ("float32", 4),
    "U8": ("uint8", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "I64": ("int64", 8),
    "F16": ("float16", 2),
}


def with_changes(base: list[int], changes: dict[int, int], width: int) -> list[int]:
    """`base` with `changes` (position -> signed step of the bit pattern), wrapping at the element width."""
    mask = (1 << (8 * width)) - 1
    out = list(base)
    for position, step in changes.items():
        out[position] = (out[position] + step) & mask
    return out


def vectors() -> dict[str, dict]:
    return {
        "bf16_diff": {
            "values": "diff",
            "step": 2,
            "base_step": 1,
            "metadata": {},
            "tensors": {
                "w": {
                    "dtype": "BF16",
                    "shape": [4, 4],
                    "base": [0x3F80 + i for i in range(16)],
                    "changes": {0: 1, 5: -1, 15: 300},
                }
            },
        },
        "f32_abs": {
            "values": "abs",
            "step": None,
            "base_step": None,
            "metadata": {},
            "tensors": {
                "bias": {
                    "dtype": "F32",
                    "shape": [10],
                    "base": [0x3F800000] * 10,
                    "changes": {3: 0x100, 9: -0x3F800000},
                }
            },
        },
        "mixed": {
            "values": "diff",
            "step": 7,
            "base_step": 6,
            "metadata": {"run": "vectors"},
            "tensors": {
                "emb": {"dtype": "BF16", "shape": [300], "base": [0x3C00] * 300, "changes": {2: 1, 290: -2}},
                "small": {"dtype": "U8", "shape": [4], "base": [1, 2, 3, 4], "changes": {0: 1, 1: 1, 2: 1, 3: 1}},
                "scale": {"dtype": "F8_E4M3", "shape": [3], "base": [0x38, 0x40, 0x48], "changes": {}},
                "count": {"dtype": "I64", "shape": [2], "base": [5, 1 << 40], "changes": {1: 1 << 33}},
            },
        },
        # The compact codec in the named layout of version 1, as writers before the packed layout wrote it.
        "bf16_compact": {
            "values": "diff",
            "codec": "compact",
            "packed": False,
            "step": 3,
            "base_step": 2,
            "metadata": {},
            "tensors": {
                "w": {
                    "dtype": "BF16",
                    "shape": [8, 8],
                    "base": [0x3F80 + i for i in range(64)],
                    "changes": {3: 1, 9: -1, 20: 1, 26: 2, 33: -1, 41: 1, 50: -2, 63: 300},
                },
                "f": {"dtype": "F32", "shape": [4], "base": [0x3F800000] * 4, "changes": {1: 0x10000}},
            },
        },
        "bf16_packed": {
            "values": "diff",
            "codec": "compact",
            "step": 4,
            "base_step": 3,
            "metadata": {},
            "tensors": {
                "layer.0.w": {
                    "dtype": "BF16",
                    "shape": [8, 8],
                    "base": [0x3F80 + i for i in range(64)],
                    "changes": {3: 1, 9: -1, 20: 1, 26: 2, 33: -1, 41: 1, 50: -2, 63: 300},
                },
                "layer.0.b": {"dtype": "F32", "shape": [4], "base": [0x3F800000] * 4, "changes": {1: 0x10000}},
                "layer.1.n": {"dtype": "BF16", "shape": [2], "base": [0x3F80, 0x3F80], "changes": {0: 300}},
                "layer.1.s": {"dtype": "F32", "shape": [2], "base": [0x3F800000] * 2, "changes": {}},
            },
        },
        # The rans value codec (§6.2), in the named layout so that its worked example shows one stream alone.
        "bf16_rans": {
            "values": "diff",
            "codec": "compact",
            "packed": False,
            "step": 4,
            "base_step": 3,
            "metadata": {},
            "tensors": {
                "w": {
                    "dtype": "BF16",
                    "shape": [16, 16],
                    "base": [0x3F80 + i for i in range(256)],
                    # Every second element: a sign flip, then mostly +1, ten -1 and two +2.
                    "changes": {
                        2 * i: 0x8000 if i == 0 else -1 if i % 13 == 5 else 2 if i in (20, 40) else 1
                        for i in range(128)
                    },
                }
            },
        },
        # The context position codec (§5.2), in the named layout so that its worked example shows one stream alone:
        # every fourth element is small (class 0) and changes, and three of the others (class 8) change.
        "bf16_context": {
            "values": "diff",
            "codec": "context",
            "packed": False,
            "step": 5,
            "base_step": 4,
            "metadata": {},
            "tensors": {
                "w": {
                    "dtype": "BF16",
                    "shape": [16, 16],
                    "base": [0x3A80 if i % 4 == 0 else 0x3F80 for i in range(256)],
                    "changes": {**{i: 1 for i in range(0, 256, 4)}, 5: -1, 6: 1, 201: 1},
                }
            },
        },
        # The rans_classes value codec (§6.3), in the named layout: every fourth element is small (class 0) and
        # changes by one of ±1 .. ±6, while every third of the others (class 8) changes by ±1, so the two classes'
        # values are coded with a table each.
        "bf16_context_classes": {
            "values": "diff",
            "codec": "context",
            "packed": False,
            "step": 6,
            "base_step": 5,
            "metadata": {},
            "tensors": {
                "w": {
                    "dtype": "BF16",
                    "shape": [32, 32],
                    "base": [0x3A80 if i % 4 == 0 else 0x3F80 for i in range(1024)],
                    "changes": {
                        **{i: (1, -2, 3, -4, 5, -6, 2, -1, 4, -3, 6, -5)[(i // 4) % 12] for i in range(0, 1024, 4)},
                        **{i: 1 if i % 2 else -1 for i in range(1024) if i % 4 and i % 3 == 1},
                    },
                }
            },
        },
        # Tied names (§2.2): the trainer's lm_head is its embedding, written once under the embedding's name.
        "tied": {
            "values": "diff",
            "step": 3,
            "base_step": 2,
            "metadata": {},
            "aliases": {"lm_head.weight": "embed.weight"},
            "tensors": {
                "embed.weight": {"dtype": "BF16", "shape": [2, 3], "base": [0x3F80] * 6, "changes": {1: 1, 4: -1}},
            },
        },
        "anchor": {
            "anchor": True,
            "step": 10,
            "metadata": {},
            "tensors": {
                "a": {"dtype": "F16", "shape": [2, 2], "base": [0, 0, 0, 0], "changes": {0: 0x3C00, 3: 0x4000}},
                "b": {"dtype": "U8", "shape": [3], "base": [0, 0, 0], "changes": {1: 9}},
            },
        },
    }


def to_array(bits: list[int], dtype: str, shape: list[int]):
    import ml_dtypes  # noqa: F401  (registers bfloat16 and float8 with numpy)

    name, width = DTYPES[dtype]
    return np.array(bits, dtype=UINT[width]).view(np.dtype(name)).reshape(shape)


def build(spec: dict) -> tuple[ds.Delta, dict, dict]:
    base, expected = {}, {}
    for name, t in spec["tensors"].items():
        width = DTYPES[t["dtype"]][1]
        base[name] = to_array(t["base"], t["dtype"], t["shape"])
        expected[name] = to_array(with_changes(t["base"], t["changes"], width), t["dtype"], t["shape"])
    if spec.get("anchor"):
        delta = ds.anchor(expected, step=spec["step"], metadata=spec["metadata"])
    else:
        delta = ds.diff(
            base,
            expected,
            values=spec["values"],
            codec=spec.get("codec", "varint"),
            step=spec["step"],
            base_step=spec["base_step"],
            metadata=spec["metadata"],
        )
        if "packed" in spec:
            delta._raw.packed = spec["packed"]
    if "aliases" in spec:
        delta.aliases = spec["aliases"]
    return delta, base, expected


def main() -> None:
    index = {}
    for name, spec in vectors().items():
        delta, _, _ = build(spec)
        blob = delta.to_bytes()
        (HERE / f"{name}.safetensors").write_bytes(blob)
        index[name] = {"spec": spec, "sha256": hashlib.sha256(blob).hexdigest(), "size": len(blob)}
    (HERE / "vectors.json").write_text(json.dumps(index, indent=1) + "\n")


if __name__ == "__main__":
    main()
