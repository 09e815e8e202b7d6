"""A fuzz harness for the manifest parser (python/deltasync_rs/manifest.py): manifest entries, `latest.json` and
`run.json` from arbitrary bytes must parse or raise DeltaFormatError/IntegrityError, nothing else, and a parsed
entry must write and parse back equal.

    python tests/fuzz_manifest.py --runs 100000            # atheris (coverage-guided) when it is installed
    python tests/fuzz_manifest.py --runs 100000 --mutate   # seeded random mutation of valid documents, no atheris

tests/test_fuzz_manifest.py runs the mutation mode briefly on every test run; docs/fuzzing.md says more.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from deltasync_rs.errors import DeltaFormatError, IntegrityError
from deltasync_rs.manifest import (
    Entry,
    anchor_key,
    delta_key,
    entry_key,
    file_ref,
    latest_document,
    parse_latest,
    parse_run,
    run_document,
)

SIGNING_KEY = b"fuzz-key"
EXPECTED = (DeltaFormatError, IntegrityError)


def seeds() -> list[bytes]:
    """Valid documents of every kind, signed and unsigned: the starting points for mutation."""
    out = []
    for key in (None, SIGNING_KEY):
        delta = Entry(
            step=7,
            base_step=6,
            delta=file_ref(delta_key(7), b"d" * 10),
            anchor=None,
            state_digest="0" * 32,
            num_changed=3,
            num_elements=100,
            created=1.5,
            run="a" * 32,
            base_entry_sha256="b" * 64,
        )
        anchor = Entry(
            step=1,
            base_step=None,
            delta=None,
            anchor=file_ref(anchor_key(1), b"a"),
            state_digest="f" * 32,
            num_changed=0,
            num_elements=2**63,
            created=0,
            run=None,
        )
        out += [delta.to_json(key), anchor.to_json(key), latest_document(7, b"entry", "c" * 32, key), run_document(key)]
    return out


def _entry_key_for(raw: bytes) -> str:
    """The store key the entry claims, so that parsing gets past the key check; a fixed key otherwise."""
    try:
        step = json.loads(raw).get("step")
    except Exception:  # noqa: BLE001 - any undecodable input just gets the fixed key
        step = None
    return (
        entry_key(step) if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 10**12 else entry_key(1)
    )


def check_one(data: bytes) -> None:
    """Parses `data` (its first byte picks the signing key) as each document kind."""
    if not data:
        return
    signing_key = SIGNING_KEY if data[0] & 1 else None
    raw = data[1:]
    key = _entry_key_for(raw)
    try:
        entry = Entry.parse(raw, key, signing_key)
    except EXPECTED:
        pass
    else:
        again = Entry.parse(entry.to_json(signing_key), key, signing_key)
        assert again == entry, (entry, again)
    for parse in (parse_latest, parse_run):
        try:
            parse(raw, signing_key)
        except EXPECTED:
            pass


def mutate(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    """One to four random edits: flip, insert, delete, duplicate a span, splice another input, or swap a token."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(6)
        at = rng.randrange(len(out) + 1)
        if kind == 0 and out:
            out[min(at, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif kind == 1:
            out[at:at] = bytes(
                [rng.choice(b'{}[]",:0123456789-.eE\\ntrufalse') if rng.random() < 0.7 else rng.randrange(256)]
            )
        elif kind == 2 and out:
            del out[at : at + rng.randint(1, 16)]
        elif kind == 3 and out:
            span = out[at : at + rng.randint(1, 32)]
            out[at:at] = span * rng.randint(1, 8)
        elif kind == 4:
            other = rng.choice(pool)
            start = rng.randrange(len(other) + 1)
            out[at:] = other[start : start + rng.randint(0, 64)] + out[at:]
        else:
            token = rng.choice(
                [
                    b"null",
                    b"true",
                    b"1e999",
                    b"-1",
                    b"18446744073709551616",
                    b"NaN",
                    b'"x"',
                    b"[]",
                    b"{}",
                    b"0.5",
                    b"[" * 40,
                    b'"\\ud800"',
                ]
            )
            out[at : at + rng.randint(0, 8)] = token
    return bytes(out)


def run_mutation(runs: int, seed: int = 0, seconds: float | None = None) -> int:
    """Checks `runs` mutated documents (fewer where `seconds` run out first, as libFuzzer's -max_total_time),
    deterministically for a given seed; returns how many were checked."""
    rng = random.Random(seed)
    pool = seeds()
    for data in pool:
        check_one(b"\0" + data)
        check_one(b"\1" + data)
    deadline = None if seconds is None else time.monotonic() + seconds
    for done in range(runs):
        if deadline is not None and time.monotonic() > deadline:
            return done
        check_one(bytes([rng.randrange(256)]) + mutate(rng, rng.choice(pool), pool))
    return runs


def run_atheris(runs: int, extra: list[str]) -> None:
    import tempfile
    from pathlib import Path

    import atheris

    # libFuzzer starts from the seeds in a corpus folder; it adds what it finds there too, so use a temporary one.
    folder = Path(tempfile.mkdtemp(prefix="fuzz-manifest-"))
    for i, data in enumerate(seeds()):
        (folder / f"seed-{i}-unsigned").write_bytes(b"\0" + data)
        (folder / f"seed-{i}-signed").write_bytes(b"\1" + data)
    # Coverage of the manifest module only (instrument_all would take a minute over numpy and the rest).
    from deltasync_rs import manifest

    for obj in [*vars(manifest).values(), *vars(Entry).values()]:
        obj = getattr(obj, "__func__", obj)
        if getattr(obj, "__module__", None) == manifest.__name__ and hasattr(obj, "__code__"):
            atheris.instrument_func(obj)
    # A crash is written under fuzz/artifacts/manifest/ (git ignores it), not into the working directory.
    artifacts = Path(__file__).resolve().parent.parent / "fuzz" / "artifacts" / "manifest"
    artifacts.mkdir(parents=True, exist_ok=True)
    atheris.Setup([sys.argv[0], f"-runs={runs}", f"-artifact_prefix={artifacts}/", *extra, str(folder)], check_one)
    atheris.Fuzz()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--mutate", action="store_true", help="random mutation instead of atheris")
    parser.add_argument("--seed", type=int, default=0)
    args, extra = parser.parse_known_args()
    if not args.mutate:
        try:
            import atheris  # noqa: F401
        except ImportError:
            print("atheris is not installed: using random mutation", file=sys.stderr)
            args.mutate = True
    if args.mutate:
        limits = [float(a.split("=", 1)[1]) for a in extra if a.startswith("-max_total_time=")]
        checked = run_mutation(args.runs, args.seed, limits[-1] if limits else None)
        print(f"checked {checked} mutated documents", file=sys.stderr)
    else:
        run_atheris(args.runs, extra)


if __name__ == "__main__":
    main()
