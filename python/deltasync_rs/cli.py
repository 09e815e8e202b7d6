"""The `deltasync` command: diff two checkpoints, apply a delta to one, and inspect a delta file."""

from __future__ import annotations

import argparse
import json
import os
import signal
import stat
import struct
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np

from . import __version__, _arrays
from ._core import DeltaSyncError, RawDelta, apply_files, diff_files
from ._outputs import refuse_overwriting_inputs, remove_stale_temps, require_output_file, require_regular_file
from ._sharded import checkpoint_files, tensor_names, write_folder
from .delta import Delta, load, state_digest
from .errors import IntegrityError
from .sync import Publisher, Subscriber, entry_key, log_entries


def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if nbytes < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    raise AssertionError("unreachable")


def _count(n: int, noun: str) -> str:
    """``1 tensor``, ``2 tensors``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _progress_bar(description: str):
    """A tqdm bar over bytes on an interactive terminal, else None (quiet in logs and pipes)."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(desc=description, unit="B", unit_scale=True, file=sys.stderr, leave=False)


def _cmd_diff(args: argparse.Namespace) -> int:
    if args.format == "trl" and args.values != "abs":
        raise DeltaSyncError("--format trl needs --values abs: TRL files hold new absolute values, not differences")
    start = time.perf_counter()
    prev, curr = checkpoint_files(args.prev), checkpoint_files(args.curr)
    if args.format == "trl" and args.codec == "context":
        raise DeltaSyncError(
            "--format trl stores positions as TRL does; --codec context applies to deltasync files only"
        )
    indexes = [c.index for c in (prev, curr) if c.index is not None]
    require_output_file(args.output)
    refuse_overwriting_inputs(args.output, prev.files + curr.files + indexes)
    remove_stale_temps(args.output)
    bar = _progress_bar("diff")

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)

    try:
        delta = Delta(diff_files(prev.files, curr.files, args.values, progress, args.codec))
    finally:
        if bar is not None:
            bar.close()
    delta.step, delta.base_step = args.step, args.base_step
    delta.save(args.output, format=args.format)
    elapsed = time.perf_counter() - start
    changed, total = delta.num_changed, delta.num_elements
    print(
        f"{args.output}: {_count(len(delta), 'tensor')}, {changed} of {total} elements changed "
        f"({(changed / total if total else 0):.4%}), {_human(delta.nbytes)} of streams, {elapsed:.2f} s"
    )
    return 0


def _cmd_apply(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    base = checkpoint_files(args.base)
    require_regular_file(args.delta)
    delta = load(args.delta)
    if delta.aliases:
        # A tied name the checkpoint holds as a tensor of its own is written as its tensor is (docs/format.md §2.2).
        delta = delta._with_ties({name for file in base.files for name in tensor_names(file)})
    check_base = not args.no_check_base
    if base.index is None:
        if os.path.isdir(args.output):
            raise DeltaSyncError(f"{args.output}: a folder; -o names the checkpoint file to write")
        require_output_file(args.output)
        refuse_overwriting_inputs(args.output, [args.delta])  # BASE itself may be replaced: it keeps its mode
        remove_stale_temps(args.output)
        apply_files(base.files, delta._raw, [args.output], check_base)
    else:
        # A new folder of shards, written beside the output and put in its place at once.
        write_folder(base, args.output, lambda shards: apply_files(base.files, delta._raw, shards, check_base))
    print(
        f"{args.output}: applied {_count(delta.num_changed, 'change')} to {_count(len(delta), 'tensor')} "
        f"in {time.perf_counter() - start:.2f} s"
    )
    return 0


def _checksum_of(path: str) -> str | None:
    """The file checksum (docs/format.md §2.1) in the header of the file at ``path``, which ``load`` has checked, or
    None for a file written without one (an older writer, a TRL import)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        metadata = json.loads(f.read(length)).get("__metadata__") or {}
    value = metadata.get("file_xxh3")
    return value if isinstance(value, str) else None


def _cmd_inspect(args: argparse.Namespace) -> int:
    require_regular_file(args.delta)
    delta = load(args.delta)
    raw: RawDelta = delta._raw
    checksum = _checksum_of(args.delta)
    if args.json:
        print(
            json.dumps(
                {
                    "kind": "anchor" if delta.is_anchor else "delta",
                    "packed": raw.format_version == "2",
                    "step": delta.step,
                    "base_step": delta.base_step,
                    "metadata": delta.metadata,
                    "checksum": checksum,
                    "num_changed": delta.num_changed,
                    "num_elements": delta.num_elements,
                    "nbytes": delta.nbytes,
                    "tensors": [t._asdict() | {"density": t.density} for t in delta.tensors],
                },
                indent=2,
            )
        )
        return 0
    layout = ", packed layout (format version 2)" if raw.format_version == "2" else ""
    print(
        f"{args.delta}: {'anchor' if raw.is_anchor else 'delta'}{layout}, step={delta.step}, base_step={delta.base_step}"
    )
    if checksum is None:
        print("  checksum: none (an older writer's file, or a TRL patch: damage to it would go unnoticed)")
    else:
        print(f"  checksum: file_xxh3 {checksum}, checked")
    for key, value in sorted(delta.metadata.items()):
        print(f"  {key} = {value}")
    name_width = max([len(t.name) for t in delta.tensors] + [6])
    print(f"{'tensor':<{name_width}}  {'dtype':<8} {'shape':<18} {'changed':>12} {'density':>9} {'bytes':>12}  codecs")
    for t in delta.tensors:
        density = "?" if t.density is None else f"{t.density:.4%}"
        shape = "?" if t.shape is None else "x".join(map(str, t.shape)) or "scalar"
        print(
            f"{t.name:<{name_width}}  {t.dtype:<8} {shape:<18} {t.changed:>12} {density:>9} {t.nbytes:>12}  "
            f"{t.positions}/{t.values}"
        )
    per_change = delta.nbytes / delta.num_changed if delta.num_changed else 0.0
    if any(t.shape is None for t in delta.tensors):  # TRL files store no shapes
        changed = f"{_count(delta.num_changed, 'element')} changed (shapes unknown)"
    else:
        changed = f"{delta.num_changed} of {delta.num_elements} elements changed"
    print(f"total: {changed}, {_human(delta.nbytes)} of streams ({per_change:.2f} bytes per changed element)")
    return 0


def _load_checkpoint(path: str) -> dict[str, np.ndarray]:
    """A checkpoint (one safetensors file, or a sharded checkpoint's files: see ``_sharded``) as read-only numpy
    arrays mapped from its files (bf16 and fp8 through ml_dtypes), without torch: their pages are the page cache's,
    which the kernel can drop and read again, so a checkpoint larger than the memory left beside the publisher's
    mirror still publishes. The files must not change meanwhile."""
    state: dict[str, np.ndarray] = {}
    for file in checkpoint_files(path).files:
        for name, array in _load_file(file).items():
            if name in state:
                raise DeltaSyncError(f"{file}: tensor {name!r} is also in another file of the checkpoint {path}")
            state[name] = array
    return state


def _load_file(path: str) -> dict[str, np.ndarray]:
    """One safetensors file as read-only numpy arrays mapped from it."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="np") as checkpoint:  # validates the header: sizes, offsets, overlaps
            names = list(checkpoint.keys())
        with open(path, "rb") as file:
            (header_size,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(header_size))
    except FileNotFoundError:
        raise DeltaSyncError(f"{path}: no such file") from None
    except Exception as error:  # safetensors raises its own error types for bad files
        raise DeltaSyncError(f"{path}: cannot read this checkpoint: {error}") from error
    # One mapping for the whole file, each tensor a view of it (a mapping per tensor would run into the kernel's
    # limit on mappings, 65,530 by default, with the tens of thousands of tensors of a mixture-of-experts model).
    whole = np.memmap(path, dtype=np.uint8, mode="r")  # never empty: the header was read above
    state = {}
    for name in names:
        info = header[name]
        dtype = _arrays.numpy_dtype(info["dtype"])
        begin, end = info["data_offsets"]
        data = whole[8 + header_size + begin : 8 + header_size + end]
        state[name] = data.view(dtype).reshape(info["shape"])
    return state


#: --dtype's choices: the safetensors names of the dtypes a checkpoint's floating-point tensors may be cast to.
_CAST_TO = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
#: The dtypes --dtype casts from (numpy names), which numpy rounds to each target exactly as torch's ``.to()`` does
#: (to nearest, ties to even); float64 would round twice through numpy, so it is refused rather than cast.
_CAST_FROM = ("float32", "float16", "bfloat16")


def _cast(state: dict[str, np.ndarray], dtype: str, path: str) -> dict[str, np.ndarray]:
    """The checkpoint's floating-point tensors cast to ``dtype`` (in memory; the others kept mapped), bit for bit as
    torch's ``.to(dtype)`` casts them but for NaN payloads (torch's own differ from kernel to kernel), so that a
    trainer saving float32 weights publishes the bf16 weights an engine serves: a float32 checkpoint changes nearly
    every element each step, its bf16 rounding about 1%."""
    target = _arrays.numpy_dtype(_CAST_TO[dtype])
    out = {}
    for name, array in state.items():
        kind = array.dtype.name
        if array.dtype == target or array.dtype.kind not in "fV" or kind.startswith("float8"):
            out[name] = array  # integers, bools and fp8 are kept as they are
            continue
        if kind not in _CAST_FROM:
            raise DeltaSyncError(
                f"{path}: tensor {name!r} is {kind}: --dtype casts float32, float16 and bfloat16 tensors only "
                "(cast it as your engine does, then publish)"
            )
        with np.errstate(all="ignore"):  # values beyond the target's range become infinities, as with torch
            out[name] = array.astype(target)
    return out


def _cmd_publish(args: argparse.Namespace) -> int:
    state = _load_checkpoint(args.checkpoint)
    if args.dtype is not None:
        state = _cast(state, args.dtype, args.checkpoint)
    with Publisher(
        args.store,
        anchor_every=args.anchor_every,
        keep_anchors=args.keep_anchors,
        values=args.values,
        codec=args.codec,
        background=False,
        whole_sha256=args.whole_sha256,
    ) as publisher:
        subscriber = Subscriber(publisher.store)
        latest = subscriber.latest_step()
        if args.resume_at is not None:
            if args.anchor:
                raise DeltaSyncError(
                    "--resume-at and --anchor: give one (--resume-at publishes a delta from that step)"
                )
            if latest is None or args.resume_at > latest:
                raise DeltaSyncError(
                    f"{args.store}: --resume-at {args.resume_at}: the store's newest step is {latest}; nothing was written"
                )
            if args.step <= args.resume_at:
                raise DeltaSyncError(f"--step {args.step} is not after --resume-at {args.resume_at}")
            # A restart from an older checkpoint: that step's state rebuilt and resumed (its digest checked against
            # its entry); the steps after it, a history the run leaves, are removed; then this step, a delta.
            base, step = _rebuild(subscriber, args.store, until=args.resume_at)
            publisher.resume(base, step=step, copy=False)
            del base
            publisher.publish(args.step, state)
        elif latest is not None and not args.anchor:
            # Rebuild the last published state, so this step is a delta against it, in arrays that the publisher
            # then keeps as its mirror: the mapped checkpoint and one state in memory, never two.
            base, step = _rebuild(subscriber, args.store)
            if step != latest:
                # Resuming at an older step would leave the steps after it (Publisher.resume removes them).
                raise DeltaSyncError(
                    f"{args.store}: the newest step {latest} could not be rebuilt (only step {step}); nothing was "
                    "written: try again, or publish with --anchor to start over from the checkpoint"
                )
            only_store, only_checkpoint = sorted(base.keys() - state.keys()), sorted(state.keys() - base.keys())
            if only_store or only_checkpoint:
                raise DeltaSyncError(
                    f"{args.checkpoint}: its tensors differ from the state published at step {step} (only in the "
                    f"store: {only_store[:5]}, only in the checkpoint: {only_checkpoint[:5]}); publish it with "
                    "--anchor to start over from it"
                )
            publisher._continue(base, step)
            del base
            publisher.publish(args.step, state)
        else:
            # An anchor (a first step, or --anchor): written straight from the mapped checkpoint, which the
            # publisher shares rather than copies into a mirror that this one-step process would never use.
            publisher.publish_shared(args.step, state, read_only=True)
    entry = subscriber.entry(args.step)
    files = [ref["key"] + f" ({_human(ref['size'])})" for ref in (entry.delta, entry.anchor) if ref]
    print(f"{args.store}: published step {args.step}: {', '.join(files)}")
    return 0


def _rebuild(subscriber: Subscriber, store: str, until: int | None = None) -> tuple[dict[str, np.ndarray], int]:
    """The newest published state (or step ``until``'s) rebuilt from an anchor and the deltas after it into new
    arrays (a publisher's mirror), checked against that step's state digest; with its step."""
    deltas = subscriber.fetch(None, until=until)
    state = {}
    for t in deltas[0].tensors:  # an anchor: every tensor whole, with its shape
        if t.shape is None:
            raise DeltaSyncError(f"{store}: tensor {t.name!r} of the first file has no shape")
        state[t.name] = np.empty(t.shape, dtype=_arrays.numpy_dtype(t.dtype))
    for delta in deltas:
        delta.apply_(state)
    step = deltas[-1].step
    if step is None:
        raise DeltaSyncError(f"{store}: the last file of the chain records no step")
    if state_digest(state) != subscriber.entry(step).state_digest:
        raise IntegrityError(
            f"{store}: the state rebuilt at step {step} does not match the state digest in "
            f"{entry_key(step)}; nothing was written"
        )
    return state, step


def _cmd_pull(args: argparse.Namespace) -> int:
    # Rebuilt in the output file itself (laid out as save_file lays it out), never as a second state in memory.
    step = Subscriber(args.store, max_age=args.max_age).pull_to_file(args.output, until=args.step)
    print(f"{args.output}: step {step}")
    return 0


def _cmd_log(args: argparse.Namespace) -> int:
    entries = log_entries(args.store)
    print(f"{'step':>10} {'base':>10}  {'kind':<14} {'bytes':>12} {'changed':>12}  created")
    for entry in entries:
        kind = " + ".join(k for k, ref in (("delta", entry.delta), ("anchor", entry.anchor)) if ref)
        size = sum(ref["size"] for ref in (entry.delta, entry.anchor) if ref)
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.created))
        base = "-" if entry.base_step is None else entry.base_step
        print(f"{entry.step:>10} {base:>10}  {kind:<14} {size:>12} {entry.num_changed:>12}  {created}")
    print(_count(len(entries), "step"))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    if args.without_signatures:  # no key at all, not even the environment's (which would refuse an unsigned store)
        os.environ.pop("DELTASYNC_SIGNING_KEY", None)
    subscriber = Subscriber(args.store, retries=1)
    problems = subscriber.verify(signatures=not args.without_signatures)
    for problem in problems:
        print(problem)
    if problems:
        print(f"{args.store}: {_count(len(problems), 'problem')}", file=sys.stderr)
        return 1
    # No problem: with a key the store is signed throughout; without one, unsigned, unless signatures were let go.
    if args.without_signatures and subscriber._signed():
        print(f"{args.store}: every entry and file digest checks out; its signatures were not checked")
    elif subscriber._key is None:
        print(f"{args.store}: every entry and file digest checks out (an unsigned store)")
    else:
        print(f"{args.store}: every entry, signature and file digest checks out")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401

        from . import bench
    except ImportError as error:
        print(f"deltasync bench: needs torch ({error}); pip install 'deltasync-rs[bench]'", file=sys.stderr)
        return 1
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("deltasync bench: --plot needs matplotlib; pip install 'deltasync-rs[bench]'", file=sys.stderr)
            return 1
    results = bench.run(
        args.scale,
        args.densities,
        args.rounds,
        peers=not args.no_peers,
        progress=lambda line: print(line, file=sys.stderr),
    )
    from . import _core

    print(
        f"synthetic Qwen3-0.6B-shaped bf16 state at scale {args.scale}; medians of {args.rounds} rounds, ms; "
        f"{_core.get_num_threads()} threads, {_core.scan_kernel()} compare kernel"
    )
    print(bench.table(results))
    if args.plot:
        bench.plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _density(text: str) -> float:
    try:
        value = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a density (0.01 or 1%)") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a density in (0, 1]")
    return value


def _step_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step number") from None
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"{text} is not a step number (0 to 2**64-1)")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds above 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deltasync",
        description="Bit-exact sparse deltas of safetensors checkpoints.",
        epilog="A signed store's key (HMAC) is read from DELTASYNC_SIGNING_KEY by publish, pull, log and verify.",
    )
    parser.add_argument("--version", action="version", version=f"deltasync-rs {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("diff", help="write the delta between two checkpoints (memory-mapped, streamed)")
    p.add_argument("prev", help="the older checkpoint: a .safetensors file, or a sharded checkpoint's index or folder")
    p.add_argument("curr", help="the newer checkpoint, as PREV")
    p.add_argument("-o", "--output", required=True, help="the delta file to write")
    p.add_argument(
        "--values",
        choices=("diff", "abs"),
        default="diff",
        help="store bit-pattern differences (smallest) or new absolute values (TRL-compatible)",
    )
    p.add_argument(
        "--codec",
        choices=("varint", "compact", "context"),
        default="compact",
        help="compact: packed records, Rice positions, bit-packed or rANS values (the default); varint: byte-aligned streams that version-1 readers also read; context: compact with positions coded by the base's exponent classes (smallest on training steps; decodes only against the exact base)",
    )
    p.add_argument("--format", choices=("deltasync", "trl"), default="deltasync", help="file layout to write")
    p.add_argument("--step", type=_step_number, default=None, help="step number to record")
    p.add_argument("--base-step", type=_step_number, default=None, help="base step number to record")
    p.set_defaults(run=_cmd_diff)

    p = commands.add_parser("apply", help="write BASE with DELTA applied")
    p.add_argument(
        "base",
        help="the checkpoint the delta was made against: a .safetensors file, or a sharded checkpoint's index or folder",
    )
    p.add_argument("delta", help="a deltasync or TRL delta file")
    p.add_argument(
        "-o",
        "--output",
        required=True,
        help="the checkpoint to write (may be BASE itself); for a sharded BASE, a new folder (or BASE's own) that gets "
        "the shards, the index and BASE's other files, all at once",
    )
    p.add_argument(
        "--no-check-base",
        action="store_true",
        help="skip checking that BASE is the exact base the delta was made against (checked by default: "
        "a wrong base, or a delta applied twice, is refused)",
    )
    p.set_defaults(run=_cmd_apply)

    p = commands.add_parser("publish", help="publish a checkpoint as a step: a delta against the last published step")
    p.add_argument("checkpoint", help="a .safetensors file, or a sharded checkpoint's index or folder")
    p.add_argument("--store", required=True, help="a folder, s3://..., gs://... or hf://buckets/ORG/NAME/PREFIX")
    p.add_argument("--step", required=True, type=_step_number, help="the step number to publish it as")
    p.add_argument("--anchor-every", type=int, default=10, help="write a full anchor every N publishes")
    p.add_argument("--keep-anchors", type=int, default=2, help="anchors to keep (older files are deleted)")
    p.add_argument("--values", choices=("diff", "abs"), default="diff")
    p.add_argument(
        "--codec",
        choices=("varint", "compact", "context"),
        default="compact",
        help="compact (the default), varint (byte-aligned, read by version-1 readers too) or context (smallest on "
        "training steps; needs --values diff, and readers holding whole tensors)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(_CAST_TO),
        default=None,
        help="cast the checkpoint's float32, float16 and bfloat16 tensors to this dtype first, as torch's .to() does "
        "(a trainer's float32 weights published as the bf16 an engine serves; the cast state is held in memory)",
    )
    p.add_argument("--anchor", action="store_true", help="publish an anchor, without reading the store's last state")
    p.add_argument(
        "--resume-at",
        type=_step_number,
        default=None,
        metavar="STEP",
        help="a restart from the checkpoint of an older step: continue from STEP's published state (rebuilt and "
        "checked), removing the store's later steps, a history the run leaves; --step must be after it",
    )
    p.add_argument(
        "--whole-sha256",
        action="store_true",
        help="also record an anchor's whole-file SHA-256 (one more pass over it, on one core), which readers before "
        "sync protocol version 2 need; by default its pieces sidecar alone checks it",
    )
    p.set_defaults(run=_cmd_publish)

    p = commands.add_parser("pull", help="reconstruct the newest (or a given) step from a store into a checkpoint")
    p.add_argument("--store", required=True)
    p.add_argument("-o", "--output", required=True, help="the .safetensors checkpoint to write")
    p.add_argument("--step", type=_step_number, default=None, help="stop at this step (default: the newest)")
    p.add_argument(
        "--max-age",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="refuse a store whose newest step was published longer ago than this (with a signing key: a store "
        "rolled back to an earlier copy is refused after that long)",
    )
    p.set_defaults(run=_cmd_pull)

    p = commands.add_parser("log", help="list a store's published steps: kinds, sizes, changes, times")
    p.add_argument("--store", required=True)
    p.set_defaults(run=_cmd_log)

    p = commands.add_parser(
        "verify",
        help="check every manifest entry, signature and file digest in a store (signatures with the key in "
        "DELTASYNC_SIGNING_KEY: a signed store without it is a problem, unless --without-signatures)",
    )
    p.add_argument("--store", required=True)
    p.add_argument(
        "--without-signatures",
        action="store_true",
        help="check a signed store's entries and file digests without its key (which then cannot tell a writer "
        "without the key from the publisher)",
    )
    p.set_defaults(run=_cmd_verify)

    p = commands.add_parser("inspect", help="per-tensor counts, density, bytes and codecs of a delta file")
    p.add_argument("delta", help="a deltasync or TRL delta file")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_cmd_inspect)

    p = commands.add_parser("bench", help="compare the codecs with TRL and grail-like encoders on a synthetic state")
    p.add_argument(
        "--scale",
        type=float,
        default=0.05,
        help="fraction of the Qwen3-0.6B shape to generate (default 0.05, about 23M params; 1 is the full model)",
    )
    p.add_argument(
        "--densities",
        type=_density,
        nargs="+",
        default=[0.0025, 0.005, 0.01, 0.02, 0.05],
        help="fractions of changed elements (0.01 or 1%%)",
    )
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per measurement, after one warm-up")
    p.add_argument("--no-peers", action="store_true", help="time deltasync's codecs only")
    p.add_argument("--plot", metavar="PNG", help="also write a chart of size and time per codec and density")
    p.set_defaults(run=_cmd_bench)
    return parser


def _stdout_is_a_pipe() -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(sys.stdout.fileno()).st_mode)
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor, or closed
        return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv)
    # SIGTERM (timeout, systemd, Kubernetes) ends a command as Ctrl-C does: on the way out it removes its temporary
    # files (a checkpoint-sized one while a pull or publish writes), instead of leaving them for a later sweep.
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        return args.run(args)
    except DeltaSyncError as error:
        print(f"deltasync {args.command}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"deltasync {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_is_a_pipe():
            raise
        # The reader of the output went away (`deltasync log | head`): stop quietly, as other commands do, with
        # what is left of the output sent nowhere (Python flushes it at exit, which would fail again).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a command a closed pipe ended
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
