"""Adapters between torch tensors / numpy arrays and the raw little-endian bytes the Rust core reads and writes."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._core import BaseMismatchError, DeltaSyncError

# numpy dtypes by safetensors name; bf16 and fp8 come from ml_dtypes and are matched by name.
_NUMPY_NAMES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "int64": "I64",
    "uint64": "U64",
    "float64": "F64",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}

_TORCH_NAMES = {
    "torch.bool": "BOOL",
    "torch.uint8": "U8",
    "torch.int8": "I8",
    "torch.int16": "I16",
    "torch.uint16": "U16",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
    "torch.int32": "I32",
    "torch.uint32": "U32",
    "torch.float32": "F32",
    "torch.int64": "I64",
    "torch.uint64": "U64",
    "torch.float64": "F64",
    "torch.float8_e4m3fn": "F8_E4M3",
    "torch.float8_e5m2": "F8_E5M2",
}

WIDTHS = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


_TENSOR_TYPE: list[type] = []  # torch.Tensor, once torch has been imported by anyone


def is_torch(x: Any) -> bool:
    if not _TENSOR_TYPE:
        torch = sys.modules.get("torch")
        if torch is None:
            return False  # never imported, so x cannot be a tensor
        _TENSOR_TYPE.append(torch.Tensor)
    return isinstance(x, _TENSOR_TYPE[0])


def address(x: Any) -> int:
    """The address of the first element of a torch tensor or numpy array (0 for anything else)."""
    if is_torch(x):
        return int(x.data_ptr())
    if hasattr(x, "__array_interface__"):
        return int(x.__array_interface__["data"][0])
    return 0


def is_array(x: Any) -> bool:
    return is_torch(x) or isinstance(x, np.ndarray)


_TORCH_DTYPES: dict[Any, str] = {}  # torch dtype object -> safetensors name, filled on first use


def _torch_dtype_name(dtype: Any) -> str | None:
    name = _TORCH_DTYPES.get(dtype)
    if name is None:
        name = _TORCH_NAMES.get(str(dtype))
        if name is not None:
            _TORCH_DTYPES[dtype] = name
    return name


def describe(x: Any, name: str) -> tuple[str, tuple[int, ...]]:
    """The safetensors dtype name and the shape of a tensor or array."""
    if is_torch(x):
        dtype = _torch_dtype_name(x.dtype)
        shape = tuple(x.shape)  # torch.Size holds Python ints
        if dtype is None:
            raise DeltaSyncError(f"tensor {name!r}: dtype {x.dtype} is not supported")
        if x.layout is not _torch().strided:
            raise DeltaSyncError(f"tensor {name!r}: {x.layout} tensors are not supported; pass x.to_dense()")
        if x.is_meta:
            raise DeltaSyncError(f"tensor {name!r}: a meta tensor has no data")
        return dtype, shape
    if isinstance(x, np.ndarray):
        if x.dtype.byteorder == ">" or (x.dtype.byteorder == "=" and sys.byteorder == "big"):
            raise DeltaSyncError(f"tensor {name!r}: big-endian arrays are not supported; use .astype('<...')")
        dtype = _NUMPY_NAMES.get(x.dtype.name)
        shape = x.shape
    else:
        raise DeltaSyncError(f"tensor {name!r}: expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")
    if dtype is None:
        raise DeltaSyncError(f"tensor {name!r}: dtype {x.dtype} is not supported")
    return dtype, tuple(int(d) for d in shape)


def check_state(state: Any, role: str) -> Mapping[str, Any]:
    """``state`` as a mapping of tensor names to tensors, or DeltaSyncError: it is no mapping, or a name is no
    string."""
    if not isinstance(state, Mapping):
        raise DeltaSyncError(
            f"{role} must be a mapping of tensor names to tensors or arrays, not {type(state).__name__}"
        )
    for name in state:
        if not isinstance(name, str):
            raise DeltaSyncError(f"{role}: tensor names must be strings, not {type(name).__name__} ({name!r})")
    return state


def readable_in_place(t: Any) -> bool:
    """Whether the Rust core can read (and write) a torch tensor's own memory: on the CPU, contiguous, and with
    no lazy negation or conjugation bit."""
    return t.is_cpu and t.is_contiguous() and not t.is_neg() and not t.is_conj()


def host_bytes(x: Any) -> tuple[Any, int]:
    """The tensor's row-major bytes on the host, as something the Rust core reads in place (a CPU contiguous torch
    tensor, read through its ``data_ptr``, or a C-contiguous uint8 numpy view), and how many bytes were copied to
    make it (0 when the tensor's own memory is used)."""
    if is_torch(x):
        if readable_in_place(x):
            return x, 0
        t = x.detach().to("cpu").contiguous().resolve_neg().resolve_conj()
        return t, t.numel() * t.element_size()
    flat = np.ascontiguousarray(x)
    copied = 0 if flat is x or np.shares_memory(flat, x) else flat.nbytes
    return flat.reshape(-1).view(np.uint8), copied


def flat_host_bytes(x: Any) -> Any:
    """``host_bytes(x)`` as one flat run of bytes (a uint8 torch tensor or numpy array), to be sliced by byte
    offsets."""
    data, _ = host_bytes(x)
    return data.reshape(-1).view(_torch().uint8) if is_torch(data) else data


def writable_bytes(x: Any) -> Any | None:
    """Something the Rust core may write into (the tensor itself, or a uint8 numpy view), or None when the target
    needs the tensor path."""
    if is_torch(x):
        return x if readable_in_place(x) else None
    if not x.flags.c_contiguous:
        return None
    if not x.flags.writeable:
        raise DeltaSyncError("target array is read-only")
    return x.reshape(-1).view(np.uint8)


def torch_dtype(name: str):
    """The torch dtype of a safetensors dtype name."""
    by_name = {v: k for k, v in _TORCH_NAMES.items()}
    if name not in by_name:
        raise DeltaSyncError(f"dtype {name} has no torch equivalent")
    return getattr(_torch(), by_name[name].removeprefix("torch."))


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype name; bf16 and fp8 need the ml_dtypes package."""
    by_name = {v: k for k, v in _NUMPY_NAMES.items()}
    if name not in by_name:
        raise DeltaSyncError(f"dtype {name} has no numpy equivalent")
    if by_name[name] in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        try:
            import ml_dtypes
        except ImportError:
            raise DeltaSyncError(
                f"dtype {name} needs the ml_dtypes package with numpy: pip install ml_dtypes "
                "(or 'deltasync-rs[numpy-bf16]')"
            ) from None
        return np.dtype(getattr(ml_dtypes, by_name[name]))
    return np.dtype(by_name[name])


def _torch():
    import torch

    return torch


def check_same_kind(prev: Any, curr: Any, name: str) -> tuple[str, tuple[int, ...]]:
    prev_dtype, prev_shape = describe(prev, name)
    curr_dtype, curr_shape = describe(curr, name)
    if (prev_dtype, prev_shape) != (curr_dtype, curr_shape):
        raise BaseMismatchError(
            f"tensor {name!r}: previous is {prev_dtype}{list(prev_shape)} but current is {curr_dtype}{list(curr_shape)}"
        )
    return curr_dtype, curr_shape
