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


def test_a_non_ascii_signature_is_an_integrity_error():
    """Found by the harness: hmac.compare_digest raised TypeError on a signature with non-ASCII characters."""
    import json

    import pytest

    from deltasync_rs.errors import IntegrityError
    from deltasync_rs.manifest import Entry, entry_key
    from tests.fuzz_manifest import SIGNING_KEY

    signed = json.loads(seeds()[5])  # the signed anchor entry, step 1
    signed["signature"] = "\u00e9" * 64
    with pytest.raises(IntegrityError, match="bad signature"):
        Entry.parse(json.dumps(signed).encode(), entry_key(1), SIGNING_KEY)
