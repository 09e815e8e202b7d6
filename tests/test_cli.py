"""The `deltasync` command end to end on real safetensors checkpoints: diff, apply, inspect, and their errors,
through `main([...])`, `python -m deltasync_rs.cli` and the installed console script."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import deltasync_rs as ds
from deltasync_rs.cli import main
from tests.helpers import assert_states_equal, bits, clone_state
from tests.test_trl import TRL_FORMAT, read_trl, trl_apply

NAMES = ["model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.bias"]


def _states():
    g = torch.Generator().manual_seed(11)
    prev = {
        NAMES[0]: torch.randn(96, 32, generator=g).to(torch.bfloat16),
        NAMES[1]: torch.randn(32, 64, generator=g),  # float32
        NAMES[2]: torch.randn(32, generator=g).to(torch.bfloat16),  # left unchanged
        NAMES[3]: torch.randn(17, generator=g).to(torch.float16),
    }
    curr = clone_state(prev)
    flat = curr[NAMES[0]].view(-1)
    flat[::6] = (flat[::6].float() * 1.03 + 0.002).to(torch.bfloat16)
    curr[NAMES[1]].view(torch.int32).view(-1)[torch.randperm(32 * 64, generator=g)[:50]] += 1
    curr[NAMES[3]].view(torch.int16)[[0, 16]] -= 1
    return prev, curr


def _num_changed(prev, curr):
    return sum(int((bits(prev[n]) != bits(curr[n])).sum()) for n in curr)


@pytest.fixture
def ckpts(tmp_path):
    prev, curr = _states()
    prev_path, curr_path = tmp_path / "prev.safetensors", tmp_path / "curr.safetensors"
    save_file(prev, prev_path)
    save_file(curr, curr_path)
    return prev, curr, prev_path, curr_path


def _run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _console_script() -> str:
    found = Path(sys.executable).parent / "deltasync"
    if found.exists():
        return str(found)
    which = shutil.which("deltasync")
    assert which, "the deltasync console script is not installed next to the interpreter or on PATH"
    return which


def _subprocess(args, cwd):
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_diff_then_apply_reproduces_curr_bit_exactly(tmp_path, capsys, ckpts):
    prev, curr, prev_path, curr_path = ckpts
    delta_path, out_path = tmp_path / "delta.safetensors", tmp_path / "out.safetensors"

    rc, out, err = _run(capsys, "diff", prev_path, curr_path, "-o", delta_path)
    assert (rc, err) == (0, "")
    assert str(delta_path) in out and f"{len(NAMES)} tensors" in out
    assert f"{_num_changed(prev, curr)} of {sum(t.numel() for t in curr.values())} elements changed" in out
    delta = ds.load(delta_path)
    assert sorted(delta.names) == sorted(NAMES)
    assert delta.num_changed == _num_changed(prev, curr)
    assert delta.step is None and delta.base_step is None

    rc, out, err = _run(capsys, "apply", prev_path, delta_path, "-o", out_path)
    assert (rc, err) == (0, "")
    assert str(out_path) in out
    applied = load_file(out_path)
    assert sorted(applied) == sorted(curr)
    assert_states_equal({n: applied[n] for n in curr}, curr)
    # apply copies the base file and patches tensor bytes: with headers written alike, the files are identical
    assert out_path.read_bytes() == curr_path.read_bytes()
    assert prev_path.read_bytes() != curr_path.read_bytes()
    base = load_file(prev_path)  # the base file is left as it was
    assert_states_equal({n: base[n] for n in prev}, prev)


def test_compact_codec_is_smaller_and_applies_bit_exactly(tmp_path, capsys, ckpts):
    prev, curr, prev_path, curr_path = ckpts
    varint_path, compact_path = tmp_path / "varint.safetensors", tmp_path / "compact.safetensors"
    out_path = tmp_path / "out.safetensors"
    assert _run(capsys, "diff", prev_path, curr_path, "-o", varint_path, "--codec", "varint")[0] == 0
    rc, out, err = _run(capsys, "diff", prev_path, curr_path, "-o", compact_path)  # compact is the default
    assert (rc, err) == (0, "")
    varint, compact = ds.load(varint_path), ds.load(compact_path)
    assert compact.num_changed == varint.num_changed == _num_changed(prev, curr)
    assert compact.nbytes < varint.nbytes
    assert {(t.positions, t.values) for t in compact.tensors if t.changed} >= {("rice", "rans")}
    rc, out, err = _run(capsys, "inspect", compact_path)
    assert rc == 0 and "rice/rans" in out
    rc, out, err = _run(capsys, "apply", prev_path, compact_path, "-o", out_path)
    assert (rc, err) == (0, "")
    assert out_path.read_bytes() == curr_path.read_bytes()


def test_abs_trl_output_loads_everywhere(tmp_path, capsys, ckpts):
    prev, curr, prev_path, curr_path = ckpts
    trl_path = tmp_path / "deltas" / "step_000007.safetensors"
    trl_path.parent.mkdir()
    rc, _, err = _run(
        capsys, "diff", prev_path, curr_path, "-o", trl_path, "--values", "abs", "--format", "trl", "--step", 7
    )
    assert (rc, err) == (0, "")
    data = trl_path.read_bytes()

    meta, params = read_trl(data)
    assert meta["format"] == TRL_FORMAT and meta["version"] == "1" and meta["sparse"] == "True"
    assert meta["model_version"] == "7"
    changed = [n for n in NAMES if n != "model.norm.weight"]
    assert sorted(params) == sorted(changed)
    assert sorted(json.loads(meta["changed_params"])) == sorted(changed)
    assert meta["total_changed_elements"] == str(_num_changed(prev, curr))
    target = clone_state(prev)
    trl_apply(data, target)
    assert_states_equal(target, curr)

    delta = ds.load(trl_path)
    assert delta.step == 7 and sorted(delta.names) == sorted(changed)
    target = clone_state(prev)
    delta.apply_(target)
    assert_states_equal(target, curr)

    # the CLI applies TRL files too
    out_path = tmp_path / "out.safetensors"
    rc, _, err = _run(capsys, "apply", prev_path, trl_path, "-o", out_path)
    assert (rc, err) == (0, "")
    assert out_path.read_bytes() == curr_path.read_bytes()


def test_diff_values_to_trl_is_an_error(tmp_path, capsys, ckpts):
    _, _, prev_path, curr_path = ckpts
    out_path = tmp_path / "d.safetensors"
    rc, out, err = _run(capsys, "diff", prev_path, curr_path, "-o", out_path, "--format", "trl")
    assert rc == 1 and out == ""
    assert err.startswith("deltasync diff: error:") and "abs" in err
    assert not out_path.exists()


def test_step_and_base_step_are_recorded(tmp_path, capsys, ckpts):
    prev, curr, prev_path, curr_path = ckpts
    delta_path = tmp_path / "d.safetensors"
    rc, _, _ = _run(capsys, "diff", prev_path, curr_path, "-o", delta_path, "--step", 9, "--base-step", 8)
    assert rc == 0
    delta = ds.load(delta_path)
    assert (delta.step, delta.base_step) == (9, 8)
    rc, out, _ = _run(capsys, "inspect", delta_path, "--json")
    assert rc == 0
    report = json.loads(out)
    assert (report["step"], report["base_step"]) == (9, 8)


def test_inspect_table_and_json(tmp_path, capsys, ckpts):
    prev, curr, prev_path, curr_path = ckpts
    delta_path = tmp_path / "d.safetensors"
    assert _run(capsys, "diff", prev_path, curr_path, "-o", delta_path, "--step", 3)[0] == 0

    rc, out, err = _run(capsys, "inspect", delta_path)
    assert (rc, err) == (0, "")
    for name in NAMES:
        assert name in out
    lines = out.splitlines()
    total_lines = [line for line in lines if line.startswith("total:")]
    assert len(total_lines) == 1
    expected = _num_changed(prev, curr)
    assert f"total: {expected} of {sum(t.numel() for t in curr.values())} elements changed" in total_lines[0]
    assert "step=3" in lines[0]
    header = json.loads(delta_path.read_bytes()[8 : 8 + int.from_bytes(delta_path.read_bytes()[:8], "little")])
    value = header["__metadata__"]["file_xxh3"]
    assert lines[1] == f"  checksum: file_xxh3 {value}, checked"

    rc, out, err = _run(capsys, "inspect", delta_path, "--json")
    assert (rc, err) == (0, "")
    report = json.loads(out)
    assert report["kind"] == "delta" and report["checksum"] == value
    assert report["num_changed"] == expected
    assert report["num_elements"] == sum(t.numel() for t in curr.values())
    by_name = {t["name"]: t for t in report["tensors"]}
    assert sorted(by_name) == sorted(NAMES)
    for name in NAMES:
        assert by_name[name]["changed"] == int((bits(prev[name]) != bits(curr[name])).sum())
        assert by_name[name]["shape"] == list(curr[name].shape)
    assert by_name["model.norm.weight"]["changed"] == 0


def test_inspect_trl_file_has_unknown_shapes(tmp_path, capsys, ckpts):
    prev, curr, prev_path, curr_path = ckpts
    trl_path = tmp_path / "t.safetensors"
    assert _run(capsys, "diff", prev_path, curr_path, "-o", trl_path, "--values", "abs", "--format", "trl")[0] == 0
    rc, out, _ = _run(capsys, "inspect", trl_path, "--json")
    assert rc == 0
    report = json.loads(out)
    assert report["num_changed"] == _num_changed(prev, curr)
    assert all(t["shape"] is None and t["density"] is None for t in report["tensors"])
    assert report["checksum"] is None
    rc, out, _ = _run(capsys, "inspect", trl_path)
    assert rc == 0 and "total:" in out and "lm_head.bias" in out and "checksum: none" in out


def test_apply_to_mismatched_base_fails_cleanly(tmp_path, capsys, ckpts):
    prev, curr, prev_path, curr_path = ckpts
    delta_path, out_path = tmp_path / "d.safetensors", tmp_path / "out.safetensors"
    assert _run(capsys, "diff", prev_path, curr_path, "-o", delta_path)[0] == 0
    bad = clone_state(prev)
    bad["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 32)  # same numel, other shape
    bad_path = tmp_path / "bad.safetensors"
    save_file(bad, bad_path)
    before = sorted(p.name for p in tmp_path.iterdir())

    rc, out, err = _run(capsys, "apply", bad_path, delta_path, "-o", out_path)
    assert rc == 1 and out == ""
    assert err.startswith("deltasync apply: error:")
    assert "model.layers.0.mlp.down_proj.weight" in err
    assert not out_path.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary left behind


def test_apply_refuses_a_wrong_base_and_a_second_application(tmp_path, capsys, ckpts):
    """A diff delta applied to another state, or twice, is refused by the base identity before anything is written;
    --no-check-base writes anyway (the caller's choice), as before."""
    prev, curr, prev_path, curr_path = ckpts
    delta_path, out_path = tmp_path / "d.safetensors", tmp_path / "out.safetensors"
    assert _run(capsys, "diff", prev_path, curr_path, "-o", delta_path)[0] == 0
    rc, out, err = _run(capsys, "apply", curr_path, delta_path, "-o", out_path)  # already at the new state
    assert rc == 1 and "not the base" in err and not out_path.exists()
    drifted = clone_state(prev)
    bits(drifted["model.norm.weight"])[3] += 1  # a tensor the delta does not even change
    drifted_path = tmp_path / "drifted.safetensors"
    save_file(drifted, drifted_path)
    rc, out, err = _run(capsys, "apply", drifted_path, delta_path, "-o", out_path)
    assert rc == 1 and "model.norm.weight" in err and not out_path.exists()
    assert _run(capsys, "apply", prev_path, delta_path, "-o", out_path)[0] == 0
    applied = load_file(out_path)
    assert_states_equal({name: applied[name] for name in curr}, curr)
    assert _run(capsys, "apply", drifted_path, delta_path, "-o", out_path, "--no-check-base")[0] == 0


def test_apply_trl_index_beyond_base_fails_cleanly(tmp_path, capsys, ckpts):
    prev, curr, prev_path, curr_path = ckpts
    trl_path, out_path = tmp_path / "t.safetensors", tmp_path / "out.safetensors"
    assert _run(capsys, "diff", prev_path, curr_path, "-o", trl_path, "--values", "abs", "--format", "trl")[0] == 0
    small = clone_state(prev)
    small["lm_head.bias"] = small["lm_head.bias"][:16].clone()  # the delta changes position 16
    small_path = tmp_path / "small.safetensors"
    save_file(small, small_path)
    rc, _, err = _run(capsys, "apply", small_path, trl_path, "-o", out_path)
    assert rc == 1 and "lm_head.bias" in err
    assert not out_path.exists()


def test_diff_of_different_names_fails(tmp_path, capsys, ckpts):
    prev, curr, prev_path, _ = ckpts
    other = dict(curr)
    other["model.extra.weight"] = other.pop("model.norm.weight")
    other_path = tmp_path / "other.safetensors"
    save_file(other, other_path)
    out_path = tmp_path / "d.safetensors"
    for a, b in ((prev_path, other_path), (other_path, prev_path)):
        rc, out, err = _run(capsys, "diff", a, b, "-o", out_path)
        assert rc == 1 and out == ""
        assert err.startswith("deltasync diff: error:")
        assert "model.norm.weight" in err or "model.extra.weight" in err
        assert not out_path.exists()


def test_diff_of_different_dtypes_fails(tmp_path, capsys, ckpts):
    prev, curr, prev_path, _ = ckpts
    other = dict(curr)
    other["model.norm.weight"] = other["model.norm.weight"].half()
    other_path = tmp_path / "other.safetensors"
    save_file(other, other_path)
    rc, _, err = _run(capsys, "diff", prev_path, other_path, "-o", tmp_path / "d.safetensors")
    assert rc == 1 and "model.norm.weight" in err


def test_missing_files_fail_with_the_path(tmp_path, capsys, ckpts):
    _, _, prev_path, curr_path = ckpts
    missing = tmp_path / "no-such-checkpoint.safetensors"
    delta_path = tmp_path / "d.safetensors"
    assert _run(capsys, "diff", prev_path, curr_path, "-o", delta_path)[0] == 0
    cases = [
        ("diff", ["diff", missing, curr_path, "-o", tmp_path / "x.safetensors"]),
        ("diff", ["diff", prev_path, missing, "-o", tmp_path / "x.safetensors"]),
        ("apply", ["apply", missing, delta_path, "-o", tmp_path / "x.safetensors"]),
        ("apply", ["apply", prev_path, missing, "-o", tmp_path / "x.safetensors"]),
        ("inspect", ["inspect", missing]),
        ("inspect", ["inspect", missing, "--json"]),
    ]
    for command, argv in cases:
        rc, out, err = _run(capsys, *argv)
        assert rc == 1, argv
        assert out == "", argv
        assert err.startswith(f"deltasync {command}: error:"), err
        assert str(missing) in err, err
    assert not (tmp_path / "x.safetensors").exists()


def test_apply_in_place_replaces_the_base(tmp_path, capsys, ckpts):
    prev, curr, prev_path, curr_path = ckpts
    delta_path = tmp_path / "d.safetensors"
    assert _run(capsys, "diff", prev_path, curr_path, "-o", delta_path)[0] == 0
    work = tmp_path / "work.safetensors"
    shutil.copyfile(prev_path, work)
    rc, _, err = _run(capsys, "apply", work, delta_path, "-o", work)
    assert (rc, err) == (0, "")
    assert work.read_bytes() == curr_path.read_bytes()
    assert_states_equal({n: load_file(work)[n] for n in curr}, curr)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["prev.safetensors", "curr.safetensors", "d.safetensors", "work.safetensors"]
    )


def test_python_dash_m_round_trip(tmp_path, ckpts):
    prev, curr, prev_path, curr_path = ckpts
    py = [sys.executable, "-m", "deltasync_rs.cli"]
    delta_path, out_path = tmp_path / "d.safetensors", tmp_path / "out.safetensors"
    r = _subprocess(py + ["diff", prev_path, curr_path, "-o", delta_path, "--step", 2, "--base-step", 1], tmp_path)
    assert r.returncode == 0, r.stderr
    r = _subprocess(py + ["apply", prev_path, delta_path, "-o", out_path], tmp_path)
    assert r.returncode == 0, r.stderr
    assert out_path.read_bytes() == curr_path.read_bytes()
    r = _subprocess(py + ["inspect", delta_path, "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert (report["num_changed"], report["step"], report["base_step"]) == (_num_changed(prev, curr), 2, 1)
    # the process exit status carries errors
    r = _subprocess(py + ["inspect", tmp_path / "missing.safetensors"], tmp_path)
    assert r.returncode == 1
    assert "deltasync inspect: error:" in r.stderr and "missing.safetensors" in r.stderr


def test_console_script(tmp_path, ckpts):
    prev, curr, prev_path, curr_path = ckpts
    exe = _console_script()
    trl_path, out_path = tmp_path / "t.safetensors", tmp_path / "out.safetensors"
    r = _subprocess([exe, "diff", prev_path, curr_path, "-o", trl_path, "--values", "abs", "--format", "trl"], tmp_path)
    assert r.returncode == 0, r.stderr
    target = clone_state(prev)
    trl_apply(trl_path.read_bytes(), target)
    assert_states_equal(target, curr)
    r = _subprocess([exe, "apply", prev_path, trl_path, "-o", out_path], tmp_path)
    assert r.returncode == 0, r.stderr
    assert out_path.read_bytes() == curr_path.read_bytes()
    r = _subprocess([exe, "inspect", trl_path], tmp_path)
    assert r.returncode == 0 and "total:" in r.stdout
    r = _subprocess([exe, "apply", prev_path, tmp_path / "nope.safetensors", "-o", out_path], tmp_path)
    assert r.returncode == 1 and "nope.safetensors" in r.stderr
    r = _subprocess([exe, "--version"], tmp_path)
    assert r.returncode == 0 and ds.__version__ in r.stdout
    assert os.access(exe, os.X_OK)


def test_bad_inputs_fail_with_a_message(tmp_path, capsys, ckpts):
    _, _, prev_path, curr_path = ckpts
    delta_path = tmp_path / "d.safetensors"
    assert _run(capsys, "diff", prev_path, curr_path, "-o", delta_path)[0] == 0
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"this is not a safetensors file at all")
    cases = [
        (["inspect", prev_path], "deltasync inspect: error:", "plain checkpoint"),  # a checkpoint is not a delta
        (
            ["apply", prev_path, curr_path, "-o", tmp_path / "x.safetensors"],
            "deltasync apply: error:",
            "curr.safetensors",
        ),
        (["apply", junk, delta_path, "-o", tmp_path / "x.safetensors"], "deltasync apply: error:", "junk.safetensors"),
        (["inspect", junk], "deltasync inspect: error:", "junk.safetensors"),
        (
            ["diff", prev_path, curr_path, "-o", tmp_path / "no-such-dir" / "d.safetensors"],
            "deltasync diff: error:",
            "no-such-dir",
        ),
    ]
    for argv, prefix, detail in cases:
        rc, out, err = _run(capsys, *argv)
        assert rc == 1 and out == "", argv
        assert err.startswith(prefix) and detail in err, err
    assert not (tmp_path / "x.safetensors").exists()
    # argument errors are argparse's: exit status 2
    with pytest.raises(SystemExit) as exc:
        main(["diff", str(prev_path), str(curr_path), "-o", str(delta_path), "--values", "nope"])
    assert exc.value.code == 2
    capsys.readouterr()


@pytest.mark.parametrize("flag", ["--step", "--base-step"])
def test_negative_step_is_a_clean_error(tmp_path, capsys, ckpts, flag):
    _, _, prev_path, curr_path = ckpts
    out_path = tmp_path / "d.safetensors"
    try:
        rc = main(["diff", str(prev_path), str(curr_path), "-o", str(out_path), flag, "-1"])
    except SystemExit as exit_:  # rejecting it while parsing arguments is fine too
        rc = exit_.code
    err = capsys.readouterr().err
    assert rc in (1, 2)
    assert "deltasync diff: error:" in err
    assert not out_path.exists()


def test_bench_prints_a_table_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "bench.png"
    rc, out, err = _run(
        capsys, "bench", "--scale", "0.002", "--densities", "1%", "0.05", "--rounds", "1", "--plot", plot
    )
    assert rc == 0, err
    for what in ("deltasync varint", "deltasync compact", "TRL v1", "TRL v3 gap_delta", "read floor"):
        assert what in out
    from deltasync_rs import _core

    assert _core.scan_kernel() in ("avx512", "avx2", "sse2", "portable")
    assert f"{_core.scan_kernel()} compare kernel" in out
    rows = [line.split() for line in out.splitlines() if "deltasync" in line]
    assert [row[0] for row in rows] == ["1.00%", "1.00%", "5.00%", "5.00%"]
    sizes = {(row[0], row[2]): float(row[3]) for row in rows}
    assert sizes[("1.00%", "compact")] < sizes[("1.00%", "varint")]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_outputs_honour_the_umask_and_apply_keeps_the_base_mode(tmp_path, capsys, ckpts):
    _, _, prev_path, curr_path = ckpts
    delta_path, out_path, work = tmp_path / "d.safetensors", tmp_path / "out.safetensors", tmp_path / "work.safetensors"
    old = os.umask(0o022)
    try:
        assert _run(capsys, "diff", prev_path, curr_path, "-o", delta_path)[0] == 0
        assert _run(capsys, "apply", prev_path, delta_path, "-o", out_path)[0] == 0
        shutil.copyfile(prev_path, work)
        work.chmod(0o640)
        assert _run(capsys, "apply", work, delta_path, "-o", work)[0] == 0
        store = tmp_path / "store"
        assert _run(capsys, "publish", curr_path, "--store", store, "--step", "0")[0] == 0
        assert _run(capsys, "pull", "--store", store, "-o", tmp_path / "pulled.safetensors")[0] == 0
    finally:
        os.umask(old)
    modes = {
        p.name: stat.S_IMODE(p.stat().st_mode)
        for p in (
            delta_path,
            out_path,
            work,
            tmp_path / "pulled.safetensors",
            store / "manifest" / "step_000000000000.json",
        )
    }
    assert modes == {
        "d.safetensors": 0o644,
        "out.safetensors": 0o644,
        "work.safetensors": 0o640,
        "pulled.safetensors": 0o644,
        "step_000000000000.json": 0o644,
    }
    assert work.read_bytes() == curr_path.read_bytes()


def test_an_output_that_is_one_of_the_inputs_is_refused(tmp_path, capsys, ckpts):
    _, _, prev_path, curr_path = ckpts
    delta_path = tmp_path / "d.safetensors"
    assert _run(capsys, "diff", prev_path, curr_path, "-o", delta_path)[0] == 0
    alias = tmp_path / "alias.safetensors"
    alias.symlink_to(prev_path)
    before = {p: p.read_bytes() for p in (prev_path, curr_path, delta_path)}
    for argv in (
        ["diff", prev_path, curr_path, "-o", prev_path],
        ["diff", prev_path, curr_path, "-o", curr_path],
        ["diff", prev_path, curr_path, "-o", alias],
        ["apply", prev_path, delta_path, "-o", delta_path],
    ):
        rc, out, err = _run(capsys, *argv)
        assert rc == 1 and out == "", argv
        assert "is also the input" in err, err
    assert {p: p.read_bytes() for p in before} == before


def test_stale_temp_files_of_killed_runs_are_removed(tmp_path, capsys, ckpts):
    _, _, prev_path, curr_path = ckpts
    stale, live = tmp_path / ".deltasync-1234-abcd.tmp", tmp_path / ".deltasync-5678-ef01.tmp"
    for path in (stale, live):
        path.write_bytes(b"half a checkpoint")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    assert _run(capsys, "diff", prev_path, curr_path, "-o", tmp_path / "d.safetensors")[0] == 0
    assert not stale.exists() and live.exists()


def test_non_regular_inputs_are_refused_without_hanging(tmp_path, capsys, ckpts):
    _, _, prev_path, _ = ckpts
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    results = []
    runs = [
        ["inspect", fifo],
        ["diff", prev_path, fifo, "-o", tmp_path / "d.safetensors"],
        ["apply", prev_path, fifo, "-o", tmp_path / "o.safetensors"],
        ["inspect", tmp_path],
    ]
    worker = threading.Thread(target=lambda: results.extend(main([str(a) for a in argv]) for argv in runs), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "a command waits on a FIFO"
    assert results == [1, 1, 1, 1]
    assert capsys.readouterr().err.count("not a regular file") == 4


def test_publish_refuses_to_resume_below_a_newest_step_it_cannot_rebuild(ckpts, tmp_path, capsys):
    """The newest step's delta unreadable (a damaged file, or a read that failed): the rebuild reaches only an
    older step, and resuming there would remove the newer steps. Refused, and the store left as it was."""
    prev, curr, prev_path, curr_path = ckpts
    store = tmp_path / "store"
    for step, path in enumerate((prev_path, curr_path, prev_path)):
        assert _run(capsys, "publish", path, "--store", store, "--step", step)[0] == 0
    damaged = store / "deltas" / "step_000000000002.safetensors"
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    listed = sorted(p.relative_to(store) for p in store.rglob("*"))
    rc, _, err = _run(capsys, "publish", curr_path, "--store", store, "--step", 3)
    assert rc == 1 and "the newest step 2 could not be rebuilt (only step 1)" in err
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == listed


def test_publish_resume_at_an_older_step_continues_from_it_and_removes_the_later_steps(ckpts, tmp_path, capsys):
    """A trainer restarted from the checkpoint of step 1 publishes its step 2 with --resume-at 1: step 1's state is
    rebuilt and checked, the old steps 2 and 3 (a history the run leaves) are removed, and step 2 is a delta from
    step 1 that pulls bit-exact. Before, a step not after the store's newest was refused with no way on but a new
    store. Bad combinations are refused with the store left as it was."""
    prev, curr, prev_path, curr_path = ckpts
    store, out = tmp_path / "store", tmp_path / "out.safetensors"
    for step, path in enumerate((prev_path, curr_path, prev_path, curr_path)):
        assert _run(capsys, "publish", path, "--store", store, "--step", step)[0] == 0
    listed = sorted(p.relative_to(store) for p in store.rglob("*"))
    for argv, message in [
        (("--step", 2, "--resume-at", 2), "--step 2 is not after --resume-at 2"),
        (("--step", 9, "--resume-at", 7), "--resume-at 7: the store's newest step is 3"),
        (("--step", 2, "--resume-at", 1, "--anchor"), "--resume-at and --anchor"),
    ]:
        rc, _, err = _run(capsys, "publish", prev_path, "--store", store, *argv)
        assert rc == 1 and message in err, err
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == listed

    rc, out_text, err = _run(capsys, "publish", prev_path, "--store", store, "--step", 2, "--resume-at", 1)
    assert rc == 0, err
    entries = ds.sync.log_entries(str(store))
    assert [(e.step, e.base_step) for e in entries] == [(0, None), (1, 0), (2, 1)]
    assert entries[-1].delta is not None and entries[-1].anchor is None
    assert _run(capsys, "pull", "--store", store, "-o", out)[0] == 0
    assert_states_equal(dict(sorted(load_file(out).items())), dict(sorted(prev.items())))


def test_publish_dtype_casts_float_checkpoints_as_torch_does(tmp_path, capsys):
    """A trainer that keeps float32 weights saves float32 checkpoints, where nearly every element changes each step;
    --dtype bfloat16 publishes the bf16 weights an engine serves, cast as torch's .to() casts them (every bit
    pattern but NaNs), integer tensors kept, and a float64 tensor refused by name with nothing written."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    store, out = tmp_path / "store", tmp_path / "out.safetensors"
    expected = []
    for step in range(3):
        if step:
            model(torch.randn(4, 64)).square().mean().backward()
            optimizer.step()
        state = {name: p.detach().clone() for name, p in model.state_dict().items()}
        state["counter"] = torch.tensor([step, 7], dtype=torch.int64)
        path = tmp_path / f"step{step}.safetensors"
        save_file(state, path)
        rc, _, err = _run(capsys, "publish", path, "--store", store, "--step", step, "--dtype", "bfloat16")
        assert rc == 0, err
        expected.append({n: (t if n == "counter" else t.to(torch.bfloat16)) for n, t in state.items()})
    entry = ds.Subscriber(str(store)).entry(2)
    assert 0 < entry.num_changed < 0.2 * sum(t.numel() for t in expected[2].values())  # float32: nearly all
    for step in range(3):
        assert _run(capsys, "pull", "--store", store, "--step", step, "-o", out)[0] == 0
        pulled = load_file(out)
        assert sorted(pulled) == sorted(expected[step])
        for name in pulled:
            assert pulled[name].dtype == expected[step][name].dtype, name
            assert torch.equal(bits(pulled[name]), bits(expected[step][name])), (step, name)

    # Every bit pattern of each source dtype but NaN, to each target, as torch casts it.
    from deltasync_rs._arrays import numpy_dtype
    from deltasync_rs.cli import _cast

    g = torch.Generator().manual_seed(2)
    every_half = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    sources = {
        (torch.float32, "F32"): torch.randint(-(2**31), 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int32),
        (torch.float16, "F16"): every_half,
        (torch.bfloat16, "BF16"): every_half,
    }
    for (source, source_name), patterns in sources.items():
        values = patterns.view(source)
        kept = ~torch.isnan(values.float())
        array = patterns.numpy().view(numpy_dtype(source_name))
        for target, name in [(torch.bfloat16, "bfloat16"), (torch.float16, "float16"), (torch.float32, "float32")]:
            cast = torch.from_numpy(_cast({"x": array}, name, "p")["x"].view(f"int{target.itemsize * 8}"))
            assert torch.equal(cast[kept], bits(values.to(target))[kept]), (source, target)

    wide = tmp_path / "wide.safetensors"
    save_file({"w": torch.zeros(3, dtype=torch.float64)}, wide)
    rc, _, err = _run(capsys, "publish", wide, "--store", tmp_path / "store2", "--step", 0, "--dtype", "bfloat16")
    assert rc == 1 and "tensor 'w' is float64" in err, err
    assert not (tmp_path / "store2").exists()


def test_outputs_that_are_not_files_and_stores_that_cannot_be_read_back_are_refused(ckpts, tmp_path, capsys):
    """From an adversarial helper running the CLI as an operator: an output that was a device or a FIFO was
    replaced by the written file (as root, -o /dev/null replaced /dev/null) with exit code 0; a store URL with an
    empty part published steps no reader could list back; a publisher without the key wrote unsigned steps into a
    signed store, which every reader with the key then refused."""
    _, curr, prev_path, curr_path = ckpts
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    delta = tmp_path / "d.safetensors"
    assert _run(capsys, "diff", prev_path, curr_path, "-o", delta)[0] == 0
    for argv in (
        ("diff", prev_path, curr_path, "-o", fifo),
        ("apply", prev_path, delta, "-o", fifo),
    ):
        rc, _, err = _run(capsys, *argv)
        assert rc == 1 and "not a regular file" in err, err
        assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    with pytest.raises(ds.DeltaSyncError, match="not a regular file"):
        ds.load(delta).save(fifo)
    with pytest.raises(ds.StoreError, match="empty part"):
        ds.open_store("memory://bucket//run")
    store = tmp_path / "signed"
    with ds.Publisher(store, signing_key="k" * 32, background=False) as publisher:
        publisher.publish(0, {"w": torch.zeros(4)})
    with pytest.raises(ds.IntegrityError, match="store is signed"):
        ds.Publisher(store)
    rc, _, err = _run(capsys, "publish", "--store", store, curr_path, "--step", 1)
    assert rc == 1 and "store is signed" in err, err
    assert ds.Subscriber(store, signing_key="k" * 32).latest_step() == 0


def test_output_into_a_closed_pipe_ends_quietly(tmp_path, ckpts):
    """`deltasync inspect FILE | head -1`: the reader goes away before the output is written. That was a
    BrokenPipeError traceback on stderr; now the command stops quietly with 141 (128 + SIGPIPE), as a shell reports
    other commands a closed pipe ended."""
    _, _, prev_path, curr_path = ckpts
    delta_path = tmp_path / "d.safetensors"
    assert (
        _subprocess(
            [sys.executable, "-m", "deltasync_rs.cli", "diff", prev_path, curr_path, "-o", delta_path], tmp_path
        ).returncode
        == 0
    )
    read, write = os.pipe()
    os.close(read)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "deltasync_rs.cli", "inspect", str(delta_path)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert (run.returncode, run.stderr) == (141, "")
