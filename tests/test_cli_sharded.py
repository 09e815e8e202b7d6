"""The `deltasync` command on Hugging Face sharded checkpoints (``save_pretrained`` above ``max_shard_size``: a
folder of shards and ``model.safetensors.index.json``), as a trainer writes them: diff, apply (a folder of shards
out, all or nothing), publish and pull, and the layouts it refuses."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltasync_rs.cli import main
from tests.helpers import assert_states_equal, bits

transformers = pytest.importorskip("transformers")

INDEX = "model.safetensors.index.json"


def _run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _merged(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / INDEX).read_text())
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        state |= load_file(folder / shard)
    assert sorted(state) == sorted(index["weight_map"])
    return dict(sorted(state.items()))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny Llama saved sharded in bf16 before and after one real AdamW step (4+ shards), and its states."""
    root = tmp_path_factory.mktemp("sharded")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    folders = []
    for step in range(2):
        if step:
            ids = torch.randint(0, 256, (2, 16))
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
        folder = root / f"checkpoint-{step}"
        model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="60KB", safe_serialization=True)
        model.float()
        folders.append(folder)
    assert len({p.name for p in folders[0].glob("*.safetensors")}) >= 4
    return folders[0], folders[1], _merged(folders[0]), _merged(folders[1])


def test_diff_and_apply_of_sharded_checkpoints_write_a_sharded_checkpoint(sharded, tmp_path, capsys):
    """The folder or its index names a sharded checkpoint; apply writes every shard under its own name and the
    index into the output folder, which transformers loads as the newer checkpoint."""
    prev_dir, curr_dir, prev, curr = sharded
    for prev_arg, curr_arg in [(prev_dir, curr_dir), (prev_dir / INDEX, curr_dir / INDEX)]:
        delta = tmp_path / "d.safetensors"
        rc, out, err = _run(capsys, "diff", prev_arg, curr_arg, "-o", delta)
        assert rc == 0, err
        changed = sum(int((bits(prev[n]) != bits(curr[n])).sum()) for n in curr)
        assert f"{changed} of" in out and changed > 0
        out_dir = tmp_path / "out"
        rc, _, err = _run(capsys, "apply", prev_arg, delta, "-o", out_dir)
        assert rc == 0, err
        # the shards, the index and the base folder's other files (config.json: transformers loads the folder)
        assert sorted(p.name for p in out_dir.iterdir()) == sorted(p.name for p in prev_dir.iterdir())
        assert (out_dir / INDEX).read_bytes() == (prev_dir / INDEX).read_bytes()
        assert_states_equal(_merged(out_dir), curr)
        reloaded = transformers.LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.bfloat16)
        for name, tensor in reloaded.state_dict().items():
            assert torch.equal(bits(tensor), bits(curr[name])), name
        for shard in prev_dir.glob("*.safetensors"):  # each output shard: the base shard's layout, patched
            assert len((out_dir / shard.name).read_bytes()) == len(shard.read_bytes())
        shutil.rmtree(out_dir)


def test_a_delta_applied_to_its_result_is_refused(sharded, tmp_path, capsys):
    prev_dir, curr_dir, _, curr = sharded
    delta = tmp_path / "d.safetensors"
    assert _run(capsys, "diff", prev_dir, curr_dir, "-o", delta)[0] == 0
    assert _run(capsys, "apply", prev_dir, delta, "-o", tmp_path / "once")[0] == 0
    assert_states_equal(_merged(tmp_path / "once"), curr)
    rc, _, err = _run(capsys, "apply", tmp_path / "once", delta, "-o", tmp_path / "twice")
    assert rc == 1 and "base" in err, err
    assert not (tmp_path / "twice").exists()


def test_publish_sharded_checkpoints_and_pull_the_newest(sharded, tmp_path, capsys):
    prev_dir, curr_dir, prev, curr = sharded
    store, out = tmp_path / "store", tmp_path / "pulled.safetensors"
    assert _run(capsys, "publish", prev_dir, "--store", store, "--step", 0)[0] == 0
    rc, text, err = _run(capsys, "publish", curr_dir / INDEX, "--store", store, "--step", 1)
    assert rc == 0 and "deltas/step_000000000001" in text, err
    for step, expected in [(0, prev), (1, curr)]:
        assert _run(capsys, "pull", "--store", store, "--step", step, "-o", out)[0] == 0
        assert_states_equal(dict(sorted(load_file(out).items())), expected)


def test_a_shard_write_that_fails_leaves_no_output_and_the_base_as_it_was(tmp_path):
    """A write that fails (a file size limit here, a full disk in life) on a later shard leaves no output folder
    and no staging folder, and the base as it was."""
    g = torch.Generator().manual_seed(3)
    prev = {"a.weight": torch.randn(8, 8, generator=g), "b.weight": torch.randn(256, 256, generator=g)}
    curr = {name: t + 1 for name, t in prev.items()}
    delta = tmp_path / "d.safetensors"
    for name, state in [("prev", prev), ("curr", curr)]:
        folder = tmp_path / name
        folder.mkdir()
        save_file({"a.weight": state["a.weight"]}, folder / "model-00001-of-00002.safetensors")
        save_file({"b.weight": state["b.weight"]}, folder / "model-00002-of-00002.safetensors")
        weight_map = {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}
        (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert main(["diff", str(tmp_path / "prev"), str(tmp_path / "curr"), "-o", str(delta)]) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "prev").iterdir()}

    def limit_file_size() -> None:  # the small shard fits, the large one does not
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    prev_dir, out = str(tmp_path / "prev"), tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "deltasync_rs.cli", "apply", prev_dir, str(delta), "-o", str(out)],
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "model-00002-of-00002.safetensors" in done.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "prev").iterdir()} == before
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".deltasync-")]


def test_layouts_that_are_not_one_checkpoint_are_refused(sharded, tmp_path, capsys):
    prev_dir, curr_dir, _, _ = sharded
    delta = tmp_path / "d.safetensors"
    assert _run(capsys, "diff", prev_dir, curr_dir, "-o", delta)[0] == 0

    def copy(name: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        for file in prev_dir.iterdir():
            (folder / file.name).write_bytes(file.read_bytes())
        return folder

    def rewrite_index(folder: Path, change) -> None:
        index = json.loads((folder / INDEX).read_text())
        change(index["weight_map"])
        (folder / INDEX).write_text(json.dumps(index))

    no_index = copy("no-index")
    (no_index / INDEX).unlink()
    missing_shard = copy("missing-shard")
    first = sorted(missing_shard.glob("*.safetensors"))[0]
    first.unlink()
    unlisted = copy("unlisted")
    # a tensor whose shard holds others too (a shard the index never names is not part of the checkpoint, as for
    # transformers: Mistral's repositories keep a consolidated.safetensors beside the shards)
    rewrite_index(unlisted, lambda m: m.pop(next(n for n in sorted(m) if list(m.values()).count(m[n]) > 1)))
    listed_elsewhere = copy("listed-elsewhere")
    shards = sorted({*json.loads((prev_dir / INDEX).read_text())["weight_map"].values()})
    rewrite_index(
        listed_elsewhere, lambda m: m.update({n: next(s for s in shards if s != m[n]) for n in sorted(m)[:1]})
    )
    escaping = copy("escaping")
    rewrite_index(escaping, lambda m: m.update({sorted(m)[0]: "../x.safetensors"}))
    not_an_index = copy("not-an-index")
    (not_an_index / INDEX).write_text("[1, 2]")
    two_indexes = copy("two-indexes")
    (two_indexes / "other.safetensors.index.json").write_text((prev_dir / INDEX).read_text())
    cases = [
        (no_index, ".safetensors files"),
        (missing_shard, f"{first.name}: no such file"),
        (unlisted, "not in the index"),
        (listed_elsewhere, "which does not hold it"),
        (escaping, "not a .safetensors file beside the index"),
        (not_an_index, "not a sharded checkpoint's index"),
        (two_indexes, "2 checkpoint indexes"),
    ]
    for folder, message in cases:
        listed = {p.name: p.read_bytes() for p in folder.iterdir()}
        for argv in (
            ["diff", folder, curr_dir, "-o", tmp_path / "x.safetensors"],
            ["apply", folder, delta, "-o", folder],
            ["publish", folder, "--store", tmp_path / f"store-{folder.name}", "--step", 0],
        ):
            rc, out, err = _run(capsys, *argv)
            assert rc == 1 and message in err, (argv, err)
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == listed
        assert not (tmp_path / "x.safetensors").exists()
        assert not (tmp_path / f"store-{folder.name}").exists()

    # A sharded base writes a folder; a single-file base, a file.
    single = tmp_path / "single.safetensors"
    save_file(_merged(prev_dir), single)
    rc, _, err = _run(capsys, "apply", prev_dir, delta, "-o", single)
    assert rc == 1 and "exists; a sharded checkpoint is written as a new folder" in err
    rc, _, err = _run(capsys, "apply", single, delta, "-o", tmp_path)
    assert rc == 1 and "a folder" in err
    # A delta that does not fit leaves no output folder behind.
    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(3)}, other)
    rc, _, err = _run(capsys, "diff", other, other, "-o", tmp_path / "x.safetensors")
    assert rc == 0
    rc, _, err = _run(capsys, "apply", prev_dir, tmp_path / "x.safetensors", "-o", tmp_path / "new")
    assert rc == 1 and '"x"' in err, err
    assert not (tmp_path / "new").exists()
    assert os.path.exists(prev_dir / INDEX)


def test_a_new_folder_gets_the_base_folders_files_but_other_weights(sharded, tmp_path, capsys):
    """A sharded output is a new folder put in place at once: the shards, the index and the base folder's other
    files (tokenizer, config), not other weight files (which would stay at the base's step beside the new
    shards); an existing folder that is not empty, and not the base's own, is refused."""
    prev_dir, curr_dir, _, curr = sharded
    base = tmp_path / "base"
    shutil.copytree(prev_dir, base)
    (base / "tokenizer.json").write_text("{}")
    (base / "pytorch_model.bin").write_bytes(b"stale")
    (base / "consolidated.safetensors").write_bytes(b"stale")
    (base / "sub").mkdir()
    delta = tmp_path / "d.safetensors"
    assert _run(capsys, "diff", prev_dir, curr_dir, "-o", delta)[0] == 0
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    rc, _, err = _run(capsys, "apply", base, delta, "-o", occupied)
    assert rc == 1 and "exists" in err and (occupied / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in occupied.iterdir()) == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (tmp_path / "fresh", empty):
        rc, _, err = _run(capsys, "apply", base, delta, "-o", out)
        assert rc == 0, err
        expected = sorted(p.name for p in prev_dir.iterdir()) + ["tokenizer.json"]
        assert sorted(p.name for p in out.iterdir()) == sorted(expected)
        assert_states_equal(_merged(out), curr)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".deltasync-")]


def test_a_sharded_checkpoint_is_not_patched_in_place(sharded, tmp_path, capsys):
    """Shards renamed into place one by one let a reader (or a kill between two renames) see shards of two steps,
    which --no-check-base then patched twice; swapping whole folders lost what others wrote into the old folder and
    what could not be linked across (found by adversarial helpers). In place is refused, nothing written."""
    prev_dir, curr_dir, _, _ = sharded
    work = tmp_path / "work"
    shutil.copytree(prev_dir, work)
    delta = tmp_path / "d.safetensors"
    assert _run(capsys, "diff", prev_dir, curr_dir, "-o", delta)[0] == 0
    before = {p.name: p.read_bytes() for p in work.iterdir()}
    for base, out in [(work, work), (work / INDEX, work), (work, tmp_path / "link")]:
        if out.name == "link":
            out.symlink_to(work)
        rc, _, err = _run(capsys, "apply", base, delta, "-o", out)
        assert rc == 1 and "not patched in place" in err, err
    assert {p.name: p.read_bytes() for p in work.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".deltasync-")]


def test_a_staging_folder_left_by_a_killed_run_is_removed_later(sharded, tmp_path, capsys):
    prev_dir, curr_dir, _, curr = sharded
    # a dead process's old folder goes; a recent one, a live process's (checking a large base for longer than
    # the limit before it writes) and folders of other names stay
    stale = tmp_path / ".deltasync-4999999-0123456789ab.tmp"
    fresh = tmp_path / ".deltasync-4999998-0123456789ab.tmp"
    live = tmp_path / f".deltasync-{os.getpid()}-0123456789ab.tmp"
    other = tmp_path / ".deltasync-cache.tmp"
    for folder in (stale, fresh, live, other):
        folder.mkdir()
        (folder / "model-00001-of-00002.safetensors").write_bytes(b"half")
    old = time.time() - 3600
    for folder in (stale, live, other):
        os.utime(folder, (old, old))
    delta = tmp_path / "d.safetensors"
    assert _run(capsys, "diff", prev_dir, curr_dir, "-o", delta)[0] == 0
    assert _run(capsys, "apply", prev_dir, delta, "-o", tmp_path / "out")[0] == 0
    assert not stale.exists() and fresh.exists() and live.exists() and other.exists()


def test_a_folder_with_an_index_and_the_file_transformers_loads_first_is_refused(sharded, tmp_path, capsys):
    """transformers loads model.safetensors and ignores an index beside it (a folder saved single-file, then
    sharded): which is the checkpoint is not clear, so a folder holding both is refused; either one given by name
    is used (found by an adversarial helper)."""
    prev_dir, curr_dir, prev, _ = sharded
    both = tmp_path / "both"
    shutil.copytree(prev_dir, both)
    save_file({"x": torch.zeros(2)}, both / "model.safetensors")
    store = tmp_path / "store"
    rc, _, err = _run(capsys, "publish", both, "--store", store, "--step", 0)
    assert rc == 1 and "both model.safetensors and model.safetensors.index.json" in err
    assert not store.exists()
    assert _run(capsys, "publish", both / INDEX, "--store", store, "--step", 0)[0] == 0
    rc, _, err = _run(capsys, "diff", prev_dir, curr_dir, "-o", curr_dir / INDEX)
    assert rc == 1 and "also the input" in err
