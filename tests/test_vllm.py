"""deltasync_rs.vllm on real vLLM model classes, on CPU: TP=1 and TP=2 (spawned gloo ranks), fused and tied
parameters, rejections that leave the model untouched, vLLM's loader as the fallback, the worker extension and the
``deltasync`` weight-transfer engine."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

# vLLM picks its platform once per process, on first use: these CPU tests need the CPU one.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm", reason="vllm is not installed (pip install 'deltasync-rs[vllm]')")

import deltasync_rs as ds  # noqa: E402
from deltasync_rs import vllm as ds_vllm  # noqa: E402
from deltasync_rs.manifest import anchor_key  # noqa: E402
from deltasync_rs.subscriber import Subscriber  # noqa: E402
from tests import vllm_workers  # noqa: E402
from tests.helpers import republish_anchor  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------- real vLLM models in spawned ranks (TP=1, TP=2)


@pytest.fixture(scope="session")
def prepared_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-models")
    return [vllm_workers.prepare(name, root / name) for name in vllm_workers.MODELS]


_RESULTS: dict[int, list[list[dict]]] = {}


def _rank_results(tp: int, prepared, tmp_path_factory) -> list[list[dict]]:
    """Runs every check on every model in one spawned process group of `tp` ranks (building vLLM is the slow part)."""
    if tp not in _RESULTS:
        import torch.multiprocessing as mp

        out = tmp_path_factory.mktemp(f"vllm-tp{tp}")
        mp.spawn(
            vllm_workers.run_rank,
            args=(tp, str(out / "init"), prepared, str(out), vllm_workers.CHECKS),
            nprocs=tp,
            join=True,
        )
        _RESULTS[tp] = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(tp)]
    return _RESULTS[tp]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model_name", list(vllm_workers.MODELS))
@pytest.mark.parametrize("check", [c.__name__ for c in vllm_workers.CHECKS])
def test_on_vllm_model(tp, model_name, check, prepared_models, tmp_path_factory):
    ranks = _rank_results(tp, prepared_models, tmp_path_factory)
    for rank, results in enumerate(ranks):
        setup = [r for r in results if r["check"] == "setup"]
        assert not setup, f"rank {rank} failed to set up:\n{setup[0]['error']}"
        mine = [r for r in results if r["model"] == model_name and r["check"] == check]
        assert len(mine) == 1, f"rank {rank} did not run {check} on {model_name}"
        assert mine[0]["error"] is None, f"TP={tp} rank {rank}, {model_name}:\n{mine[0]['error']}"


def test_tp2_ranks_read_about_half_of_an_anchor(prepared_models, tmp_path_factory):
    """Issue 16's "done when", summed over ranks: the two TP=2 ranks of each model read (anchor ranges and pieces
    sidecar together) less than 1.6 times the anchor, not two copies of it."""
    _rank_results(2, prepared_models, tmp_path_factory)
    for item in prepared_models:
        counts = [json.loads(Path(item.path(f"anchor-read-tp2-rank{rank}.json")).read_text()) for rank in range(2)]
        total = sum(c["read"] for c in counts)
        assert 0 < total < 1.6 * counts[0]["size"], f"{item.name}: the ranks read {counts}"


def test_deltas_come_from_sparse_real_steps(prepared_models):
    for item in prepared_models:
        delta = ds.load(item.path("delta_1_diff.safetensors"))
        assert 0 < delta.num_changed < delta.num_elements, (item.name, delta)
        assert "lm_head.weight" in delta.names


# ------------------------------------------------------------------ a model outside the mapping, in this process


class TinyCustomLM(torch.nn.Module):
    """Not a mapped architecture: apply_delta must go through vLLM's load_checkpoint_weight_patches."""

    def __init__(self, fail_on: str | None = None):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.embed = torch.nn.Parameter(torch.randn(10, 6, generator=g).to(torch.bfloat16), requires_grad=False)
        self.proj = torch.nn.Parameter(torch.randn(6, 6, generator=g).to(torch.bfloat16), requires_grad=False)
        self.fail_on = fail_on

    def load_weights(self, weights):
        loaded = set()
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if name == self.fail_on:
                raise RuntimeError(f"loader failure on {name}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


def _tiny_states(steps=3):
    model = TinyCustomLM()
    states = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    g = torch.Generator().manual_seed(2)
    for _ in range(steps):
        nxt = {n: t.clone() for n, t in states[-1].items()}
        for t in nxt.values():
            flat = t.view(-1)
            picks = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 7)]
            flat[picks] = (flat[picks].float() * 1.01 + 0.01).to(torch.bfloat16)
        states.append(nxt)
    return model, states


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _bits_equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a)


def test_unmapped_model_uses_vllms_loader_with_abs_values():
    model, states = _tiny_states()
    assert not ds_vllm.is_mapped(model)
    assert (
        ds_vllm.apply_delta(model, ds.diff(states[0], states[1], values="abs", step=1, base_step=0), current_step=0) > 0
    )
    assert _bits_equal(_params(model), states[1])
    ds_vllm.apply_delta(model, ds.anchor(states[2], step=2))  # a whole-tensor anchor goes through as dense patches
    assert _bits_equal(_params(model), states[2])


def test_unmapped_model_refuses_diff_values_clearly():
    model, states = _tiny_states()
    with pytest.raises(ds.DeltaSyncError, match='values="abs"') as info:
        ds_vllm.apply_delta(model, ds.diff(states[0], states[1], values="diff"))
    assert "TinyCustomLM" in str(info.value) and "'embed'" in str(info.value)
    assert _bits_equal(_params(model), states[0])


def test_loader_failure_is_rolled_back():
    model, states = _tiny_states()
    model.fail_on = "proj"  # the loader writes `embed`, then fails
    with pytest.raises(ds.DeltaSyncError, match="restored"):
        ds_vllm.apply_delta(model, ds.diff(states[0], states[1], values="abs"))
    assert _bits_equal(_params(model), states[0])


def test_loader_path_rejects_unknown_names_and_nan_before_writing():
    model, states = _tiny_states()
    prev, curr = dict(states[0]), dict(states[1])
    prev["nope"], curr["nope"] = torch.zeros(3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(ds.BaseMismatchError, match="'nope'"):
        ds_vllm.apply_delta(model, ds.diff(prev, curr, values="abs"))
    bad = {n: t.clone() for n, t in states[1].items()}
    bad["proj"].view(-1)[3] = float("nan")
    with pytest.raises(ds.DeltaSyncError, match="'proj'.*NaN"):
        ds_vllm.apply_delta(model, ds.diff(states[0], bad, values="abs"))
    assert _bits_equal(_params(model), states[0])


class _IndexAssigningLM(TinyCustomLM):
    """A loader that writes by index assignment, as DBRX's and MiniCPM's expert loaders do, not by the final copy_
    through which vLLM's sparse patches keep the elements they leave unchanged (NaN in the patch)."""

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            params[name].data[...] = tensor
        return {name for name, _ in weights}


def test_loader_path_refuses_a_loader_that_writes_the_unchanged_marks():
    """Such a loader wrote NaN into every element a sparse patch left unchanged, silently; now refused, restored."""
    model, states = _tiny_states()
    model.__class__ = _IndexAssigningLM
    with pytest.raises(ds.DeltaSyncError, match="wrote NaN into.*restored"):
        ds_vllm.apply_delta(model, ds.diff(states[0], states[1], values="abs"))
    assert _bits_equal(_params(model), states[0])
    ds_vllm.apply_delta(model, ds.anchor(states[1]))  # dense patches hold no marks: written as they are
    assert _bits_equal(_params(model), states[1])
    with_nan = {name: t.clone() for name, t in states[2].items()}
    with_nan["proj"].view(-1)[5] = float("nan")  # a value like any other in a dense patch
    ds_vllm.apply_delta(model, ds.anchor(with_nan))
    assert _bits_equal(_params(model), with_nan)


class MLAAttention(torch.nn.Module):
    """Named as vLLM's: it derives W_UK/W_UV from kv_b_proj's weight when the model loads."""

    def __init__(self):
        super().__init__()
        self.kv_b_proj = torch.nn.Linear(6, 4, bias=False).to(torch.bfloat16).requires_grad_(False)


def test_loader_path_refuses_weights_that_vllm_derives_others_from():
    """MLA attention's W_UK/W_UV are computed from kv_b_proj once, at load: an update of kv_b_proj in place left
    them stale (a risk an adversarial helper named). Refused before anything is written; other tensors apply."""
    model = TinyCustomLM()
    model.attn = MLAAttention()
    prev = _params(model)
    curr = {name: (tensor.float() + 0.5).to(torch.bfloat16) for name, tensor in prev.items()}
    with pytest.raises(ds.DeltaSyncError, match="'attn.kv_b_proj.weight'.*MLAAttention"):
        ds_vllm.apply_delta(model, ds.diff(prev, curr, values="abs"))
    assert _bits_equal(_params(model), prev)
    curr["attn.kv_b_proj.weight"] = prev["attn.kv_b_proj.weight"]
    ds_vllm.apply_delta(model, ds.diff(prev, curr, values="abs"))
    assert _bits_equal(_params(model), curr)


def test_mapped_path_refuses_unmapped_architecture():
    model, states = _tiny_states()
    with pytest.raises(ds.DeltaSyncError, match="path='loader'"):
        ds_vllm.apply_delta(model, ds.diff(states[0], states[1], values="abs"), path="mapped")


# ------------------------------------------------------------- worker extension and engine, pulling from a real store


@pytest.fixture
def published_store(tmp_path):
    """Steps 0-3 of a tiny model published by a real Publisher to a local-folder store."""
    model, states = _tiny_states(steps=3)
    store = tmp_path / "store"
    with ds.Publisher(store, anchor_every=10, values="abs", background=False) as publisher:
        for step, state in enumerate(states):
            publisher.publish(step, state)
    return model, states, str(store)


def test_worker_extension_pulls_in_order(published_store):
    model, states, store = published_store
    worker = ds_vllm.DeltaSyncWorkerExtension()
    worker.model_runner = SimpleNamespace(model=model)
    assert worker.deltasync_pull(store, 2) == 2  # unknown step: the anchor, then deltas 1 and 2
    assert _bits_equal(_params(model), states[2])
    assert worker.deltasync_pull(store) == 3
    assert _bits_equal(_params(model), states[3])
    assert worker.deltasync_pull(store) == 3  # up to date: nothing applied
    assert worker.deltasync_pull(store, "3") == 3  # the dev-mode HTTP route passes strings
    assert _bits_equal(_params(model), states[3])
    for bad in ("abc", "1.5", "-1", True, 2**64):
        with pytest.raises(ds.DeltaSyncError, match="step must be"):
            worker.deltasync_pull(store, bad)
        with pytest.raises(ds.DeltaSyncError, match="step must be"):
            worker.deltasync_set_step(bad)
    with pytest.raises(ds.DeltaSyncError, match="current_step must be"):
        ds_vllm.apply_delta(model, ds.diff(states[3], states[3], values="abs"), current_step="3")
    assert worker.deltasync_step() == 3 and _bits_equal(_params(model), states[3])


def test_a_worker_takes_an_older_anchor_where_the_newest_is_not_what_its_deltas_were_made_against(
    tmp_path, monkeypatch
):
    """A wrong anchor of step 2 (step 0's weights, labelled step 2) in an unsigned store, every file matching its
    entry: a worker starting afresh applied it, then delta 3 without a base check (the workers' default), and said
    it held step 3 over other weights. The anchor's tensors are now compared with delta 3's base identities as it is
    read, before anything is written, and the way from anchor 0 is taken."""
    model, states = _tiny_states(steps=3)
    store = tmp_path / "store"
    with ds.Publisher(store, anchor_every=2, values="abs", background=False) as publisher:
        for step, state in enumerate(states):
            publisher.publish(step, state)
    republish_anchor(store, 2, ds.anchor(states[0], step=2).to_bytes())
    worker = ds_vllm.DeltaSyncWorkerExtension()
    worker.model_runner = SimpleNamespace(model=model)
    assert worker.deltasync_pull(str(store)) == 3
    assert _bits_equal(_params(model), states[3])
    # The worker remembers the anchor it refused: a later pull from no step does not download it again.
    assert len(worker._deltasync_tracker().refused_anchors) == 1
    read = []
    real = Subscriber._file
    monkeypatch.setattr(
        Subscriber, "_file", lambda self, ref, *a, **k: read.append(ref["key"]) or real(self, ref, *a, **k)
    )
    worker.deltasync_set_step(None)
    assert worker.deltasync_pull(str(store)) == 3
    assert _bits_equal(_params(model), states[3])
    assert anchor_key(2) not in read and anchor_key(0) in read


def test_worker_extension_refuses_a_store_older_than_max_age(published_store, monkeypatch):
    """deltasync_pull's max_age (a string from the dev-mode HTTP route too): a store whose newest step was published
    longer ago is refused with nothing written, as Subscriber(max_age=) refuses it; a bad value is refused."""
    model, states, store = published_store
    worker = ds_vllm.DeltaSyncWorkerExtension()
    worker.model_runner = SimpleNamespace(model=model)
    assert worker.deltasync_pull(store, 1, max_age="600") == 1
    later = time.time() + 1200
    monkeypatch.setattr("deltasync_rs.subscriber.time.time", lambda: later)
    with pytest.raises(ds.StaleStoreError, match="more than max_age=600 s"):
        worker.deltasync_pull(store, max_age=600)
    assert worker.deltasync_step() == 1 and _bits_equal(_params(model), states[1])
    for bad in ("abc", "0", -5, True):
        with pytest.raises(ds.DeltaSyncError, match="max_age must be a number of seconds above 0"):
            worker.deltasync_pull(store, max_age=bad)
    assert worker.deltasync_pull(store) == 3


def test_worker_extension_follows_a_store_published_into_again_by_a_new_run_from_its_anchor(published_store):
    """The store emptied and a new run published into it (a trainer restarted from scratch): the new run's delta
    4 names its own step 3, not the one the worker holds, so the worker takes the new run's anchor instead of
    applying that delta onto the old run's weights (which left a mix of the two runs, silently)."""
    import shutil

    model, states, store = published_store
    worker = ds_vllm.DeltaSyncWorkerExtension()
    worker.model_runner = SimpleNamespace(model=model)
    assert worker.deltasync_pull(store) == 3
    _, other = _tiny_states(steps=5)
    for state in other:
        for tensor in state.values():
            tensor.mul_(1.5)
    shutil.rmtree(store)
    with ds.Publisher(store, anchor_every=10, values="abs", background=False) as publisher:
        for step, state in enumerate(other):
            publisher.publish(step, state)
    assert worker.deltasync_pull(store) == 5
    assert _bits_equal(_params(model), other[5])
    assert worker.deltasync_pull(store) == 5  # and on from there as usual
    # Emptied again, and the next run not yet past the step the worker holds: followed all the same.
    shutil.rmtree(store)
    with ds.Publisher(store, anchor_every=10, values="abs", background=False) as publisher:
        for step, state in enumerate(states[:3]):
            publisher.publish(step, state)
    assert worker.deltasync_pull(store) == 2
    assert _bits_equal(_params(model), states[2])
    # A step set by hand has no entry to check against: the way on from it is taken as before.
    worker.deltasync_set_step(5)
    assert worker._deltasync_tracker().entry is None


def test_a_pull_after_vllm_put_other_weights_in_place_starts_from_an_anchor(published_store):
    """vLLM reloaded the weights (reload_weights, a wake-up from a level-2 sleep) after the worker pulled step 1:
    the tracker still said 1, and the next pull applied the deltas after it onto the reloaded weights, which then
    held no step at all, silently (found by an adversarial helper). The tracker's sample of the weights it left
    shows the change: the pull starts from an anchor, explicit files are refused with nothing written. Weights
    written back as they were (the same step reloaded) are still at the step."""
    model, states, store = published_store
    worker = ds_vllm.DeltaSyncWorkerExtension()
    worker.model_runner = SimpleNamespace(get_model=lambda: model)  # a runner that wraps its model: unwrapped
    assert worker.deltasync_pull(store, 1) == 1
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in states[0].items():  # vLLM's loaders write through .data: no version bump
            params[name].data.copy_(tensor)
    assert worker.deltasync_pull(store) == 3
    assert _bits_equal(_params(model), states[3])
    with torch.no_grad():  # one parameter of one layer reloaded
        params["proj"].data.copy_(states[0]["proj"])
    before = _params(model)
    delta_file = ds.diff(states[3], states[3], values="abs", step=4, base_step=3)
    with pytest.raises(ds.BaseMismatchError, match="step is unknown"):
        worker.deltasync_apply([delta_file])
    assert _bits_equal(_params(model), before) and worker.deltasync_step() is None
    assert worker.deltasync_pull(store) == 3  # from the anchor
    assert _bits_equal(_params(model), states[3])
    with torch.no_grad():  # the same weights written again: nothing to forget
        params["proj"].data.copy_(states[3]["proj"])
    assert worker.deltasync_apply([delta_file]) == 4


def test_the_step_trackers_sample_skips_what_holds_no_data_and_shared_memory():
    """A parameter on the meta device (a layer never materialised) has no data to sample, and would make every
    comparison raise; tied weights are one memory, sampled once."""
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.randn(10, 3).to(torch.bfloat16))
    model.tied = model.a
    model.b = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
    model.c = torch.nn.Parameter(torch.zeros(0))
    tracker = ds_vllm._StepTracker(1)
    tracker.mark(model)
    assert sorted(tracker._marks) == ["a"] and tracker.changed_outside(model) == []
    with torch.no_grad():
        model.a.data[2, 1] += 1
    assert tracker.changed_outside(model) == ["a"]


def test_the_worker_extension_reaches_the_model_behind_a_wrapper(published_store):
    """vLLM's GPU runner wraps its model for full CUDA graphs (CUDAGraphWrapper, not a module; get_model() unwraps
    it): the extension took the wrapper for the model, sent a mapped model down the loader path and kept a step
    tracker apart from the weight-transfer engine's (found by an adversarial helper)."""
    model, states, store = published_store

    class Wrapper:  # as vLLM's CUDAGraphWrapper: a callable that is not a module
        def unwrap(self):
            return model

    for runner in (SimpleNamespace(model=Wrapper()), SimpleNamespace(model=Wrapper(), get_model=lambda: model)):
        worker = ds_vllm.DeltaSyncWorkerExtension()
        worker.model_runner = runner
        assert worker._deltasync_model() is model
    assert worker.deltasync_pull(store, 2) == 2
    assert ds_vllm._tracker_for(model).current_step == 2 and _bits_equal(_params(model), states[2])


def test_a_worker_pull_that_fails_part_way_keeps_the_entry_of_the_step_it_reached(published_store, monkeypatch):
    """A pull from step 1 applies delta 2, then fails on delta 3 (a refused delta, a device out of memory): the
    worker is at step 2. The trainer restarts from step 1, and steps 2-4 are published again with other weights.
    The next pull must see that the worker's step 2 is not the store's step 2: it lost the entry of step 2 and
    applied the new deltas 3 and 4 onto the old step 2's weights, reporting step 4 (found by an adversarial
    helper)."""
    model, states, store = published_store
    worker = ds_vllm.DeltaSyncWorkerExtension()
    worker.model_runner = SimpleNamespace(model=model)
    assert worker.deltasync_pull(store, 1) == 1
    real_apply, calls = ds_vllm.apply_delta, []

    def failing_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise ds.DeltaSyncError("refused")
        return real_apply(*args, **kwargs)

    monkeypatch.setattr(ds_vllm, "apply_delta", failing_second)
    with pytest.raises(ds.DeltaSyncError, match="refused"):
        worker.deltasync_pull(store)
    monkeypatch.setattr(ds_vllm, "apply_delta", real_apply)
    assert worker.deltasync_step() == 2 and worker._deltasync_tracker().entry.step == 2
    _, other = _tiny_states(steps=4)
    for state in other:
        for tensor in state.values():
            tensor.mul_(1.5)
    with ds.Publisher(store, anchor_every=10, values="abs", background=False) as publisher:
        publisher.resume(states[1], step=1)
        for step in (2, 3, 4):
            publisher.publish(step, other[step])
    assert worker.deltasync_pull(store) == 4
    assert _bits_equal(_params(model), other[4])


def test_worker_extension_rejects_a_broken_chain_before_writing(tmp_path):
    model, states = _tiny_states()
    worker = ds_vllm.DeltaSyncWorkerExtension()
    worker.model_runner = SimpleNamespace(model=model)
    worker.deltasync_set_step(0)
    d1 = ds.diff(states[0], states[1], values="abs", step=1, base_step=0)
    d3 = ds.diff(states[2], states[3], values="abs", step=3, base_step=2)
    d1.save(tmp_path / "d1.safetensors")
    with pytest.raises(ds.BaseMismatchError, match="do not chain"):
        worker.deltasync_apply([str(tmp_path / "d1.safetensors"), d3.to_bytes()])
    assert _bits_equal(_params(model), states[0]) and worker.deltasync_step() == 0
    with pytest.raises(ds.BaseMismatchError, match="step 2"):
        worker.deltasync_apply(d3.to_bytes())
    assert worker.deltasync_apply(str(tmp_path / "d1.safetensors")) == 1


def test_worker_extension_refuses_a_delta_that_names_no_base_step():
    """A delta made without base_step= was applied onto whatever the worker held, even at an unknown step, and the
    worker then claimed the delta's step (found by an adversarial helper): refused before writing, at any step, in
    a list too. A delta that names no step of its own leaves the worker at no known step."""
    model, states = _tiny_states()
    worker = ds_vllm.DeltaSyncWorkerExtension()
    worker.model_runner = SimpleNamespace(model=model)
    unlinked = ds.diff(states[1], states[2], values="abs", step=2).to_bytes()
    for step in (None, 1):
        worker.deltasync_set_step(step)
        with pytest.raises(ds.BaseMismatchError, match="names no base step"):
            worker.deltasync_apply(unlinked)
        assert _bits_equal(_params(model), states[0]) and worker.deltasync_step() == step
    worker.deltasync_set_step(0)
    first = ds.diff(states[0], states[1], values="abs", step=1, base_step=0).to_bytes()
    with pytest.raises(ds.BaseMismatchError, match="names no base step"):
        worker.deltasync_apply([first, unlinked])
    assert _bits_equal(_params(model), states[0]) and worker.deltasync_step() == 0
    # Every tensor of a delta changed whole (it reads as an anchor), but it names its base: checked as a delta, not
    # applied at any step as a whole state.
    whole = ds.diff(states[0], {n: t + 1 for n, t in states[0].items()}, values="abs", step=9, base_step=8)
    assert whole.is_anchor
    with pytest.raises(ds.BaseMismatchError, match="applies to step 8"):
        worker.deltasync_apply(whole.to_bytes())
    worker.deltasync_set_step(None)  # it was applied at an unknown step, as if it were the whole state
    with pytest.raises(ds.BaseMismatchError, match="step is unknown"):
        worker.deltasync_apply(whole.to_bytes())
    worker.deltasync_set_step(0)
    assert _bits_equal(_params(model), states[0]) and worker.deltasync_step() == 0
    stepless = ds.diff(states[0], states[1], values="abs", base_step=0).to_bytes()
    assert worker.deltasync_apply(stepless) is None
    assert _bits_equal(_params(model), states[1])
    with pytest.raises(ds.BaseMismatchError, match="step is unknown"):
        worker.deltasync_apply(ds.diff(states[1], states[2], values="abs", step=2, base_step=1).to_bytes())


def _engine(model):
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    ds_vllm.register()
    ds_vllm.register()  # plugins may load several times per process
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(), model_config=SimpleNamespace())
    return WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="deltasync"), vllm_config, torch.device("cpu"), model
    )


def test_weight_transfer_engine_native_flow(published_store):
    model, states, store = published_store
    engine = _engine(model)
    assert isinstance(engine, ds_vllm.DeltaSyncWeightTransferEngine)
    engine.init_transfer_engine(engine.parse_init_info({"store": store, "current_step": 0}))
    engine.start_weight_update()
    engine.update_weights({"step": 1})
    engine.finish_weight_update()
    assert _bits_equal(_params(model), states[1]) and engine.tracker.current_step == 1
    file = str(Path(store) / "deltas" / "step_000000000002.safetensors")
    for both in ({"step": 2}, {"store": store}):  # files and a pull at once: which? (step 2 was dropped)
        with pytest.raises(ds.DeltaSyncError, match="not both"):
            engine.update_weights({"paths": [file], **both})
    assert _bits_equal(_params(model), states[1]) and engine.tracker.current_step == 1
    engine.update_weights({"paths": file})  # one file, not read letter by letter
    assert _bits_equal(_params(model), states[2]) and engine.tracker.current_step == 2
    engine.update_weights({})  # no step: the newest
    assert _bits_equal(_params(model), states[3]) and engine.tracker.current_step == 3
    with pytest.raises(ValueError, match="Invalid update_info"):
        engine.update_weights({"bucket": "x"})


def _native_worker(engine):
    """vLLM 0.33's own worker class around ``engine``: its start/update/finish methods, and the "update active" flag
    they keep, are vLLM's (built without a device or a model runner, which these methods do not need)."""
    from vllm.v1.worker.gpu_worker import Worker

    worker = object.__new__(Worker)
    worker.weight_transfer_engine, worker.vllm_config, worker.rank = engine, engine.vllm_config, 0
    worker._weight_update_active = worker._weight_update_is_draft = False
    worker.model_runner = SimpleNamespace(reset_lora_state=lambda: None)
    return worker


def test_a_refusal_every_rank_shares_ends_the_native_update_on_every_rank(published_store, monkeypatch):
    """At TP > 1 vLLM's executor reads the ranks' replies in order and stops at the first error: a rank before the
    last that raised left the later replies unread (the next calls got them), and one that returned stayed in its
    update (vLLM clears its flag only where update_weights raised), refusing every later start. Such a rank now
    ends the update as vLLM's worker does on an error, and returns; the last rank raises."""
    model, states, store = published_store
    engine = _engine(model)
    engine.init_transfer_engine(engine.parse_init_info({"store": store, "current_step": 0}))
    worker = _native_worker(engine)
    # Rank 0 of 2 under the mp executor; the other rank's all-gathered summaries are this one's.
    monkeypatch.setattr(ds_vllm, "_tensor_parallel", lambda: 2)
    monkeypatch.setattr(ds_vllm, "_all_gather", lambda mine: [mine, mine])
    monkeypatch.setattr(ds_vllm, "_replies_before_the_last", lambda vllm_config: True)
    worker.start_weight_update()
    assert worker.update_weights({"step": 99}) is None  # refused (never published): the last rank raises it
    assert not worker._weight_update_active and engine.tracker.current_step == 0
    assert _bits_equal(_params(model), states[0])
    # A failure not every rank shares is raised where it happens, and vLLM ends that rank's update.
    worker.start_weight_update()  # a new update starts
    with monkeypatch.context() as patch:
        patch.setattr(engine, "receive_weights", lambda info: (_ for _ in ()).throw(OSError("disk gone")))
        with pytest.raises(OSError, match="disk gone"):
            worker.update_weights({"step": 1})
    assert not worker._weight_update_active
    monkeypatch.undo()  # one rank: every refusal is raised, and vLLM ends the update
    worker.start_weight_update()
    worker.update_weights({"step": 1})
    worker.finish_weight_update()
    assert _bits_equal(_params(model), states[1]) and engine.tracker.current_step == 1
    worker.start_weight_update()
    with pytest.raises(ds.DeltaSyncError, match="step 99 is not published"):
        worker.update_weights({"step": 99})
    assert not worker._weight_update_active and engine.tracker.current_step == 1
    # A refused init (its arguments are every rank's) is raised by the last rank alone too, and changes nothing.
    monkeypatch.setattr(ds_vllm, "_replies_before_the_last", lambda vllm_config: True)
    assert engine.init_transfer_engine(engine.parse_init_info({"store": "s3://other/run", "max_age": "soon"})) is None
    assert (engine.store, engine.tracker.current_step) == (store, 1)
    monkeypatch.undo()
    with pytest.raises(ds.DeltaSyncError, match="max_age must be"):
        engine.init_transfer_engine(engine.parse_init_info({"store": "s3://other/run", "max_age": "soon"}))


def test_a_refused_engine_init_changes_nothing(published_store):
    """init_transfer_engine took the store and key before it checked max_age: a refused init left the new store set
    and the key dropped, so the next update pulled another store unsigned (found by reviewing max_age)."""
    model, states, store = published_store
    engine = _engine(model)
    engine.init_transfer_engine(engine.parse_init_info({"store": store, "signing_key": None, "max_age": 60}))
    for bad in ({"store": "s3://other/run", "max_age": "soon"}, {"store": "s3://other/run", "current_step": -1}):
        with pytest.raises(ds.DeltaSyncError, match="must be"):
            engine.init_transfer_engine(engine.parse_init_info(bad))
    assert (engine.store, engine.signing_key, engine.max_age) == (store, None, 60.0)


def test_engine_without_a_store_says_so():
    model, _ = _tiny_states()
    engine = _engine(model)
    engine.init_transfer_engine(engine.parse_init_info({}))
    with pytest.raises(ds.DeltaSyncError, match="no store"):
        engine.update_weights({"step": 3})


def test_plugin_entry_point_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = project["project"]["entry-points"]["vllm.general_plugins"]["deltasync"]
    module, func = target.split(":")
    assert (module, func) == ("deltasync_rs.vllm", "register") and callable(getattr(ds_vllm, func))


_MOE_SCRIPT = r"""
import os, sys, tempfile
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import torch, transformers
import deltasync_rs as ds
from deltasync_rs.vllm import apply_delta
from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
from vllm.utils.torch_utils import set_default_torch_dtype

folder = tempfile.mkdtemp()
config = transformers.Qwen3MoeConfig(
    vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=64,
)
config.architectures = ["Qwen3MoeForCausalLM"]
torch.manual_seed(0)
hf = transformers.Qwen3MoeForCausalLM(config)
config.save_pretrained(folder)
before = {k: v.detach().bfloat16().clone() for k, v in hf.state_dict().items()}
after = {k: (v + 1 if "experts" in k else v) for k, v in before.items()}
vllm_config = VllmConfig(
    model_config=ModelConfig(model=folder, dtype="bfloat16", skip_tokenizer_init=True),
    device_config=DeviceConfig(device="cpu"),
)
with set_current_vllm_config(vllm_config):
    init_distributed_environment(1, 0, f"file://{folder}/init", 0, backend="gloo")
    initialize_model_parallel(1, 1)
    with set_default_torch_dtype(torch.bfloat16):
        model = Qwen3MoeForCausalLM(vllm_config=vllm_config)
    model.load_weights(before.items())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        apply_delta(model, ds.diff(before, after, values="abs", step=1, base_step=0), current_step=0)
    except ds.DeltaSyncError as error:
        print("ERROR", error)
    same = all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    print("UNTOUCHED" if same else "CHANGED")
"""


def test_fused_moe_experts_are_refused_by_what_they_are():
    """A mixture-of-experts model's fused expert weights are not mapped (docs/vllm.md, Limits): refused with that
    reason and nothing written (it read as a wrong name; found by an adversarial helper)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _MOE_SCRIPT], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mixture-of-experts layers are fused" in done.stdout and "UNTOUCHED" in done.stdout, done.stdout


def test_ds_vllm_is_there_after_a_plain_import():
    """README's `deltasync_rs.vllm.apply_delta` after `import deltasync_rs` raised AttributeError unless vLLM's
    plugin loader had imported the submodule (found by a helper checking the docs); it loads on first use now, as
    `ds.torch` and `ds.integrations` do, in a fresh interpreter."""
    import subprocess
    import sys

    code = (
        "import sys, deltasync_rs as ds\n"
        "assert 'deltasync_rs.vllm' not in sys.modules\n"
        "assert ds.vllm.apply_delta is sys.modules['deltasync_rs.vllm'].apply_delta\n"
        "print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


# ------------------------------------------ tensor-parallel ranks checking an anchor together (threads, in process)


class _Ranks:
    """``n`` tensor-parallel ranks run as threads: vLLM's tensor-parallel all-gather (and ``_exchange``'s gathers to
    each rank) become exchanges through a barrier (each rank's object pickled, as ``all_gather_object`` does) and
    the rank is the thread's. ``received[r]`` counts the pickled bytes rank ``r`` received from the others."""

    def __init__(self, monkeypatch, n: int) -> None:
        import pickle
        import threading

        from vllm.distributed import parallel_state

        self.n, self.local = n, threading.local()
        self.barrier = threading.Barrier(n, timeout=60)
        self.slots: list = [None] * n
        self.received = [0] * n
        ranks = self

        class Group:
            world_size = n

            @property
            def rank_in_group(self) -> int:
                return ranks.local.rank

        def all_gather(mine):
            rank = self.local.rank
            self.slots[rank] = pickle.dumps(mine)
            self.barrier.wait()
            everyone = [pickle.loads(sent) for sent in self.slots]
            self.received[rank] += sum(len(sent) for r, sent in enumerate(self.slots) if r != rank)
            self.barrier.wait()
            return everyone

        def exchange(outgoing):
            rank = self.local.rank
            self.slots[rank] = [pickle.dumps(item) for item in outgoing]
            self.barrier.wait()
            mine = [pickle.loads(sent[rank]) for sent in self.slots]
            self.received[rank] += sum(len(sent[rank]) for r, sent in enumerate(self.slots) if r != rank)
            self.barrier.wait()
            return mine

        monkeypatch.setattr(ds_vllm, "_tensor_parallel", lambda: n)
        monkeypatch.setattr(ds_vllm, "_all_gather", all_gather)
        monkeypatch.setattr(ds_vllm, "_exchange", exchange)
        monkeypatch.setattr(parallel_state, "get_tp_group", lambda: Group())

    def run(self, work):
        """``work(rank)`` on every rank at once: each rank's result, or the exception it raised."""
        import threading

        results: list = [None] * self.n

        def go(rank: int) -> None:
            self.local.rank = rank
            try:
                results[rank] = work(rank)
            except BaseException as error:  # noqa: BLE001 (returned to the test)
                results[rank] = error

        threads = [threading.Thread(target=go, args=(rank,)) for rank in range(self.n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return results


def _tp_states(steps: int = 4) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    states = [
        {
            "big.weight": torch.randn(1000, 700, generator=generator).to(torch.bfloat16),
            "norm.weight": torch.randn(700, generator=generator).to(torch.bfloat16),
            "f.weight": torch.randn(300, 33, generator=generator),
        }
    ]
    for step in range(1, steps):
        state = {name: tensor.clone() for name, tensor in states[-1].items()}
        for tensor in state.values():
            bits = tensor.view(torch.int16 if tensor.dtype == torch.bfloat16 else torch.int32).view(-1)
            bits[step::53] += 1
        states.append(state)
    return states


def _rows(layout: dict[str, tuple[int, int]]):
    """anchor_ranges for a rank that reads rows ``(first, last)`` of the tensors ``layout`` names, others whole."""

    def needed(tensors):
        out = []
        for tensor in tensors:
            if tensor.name in layout:
                first, last = layout[tensor.name]
                row = (tensor.end - tensor.start) // tensor.shape[0]
                out.append((tensor.start + first * row, tensor.start + last * row))
            else:
                out.append((tensor.start, tensor.end))
        return out

    return needed


_TP_LAYOUTS = {
    "halves": [{"big.weight": (0, 500), "f.weight": (0, 150)}, {"big.weight": (500, 1000), "f.weight": (150, 300)}],
    "cut inside blocks": [
        {"big.weight": (0, 377), "f.weight": (0, 1)},
        {"big.weight": (377, 1000), "f.weight": (1, 300)},
    ],
    "three ranks, two overlapping": [{"big.weight": (0, 400)}, {"big.weight": (300, 700)}, {"big.weight": (300, 1000)}],
}


def _tp_store(tmp_path, after: str, wrong: str | None = None):
    """`_tp_states` published with an anchor every step (``after="nothing"``: no delta follows the newest anchor)
    or every other step (a delta follows it); with ``wrong``, that anchor published again holding step 1's
    ``wrong`` tensor, every file made to agree with it. The states, the store and that anchor's step."""
    states = _tp_states()
    root = tmp_path / "store"
    with ds.Publisher(root, background=False, anchor_every=1 if after == "nothing" else 2, piece_bytes=4096) as p:
        for step, state in enumerate(states):
            p.publish(step, state)
    step = 3 if after == "nothing" else 2
    if wrong is not None:
        republish_anchor(root, step, ds.anchor(states[step] | {wrong: states[1][wrong]}).to_bytes())
    return states, root, step


@pytest.mark.parametrize("layout", list(_TP_LAYOUTS))
@pytest.mark.parametrize("after", ["a delta", "nothing"])
@pytest.mark.parametrize("wrong", [None, "big.weight", "norm.weight", "f.weight"])
def test_ranks_that_read_an_anchor_in_parts_check_it_together(tmp_path, monkeypatch, layout, after, wrong):
    """At TP > 1 each rank reads only its rows of a row-split tensor, so no rank could compare such a tensor with
    the first delta's base identities, nor make the anchor's state digest where no delta follows it: a wrong anchor
    (every file matching its entry) was applied. The ranks now check them together, with the hashes of the blocks
    each holds and the bytes of those a cut falls in (an anchor and a delta), or by hashing each such tensor in turn
    (the anchor alone); a wrong anchor is refused on every rank and the older anchor's way taken. A right one is
    taken (any piece size, cuts inside blocks and pieces, overlapping ranks)."""
    states, root, wrong_anchor = _tp_store(tmp_path, after, wrong)
    ranks = _Ranks(monkeypatch, len(_TP_LAYOUTS[layout]))
    subscribers = [Subscriber(root, anchor_ranges=_rows(rows)) for rows in _TP_LAYOUTS[layout]]

    def pull(rank: int):
        deltas = _agreed_pull(subscribers[rank])
        return [delta.step for delta in deltas], isinstance(deltas[0], ds_vllm.PartialAnchor)

    results = ranks.run(pull)
    expected = [wrong_anchor] + list(range(wrong_anchor + 1, len(states)))
    if wrong is not None:  # the older anchor's way
        older = wrong_anchor - (1 if after == "nothing" else 2)
        expected = [older] + list(range(older + 1, len(states)))
    assert results == [(expected, True)] * ranks.n
    assert [len(s._refused_anchors) for s in subscribers] == [int(wrong is not None)] * ranks.n


def test_a_rank_whose_work_panics_does_not_leave_the_others_waiting(monkeypatch):
    """A panic in the core reaches Python as a BaseException that is not an Exception: a rank whose part of a
    collective step raised one did not tell the others, which then waited for it in the next all-gather. Every
    rank raises now."""

    class Panic(BaseException):  # as pyo3's PanicException is
        pass

    ranks = _Ranks(monkeypatch, 3)

    def work(rank: int):
        def mine():
            if rank == 1:
                raise Panic("assertion failed in the core")
            return rank

        return ds_vllm._together(mine, 4, "hash its part of the anchor")

    results = ranks.run(work)
    assert isinstance(results[1], Panic)
    for rank in (0, 2):
        assert isinstance(results[rank], ds.DeltaSyncError), results[rank]
        assert "rank 1 could not hash its part of the anchor (Panic: assertion failed" in str(results[rank])


def _steps(deltas: list) -> list[int]:
    return [delta.step for delta in deltas]


def _agreed_pull(subscriber: Subscriber, forget=None) -> list:
    """What a vLLM worker's pull agrees on with the other ranks: the deltas it would apply."""
    deltas, _ = ds_vllm._agreed(
        subscriber._fetch_checked_by_the_apply,
        None,
        None,
        subscriber._refused_anchors,
        subscriber.entry,
        forget or subscriber._entries.clear,
    )
    return deltas


def _store_and_a_rewritten_copy(tmp_path, after: str):
    """A store, and a copy of it whose newest anchor was published again with other bytes (of tensors every rank
    reads whole, or of rows that two of `three ranks, two overlapping`'s ranks read)."""
    states, root, step = _tp_store(tmp_path, after)
    other = tmp_path / "other"
    shutil.copytree(root, other)
    wrong = {name: tensor.clone() for name, tensor in states[step].items()}
    if after == "a delta":  # rows 300..700 of big.weight, which ranks 1 and 2 both read
        wrong["big.weight"][300:700] = states[1]["big.weight"][300:700]
    else:  # norm.weight, which every rank reads whole
        wrong["norm.weight"] = states[1]["norm.weight"]
    republish_anchor(other, step, ds.anchor(wrong).to_bytes())
    return states, root, other, step


@pytest.mark.parametrize("after", ["a delta", "nothing"])
def test_ranks_that_read_other_entries_of_a_step_fetch_again(tmp_path, monkeypatch, after):
    """Rank 2 reads the store while it is published into (another anchor for the newest anchor's step): the ranks
    reach the same step from the same anchor step, but by other manifest entries, so rank 2 would apply other
    bytes. They now compare the entries they read, forget what they cached and fetch again: where the store has
    settled, every rank takes the same way; where the ranks keep reading different entries, every rank raises."""
    states, root, other, step = _store_and_a_rewritten_copy(tmp_path, after)
    layout = _TP_LAYOUTS["three ranks, two overlapping"]
    ranks = _Ranks(monkeypatch, len(layout))
    subscribers = [Subscriber(p, anchor_ranges=_rows(rows)) for p, rows in zip([root, root, other], layout)]
    settled = Subscriber(root).store

    def settle() -> None:  # rank 2's next reads find the store as it is now
        subscribers[2]._entries.clear()
        subscribers[2].store = settled

    results = ranks.run(lambda rank: _steps(_agreed_pull(subscribers[rank], settle if rank == 2 else None)))
    assert results == [list(range(step, len(states)))] * 3, results
    # Ranks that keep reading different entries: all raise, none applies.
    subscribers = [Subscriber(p, anchor_ranges=_rows(rows)) for p, rows in zip([root, root, other], layout)]
    results = ranks.run(lambda rank: _steps(_agreed_pull(subscribers[rank])))
    assert all(isinstance(r, ds.DeltaSyncError) and "same manifest entries" in str(r) for r in results), results


@pytest.mark.parametrize("after", ["a delta", "nothing"])
def test_ranks_that_read_different_bytes_of_one_anchor_refuse_it(tmp_path, monkeypatch, after):
    """Beneath the entries' comparison: the ranks' checks of an anchor they read in parts refuse one of which they
    hold different bytes (rank 2 reads another file, differing from the others' in bytes that rank 1 also holds:
    rank 0 and 1's bytes, first in rank order, make the right identity or digest, so only the ranks' disagreement
    shows the wrong bytes rank 2 would apply)."""
    states, root, other, step = _store_and_a_rewritten_copy(tmp_path, after)
    layout = _TP_LAYOUTS["three ranks, two overlapping"]
    ranks = _Ranks(monkeypatch, len(layout))
    subscribers = [Subscriber(p, anchor_ranges=_rows(rows)) for p, rows in zip([root, root, other], layout)]
    digest = subscribers[0].entry(step).state_digest

    def check(rank: int):
        deltas = subscribers[rank].fetch(None)
        assert deltas[0].step == step
        if after == "a delta":
            return ds_vllm._split_anchor_error(deltas[0], deltas[1], None)
        return ds_vllm._split_digest_error(deltas[0], digest, None)

    results = ranks.run(check)
    assert all(isinstance(r, str) and "read different bytes" in r for r in results), results


def test_ranks_whose_parts_of_a_tensor_differ_in_size_refuse_the_anchor(tmp_path, monkeypatch):
    """Parts of one tensor of different sizes are parts of different anchors: the ranks making the state digest
    together refuse it (it was taken, with a warning that it could not be checked)."""
    states = _tp_states()
    roots = [tmp_path / "store", tmp_path / "other"]
    for root, big in zip(roots, ["big.weight", None]):
        with ds.Publisher(root, background=False, anchor_every=1, piece_bytes=4096) as p:
            for step, state in enumerate(states):
                p.publish(step, state | ({} if big else {"big.weight": state["big.weight"][:900]}))
    layout = [{"big.weight": (0, 500)}, {"big.weight": (450, 900)}]  # rank 1's anchor has 900 rows
    ranks = _Ranks(monkeypatch, 2)
    subscribers = [Subscriber(root, anchor_ranges=_rows(rows)) for root, rows in zip(roots, layout)]
    digest = subscribers[0].entry(3).state_digest
    results = ranks.run(lambda rank: ds_vllm._split_digest_error(subscribers[rank].fetch(None)[0], digest, None))
    assert all(isinstance(r, str) and "read different bytes of tensor 'big.weight'" in r for r in results), results


@pytest.mark.parametrize("after", ["a delta", "nothing"])
@pytest.mark.parametrize("wrong", [None, "big.weight"])
def test_a_rank_that_reads_the_anchor_whole_and_one_that_reads_part_agree(tmp_path, monkeypatch, after, wrong):
    """Rank 0 reads the anchor whole (no anchor_ranges), rank 1 its half of big.weight. A right anchor is taken by
    both; a wrong one is refused by rank 0 alone in its fetch, and that refusal is shared: both take the older
    anchor's way (nothing hangs, nothing raises)."""
    states, root, wrong_anchor = _tp_store(tmp_path, after, wrong)
    ranks = _Ranks(monkeypatch, 2)
    subscribers = [Subscriber(root), Subscriber(root, anchor_ranges=_rows({"big.weight": (500, 1000)}))]

    def pull(rank: int):
        deltas = _agreed_pull(subscribers[rank])
        return [delta.step for delta in deltas], isinstance(deltas[0], ds_vllm.PartialAnchor)

    results = ranks.run(pull)
    start = wrong_anchor if wrong is None else wrong_anchor - (1 if after == "nothing" else 2)
    steps = list(range(start, len(states)))
    assert results == [(steps, False), (steps, True)], results


def test_ranks_that_leave_rows_of_a_tensor_unread_take_a_right_anchor_unchecked(tmp_path, monkeypatch, caplog):
    """Where no rank reads some rows of a row-split tensor and no delta follows the anchor, the state digest cannot
    be made: the anchor is taken (a warning says it was not checked), not refused as if it were wrong."""
    states, root, _ = _tp_store(tmp_path, "nothing")
    layout = [{"big.weight": (0, 400), "f.weight": (0, 150)}, {"big.weight": (600, 1000), "f.weight": (150, 300)}]
    ranks = _Ranks(monkeypatch, 2)
    subscribers = [Subscriber(root, anchor_ranges=_rows(rows)) for rows in layout]
    with caplog.at_level("WARNING"):
        results = ranks.run(lambda rank: _steps(_agreed_pull(subscribers[rank])))
    assert results == [[3]] * 2, results
    assert "is not checked against its entry's state digest" in caplog.text
    assert all(not s._refused_anchors for s in subscribers)


@pytest.mark.parametrize("layout", ["halves", "three ranks, two overlapping"])
def test_ranks_refuse_a_split_anchor_whose_entry_vouches_for_it_but_the_next_delta_does_not(
    tmp_path, monkeypatch, layout
):
    """A wrong anchor whose entry's state digest was made to agree with it (a buggy or hostile publisher) still
    is not the state the next delta was made against: with a delta after it, the ranks compare the tensor they read
    in parts with that delta's base identity, not only with the entry's digest."""
    states, root, _ = _tp_store(tmp_path, "a delta")
    held = states[2] | {"big.weight": states[1]["big.weight"]}
    republish_anchor(root, 2, ds.anchor(held).to_bytes(), state_digest=ds.state_digest(held))
    ranks = _Ranks(monkeypatch, len(_TP_LAYOUTS[layout]))
    subscribers = [Subscriber(root, anchor_ranges=_rows(rows)) for rows in _TP_LAYOUTS[layout]]
    results = ranks.run(lambda rank: _steps(_agreed_pull(subscribers[rank])))
    assert results == [[0, 1, 2, 3]] * len(_TP_LAYOUTS[layout]), results


def test_every_rank_raises_the_failed_ranks_kind_of_error(monkeypatch):
    """A rank whose work raised DeltaFormatError makes every rank raise a DeltaFormatError (not a bare
    DeltaSyncError), so that all take the same way on (a pull reads a delta with a malformed stream again on it)."""
    ranks = _Ranks(monkeypatch, 3)

    def work(rank: int):
        def mine():
            if rank == 2:
                raise ds.DeltaFormatError("a malformed stream")
            return rank

        return ds_vllm._together(mine, 4, "fetch the deltas")

    results = ranks.run(work)
    assert all(isinstance(result, ds.DeltaFormatError) for result in results), results


def test_ranks_that_reach_different_steps_fetch_again_up_to_the_step_all_reached(monkeypatch):
    """Rank 0 finds step 3, rank 1 only step 2 (a publish between their reads): the rank ahead fetches again up
    to step 2, which every rank reached, and both return deltas to step 2."""
    ranks = _Ranks(monkeypatch, 2)
    newest = [3, 2]

    def pull(rank: int):
        def fetch(at, until):
            last = newest[rank] if until is None else min(until, newest[rank])
            return [SimpleNamespace(step=step, _whole_state=False) for step in range(1, last + 1)]

        deltas, until = ds_vllm._agreed(fetch, 0, None)
        return [d.step for d in deltas], until

    assert ranks.run(pull) == [([1, 2], 2)] * 2


def test_ranks_that_start_from_different_anchors_without_a_refusal_raise_together(monkeypatch):
    """Ranks that reach the same step from different anchors, none of them having refused one (rank 1 could not
    read the anchor rank 0 took), raise together at once, naming each rank's start: nothing to refuse, so fetching
    again would only repeat it."""
    ranks = _Ranks(monkeypatch, 2)
    starts = [2, 0]
    calls = [0, 0]

    def pull(rank: int):
        def fetch(at, until):
            calls[rank] += 1
            if calls[rank] > 3:
                raise AssertionError("fetched again and again")
            anchor = SimpleNamespace(step=starts[rank], _whole_state=True)
            return [anchor] + [SimpleNamespace(step=s, _whole_state=False) for s in range(starts[rank] + 1, 4)]

        return ds_vllm._agreed(fetch, None, None, set())

    results = ranks.run(pull)
    assert all(isinstance(r, ds.IntegrityError) and "from different anchors" in str(r) for r in results), results
    assert "rank 0: the anchor of step 2, rank 1: the anchor of step 0" in str(results[0])
    assert calls == [1, 1]


# ------------------------------------- check_base at TP > 1: the ranks check the tensors split across them together


def _slices(full: torch.Tensor, how: str, cuts: list[int], pad: int = 0) -> list[ds_vllm.ShardMap]:
    """Each rank's ShardMap of ``full`` as vLLM would hold it: ``how="rows"`` (rows ``cuts[r] .. cuts[r + 1]``, in a
    fused parameter after 3 rows of another tensor and before ``pad`` more), ``"cols"`` (columns likewise, a
    parameter of its own), ``"overlap"`` (rank 0 rows up to ``cuts[1]``, rank 1 from ``cuts[0]``) or ``"replicas"``
    (rows as for "rows", each slice held by two ranks, as vLLM replicates KV heads at TP above their number), or
    ``"cols-replicas"`` (columns so)."""
    rows = full.shape[0]
    cols = full.shape[1] if full.dim() == 2 else 1
    bounds = [(cuts[r], cuts[r + 1]) for r in range(len(cuts) - 1)]
    if how == "overlap":
        bounds = [(0, cuts[1]), (cuts[0], rows)]
    if how.endswith("replicas"):
        bounds = [bound for bound in bounds for _ in range(2)]
    out = []
    for start, end in bounds:
        if how.startswith("cols"):
            param = full[:, start:end].contiguous()
            out.append(ds_vllm.ShardMap("t", "p", param, tuple(full.shape), 0, rows, start, end - start, 0))
            continue
        param = torch.zeros((3 + end - start + pad, *full.shape[1:]), dtype=full.dtype)
        param[3 : 3 + end - start] = full[start:end]
        out.append(ds_vllm.ShardMap("t", "p", param, tuple(full.shape), start, end - start, 0, cols, 3))
    return out


def _split_check(monkeypatch, delta, shards: list[ds_vllm.ShardMap]) -> list:
    """``_split_base_error`` on every rank (threads), each holding its ShardMap of tensor "t"."""
    ranks = _Ranks(monkeypatch, len(shards))
    index = delta.names.index("t")

    def work(rank: int):
        shard = shards[rank]
        parts = {"t": ds_vllm._split_part(shard, 2 if shard.param.dtype == torch.bfloat16 else 4)}
        everyone = ds_vllm._all_gather(parts)
        return ds_vllm._split_base_error(delta, [(index, shard)], everyone)

    return ranks.run(work)


def _rank_check(delta, state: dict, layout: dict, rank: int):
    """``_split_base_error`` on rank ``rank``, which holds its ``_slices`` of each bf16 tensor of ``state`` as
    ``layout[name] = (how, cuts)`` cuts it (an empty slice held as nothing, as vLLM's ranks hold it)."""
    plan = []
    for name, (how, cuts) in layout.items():
        shard = dataclasses.replace(_slices(state[name], how, cuts)[rank], hf_name=name)
        if shard.row_count and shard.col_count:
            plan.append((delta.names.index(name), shard))
    everyone = ds_vllm._all_gather({shard.hf_name: ds_vllm._split_part(shard, 2) for _, shard in plan})
    return ds_vllm._split_base_error(delta, plan, everyone)


@pytest.mark.parametrize(
    "shape, how, cuts",
    [
        ((1000, 512), "rows", [0, 437, 1000]),  # a cut inside a 256 KiB block (256 rows of 1 KiB)
        ((1000, 512), "rows", [0, 256, 768, 1000]),  # cuts on block boundaries, three ranks
        ((1000, 512), "rows", [0, 100, 150, 1000]),  # a rank inside one block
        ((1000, 512), "cols", [0, 256, 512]),  # every row cut: no rank holds a block whole
        ((300, 1024), "cols", [0, 128, 640, 1024]),
        ((300_000,), "rows", [0, 131_073, 300_000]),  # a vector
        ((1000, 512), "overlap", [400, 700, 1000]),  # both ranks hold rows 400..700 (replicated there)
        ((1000, 512), "replicas", [0, 437, 1000]),  # four ranks, two per slice
        ((1000, 512), "replicas", [0, 512, 1000]),
        ((1000, 512), "cols-replicas", [0, 200, 512]),
    ],
)
@pytest.mark.parametrize("on_device", [False, True])
def test_ranks_that_each_hold_a_slice_check_its_base_together(monkeypatch, shape, how, cuts, on_device):
    from deltasync_rs import _identity

    if on_device:  # torch ops hash the blocks, as on a GPU
        monkeypatch.setattr(_identity, "TORCH_ON_CPU", True)
        monkeypatch.setattr(_identity, "HOST_BELOW", 0)
    generator = torch.Generator().manual_seed(len(cuts) + shape[0])
    base = torch.randn(shape, generator=generator).to(torch.bfloat16)
    new = base.clone()
    new.view(torch.int16).view(-1)[7::97] += 1
    delta = ds.diff({"t": base}, {"t": new}, step=1, base_step=0)
    assert _split_check(monkeypatch, delta, _slices(base, how, cuts)) == [None] * len(_slices(base, how, cuts))
    flat = base.numel()
    # One element off, the same on every rank that holds it: inside a block one rank holds whole, in a block a cut
    # shares, at the very end.
    for element in (flat // 3, cuts[1] * (base.shape[1] if base.dim() == 2 else 1) - 1, flat - 1):
        wrong = base.clone()
        wrong.view(torch.int16).view(-1)[element] ^= 0x10
        results = _split_check(monkeypatch, delta, _slices(wrong, how, cuts))
        assert len(set(results)) == 1 and results[0] is not None, results
        assert "tensor 't'" in results[0] and "made against base" in results[0], results[0]
        assert "nothing was applied" in results[0]
    # One element off on one rank alone, wherever its slice lies: where another rank holds it too, they disagree.
    shards = _slices(base, how, cuts)
    for rank in range(len(shards)):
        for where in (0.0, 0.5, 1.0):
            shards = _slices(base, how, cuts)
            shard = shards[rank]
            held = shard.param if how.startswith("cols") else shard.param[3 : 3 + shard.row_count]
            bits = held.view(torch.int16).reshape(-1)
            bits[min(int(where * bits.numel()), bits.numel() - 1)] ^= 0x10
            results = _split_check(monkeypatch, delta, shards)
            assert len(set(results)) == 1 and results[0] is not None, (rank, where, results)
            assert "made against base" in results[0] or "different bytes" in results[0], results[0]
            if how.endswith("replicas"):
                assert "different bytes" in results[0], results[0]


def test_ranks_whose_slices_leave_a_gap_cannot_check_the_base(monkeypatch):
    base = torch.randn(1000, 512).to(torch.bfloat16)
    delta = ds.diff({"t": base}, {"t": base + 1}, step=1, base_step=0)
    shards = _slices(base, "rows", [0, 437, 1000])
    gap = shards[1]
    shards[1] = ds_vllm.ShardMap("t", "p", gap.param, gap.hf_shape, 440, 560, 0, 512, 3)
    results = _split_check(monkeypatch, delta, shards)
    assert all(r is not None and "do not cover" in r for r in results), results
    shards = _slices(base, "cols", [0, 200, 512])  # columns 200 .. 300 held by neither
    shards[-1] = _slices(base, "cols", [0, 300, 512])[-1]
    results = _split_check(monkeypatch, delta, shards)
    assert all(r is not None and "do not cover" in r for r in results), results
    shards = [_slices(base, "rows", [0, 437, 1000])[0], _slices(base, "cols", [0, 256, 512])[1]]
    results = _split_check(monkeypatch, delta, shards)
    assert all(r is not None and "split in different ways" in r for r in results), results


def test_the_slices_of_a_large_split_tensor_cross_in_rounds(monkeypatch):
    """A column split's slices are all sent: in rounds of at most _SPLIT_ROUND_BYTES, each tensor's in one."""
    monkeypatch.setattr(ds_vllm, "_SPLIT_ROUND_BYTES", 1)
    calls = []
    together = ds_vllm._together

    def counted(work, step, what, summary=lambda _: None):
        calls.append(what)
        return together(work, step, what, summary)

    monkeypatch.setattr(ds_vllm, "_together", counted)
    base = {name: torch.randn(64, 96).to(torch.bfloat16) for name in ("a", "b", "t")}
    new = {name: tensor + 1 for name, tensor in base.items()}
    delta = ds.diff(base, new, step=1, base_step=0)
    ranks = _Ranks(monkeypatch, 2)

    layout = {name: ("cols", [0, 40, 96]) for name in ("a", "b", "t")}
    assert ranks.run(lambda rank: _rank_check(delta, base, layout, rank)) == [None, None]
    assert calls.count("send its slices of the delta's bases") == 6  # three rounds, on each of two ranks


@pytest.mark.filterwarnings("ignore:You are using a Backend:UserWarning")  # a gloo backend per thread, no global group
def test_ranks_over_real_gloo_groups_check_split_bases_together(monkeypatch):
    """The split base check over torch's own gloo collectives (``_all_gather``'s ``all_gather_object`` and
    ``_exchange``'s ``gather_object`` to each rank, nothing replaced): four ranks as threads, each with a
    ``ProcessGroupGloo`` on one in-memory store, in rounds of a few KiB, holding a row split with uneven cuts, a
    column split two ranks hold nothing of, and an even column split. The right base passes on every rank; one
    element off in any of them is refused by every rank with the same message."""
    import datetime
    import threading

    import torch.distributed as dist
    from vllm.distributed import parallel_state

    n, local, store = 4, threading.local(), dist.HashStore()
    groups: list = [None] * n

    class Group:
        world_size = n

        @property
        def rank_in_group(self) -> int:
            return local.rank

        @property
        def cpu_group(self):
            return groups[local.rank]

    monkeypatch.setattr(ds_vllm, "_tensor_parallel", lambda: n)
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: Group())
    monkeypatch.setattr(ds_vllm, "_SPLIT_ROUND_BYTES", 40_000)

    def run(work) -> list:
        results: list = [None] * n

        def go(rank: int) -> None:
            local.rank = rank
            try:
                results[rank] = work(rank)
            except BaseException as error:  # noqa: BLE001 (returned to the test)
                results[rank] = error

        threads = [threading.Thread(target=go, args=(rank,)) for rank in range(n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in threads), "a rank still waits in a collective"
        return results

    run(lambda rank: groups.__setitem__(rank, dist.ProcessGroupGloo(store, rank, n, datetime.timedelta(seconds=60))))
    generator = torch.Generator().manual_seed(1)
    shapes = {"r": (1000, 300), "c_empty": (64, 96), "c": (640, 96)}
    layout = {"r": ("rows", [0, 100, 555, 800, 1000]), "c_empty": ("cols", [0, 40, 96, 96, 96])}
    layout["c"] = ("cols", [0, 24, 48, 72, 96])
    base = {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in shapes.items()}
    delta = ds.diff(base, {name: tensor + 1 for name, tensor in base.items()}, step=1, base_step=0)
    assert run(lambda rank: _rank_check(delta, base, layout, rank)) == [None] * n
    for name, element in (("c", (600, 80)), ("c_empty", (5, 50)), ("r", (700, 3))):
        wrong = {key: tensor.clone() for key, tensor in base.items()}
        wrong[name].view(torch.int16)[element] ^= 0x10
        results = run(lambda rank, wrong=wrong: _rank_check(delta, wrong, layout, rank))
        assert len(set(map(str, results))) == 1 and f"tensor {name!r}" in str(results[0]), results
        assert "made against base" in str(results[0]), results


def test_a_column_splits_slices_go_only_to_the_rank_that_rebuilds_it(monkeypatch):
    """Each column-split tensor is rebuilt by one rank: the others' slices of it go to that rank alone, so a rank
    receives its own share of the column splits, not every rank's slice of every one (at 70B and TP 8 an
    all-gather brought each rank about 42 GB per checked delta)."""
    names = [f"t{i}" for i in range(4)]
    base = {name: torch.randn(64, 512).to(torch.bfloat16) for name in names}
    delta = ds.diff(base, {name: tensor + 1 for name, tensor in base.items()}, step=1, base_step=0)
    ranks = _Ranks(monkeypatch, 4)

    layout = {name: ("cols", [0, 128, 256, 384, 512]) for name in names}
    assert ranks.run(lambda rank: _rank_check(delta, base, layout, rank)) == [None] * 4
    slice_bytes = 64 * 128 * 2  # one rank's slice of one tensor
    # Each rank rebuilds one of the four tensors: three slices of it come from the others, with small messages.
    assert all(3 * slice_bytes <= got < 4 * slice_bytes for got in ranks.received), ranks.received
    wrong = {name: tensor.clone() for name, tensor in base.items()}
    wrong["t2"].view(torch.int16)[5, 300] ^= 0x10  # on rank 2's slice; t2 is rebuilt by rank 2
    results = ranks.run(lambda rank: _rank_check(delta, wrong, layout, rank))
    assert len(set(results)) == 1 and "tensor 't2'" in results[0] and "made against base" in results[0], results
    # Tensors of different sizes are dealt out by size: one of 4 units and four of 1 leave each of two ranks 4.
    sizes = {"a": 4, "b": 1, "c": 1, "d": 1, "e": 1}
    base = {name: torch.randn(64 * rows, 512).to(torch.bfloat16) for name, rows in sizes.items()}
    delta = ds.diff(base, {name: tensor + 1 for name, tensor in base.items()}, step=1, base_step=0)
    ranks = _Ranks(monkeypatch, 2)

    layout = {name: ("cols", [0, 256, 512]) for name in sizes}
    assert ranks.run(lambda rank: _rank_check(delta, base, layout, rank)) == [None, None]
    unit = 64 * 256 * 2  # one rank's slice of a tensor of 1 unit
    assert all(4 * unit <= got < 5 * unit for got in ranks.received), ranks.received


def test_ranks_compare_the_entries_their_files_were_verified_against(tmp_path, monkeypatch):
    """The entries' comparison of `_agreed` takes each file's entry from the fetch that verified the file against it,
    not from the subscriber's cache: an entry evicted from it (a way longer than its 64 entries) was read again from
    the store, one GET per step, and could be another than the one the file was verified against."""
    states, root, step = _tp_store(tmp_path, "a delta")
    ranks = _Ranks(monkeypatch, 2)
    subscribers = [Subscriber(root, anchor_ranges=_rows(rows)) for rows in _TP_LAYOUTS["halves"]]

    def unread(step: int):
        raise AssertionError(f"entry of step {step} read again")

    def pull(rank: int):
        deltas, _ = ds_vllm._agreed(
            subscribers[rank]._fetch_checked_by_the_apply,
            None,
            None,
            subscribers[rank]._refused_anchors,
            unread,
            subscribers[rank]._entries.clear,
        )
        assert all(d._entry == subscribers[rank].entry(d.step) for d in deltas)
        return _steps(deltas)

    assert ranks.run(pull) == [list(range(step, len(states)))] * 2


def test_a_rank_holding_an_empty_slice_adds_nothing_to_check(monkeypatch):
    """A padded vocabulary of at most 64 x TP rows leaves the last rank an empty slice while another holds every row:
    that one checks the tensor alone, and the empty slice is not a part no rank could cover (it was refused)."""
    from deltasync_rs import _write

    base = torch.randn(30, 8).to(torch.bfloat16)
    delta = ds.diff({"t": base}, {"t": base + 1}, step=1, base_step=0)
    whole, empty = _slices(base, "rows", [0, 30, 30])
    assert whole.covers_all
    writes = _write.Writes(delta._raw)
    assert ds_vllm._check_base(writes, delta, [(0, empty)]) == {}
    assert ds_vllm._check_base(writes, delta, [(0, whole)]) == {}
    wrong = _slices(base + 2, "rows", [0, 30, 30])[0]
    with pytest.raises(ds.BaseMismatchError):
        ds_vllm._check_base(writes, delta, [(0, wrong)])


def test_a_rank_that_fails_to_rebuild_a_column_split_tells_the_others(monkeypatch):
    """The rank that rebuilds a column-split tensor does so outside the exchange: an error there (out of memory, a
    panic in the core) is told to the others, which all raise it, instead of leaving them waiting for that rank."""
    from deltasync_rs import _ranged

    base = {name: torch.randn(64, 96).to(torch.bfloat16) for name in ("a", "b", "c")}
    delta = ds.diff(base, {name: tensor + 1 for name, tensor in base.items()}, step=1, base_step=0)
    real = _ranged.columns_identity

    def fails_on_rank_1(parts, sent):
        if ds_vllm._tp_rank() == 1:
            raise MemoryError("no room for the tensor")
        return real(parts, sent)

    monkeypatch.setattr(_ranged, "columns_identity", fails_on_rank_1)
    ranks = _Ranks(monkeypatch, 2)

    layout = {name: ("cols", [0, 40, 96]) for name in ("a", "b", "c")}
    results = ranks.run(lambda rank: _rank_check(delta, base, layout, rank))  # ranks 0, 1 and 0 rebuild a, b and c
    assert all(isinstance(r, ds.DeltaSyncError) for r in results), results
    assert all("tensor 'b'" in str(r) and "rank 1 could not rebuild it (MemoryError" in str(r) for r in results)


def test_the_step_a_fetch_reaches_keeps_the_entry_its_file_was_verified_against(tmp_path):
    """After the fetch, the entry kept for the step reached (a Subscriber's, or the vLLM tracker's, from which the
    next pull must continue) and the ties read for the apply are those of the entry each file was verified against:
    on a way of 80 steps the subscriber's cache of 64 had evicted the newest entries, read again from the store (and
    another entry where the step was published again in between)."""
    import numpy as np

    state = {"w": np.arange(256, dtype=np.float32)}
    with ds.Publisher(tmp_path / "store", background=False, anchor_every=1000) as publisher:
        for step in range(80):
            state = {"w": state["w"] + np.float32(1)}
            publisher.publish(step, state)
    subscriber = Subscriber(tmp_path / "store")
    deltas = subscriber.fetch(None)
    assert len(deltas) == 80 and subscriber._at is deltas[-1]._entry

    def unread(step: int):
        raise AssertionError(f"entry of step {step} read again")

    for delta in deltas:
        assert ds_vllm._entry_aliases(unread, delta) == delta._entry.aliases
        assert ds_vllm._entry_of(delta, unread) is delta._entry
