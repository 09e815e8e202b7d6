"""Trainer side: ds.torch.Mirror.step (copy + compare + mirror update in one pass) on the Qwen3-0.6B-shaped bf16
workload on the CPU, against the sum of its parts: a plain copy of the weights to host buffers, and ds.diff alone.
The old two-pass mirror (ds.diff, then apply the delta to the mirror) is timed too. ``Mirror.step`` runs with each
codec, one after the other in the same run (the compact one re-encodes each tensor's streams at its finish), and
with the encoding deferred, as the publisher's hooks run it (the upload thread encodes; not timed here).

Each round starts from a mirror equal to ``prev`` with the model at ``curr``; resetting the mirror is setup, not timed.
Results are checked against ds.diff (bit-exact file bytes), so a benchmark that runs is also a correctness test."""

from __future__ import annotations

import pytest
import torch

import deltasync_rs as ds
import deltasync_rs.torch as ds_torch


@pytest.fixture(scope="module")
def reference(workload):
    """The default codec's file (compact)."""
    return ds.diff(workload.prev, workload.curr, step=1, base_step=0).to_bytes()


@pytest.fixture(scope="module")
def varint_reference(workload):
    return ds.diff(workload.prev, workload.curr, codec="varint", step=1, base_step=0).to_bytes()


@pytest.fixture(scope="module")
def mirror_at_prev(workload):
    """A Mirror of a model whose weights are ``curr``, whose mirror each round is reset to ``prev``."""
    model = dict(workload.prev)  # the Mirror re-reads the mapping each step, so swapping values moves the model
    mirror = ds_torch.Mirror(model, step=0)
    model.update(workload.curr)

    def reset():
        for name, tensor in mirror.tensors.items():
            tensor.copy_(workload.prev[name])
        mirror.current_step = 0
        return (1,), {}  # the step to publish

    return mirror, reset


@pytest.mark.parametrize("codec", ["varint", "compact"])
def test_mirror_step(benchmark, workload, pedantic_opts, mirror_at_prev, reference, varint_reference, codec):
    mirror, reset = mirror_at_prev
    mirror.codec = codec
    try:
        delta = benchmark.pedantic(mirror.step, setup=reset, **pedantic_opts)
    finally:
        mirror.codec = "compact"
    assert delta.to_bytes() == (reference if codec == "compact" else varint_reference)
    assert all(
        torch.equal(mirror.tensors[n].view(torch.int16), workload.curr[n].view(torch.int16)) for n in mirror.tensors
    )
    benchmark.extra_info.update(changed=delta.num_changed, delta_bytes=delta.nbytes, mirror_bytes=mirror.nbytes)


@pytest.mark.parametrize("codec", ["compact", "context"])
def test_mirror_step_deferred(benchmark, workload, pedantic_opts, mirror_at_prev, reference, codec):
    """What the trainer waits for in ``ds.torch.attach``'s hook and ``DeltaSyncCallback``: the step with the encoding
    deferred to the publisher's upload thread (``_step(..., defer=True)``). The encoding is done after the timed
    rounds, from the mirror, and checked against ds.diff's bytes."""
    mirror, reset = mirror_at_prev
    mirror.codec = codec
    try:
        deferred = benchmark.pedantic(lambda step: mirror._step(step, defer=True), setup=reset, **pedantic_opts)
        delta = deferred.complete(mirror.tensors)
    finally:
        mirror.codec = "compact"
    want = reference if codec == "compact" else ds.diff(workload.prev, workload.curr, codec=codec, step=1, base_step=0)
    assert delta.to_bytes() == (want if isinstance(want, bytes) else want.to_bytes())
    benchmark.extra_info.update(changed=delta.num_changed, delta_bytes=delta.nbytes)


def test_copy_alone(benchmark, workload, pedantic_opts):
    """The copy part: every weight into a preallocated host buffer (what a .cpu() of CPU weights costs)."""
    host = {name: torch.empty_like(t) for name, t in workload.curr.items()}

    def copy():
        for name, tensor in workload.curr.items():
            host[name].copy_(tensor)

    benchmark.pedantic(copy, **pedantic_opts)
    assert all(torch.equal(host[n].view(torch.int16), workload.curr[n].view(torch.int16)) for n in host)


def test_diff_alone(benchmark, workload, pedantic_opts, reference):
    delta = benchmark.pedantic(
        ds.diff, args=(workload.prev, workload.curr), kwargs={"step": 1, "base_step": 0}, **pedantic_opts
    )
    assert delta.to_bytes() == reference


def test_two_pass_mirror(benchmark, workload, pedantic_opts, mirror_at_prev, reference):
    """The mirror as it was: ds.diff against the mirror, then apply that delta to the mirror."""
    mirror, reset = mirror_at_prev

    def two_pass(step):
        delta = ds.diff(mirror.tensors, workload.curr, step=step, base_step=0)
        delta.apply_(mirror.tensors)
        return delta

    delta = benchmark.pedantic(two_pass, setup=reset, **pedantic_opts)
    assert delta.to_bytes() == reference
