"""Base identities (docs/format.md §3) and state-digest hashes (§10) of tensors on any torch device, computed there
by torch integer ops, so that checking a CUDA target's base copies no weights to the host: only each 256 KiB block's
8-byte hash and the bytes after the last whole block (shorter than a block) cross, and the core combines them
(``base_identity_from_blocks``). A state-digest hash is one XXH3-128 over the tensor's dtype, shape and bytes: its
1,024-byte rounds are summed on the device the same way, and only the sums (1/16 of the bytes) and a few KiB of
bytes at the ends cross; the core chains the rounds (``tensor_hash_from_rounds``).

Each whole block's hash is XXH3-64 (seed 0, the default secret) of its 262,144 bytes, by the algorithm of the
XXH3 specification for inputs over 240 bytes: eight 64-bit accumulators take 16 stripes of 64 bytes per 1,024-byte
round, then are scrambled; the round's sums do not depend on the accumulators, so every round of every block is
summed at once and only the 256 scrambles run one after another, over all blocks together. int64 arithmetic wraps
as unsigned arithmetic does; right shifts are masked to be logical. The 64 x 64 -> 128-bit multiplies of the final
merge run on the host in Python integers (four per block)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

BLOCK_BYTES = 1 << 18
_ROUND = 1024  # bytes per round: 16 stripes of 64
_STRIPES = 16
_ROUNDS = BLOCK_BYTES // _ROUND
_GROUP_BLOCKS = 128  # 32 MiB of blocks summed at a time
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221"
    "b8084674f743248ee03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb"
    "170ddd51b7f0da49d316552629d4689e2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"
)
_MASK64 = (1 << 64) - 1
_P32_1, _P32_2, _P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_P64_1, _P64_2, _P64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
_P64_4, _P64_5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
_INIT = (_P32_3, _P64_1, _P64_2, _P64_3, _P64_4, _P32_2, _P64_5, _P32_1)


def _word(offset: int) -> int:
    return int.from_bytes(_SECRET[offset : offset + 8], "little")


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def _lanes(offset: int) -> list[int]:
    """Eight secret words from ``offset``, as int64 values."""
    return [_signed(_word(offset + 8 * lane)) for lane in range(8)]


def _avalanche(h: int) -> int:
    h ^= h >> 37
    h = (h * 0x165667919E3779F9) & _MASK64
    return h ^ (h >> 32)


def _merge(acc: list[int], length: int) -> int:
    """XXH3's final merge of the accumulators (unsigned), for an input of ``length`` bytes."""
    result = (length * _P64_1) & _MASK64
    for i in range(4):
        product = (acc[2 * i] ^ _word(11 + 16 * i)) * (acc[2 * i + 1] ^ _word(11 + 16 * i + 8))
        result = (result + ((product & _MASK64) ^ (product >> 64))) & _MASK64
    return _avalanche(result)


#: Tensors smaller than this are copied to the host and hashed by the core instead: the device's 255 scramble
#: rounds cost a few kernel launches each whatever the size (about a thousand in all, shared by every tensor of one
#: call), more than copying a few MiB. A guess from launch counts; not timed on a GPU here.
HOST_BELOW = 16 << 20
#: CPU tensors are hashed by the core; True sends them down the device path too (the tests' way to run it here).
TORCH_ON_CPU = False


def _products(mixed: Any, low: Any) -> Any:
    """low32(x) * high32(x) of each int64 lane."""
    return (mixed & low) * ((mixed >> 32) & low)


def _sums(words: Any, keys: Any, low: Any) -> Any:
    """What each round of int64 ``words`` ``[..., 16, 8]`` adds to each accumulator lane: for each stripe,
    acc[lane] += low32(word ^ key) * high32(word ^ key), and acc[lane ^ 1] += the word."""
    return _products(words ^ keys, low).sum(dim=-2) + words.sum(dim=-2)[..., [1, 0, 3, 2, 5, 4, 7, 6]]


def _round_sums(words: Any, keys: Any, low: Any) -> Any:
    """``[blocks, rounds, 8]``: what each round adds to each accumulator lane (the rounds' sums do not depend on
    the accumulators), for blocks of int64 ``words`` ``[blocks, rounds, 16, 8]``, a group of blocks at a time."""
    import torch

    blocks = words.shape[0]
    sums = torch.empty(blocks, _ROUNDS, 8, dtype=torch.int64, device=words.device)
    for start in range(0, blocks, _GROUP_BLOCKS):
        sums[start : start + _GROUP_BLOCKS] = _sums(words[start : start + _GROUP_BLOCKS], keys, low)
    # The last round takes stripes 0-14 with their keys, then the block's last 64 bytes (its 16th stripe) with the
    # secret from byte 121 instead of the 16th stripe's key, and no scramble after it.
    last = words[:, -1, -1]
    last_key = torch.tensor(_lanes(192 - 64 - 7), dtype=torch.int64, device=words.device)
    sums[:, -1] += _products(last ^ last_key, low) - _products(last ^ keys[-1], low)
    return sums


def _hash_rounds(sums: Any) -> list[int]:
    """XXH3-64 of whole blocks from their round sums ``[blocks, rounds, 8]``: the 255 scrambles in order, all blocks
    side by side, then the merge on the host."""
    import torch

    device, blocks = sums.device, sums.shape[0]
    scramble_key = torch.tensor(_lanes(192 - 64), dtype=torch.int64, device=device)
    shift_mask = torch.tensor((1 << 17) - 1, dtype=torch.int64, device=device)
    acc = torch.tensor([_signed(v) for v in _INIT], dtype=torch.int64, device=device).expand(blocks, 8).clone()
    for round_ in range(_ROUNDS - 1):
        acc += sums[:, round_]
        acc ^= (acc >> 47) & shift_mask
        acc ^= scramble_key
        acc *= _P32_1
    acc += sums[:, -1]
    return [_merge([v & _MASK64 for v in row], BLOCK_BYTES) for row in acc.cpu().tolist()]


def _flat_bytes(tensor: Any) -> Any:
    """The tensor's row-major bytes, flat. Torch counts a tensor of at most one element as contiguous whatever its
    strides (``x[::2][:1]``), and such a view keeps them, which a view as bytes refuses: it is given a stride of
    one element, which names the same memory."""
    import torch

    flat = tensor.detach().resolve_neg().contiguous().reshape(-1)
    if flat.numel() <= 1 and flat.stride() != (1,):
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def base_identities(tensors: list[Any]) -> list[str]:
    """The base identity (16 hex digits) of each tensor's row-major bytes (torch tensors on any device). Tensors
    from HOST_BELOW bytes on have their whole 256 KiB blocks hashed on their device, the blocks of every such
    tensor on one device in one run of the rounds; the bytes after the last whole block (under 256 KiB), and
    smaller tensors, are copied to the host and hashed by the core."""
    from ._core import base_identity_from_blocks, range_identities

    found: dict[int, str] = {}
    by_device: dict[Any, list[tuple[int, Any]]] = {}
    on_host: list[tuple[int, Any]] = []
    for i, tensor in enumerate(tensors):
        data = _flat_bytes(tensor)
        if (data.is_cpu and not TORCH_ON_CPU) or data.numel() < max(HOST_BELOW, BLOCK_BYTES):
            on_host.append((i, data.cpu().numpy()))
            continue
        by_device.setdefault(data.device, []).append((i, data))
    # The host's share in one call: every block of every tensor hashed side by side.
    for (i, _), identity in zip(on_host, range_identities([(data, 0, data.size) for _, data in on_host]), strict=True):
        found[i] = identity
    for items in by_device.values():
        counts = [data.numel() // BLOCK_BYTES for _, data in items]
        hashes = _device_block_hashes([data[: count * BLOCK_BYTES] for (_, data), count in zip(items, counts)])
        at = 0
        for (i, data), count in zip(items, counts):
            blocks = b"".join(h.to_bytes(8, "little") for h in hashes[at : at + count])
            at += count
            found[i] = base_identity_from_blocks(blocks, data[count * BLOCK_BYTES :].cpu().numpy())
    return [found[i] for i in range(len(tensors))]


def _device_block_hashes(bodies: list[Any]) -> list[int]:
    """The hash of each 256 KiB block of each of ``bodies`` (flat uint8 tensors of whole blocks, all on one
    device), in order: every block's rounds summed on the device in one run."""
    import torch

    device = bodies[0].device
    keys = torch.tensor([_lanes(8 * stripe) for stripe in range(_STRIPES)], dtype=torch.int64, device=device)
    low = torch.tensor(0xFFFFFFFF, dtype=torch.int64, device=device)
    sums = []
    for body in bodies:
        if body.data_ptr() % 8:
            body = body.clone()  # aligned for the int64 view, still on the device
        sums.append(_round_sums(body.view(torch.int64).view(-1, _ROUNDS, _STRIPES, 8), keys, low))
    return _hash_rounds(torch.cat(sums))


def block_hashes(data: Any) -> bytes:
    """The hashes of the 256 KiB blocks of a flat uint8 torch tensor's bytes (the last block may be short), 8 bytes
    each, as ``_core.block_hashes`` gives them: whole blocks hashed on the tensor's device where it is one
    (:func:`on_device`) and holds at least HOST_BELOW bytes, the rest copied to the host and hashed by the core."""
    from ._core import block_hashes as host_block_hashes

    whole = data.numel() // BLOCK_BYTES * BLOCK_BYTES
    if not on_device(data) or data.numel() < max(HOST_BELOW, BLOCK_BYTES):
        return bytes(host_block_hashes(data.cpu().numpy()))
    hashes = b"".join(h.to_bytes(8, "little") for h in _device_block_hashes([data[:whole]]))
    return hashes + (bytes(host_block_hashes(data[whole:].cpu().numpy())) if whole < data.numel() else b"")


def base_identity(tensor: Any) -> str:
    """The base identity (16 hex digits) of one tensor's bytes: :func:`base_identities`."""
    return base_identities([tensor])[0]


def on_device(tensor: Any) -> bool:
    """A torch tensor whose hashes are made on its device (outside the host's memory, or any with TORCH_ON_CPU)."""
    from . import _arrays

    return _arrays.is_torch(tensor) and (not tensor.is_cpu or TORCH_ON_CPU)


#: Rounds summed at a time on the device (32 MiB of bytes).
_GROUP_ROUNDS = 1 << 15
#: Tensors smaller than this are copied to the host for their state-digest hash instead (unlike a base identity,
#: a state hash runs no sequential rounds on the device: a dozen kernel launches per tensor); a guess, not timed on
#: a GPU here.
STATE_HOST_BELOW = 1 << 20
#: Small tensors of one device are copied to the host together, this many bytes at a time: one copy, not one each.
_HOST_BATCH_BYTES = 64 << 20


def state_hashes(tensors: Mapping[str, Any]) -> dict[str, bytes]:
    """The state-digest hash of each torch tensor (16 bytes, as ``_core.tensor_hashes`` gives them), by name. Tensors
    from STATE_HOST_BELOW bytes on have their rounds summed on their device, a group at a time; smaller ones are
    copied to the host in batches of up to 64 MiB per device and hashed by the core."""
    if not tensors:
        return {}
    import torch

    from . import _arrays
    from ._core import tensor_hash_from_rounds

    out: dict[str, bytes] = {}
    small: list[tuple[str, str, list[int], Any]] = []
    constants: dict[Any, tuple[Any, Any]] = {}  # by device: the 16 stripes' keys, the low-32-bit mask
    for name, tensor in tensors.items():
        dtype, shape = _arrays.describe(tensor, name)
        data = _flat_bytes(tensor)
        prefix = len(dtype) + 1 + 8 + 8 * len(shape)
        length = prefix + data.numel()
        # The rounds from the first that starts in the bytes to the last whole one before the stream's last stripe.
        first, end = -(-prefix // _ROUND), (length - 1) // 64 // _STRIPES
        if (data.is_cpu and not TORCH_ON_CPU) or data.numel() < max(STATE_HOST_BELOW, 4 * _ROUND) or end <= first:
            small.append((name, dtype, list(shape), data))
            continue
        device = data.device
        if device not in constants:
            keys = [_lanes(8 * stripe) for stripe in range(_STRIPES)]
            constants[device] = (
                torch.tensor(keys, dtype=torch.int64, device=device),
                torch.tensor(0xFFFFFFFF, dtype=torch.int64, device=device),
            )
        keys, low = constants[device]
        start = first * _ROUND - prefix  # the byte where the first summed round starts
        sums = torch.empty(end - first, 8, dtype=torch.int64, device=device)
        for at in range(0, end - first, _GROUP_ROUNDS):
            rounds = min(_GROUP_ROUNDS, end - first - at)
            part = data[start + at * _ROUND : start + (at + rounds) * _ROUND]
            if part.data_ptr() % 8:
                part = part.clone()  # aligned for the int64 view, still on the device
            sums[at : at + rounds] = _sums(part.view(torch.int64).view(rounds, _STRIPES, 8), keys, low)
        after = end * _ROUND - prefix
        out[name] = tensor_hash_from_rounds(
            dtype,
            list(shape),
            bytes(data[:start].cpu().numpy()),
            sums.cpu().view(torch.uint8).numpy(),
            bytes(data[after:].cpu().numpy()),
            bytes(data[-64:].cpu().numpy()),
        )
    out.update(_small_state_hashes(small))
    return out


def _small_state_hashes(entries: list[tuple[str, str, list[int], Any]]) -> dict[str, bytes]:
    """The state-digest hashes of tensors (name, dtype, shape, flat bytes) copied to the host: those of one device
    joined on it and copied in one go, up to _HOST_BATCH_BYTES at a time; host tensors read in place."""
    import torch

    from ._core import tensor_hashes

    out: dict[str, bytes] = {}
    batch: list[tuple[str, str, list[int], Any]] = []
    batch_bytes = 0

    def flush() -> None:
        nonlocal batch_bytes
        batch_bytes = 0
        if not batch:
            return
        joined = batch[0][3] if len(batch) == 1 else torch.cat([data for *_, data in batch])
        host = joined.cpu().numpy()
        at = 0
        hashed: list[tuple[str, str, list[int], Any]] = []
        for name, dtype, shape, data in batch:
            hashed.append((name, dtype, shape, host[at : at + data.numel()]))
            at += data.numel()
        hashes = tensor_hashes(hashed)  # numpy views of the copy, which the core reads in place
        out.update((name, bytes(h)) for (name, *_), h in zip(hashed, hashes, strict=True))
        batch.clear()

    for entry in sorted(entries, key=lambda e: str(e[3].device)):
        data = entry[3]
        if batch and (batch[0][3].device != data.device or batch_bytes + data.numel() > _HOST_BATCH_BYTES):
            flush()
        batch.append(entry)
        batch_bytes += data.numel()
    flush()
    return out
