"""The realistic workload's generator (deltasync_rs._realistic) on a tiny GPT-2: deterministic, bf16 states of the
model's parameters, sparse steps, and deltas of every step that apply bit-exactly."""

from __future__ import annotations

import importlib
import os

import pytest

from deltasync_rs._realistic import RealisticConfig, load_run

TINY = RealisticConfig(
    n_layer=2,
    n_embd=64,
    n_head=2,
    seq_len=32,
    corpus_bytes=1 << 18,
    pretrain_steps=20,
    warmup_steps=5,
    finetune_steps=2,
    finetune_batch=4,
    finetune_lr=1e-6,
    threads=1,
)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    for module in ("torch", "transformers"):  # installed by `make setup`
        if os.environ.get("DELTASYNC_NO_SKIP") == "1":
            importlib.import_module(module)  # in CI a missing module is an error here, not a skip
        else:
            pytest.importorskip(module)
    return load_run(TINY, tmp_path_factory.mktemp("realistic"), log=lambda _: None)


def _bits(state):
    import torch

    return {name: t.view(torch.int16) for name, t in state.items()}


def test_states_are_the_models_parameters_in_bf16(tiny_run):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=256, n_positions=TINY.seq_len, n_embd=TINY.n_embd, n_layer=TINY.n_layer, n_head=TINY.n_head
        )
    )
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert len(tiny_run.states) == TINY.finetune_steps + 1
    for state in tiny_run.states:
        assert {name: tuple(t.shape) for name, t in state.items()} == expected
        assert all(t.dtype == torch.bfloat16 for t in state.values())
    losses = tiny_run.meta["pretrain_losses"]
    assert len(losses) == TINY.pretrain_steps and losses[-1] < losses[0]


def test_generation_is_deterministic_and_cached(tiny_run, tmp_path):
    import torch

    again = load_run(TINY, tmp_path, log=lambda _: None)
    assert again.key == tiny_run.key
    for ours, theirs in zip(tiny_run.states, again.states):
        assert all(torch.equal(a, b) for a, b in zip(_bits(ours).values(), _bits(theirs).values()))
    cached = load_run(TINY, tmp_path, log=lambda _: None)
    assert cached.meta == again.meta
    # The first run hands out its states as a cached one does (the same order), so its deltas are the same bytes.
    import deltasync_rs as ds

    assert [list(state) for state in cached.states] == [list(state) for state in again.states]
    assert (
        ds.diff(again.states[0], again.states[1]).to_bytes() == ds.diff(cached.states[0], cached.states[1]).to_bytes()
    )
    assert all(
        torch.equal(cached.states[-1][n].view(torch.int16), again.states[-1][n].view(torch.int16))
        for n in cached.states[-1]
    )


def test_steps_are_sparse_and_their_deltas_apply_bit_exactly(tiny_run):
    import deltasync_rs as ds

    num_elements = sum(t.numel() for t in tiny_run.states[0].values())
    for prev, curr in zip(tiny_run.states, tiny_run.states[1:]):
        changed = sum(int((_bits(prev)[n] != _bits(curr)[n]).sum()) for n in curr)
        assert 0 < changed / num_elements < 0.2
        sizes = {}
        for codec in ("varint", "compact", "context"):
            blob = ds.diff(prev, curr, codec=codec).to_bytes()
            sizes[codec] = len(blob)
            delta = ds.load(blob)
            assert delta.num_changed == changed
            state = {name: t.clone() for name, t in prev.items()}
            delta.apply_(state)
            assert all(bool((_bits(state)[n] == _bits(curr)[n]).all()) for n in curr)
        # Real steps change small weights more often: positions coded by the base's exponent class are smaller.
        assert sizes["context"] < sizes["compact"] < sizes["varint"]
