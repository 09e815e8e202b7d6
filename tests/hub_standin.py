"""An in-process STAND-IN for the three huggingface_hub Bucket functions the HF store calls. There is no local Hub,
so the store's conformance suite runs against this; tests/test_stores.py checks that its signatures match the real
huggingface_hub functions, so the store calls them with the real argument shapes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class StandInBucketFile:
    path: str
    size: int
    type: str = "file"


class HubBucketsStandIn:
    """Buckets kept in a dict: {bucket_id: {remote_path: bytes}}. Records every call for inspection."""

    def __init__(self) -> None:
        self.buckets: dict[str, dict[str, bytes]] = {}
        self.calls: list[tuple[str, dict]] = []

    def batch_bucket_files(self, bucket_id, *, add=None, copy=None, delete=None, token=None):
        self.calls.append(
            ("batch_bucket_files", {"bucket_id": bucket_id, "add": add, "delete": delete, "token": token})
        )
        files = self.buckets.setdefault(bucket_id, {})
        for source, remote in add or []:
            files[remote] = bytes(source) if isinstance(source, (bytes, bytearray)) else Path(source).read_bytes()
        for remote in delete or []:
            files.pop(remote, None)

    def download_bucket_files(self, bucket_id, files, *, raise_on_missing_files=False, token=None):
        self.calls.append(("download_bucket_files", {"bucket_id": bucket_id, "files": files, "token": token}))
        stored = self.buckets.get(bucket_id, {})
        for remote, local in files:
            remote = getattr(remote, "path", remote)
            if remote not in stored:
                if raise_on_missing_files:
                    raise FileNotFoundError(f"{bucket_id}/{remote} not found")
                continue
            Path(local).write_bytes(stored[remote])

    def list_bucket_tree(self, bucket_id, prefix=None, *, recursive=None, token=None):
        self.calls.append(("list_bucket_tree", {"bucket_id": bucket_id, "prefix": prefix, "recursive": recursive}))
        for path, data in sorted(self.buckets.get(bucket_id, {}).items()):
            if prefix is None or path.startswith(prefix):
                yield StandInBucketFile(path=path, size=len(data))
