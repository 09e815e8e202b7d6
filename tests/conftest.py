"""Fixtures shared by the sync and store tests: a real S3 HTTP server (moto) on 127.0.0.1, and store factories."""

from __future__ import annotations

import socket
import uuid

import pytest

from tests.hub_standin import HubBucketsStandIn

S3_KEY, S3_SECRET = "testing", "testing"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's ThreadedMotoServer: the real S3 HTTP API, bound to loopback only."""
    moto_server = pytest.importorskip("moto.server")
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_url(s3_endpoint, monkeypatch):
    """A fresh bucket on the moto server; s3fs finds the endpoint and dummy credentials in the environment."""
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("s3fs")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/run1"


def s3_store(url: str, endpoint: str):
    from deltasync_rs.store import FsspecStore

    # s3fs's defaults otherwise (its listings cache on, as for a plain "s3://" URL); each store its own filesystem
    # object, as a publisher and a subscriber in two processes have.
    return FsspecStore(url, endpoint_url=endpoint, key=S3_KEY, secret=S3_SECRET, skip_instance_cache=True)


@pytest.fixture(params=["local", "s3", "hf-standin"])
def store(request, tmp_path):
    """Every Store backend: a local folder, S3 over real HTTP (moto), and the HF Bucket store on a stand-in hub."""
    from deltasync_rs.store import HFBucketStore, LocalStore

    if request.param == "local":
        return LocalStore(tmp_path / "store")
    if request.param == "s3":
        endpoint = request.getfixturevalue("s3_endpoint")
        return s3_store(request.getfixturevalue("s3_url"), endpoint)
    return HFBucketStore("hf://buckets/org/bucket/run1", api=HubBucketsStandIn(), token="hf_test")
