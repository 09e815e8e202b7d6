"""The manifest fuzz harness (tests/fuzz_manifest.py), briefly, in its random-mutation mode: a few thousand mutated
manifest entries, `latest.json` and `run.json` documents parse or raise DeltaFormatError/IntegrityError."""

from __future__ import annotations

from tests.fuzz_manifest import check_one, run_mutation, seeds


def test_seed_documents_parse():
    for data in seeds():
        check_one(b"\0" + data)
        check_one(b"\1" + data)


def test_mutated_documents_parse_or_raise_format_errors():
    assert run_mutation(3000, seed=1) == 3000
