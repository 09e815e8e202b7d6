"""One conformance suite for every Store backend: local folder, S3 over HTTP (moto), HF Buckets (stand-in)."""

from __future__ import annotations

import errno
import inspect
import io
import json
import os
import signal
import stat
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import deltasync_rs as ds
from deltasync_rs.store import HFBucketStore, LocalStore, check_key, open_store
from tests.hub_standin import HubBucketsStandIn


def test_put_get_roundtrip(store):
    payload = bytes(range(256)) * 3
    store.put("deltas/step_000000000001.safetensors", payload)
    assert store.get("deltas/step_000000000001.safetensors") == payload
    store.put("deltas/step_000000000001.safetensors", b"second")
    assert store.get("deltas/step_000000000001.safetensors") == b"second"
    assert store.exists("deltas/step_000000000001.safetensors")


def test_missing_object(store):
    with pytest.raises(ds.MissingObjectError):
        store.get("manifest/nothing.json")
    assert not store.exists("manifest/nothing.json")


def test_create_writes_only_where_absent_on_every_backend(store):
    """create() writes a new object and leaves an existing one as it is; local folders and S3 do it atomically
    (a link that fails where the name exists; a conditional PUT), the HF Bucket store by looking first."""
    assert store.atomic_create == (not isinstance(store, HFBucketStore))
    assert store.create("run.json", b"first")
    assert not store.create("run.json", b"second")
    assert store.get("run.json") == b"first"
    assert store.list() == ["run.json"]  # nothing left behind (a local store's temporary file)


def _open_publisher(args):
    """A Publisher made on a store by another process, once all are ready; its run id."""
    url, barrier = args
    barrier.wait()
    with ds.Publisher(url, background=False) as publisher:
        return publisher.run


def test_publishers_opening_a_new_local_store_at_once_agree_on_its_run(tmp_path):
    """A training script run on every rank makes one Publisher per rank on the same new store at once: they must all
    take the same run id (the one in run.json), or the entries of one would be refused for naming another run."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, context.Pool(6) as pool:
        for trial in range(3):
            url = str(tmp_path / f"store{trial}")
            barrier = manager.Barrier(6)
            runs = pool.map(_open_publisher, [(url, barrier)] * 6)
            assert len(set(runs)) == 1, runs
            assert runs[0] == json.loads(LocalStore(url).get("run.json"))["run"]


def test_publishers_opening_a_new_store_without_atomic_creates_agree_after_settling():
    """Where a store cannot create atomically (the HF Bucket store), each publisher writes its own run.json and reads
    back after a pause (RUN_SETTLE_SECONDS): publishers that start together then all read the last one written."""
    import threading

    api = HubBucketsStandIn()
    barrier, runs = threading.Barrier(4), []

    def open_one() -> None:
        store = HFBucketStore("hf://buckets/org/bucket/run1", api=api, token="hf_test")
        barrier.wait()
        runs.append(ds.Publisher(store, background=False).run)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store = HFBucketStore("hf://buckets/org/bucket/run1", api=api, token="hf_test")
    assert set(runs) == {json.loads(store.get("run.json"))["run"]}


def test_list_and_delete(store):
    for key in ["a/x.json", "a/y.json", "b/z.json", "latest.json"]:
        store.put(key, key.encode())
    assert store.list("a/") == ["a/x.json", "a/y.json"]
    assert store.list() == ["a/x.json", "a/y.json", "b/z.json", "latest.json"]
    assert store.list("empty/") == []
    store.delete(["a/x.json", "b/z.json", "never/was.json"])
    assert store.list() == ["a/y.json", "latest.json"]
    store.delete([])


@pytest.mark.parametrize("key", ["", "/abs", "../up", "a/../b", "a//b", "a/./b", ".hidden", "a\\b", "x y", "a/"])
def test_keys_never_become_paths(store, key):
    with pytest.raises(ds.StoreError):
        store.put(key, b"x")
    with pytest.raises(ds.StoreError):
        store.get(key)


def test_check_key_accepts_layout_keys():
    for key in ["latest.json", "manifest/step_000000000001.json", "anchors/step_000000000010.safetensors"]:
        assert check_key(key) == key


def test_local_writes_are_atomic_and_leave_no_temp_files(tmp_path):
    store = LocalStore(tmp_path / "s")
    store.put("k/v.bin", b"1" * 1000)
    assert [p.name for p in (tmp_path / "s" / "k").iterdir()] == ["v.bin"]


def test_local_writers_remove_temp_files_left_by_killed_writers(tmp_path):
    """A writer killed mid-put leaves a `.deltasync-*.tmp` in the store; the next writer into that folder removes
    it once it is stale, and leaves a live writer's alone, as well as links and anything not its own."""
    root = tmp_path / "s"
    (root / "deltas").mkdir(parents=True)
    stale, live = root / "deltas" / ".deltasync-1234-abcd.tmp", root / "deltas" / ".deltasync-5678-ef01.tmp"
    other = root / "deltas" / "notes.tmp"
    outside = tmp_path / "outside.tmp"
    for path in (stale, live, other, outside):
        path.write_bytes(b"half an anchor")
    link = root / "deltas" / ".deltasync-9999-0000.tmp"
    link.symlink_to(outside)
    old = time.time() - 3600
    for path in (stale, other, outside):
        os.utime(path, (old, old))
    os.utime(link, (old, old), follow_symlinks=False)
    store = LocalStore(root)
    assert store.list() == ["deltas/notes.tmp"]  # temp files are never listed
    store.put("deltas/step_000000000001.safetensors", b"x")
    assert not stale.exists()
    assert live.exists() and other.exists() and outside.exists() and link.is_symlink()
    stale.write_bytes(b"again")
    os.utime(stale, (old, old))
    LocalStore(root, create=False).list()  # readers never delete
    assert stale.exists()


def test_temp_files_that_killed_processes_left_in_tmpdir_are_removed(tmp_path, monkeypatch, s3_url, s3_endpoint):
    """A publisher or subscriber of a remote store stages each anchor (the whole model) in a private file in
    TMPDIR; one killed there left it forever, a full anchor per crash (found by an adversarial helper). The next
    one removes those untouched for 15 minutes whose lock nobody holds (the owner holds it while it lives, in
    whatever PID namespace: a pid in the name told nothing there); a live owner's, fresh ones and other files stay."""
    import subprocess
    import sys

    from tests.conftest import s3_store

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(gone.stdout)
    old = time.time() - 3600
    names = {
        "dead": f".deltasync-{dead}-0123456789ab.tmp",
        "unnamed": ".deltasync-k2j4h5g6.tmp",  # mkstemp's name, of earlier versions
        "live": f".deltasync-{os.getpid()}-0123456789ab.tmp",
        "fresh": f".deltasync-{dead}-ba9876543210.tmp",
        "other": "notes.tmp",
    }
    for what, name in names.items():
        (tmpdir / name).write_bytes(b"an anchor")
        if what != "fresh":
            os.utime(tmpdir / name, (old, old))
    import fcntl

    held = os.open(tmpdir / names["live"], os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # as its live owner holds it
    state = {"w": np.arange(64, dtype=np.float32)}
    with ds.Publisher(s3_store(s3_url, s3_endpoint), background=False) as publisher:
        publisher.publish(0, state)  # an anchor, staged in TMPDIR
    assert sorted(p.name for p in tmpdir.iterdir()) == sorted(names[k] for k in ("live", "fresh", "other"))
    (tmpdir / names["dead"]).write_bytes(b"an anchor")
    os.utime(tmpdir / names["dead"], (old, old))
    target = {"w": np.zeros(64, dtype=np.float32)}
    assert ds.Subscriber(s3_store(s3_url, s3_endpoint)).pull(target) == 0  # the anchor, downloaded to TMPDIR
    assert sorted(p.name for p in tmpdir.iterdir()) == sorted(names[k] for k in ("live", "fresh", "other"))
    assert np.array_equal(target["w"], state["w"])
    os.close(held)
    # A private file of this process, untouched for long, is its own while it holds it: another sweep leaves it.
    from deltasync_rs.store import private_temp, remove_abandoned_temps, remove_temp

    fd, mine = private_temp()
    os.close(fd)  # the lock outlives the caller's descriptor
    os.utime(mine, (old, old))
    remove_abandoned_temps(str(tmpdir))
    assert os.path.exists(mine)
    remove_temp(mine)
    assert not os.path.exists(mine)
    remove_abandoned_temps(str(tmpdir))
    assert sorted(p.name for p in tmpdir.iterdir()) == sorted(names[k] for k in ("fresh", "other"))


def test_open_store_dispatch(tmp_path, s3_url):
    assert isinstance(open_store(tmp_path / "x"), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}/y"), LocalStore)
    assert type(open_store(s3_url)).__name__ == "FsspecStore"
    assert isinstance(open_store("hf://buckets/org/name/run", api=HubBucketsStandIn()), HFBucketStore)
    with pytest.raises(ds.StoreError, match="hf://buckets"):
        open_store("hf://models/org/name")
    store = LocalStore(tmp_path / "z")
    assert open_store(store) is store


def test_standin_matches_the_real_huggingface_hub_signatures():
    huggingface_hub = pytest.importorskip("huggingface_hub")
    for name in ["batch_bucket_files", "download_bucket_files", "list_bucket_tree"]:
        real = inspect.signature(getattr(huggingface_hub, name))
        standin = inspect.signature(getattr(HubBucketsStandIn(), name))
        real_params = {p.name: p.kind for p in real.parameters.values()}
        for param in standin.parameters.values():
            assert param.name in real_params, f"{name}: the stand-in takes {param.name}, the real one does not"
            assert param.kind == real_params[param.name], f"{name}: {param.name} is passed differently"


def test_hf_store_call_shapes():
    hub = HubBucketsStandIn()
    store = HFBucketStore("hf://buckets/org/bucket/run1", api=hub, token="hf_x")
    store.put("latest.json", b"{}")
    store.get("latest.json")
    store.list("manifest/")
    store.delete(["latest.json"])
    names = [call[0] for call in hub.calls]
    assert names == ["batch_bucket_files", "download_bucket_files", "list_bucket_tree", "batch_bucket_files"]
    assert hub.calls[0][1]["add"] == [(b"{}", "run1/latest.json")] and hub.calls[0][1]["token"] == "hf_x"
    assert hub.calls[1][1]["files"][0][0] == "run1/latest.json"
    assert hub.calls[2][1]["prefix"] == "run1/manifest" and hub.calls[2][1]["recursive"] is True
    assert hub.calls[3][1]["delete"] == ["run1/latest.json"]


def test_hf_store_uploads_large_objects_from_a_path():
    hub = HubBucketsStandIn()
    store = HFBucketStore("hf://buckets/org/bucket", api=hub)
    big = b"\x01" * ((64 << 20) + 1)
    store.put("anchors/step_000000000000.safetensors", big)
    source, remote = hub.calls[0][1]["add"][0]
    assert isinstance(source, str) and remote == "anchors/step_000000000000.safetensors"
    assert store.get("anchors/step_000000000000.safetensors") == big


def test_local_store_never_follows_a_link_out_of_its_root(tmp_path):
    store = LocalStore(tmp_path / "s")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "step_000000000001.safetensors").write_bytes(b"outside")
    (tmp_path / "s" / "anchors").symlink_to(elsewhere)
    with pytest.raises(ds.StoreError, match="symbolic link"):
        store.put("anchors/step_000000000002.safetensors", b"x")
    with pytest.raises(ds.StoreError, match="symbolic link"):
        store.delete(["anchors/step_000000000001.safetensors"])
    with pytest.raises(ds.StoreError, match="symbolic link"):
        store.get("anchors/step_000000000001.safetensors")
    with pytest.raises(ds.StoreError, match="symbolic link"):
        store.list("anchors/")
    assert sorted(p.name for p in elsewhere.iterdir()) == ["step_000000000001.safetensors"]
    assert store.list() == []  # the linked folder is not entered
    (tmp_path / "s" / "latest.json").symlink_to(elsewhere / "step_000000000001.safetensors")
    with pytest.raises(ds.StoreError, match="symbolic link"):
        store.get("latest.json")


def test_local_store_refuses_devices_and_caps_small_reads(tmp_path):
    store = LocalStore(tmp_path / "s")
    (tmp_path / "s" / "latest.json").symlink_to("/dev/zero")
    with pytest.raises(ds.StoreError):
        store.get_small("latest.json", 1 << 20)
    (tmp_path / "s" / "latest.json").unlink()
    os.mkfifo(tmp_path / "s" / "latest.json")
    with pytest.raises(ds.StoreError, match="not a regular file"):
        store.get("latest.json")  # and does not wait for a writer
    store.put("big.json", b"x" * 101)
    with pytest.raises(ds.StoreError, match="larger than 100 bytes"):
        store.get_small("big.json", 100)
    assert store.get_small("big.json", 101) == b"x" * 101


def test_get_small_caps_every_backend(store):
    store.put("manifest/step_000000000001.json", b"{" * 2000)
    with pytest.raises(ds.StoreError, match="larger than 1000 bytes"):
        store.get_small("manifest/step_000000000001.json", 1000)
    assert store.get_small("manifest/step_000000000001.json", 2000) == b"{" * 2000


def test_local_objects_honour_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        store = LocalStore(tmp_path / "s")
        store.put("manifest/step_000000000001.json", b"{}")
        mode = stat.S_IMODE((tmp_path / "s" / "manifest" / "step_000000000001.json").stat().st_mode)
    finally:
        os.umask(old)
    assert mode == 0o640


def test_readers_never_create_a_store_folder(tmp_path):
    typo = tmp_path / "no-such-store"
    store = open_store(typo, create=False)
    for read in (lambda: store.get("latest.json"), lambda: store.list("manifest/")):
        with pytest.raises(ds.StoreError, match="no such store folder") as caught:
            read()
        assert not isinstance(caught.value, ds.MissingObjectError) and str(typo) in str(caught.value)
    assert not typo.exists()


def test_put_file_and_get_file_roundtrip(store, tmp_path):
    """Objects go in from a file and come out into one, streamed, on every backend; a missing key is an error."""
    payload = bytes(range(256)) * 5000
    source = tmp_path / "source.bin"
    source.write_bytes(payload)
    store.put_file("anchors/step_000000000001.safetensors", source)
    assert store.get("anchors/step_000000000001.safetensors") == payload
    out = io.BytesIO()
    assert store.get_file("anchors/step_000000000001.safetensors", out) == len(payload)
    assert out.getvalue() == payload
    with open(tmp_path / "out.bin", "w+b") as real_file:  # a real file: the local store copies in the kernel
        real_file.write(b"head:")
        assert store.get_file("anchors/step_000000000001.safetensors", real_file) == len(payload)
        real_file.seek(0)
        assert real_file.read() == b"head:" + payload
    source.unlink()  # the caller's file may go once put_file returned (it must never be written to)
    assert store.get("anchors/step_000000000001.safetensors") == payload
    with pytest.raises(ds.MissingObjectError):
        store.get_file("anchors/step_000000000002.safetensors", io.BytesIO())
    with pytest.raises(ds.StoreError):
        store.put_file("../up", tmp_path / "missing")


def test_local_put_file_links_in_place_or_copies(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "s")
    staged = store.staging_folder() / ".deltasync-1-aa.tmp"
    staged.write_bytes(b"anchor bytes")
    store.put_file("anchors/step_000000000001.safetensors", staged)
    stored = tmp_path / "s" / "anchors" / "step_000000000001.safetensors"
    assert stored.read_bytes() == b"anchor bytes" and os.path.samefile(stored, staged)  # linked, not copied
    staged.unlink()
    assert store.list() == ["anchors/step_000000000001.safetensors"]

    def cross_device(*args, **kwargs):
        raise OSError(errno.EXDEV, "cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    elsewhere = tmp_path / "elsewhere.bin"
    elsewhere.write_bytes(b"copied")
    store.put_file("anchors/step_000000000002.safetensors", elsewhere)
    copied = tmp_path / "s" / "anchors" / "step_000000000002.safetensors"
    assert copied.read_bytes() == b"copied" and not os.path.samefile(copied, elsewhere)
    assert sorted(p.name for p in (tmp_path / "s" / "anchors").iterdir()) == [
        "step_000000000001.safetensors",
        "step_000000000002.safetensors",
    ]


def test_local_put_file_leaves_nothing_behind_on_error(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "s")
    source = tmp_path / "source.bin"
    source.write_bytes(b"x" * 1000)
    with pytest.raises(ds.StoreError):
        store.put_file("anchors/step_000000000001.safetensors", tmp_path / "no-such-file")
    real_replace = os.replace

    def failing_replace(*args, **kwargs):
        raise OSError(errno.EIO, "disk gone")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(ds.StoreError, match="disk gone"):
        store.put_file("anchors/step_000000000001.safetensors", source)
    monkeypatch.setattr(os, "replace", real_replace)
    assert list((tmp_path / "s" / "anchors").iterdir()) == []
    assert source.read_bytes() == b"x" * 1000


def test_local_get_file_refuses_links(tmp_path):
    store = LocalStore(tmp_path / "s")
    (tmp_path / "outside.bin").write_bytes(b"secret")
    (tmp_path / "s" / "anchors").mkdir()
    (tmp_path / "s" / "anchors" / "step_000000000001.safetensors").symlink_to(tmp_path / "outside.bin")
    with pytest.raises(ds.StoreError, match="symbolic link"):
        store.get_file("anchors/step_000000000001.safetensors", io.BytesIO())


def test_get_range_reads_exact_ranges_on_every_backend(store):
    payload = bytes(range(256)) * 40
    key = "anchors/step_000000000001.safetensors"
    store.put(key, payload)
    for start, length in ((0, 0), (0, 8), (5, 300), (4000, 1), (len(payload) - 17, 17), (len(payload), 0)):
        assert store.get_range(key, start, length) == payload[start : start + length]
    with pytest.raises(ds.StoreError, match="ends before"):
        store.get_range(key, len(payload) - 4, 5)
    with pytest.raises(ds.StoreError):
        store.get_range(key, -1, 4)
    with pytest.raises(ds.MissingObjectError):
        store.get_range("anchors/step_000000000002.safetensors", 0, 4)
    # HF Buckets download whole files only: the fallback is correct, and says it reads everything
    assert store.supports_ranges == (not isinstance(store, HFBucketStore))


def test_local_get_range_refuses_links_and_devices(tmp_path):
    store = LocalStore(tmp_path / "s")
    (tmp_path / "outside").write_bytes(b"secret bytes")
    (tmp_path / "s" / "anchors").mkdir()
    (tmp_path / "s" / "anchors" / "step_000000000001.safetensors").symlink_to(tmp_path / "outside")
    with pytest.raises(ds.StoreError, match="symbolic link"):
        store.get_range("anchors/step_000000000001.safetensors", 0, 4)
    os.mkfifo(tmp_path / "s" / "anchors" / "step_000000000002.safetensors")
    with pytest.raises(ds.StoreError, match="not a regular file"):
        store.get_range("anchors/step_000000000002.safetensors", 0, 4)


def test_a_long_lived_s3_subscriber_sees_objects_written_after_its_first_listing(s3_url, s3_endpoint):
    """s3fs keeps the folder listings its ``find`` fills (a plain ``s3://`` URL has that cache on), and ``open``
    looked files up there first: a subscriber that had listed ``anchors/`` once never saw a newer anchor, and
    every pull failed once retention removed the old one. Each process has its own filesystem object."""
    import torch

    from tests.conftest import s3_store
    from tests.test_sync import _fresh, _state, _train_step

    state = _state()
    subscriber = ds.Subscriber(s3_store(s3_url, s3_endpoint))
    with ds.Publisher(s3_store(s3_url, s3_endpoint), anchor_every=2, keep_anchors=1, background=False) as publisher:
        publisher.publish(0, state)
        replica = _fresh(state)
        assert subscriber.pull(replica) == 0
        for step in range(1, 6):
            _train_step(state, step)
            publisher.publish(step, state)
    assert subscriber.pull(replica) == 5
    assert all(torch.equal(replica[k].view(torch.int16), state[k].view(torch.int16)) for k in state)
    assert subscriber.store.list("anchors/") == [
        "anchors/step_000000000004.pieces",
        "anchors/step_000000000004.safetensors",
    ]


def test_a_bucket_that_does_not_exist_is_an_error_not_an_empty_store(s3_url, s3_endpoint):
    """`deltasync log` of a store in a bucket with a typo in its name said "0 steps" (found by an adversarial
    helper); an empty prefix of a bucket that exists is still a new, empty store."""
    from tests.conftest import s3_store

    missing = s3_url.split("/")[2] + "-typo"
    with pytest.raises(ds.StoreError, match="no such bucket"):
        s3_store(f"s3://{missing}/run1", s3_endpoint).list()
    assert s3_store(s3_url, s3_endpoint).list() == []


@pytest.mark.parametrize("write", ["put_file", "put"])
def test_an_interrupted_multipart_upload_to_s3_is_aborted(s3_url, s3_endpoint, tmp_path, monkeypatch, write):
    """Ctrl-C (or SIGTERM's exit) during a large upload: fsspec's wait returned at the interrupt and left the upload
    running until the process exited, and s3fs aborts a multipart upload only when its coroutine fails, so the
    parts sent so far stayed in the bucket, unlisted and billed (found by an adversarial helper, through the CLI).
    Now the upload is cancelled and what it opened is aborted; the interrupt still reaches the caller."""
    import _thread
    import asyncio
    import threading

    from tests.conftest import s3_store

    store = s3_store(s3_url, s3_endpoint)
    fs = store.fs
    real_call = fs._call_s3
    monkeypatch.setattr("s3fs.core.calculate_chunksize", lambda *args, **kwargs: 5 << 20)  # S3's smallest part

    async def slow_parts(method, *args, **kwargs):
        if method == "upload_part":
            await asyncio.sleep(3)
        return await real_call(method, *args, **kwargs)

    fs._call_s3 = slow_parts
    real_pipe = fs._pipe_file
    fs._pipe_file = lambda path, data, **kwargs: real_pipe(path, data, chunksize=5 << 20, **kwargs)
    source = tmp_path / "anchor"
    source.write_bytes(os.urandom(12 << 20))
    bucket, prefix = fs.split_path(store.root)[:2]

    def open_uploads():
        listed = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
        return [u["Key"] for u in listed.get("Uploads", [])]

    def interrupt_once_open():
        deadline = time.monotonic() + 30
        while not open_uploads() and time.monotonic() < deadline:
            time.sleep(0.05)
        if open_uploads():  # else the write ended first, and the test fails (an interrupt now would hit another)
            _thread.interrupt_main()

    interrupter = threading.Thread(target=interrupt_once_open)
    # Ctrl-C's own handler: a test before this one (a vLLM engine in this process) may have left another.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupter.start()
        with pytest.raises(KeyboardInterrupt):
            if write == "put":  # a large delta goes up in parts too
                store.put("anchors/00000001.safetensors", source.read_bytes())
            else:
                store.put_file("anchors/00000001.safetensors", source)
        interrupter.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert open_uploads() == []
    assert not store.exists("anchors/00000001.safetensors")
    fs._call_s3, fs._pipe_file = real_call, real_pipe
    store.put_file("anchors/00000001.safetensors", source)  # the store still works after it
    assert store.get_small("anchors/00000001.safetensors", 13 << 20) == source.read_bytes()


def test_the_hf_bucket_store_downloads_into_a_folder_a_later_sweep_removes_once_its_process_is_gone(
    tmp_path, monkeypatch
):
    """The HF Bucket store downloads each object (an anchor: the whole model) into a temporary folder; a process
    killed there left the folder in TMPDIR forever, since sweeps removed files only (found by an adversarial
    helper). The folder is named and locked like the private temporary files now, and swept like them."""
    import subprocess
    import sys

    from deltasync_rs.store import HFBucketStore, private_temp, private_temp_folder, remove_temp
    from tests.hub_standin import HubBucketsStandIn

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    store = HFBucketStore("hf://buckets/org/bucket/run1", api=HubBucketsStandIn(), token="hf_test")
    store.put("anchors/x", b"an anchor" * 1000)
    sink = io.BytesIO()
    assert store.get_file("anchors/x", sink) == 9000 and sink.getvalue() == b"an anchor" * 1000
    assert list(tmpdir.iterdir()) == []  # removed after the copy
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    old = time.time() - 3600
    killed = tmpdir / f".deltasync-{int(gone.stdout)}-0123456789ab.tmp"
    killed.mkdir()
    (killed / "object").write_bytes(b"a whole anchor")
    live = private_temp_folder()  # this process's own, held
    other = tmpdir / "deltasync-notes"  # not ours to remove
    other.mkdir()
    for folder in (killed, live, other):
        os.utime(folder, (old, old))
    fd, path = private_temp()  # each new temporary file or folder sweeps first
    os.close(fd)
    remove_temp(path)
    assert sorted(p.name for p in tmpdir.iterdir()) == sorted([os.path.basename(live), other.name])
    remove_temp(live)
    assert not os.path.exists(live)


def test_a_background_publishers_upload_cut_short_at_exit_is_aborted(s3_url, s3_endpoint, monkeypatch):
    """A background publisher's upload runs on its own thread: at exit, when waiting for it ran out, the process
    ended mid-upload and its multipart upload stayed open in the bucket (found by reviewing the fix for Ctrl-C,
    which covered the calling thread only). The exit-time close aborts it now."""
    import asyncio

    from tests.conftest import s3_store

    store = s3_store(s3_url, s3_endpoint)
    fs = store.fs
    real_call = fs._call_s3
    monkeypatch.setattr("s3fs.core.calculate_chunksize", lambda *args, **kwargs: 5 << 20)

    async def slow_parts(method, *args, **kwargs):
        if method == "upload_part":
            await asyncio.sleep(3)
        return await real_call(method, *args, **kwargs)

    fs._call_s3 = slow_parts
    bucket, prefix = fs.split_path(store.root)[:2]

    def open_uploads():
        listed = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
        return [u["Key"] for u in listed.get("Uploads", [])]

    publisher = ds.Publisher(store, exit_timeout=0.5)
    publisher.publish(0, {"w": np.frombuffer(os.urandom(12 << 20), dtype=np.uint8)})  # an anchor, uploaded in parts
    deadline = time.monotonic() + 30
    while not open_uploads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert open_uploads(), "the upload never started"
    publisher.publish(1, {"w": np.frombuffer(os.urandom(12 << 20), dtype=np.uint8)})  # a delta of 12 MB: in parts
    publisher._close_at_exit()  # what interpreter exit runs for a publisher never closed
    assert open_uploads() == []
    time.sleep(2)  # neither tried again (the retry opened a new upload), nor the next job started
    assert open_uploads() == []
    fs._call_s3 = real_call


def test_get_file_refuses_an_object_larger_than_max_bytes_before_copying_it(store, tmp_path):
    """A reader that knows an object's size (its signed entry's) takes no more: on a local folder by its size before
    the kernel copies anything, on the HF Bucket store by the size the bucket lists before the download (both read
    an object planted by a writer without the key whole first, into TMPDIR; found by reviewing the cap)."""
    from deltasync_rs.store import LISTED_SIZE_FROM, HFBucketStore, TooLargeError

    size = LISTED_SIZE_FROM + 5000  # an anchor's size: the HF Bucket store looks it up before downloading
    store.put("anchors/x", b"x" * size)
    with open(tmp_path / "out", "w+b") as out:
        with pytest.raises(TooLargeError, match=f"larger than {size - 1} bytes"):
            store.get_file("anchors/x", out, max_bytes=size - 1)
        out.flush()
        assert os.path.getsize(tmp_path / "out") == 0
        assert store.get_file("anchors/x", out, max_bytes=size) == size
    if isinstance(store, HFBucketStore):
        downloads = [c for c in store.api.calls if c[0] == "download_bucket_files"]
        assert len(downloads) == 1  # the one that fit


def test_a_local_store_copies_into_a_file_on_another_kind_of_file_system(tmp_path, monkeypatch):
    """copy_file_range between file systems of different types fails (EXDEV): a pull of an anchor from a local
    folder on disk into a TMPDIR on tmpfs raised "Invalid cross-device link" (found by an adversarial helper). The
    copy goes through memory there. Into /dev/shm (a tmpfs) where the machine has one, else with EXDEV made up."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        shm = tmp_path

        def cross_device(*args, **kwargs):
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(os, "copy_file_range", cross_device)
    store = ds.LocalStore(tmp_path / "store")
    data = os.urandom(3 << 20)
    store.put("anchors/x", data)
    fd, path = tempfile.mkstemp(dir=shm)
    try:
        with os.fdopen(fd, "w+b") as out:
            out.write(b"head")
            assert store.get_file("anchors/x", out, max_bytes=len(data)) == len(data)
            out.seek(0)
            assert out.read() == b"head" + data
    finally:
        os.unlink(path)
