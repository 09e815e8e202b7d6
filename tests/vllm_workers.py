"""Tiny HF models, real AdamW steps, and the spawned vLLM ranks (gloo, CPU) that check deltasync_rs.vllm against
vLLM's own dense load_weights. Used by tests/test_vllm.py and benches/test_bench_vllm.py."""

from __future__ import annotations

import json
import os
import shutil
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

#: name -> (transformers config class, kwargs, vLLM model class path)
MODELS = {
    "qwen3-tied": (
        "Qwen3Config",
        dict(head_dim=16, num_key_value_heads=2, tie_word_embeddings=True),
        "vllm.model_executor.models.qwen3:Qwen3ForCausalLM",
    ),
    "qwen3-untied": (
        "Qwen3Config",
        dict(head_dim=16, num_key_value_heads=2, tie_word_embeddings=False),
        "vllm.model_executor.models.qwen3:Qwen3ForCausalLM",
    ),
    # one KV head: at TP=2 vLLM replicates it on both ranks; vocab 200 pads to 256 rows
    "llama-1kv": (
        "LlamaConfig",
        dict(head_dim=16, num_key_value_heads=1, tie_word_embeddings=False),
        "vllm.model_executor.models.llama:LlamaForCausalLM",
    ),
}


#: The piece size of the prepared anchor store: 1 KiB, the smallest, since the tiny models' tensors are a few KiB.
RANGED_PIECE_BYTES = 1 << 10


@dataclass
class Prepared:
    """One model's config folder, and beside it the states of consecutive bf16 exports and the deltas between them.

    The states stay out of the config folder: vLLM unties the word embeddings of a tied config whose folder holds
    a checkpoint with an ``lm_head`` (ModelConfig.maybe_untie_word_embeddings)."""

    name: str
    folder: str
    data: str

    def path(self, what: str) -> str:
        return os.path.join(self.data, what)


def _hf_config(name: str):
    import transformers

    config_cls, extra, _ = MODELS[name]
    return getattr(transformers, config_cls)(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        **extra,
    )


def bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The bf16 export of an fp32 master, every name a separate tensor (tied names included, as state_dict has them)."""
    return {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}


def prepare(name: str, folder: Path, *, steps: int = 2, lr: float = 3e-5, seed: int = 0) -> Prepared:
    """Saves the config, the step-0 state and one delta per real AdamW step (fp32 master, bf16 export)."""
    import transformers
    from safetensors.torch import save_file

    import deltasync_rs as ds
    from tests.helpers import republish_anchor

    data = folder.with_name(folder.name + "-data")
    folder.mkdir(parents=True, exist_ok=True)
    data.mkdir(parents=True, exist_ok=True)
    config = _hf_config(name)
    torch.manual_seed(seed)
    architecture = MODELS[name][2].rsplit(":", 1)[1]  # vLLM's class names are the HF architectures
    config.architectures = [architecture]
    model = getattr(transformers, architecture)(config).float()
    config.save_pretrained(folder)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    states = [bf16_state(model)]
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab_size, (2, 12), generator=generator)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        states.append(bf16_state(model))
    for step, state in enumerate(states):
        save_file(state, str(data / f"state_{step}.safetensors"))
    # A store whose only step is an anchor of the last state, in small pieces so that a rank of this tiny model can
    # read its shard alone (check_anchor_pull_reads_only_this_ranks_shard).
    with ds.Publisher(data / "store-ranged", piece_bytes=RANGED_PIECE_BYTES, background=False) as publisher:
        publisher.publish(steps, states[-1])
    # A store of every step: an anchor of step 0, then compact deltas (check_pull_checks_streams_as_it_applies).
    with ds.Publisher(data / "store-deltas", background=False) as publisher:
        for step, state in enumerate(states):
            publisher.publish(step, state)
    # A store whose anchor of step 1 is wrong (step 0's weights, every file made to agree with it) and whose step 2
    # has no anchor: a fresh pull must take anchor 0's way (check_a_wrong_anchor_is_refused_by_every_rank).
    wrong = data / "store-wrong-anchor"
    with ds.Publisher(wrong, anchor_every=1, piece_bytes=RANGED_PIECE_BYTES, background=False) as publisher:
        for step in (0, 1):
            publisher.publish(step, states[step])
    with ds.Publisher(wrong, anchor_every=1000, piece_bytes=RANGED_PIECE_BYTES, background=False) as publisher:
        publisher.resume(states[1], step=1)
        publisher.publish(2, states[2])
    republish_anchor(wrong, 1, ds.anchor(states[0], step=1).to_bytes())
    # The same, with an anchor of step 1 that is wrong only in tensors vLLM splits by rows at TP=2 (gate/up, q/k/v),
    # of which each rank reads only its own rows (check_a_wrong_anchor_in_row_split_tensors_is_refused).
    rows = data / "store-wrong-rows"
    shutil.copytree(wrong, rows)
    republish_anchor(rows, 1, ds.anchor(states[1] | _row_split(states[0]), step=1).to_bytes())
    # Stores of one step each, made here so that every rank pulls the same store: ranks that read different
    # manifest entries for a step fetch again and then refuse (vllm._agreed).
    with ds.Publisher(data / "store-tied-anchor", piece_bytes=1 << 10, background=False) as publisher:
        publisher.publish(7, _lm_head_off_by_a_row(states[2]))
    with ds.Publisher(data / "store-tied-trainer", background=False) as publisher:
        publisher.publish_shared(
            7, _without_lm_head(states[2]), aliases={"lm_head.weight": "model.embed_tokens.weight"}
        )
    # A store whose newest step's anchor is wrong, no delta after it (check_a_wrong_newest_anchor_is_refused).
    newest = data / "store-wrong-newest"
    with ds.Publisher(newest, anchor_every=1, piece_bytes=RANGED_PIECE_BYTES, background=False) as publisher:
        for step in (0, 1, 2):
            publisher.publish(step, states[step])
    republish_anchor(newest, 2, ds.anchor(states[1], step=2).to_bytes())
    for step in range(1, steps + 1):
        for values in ("diff", "abs"):
            for codec in ("varint", "compact", "context"):
                suffix = "" if codec == "varint" else f"_{codec}"
                ds.diff(states[step - 1], states[step], values=values, codec=codec, step=step, base_step=step - 1).save(
                    data / f"delta_{step}_{values}{suffix}.safetensors"
                )
    return Prepared(name, str(folder), str(data))


def _row_split(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of ``state`` that vLLM splits by rows at TP=2 (a rank holds some rows, all columns): the MLP's
    gate and up projections and the attention's query projection (the key/value ones of one KV head are replicated)."""
    return {
        name: tensor
        for name, tensor in state.items()
        if name.endswith(("gate_proj.weight", "up_proj.weight", "q_proj.weight"))
    }


def build_vllm_model(prepared: Prepared):
    """A vLLM model of `prepared`'s architecture on this rank (after init_parallel), loaded with the step-0 state."""
    import importlib

    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    module_path, cls_name = MODELS[prepared.name][2].split(":")
    model_cls = getattr(importlib.import_module(module_path), cls_name)
    config = VllmConfig(
        model_config=ModelConfig(model=prepared.folder, dtype="bfloat16", skip_tokenizer_init=True),
        device_config=DeviceConfig(device="cpu"),
    )
    with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
        model = model_cls(vllm_config=config)
    load_state(model, prepared, 0)
    return model, config


def load_state(model, prepared: Prepared, step: int) -> None:
    from safetensors.torch import load_file

    with torch.no_grad():
        model.load_weights(load_file(prepared.path(f"state_{step}.safetensors")).items())


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def differing(model, expected: dict[str, torch.Tensor]) -> list[str]:
    """Names of parameters whose bits differ from `expected` (int views, so NaN payloads and -0.0 count)."""
    bad = []
    for name, param in model.named_parameters(remove_duplicate=False):
        want = expected[name]
        if param.shape != want.shape or not torch.equal(param.detach().view(torch.int16), want.view(torch.int16)):
            bad.append(name)
    return bad


def init_parallel(rank: int, world_size: int, init_file: str) -> None:
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        init_distributed_environment(world_size, rank, f"file://{init_file}", rank, backend="gloo")
        initialize_model_parallel(world_size, 1)


def run_rank(rank: int, world_size: int, init_file: str, prepared: list[Prepared], out_dir: str, scenarios) -> None:
    """Entry point of one spawned rank: runs every scenario on every model; records ok / the failure per check."""
    torch.set_num_threads(1)
    results: list[dict] = []
    try:
        init_parallel(rank, world_size, init_file)
        for item in prepared:
            model, config = build_vllm_model(item)
            for scenario in scenarios:
                try:
                    from vllm.config import set_current_vllm_config

                    load_state(model, item, 0)
                    with set_current_vllm_config(config):
                        scenario(model, item)
                    results.append({"model": item.name, "check": scenario.__name__, "error": None})
                except Exception:  # recorded and asserted on by the parent test
                    results.append({"model": item.name, "check": scenario.__name__, "error": traceback.format_exc()})
    except Exception:
        results.append({"model": "*", "check": "setup", "error": traceback.format_exc()})
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


# ------------------------------------------------------------------------------------------ checks run in each rank


def _delta(item: Prepared, step: int, values: str, codec: str = "varint"):
    import deltasync_rs as ds

    return ds.load(item.path(f"delta_{step}_{values}{'' if codec == 'varint' else '_' + codec}.safetensors"))


def _state(item: Prepared, step: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(item.path(f"state_{step}.safetensors"))


def _dense_reference(model, item: Prepared, step: int) -> dict[str, torch.Tensor]:
    """What vLLM's own dense load_weights of the step's HF weights gives; the model is reloaded with it."""
    load_state(model, item, step)
    return snapshot(model)


def _expect_untouched(model, before, error_type, call, must_contain: str) -> None:
    try:
        call()
    except error_type as exc:
        assert must_contain in str(exc), f"error does not mention {must_contain!r}: {exc}"
    else:
        raise AssertionError(f"expected {error_type.__name__}")
    bad = differing(model, before)
    assert not bad, f"a rejected delta changed {bad[:5]}"


def _assert_equal_to_reload(model, item: Prepared, step: int) -> None:
    applied = snapshot(model)
    start = _dense_reference(model, item, 0)
    changed = [n for n in applied if not torch.equal(applied[n].view(torch.int16), start[n].view(torch.int16))]
    assert changed, "the deltas changed nothing on this rank, so the check would prove nothing"
    reference = _dense_reference(model, item, step)
    bad = [n for n in reference if not torch.equal(applied[n].view(torch.int16), reference[n].view(torch.int16))]
    assert not bad, f"{len(bad)} parameters differ from vLLM's dense reload, e.g. {bad[:5]}"


def check_diff_then_abs_match_dense_reload(model, item: Prepared) -> None:
    from deltasync_rs.vllm import apply_delta, is_mapped

    assert is_mapped(model)
    written = apply_delta(model, _delta(item, 1, "diff"), current_step=0)
    written += apply_delta(model, _delta(item, 2, "abs"), current_step=1)
    assert written > 0
    _assert_equal_to_reload(model, item, 2)


def check_compact_matches_dense_reload(model, item: Prepared) -> None:
    """Compact deltas (rice positions, diffbits or rans values) on every shard layout: fused rows, row- and column-split
    shards at TP=2, replicated norms, vocab-split embeddings."""
    from deltasync_rs.vllm import apply_delta

    first = _delta(item, 1, "diff", "compact")
    assert {"diffbits", "rans"} & {t.values for t in first.tensors}, "no tensor took a compact value codec"
    apply_delta(model, first, current_step=0)
    apply_delta(model, _delta(item, 2, "abs", "compact"), current_step=1)
    _assert_equal_to_reload(model, item, 2)


def check_compact_checked_by_the_apply(model, item: Prepared) -> None:
    """A compact delta loaded with its streams checked as they are applied (check="apply", what a Subscriber's pull
    reads): refused naming the tensor, every parameter as it was, when a stream is malformed; else bit-exact on every
    shard layout."""
    import deltasync_rs as ds
    from deltasync_rs.vllm import apply_delta
    from tests.helpers import malformed_for_the_apply

    blob = Path(item.path("delta_1_diff_compact.safetensors")).read_bytes()
    bad = ds.load(malformed_for_the_apply(blob), check="apply")
    # A DeltaFormatError from the decode; where the changed stream is one of a tied pair (one parameter in vLLM), the
    # refusal of two tensors that now differ comes first. Either way before any write.
    _expect_untouched(
        model, snapshot(model), ds.DeltaSyncError, lambda: apply_delta(model, bad, current_step=0), "tensor"
    )
    apply_delta(model, ds.load(blob, check="apply"), current_step=0)
    apply_delta(model, _delta(item, 2, "abs", "compact"), current_step=1)
    _assert_equal_to_reload(model, item, 2)


def check_pull_checks_streams_as_it_applies(model, item: Prepared) -> None:
    """A worker's pull checks the deltas' streams as it applies them: bit-exact. A delta whose stream only the apply
    finds malformed (a file that matches its entry) is refused with every parameter as it was, the worker still at
    the step before it (here no anchor leads around it); the pull then goes on once the file reads well."""
    import hashlib

    import deltasync_rs as ds
    from deltasync_rs.sync import delta_key
    from tests.helpers import subscriber_reads_malformed

    store = item.path("store-deltas")
    worker = _fresh_worker(model)
    assert worker.deltasync_pull(store, 1) == 1
    bad = hashlib.sha256(Path(store, delta_key(2)).read_bytes()).hexdigest()
    with subscriber_reads_malformed(bad) as seen:
        # A ChainError after the way was read again with every file checked first (DeltaSyncError: where the changed
        # stream is one of a tied pair, vLLM's refusal of two tensors that now differ comes first).
        _expect_untouched(model, snapshot(model), ds.DeltaSyncError, lambda: worker.deltasync_pull(store), "")
        assert worker.deltasync_step() == 1
    assert seen["deferred"] == 1, seen
    assert worker.deltasync_pull(store) == 2
    _assert_equal_to_reload(model, item, 2)


def check_ranks_pull_to_the_same_step(model, item: Prepared) -> None:
    """TP ranks pull together but each reads the store: when one finds a newer step than another (a publish between
    their reads), all end at the step every rank reached; when one rank's fetch fails, every rank raises before
    anything is applied. At TP=1 a pull is the rank's own."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    import deltasync_rs as ds
    from deltasync_rs.sync import Subscriber

    store = item.path("store-deltas")
    tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    fetch = Subscriber._fetch_checked_by_the_apply

    def rank_0_sees_step_1_only(self, current, until):
        return fetch(self, current, 1 if rank == 0 and until is None else until)

    def rank_1_fails(self, current, until):
        if rank == 1:
            raise ds.DeltaSyncError("the store is down for rank 1")
        return fetch(self, current, until)

    worker = _fresh_worker(model)
    Subscriber._fetch_checked_by_the_apply = rank_1_fails
    try:
        if tp > 1:
            _expect_untouched(
                model,
                snapshot(model),
                ds.DeltaSyncError,
                lambda: worker.deltasync_pull(store),
                "the store is down" if rank == 1 else "rank 1 could not fetch",
            )
            assert worker.deltasync_step() is None
        Subscriber._fetch_checked_by_the_apply = rank_0_sees_step_1_only
        assert worker.deltasync_pull(store) == 1  # rank 1 alone would reach step 2
    finally:
        Subscriber._fetch_checked_by_the_apply = fetch
    assert worker.deltasync_pull(store) == 2
    _assert_equal_to_reload(model, item, 2)
    if tp > 1:  # the store's run unreadable on one rank (read before the fetch): every rank raises, none waits
        worker.deltasync_set_step(None)
        assert worker.deltasync_pull(store, 1) == 1  # a pull keeps the entry of step 1, whose run is read next
        run = Subscriber.run

        def run_fails_on_rank_1(self):
            if rank == 1:
                raise ds.StoreError("run.json unreadable on rank 1")
            return run.fget(self)

        Subscriber.run = property(run_fails_on_rank_1)
        try:
            why = "run.json unreadable" if rank == 1 else "rank 1 could not check its weights"
            _expect_untouched(model, snapshot(model), ds.DeltaSyncError, lambda: worker.deltasync_pull(store), why)
        finally:
            Subscriber.run = run
        assert worker.deltasync_pull(store) == 2
    if tp > 1:  # a file one rank cannot load: every rank raises, none applies
        worker.deltasync_set_step(0)
        files = [item.path("delta_1_diff.safetensors" if rank == 0 else "missing.safetensors")]
        why = "rank 1 could not load the delta files" if rank == 0 else "missing.safetensors"
        _expect_untouched(model, snapshot(model), ds.DeltaSyncError, lambda: worker.deltasync_apply(files), why)
    if tp > 1:  # ranks that are at different steps are refused, every one of them, before anything is applied
        worker.deltasync_set_step(1 + rank)
        for call in (
            lambda: worker.deltasync_pull(store),
            lambda: worker.deltasync_apply([item.path("delta_2_diff.safetensors")]),
        ):
            _expect_untouched(model, snapshot(model), ds.BaseMismatchError, call, "ranks are at different steps")
    if tp > 1:  # under vLLM's multiprocess executor, which reads the replies in rank order, the last rank alone raises
        from types import SimpleNamespace

        for backend in ("mp", "external_launcher"):
            parallel = SimpleNamespace(distributed_executor_backend=backend, pipeline_parallel_size=1, nnodes=1)
            worker.vllm_config = SimpleNamespace(parallel_config=parallel)
            raises = backend != "mp" or rank == tp - 1
            for at, call, why in (
                (1 + rank, lambda: worker.deltasync_pull(store), "ranks are at different steps"),  # decided together
                (0, lambda: worker.deltasync_apply([item.path("missing.safetensors")]), "missing.safetensors"),
                (0, lambda: worker.deltasync_pull(store, "x"), "must be a step number"),  # the same arguments
                (5, lambda: worker.deltasync_apply([item.path("delta_1_diff.safetensors")]), "applies to step 0"),
                (0, lambda: worker.deltasync_pull(store, None, None, "bogus"), "path must be"),  # arguments
                (  # refused by vLLM's loader path (it needs new values), decided together
                    0,
                    lambda: worker.deltasync_apply([item.path("delta_1_diff.safetensors")], path="loader"),
                    'values="abs"',
                ),
            ):
                worker.deltasync_set_step(at)
                before = snapshot(model)
                if raises:
                    _expect_untouched(model, before, ds.DeltaSyncError, call, why)
                else:
                    assert call() is None, backend
                    assert not differing(model, before)
                assert worker.deltasync_step() == at
        del worker.vllm_config


def check_context_applies_bit_exactly(model, item: Prepared) -> None:
    """`context` positions decode against the base. Where the rank holds whole tensors, the core decodes them after
    checking the base identity (applied twice: refused). Where it holds a slice (TP=2), the ranks exchange how many
    elements of each class each run of their slices holds and each places its own changes (deltasync_rs._context):
    bit-exact against vLLM's dense reload. A failure on one rank before the exchange makes every rank refuse the
    delta, naming that rank, with nothing written anywhere."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    import deltasync_rs as ds
    from deltasync_rs import _write
    from deltasync_rs.vllm import apply_delta

    first = _delta(item, 1, "diff", "context")
    assert "context" in {t.positions for t in first.tensors}, "no tensor took context positions"
    tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    held, placed = _write.Writes.context_held, _write.Writes._add_context_part
    counts = {"placed": 0}

    def fail_on_rank_1(self, index, region):
        if rank == 1:
            raise ds.DeltaSyncError("a failure of rank 1 alone")
        return held(self, index, region)

    def counting(self, *args):
        counts["placed"] += 1
        return placed(self, *args)

    if tp > 1:
        _write.Writes.context_held = fail_on_rank_1
        try:
            _expect_untouched(
                model,
                snapshot(model),
                ds.DeltaSyncError,
                lambda: apply_delta(model, first, current_step=0),
                "a failure of rank 1 alone" if rank == 1 else "tensor-parallel rank 1 could not apply",
            )
        finally:
            _write.Writes.context_held = held
    _write.Writes._add_context_part = counting
    try:
        apply_delta(model, first, current_step=0)
        if tp == 1:
            _expect_untouched(
                model,
                snapshot(model),
                ds.BaseMismatchError,  # applied twice: the core checks a whole tensor's base identity first
                lambda: apply_delta(model, first),
                "base",
            )
        apply_delta(model, _delta(item, 2, "diff", "context"), current_step=1)
    finally:
        _write.Writes._add_context_part = placed
    assert (counts["placed"] > 0) == (tp > 1), counts
    _assert_equal_to_reload(model, item, 2)


def check_a_replicated_context_base_that_differs_on_one_rank_is_refused_by_every_rank(model, item: Prepared) -> None:
    """A `context` tensor every rank holds whole (a KV head replicated at TP > the model's KV heads) whose base
    differs on the last rank alone: its base was checked only as the core wrote it, after the ranks had agreed to
    write, so rank 0 wrote the step and the last rank raised, leaving the replica at two steps (found by an
    adversarial helper). Every rank refuses now, and none writes. At TP=1 the one rank refuses."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    import deltasync_rs as ds
    from deltasync_rs.vllm import _whole_region, apply_delta, shard_map

    first = _delta(item, 1, "diff", "context")
    whole = [t.name for t in first.tensors if t.positions == "context" and shard_map(model, t.name).covers_all]
    if get_tensor_model_parallel_world_size() > 1 and not any("k_proj" in n or "v_proj" in n for n in whole):
        return  # no KV head replicated on this model at this TP
    name = next(n for n in whole if "k_proj" in n or "v_proj" in n) if whole else None
    assert name is not None, "no context tensor held whole"
    if get_tensor_model_parallel_rank() == get_tensor_model_parallel_world_size() - 1:
        with torch.no_grad():
            _whole_region(shard_map(model, name)).view(torch.int16)[0] ^= 1
    _expect_untouched(
        model, snapshot(model), ds.BaseMismatchError, lambda: apply_delta(model, first, current_step=0), name
    )


def check_context_on_a_device(model, item: Prepared) -> None:
    """Parameters on a device (no GPU here: every torch tensor is treated as one, and the device hash runs on CPU
    tensors): a whole `context` tensor's identity is computed by torch ops, all of one delta's in one batched call,
    then its classes and changes there too; bit-exact against the dense reload, and applied twice it is refused
    with nothing written. A rank's slice (TP=2) is placed as before."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size

    import deltasync_rs as ds
    from deltasync_rs import _identity, _write
    from deltasync_rs.vllm import apply_delta

    first = _delta(item, 1, "diff", "context")
    calls: list[int] = []
    saved = _write._on_device, _identity.base_identities, _identity.TORCH_ON_CPU, _identity.HOST_BELOW
    real = _identity.base_identities
    _write._on_device = lambda x: isinstance(x, torch.Tensor)
    _identity.base_identities = lambda tensors: calls.append(len(tensors)) or real(tensors)
    _identity.TORCH_ON_CPU, _identity.HOST_BELOW = True, 0
    try:
        apply_delta(model, first, current_step=0)
        if get_tensor_model_parallel_world_size() == 1:
            whole = sum(t.positions == "context" for t in first.tensors)
            # Every whole context tensor hashed together, once (a tied head is the embedding's parameter: one less).
            assert len(calls) == 1 and whole - 1 <= calls[0] <= whole, (calls, whole)
            _expect_untouched(
                model, snapshot(model), ds.BaseMismatchError, lambda: apply_delta(model, first), "not the base"
            )
        apply_delta(model, _delta(item, 2, "diff", "context"), current_step=1)
    finally:
        _write._on_device, _identity.base_identities, _identity.TORCH_ON_CPU, _identity.HOST_BELOW = saved
    _assert_equal_to_reload(model, item, 2)


def check_context_abs_values_at_any_tp(model, item: Prepared) -> None:
    """`context` positions with new values (values="abs"), steps 1 then 2: bit-exact against the dense reload."""
    from deltasync_rs.vllm import apply_delta

    apply_delta(model, _delta(item, 1, "abs", "context"), current_step=0)
    apply_delta(model, _delta(item, 2, "abs", "context"), current_step=1)
    _assert_equal_to_reload(model, item, 2)


def check_base_identity_at_any_tp(model, item: Prepared) -> None:
    """check_base=True: a rank checks the tensors it holds whole alone, and the ranks check together those split
    across them (row and column splits): a base that differs on one rank alone is refused by every rank."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    import deltasync_rs as ds
    from deltasync_rs.vllm import apply_delta

    delta = _delta(item, 1, "diff", "compact")
    if get_tensor_model_parallel_world_size() > 1:
        params = dict(model.named_parameters())
        # One element of one rank's slice: rank 1's rows of the fused q/k/v (a row split), rank 0's columns of
        # o_proj (a column split), rank 1's rows of the vocabulary.
        for rank, name in (
            (1, "model.layers.0.self_attn.qkv_proj.weight"),
            (0, "model.layers.1.self_attn.o_proj.weight"),
            (1, "model.embed_tokens.weight"),
        ):
            bits = params[name].data.view(torch.int16).view(-1)
            if get_tensor_model_parallel_rank() == rank:
                bits[3] ^= 0x10
            _expect_untouched(
                model,
                snapshot(model),
                ds.BaseMismatchError,
                lambda: apply_delta(model, delta, current_step=0, check_base=True),
                "base",
            )
            if get_tensor_model_parallel_rank() == rank:
                bits[3] ^= 0x10
    apply_delta(model, delta, current_step=0, check_base=True)
    _expect_untouched(
        model,
        snapshot(model),
        ds.BaseMismatchError,  # applied twice: the base no longer matches
        lambda: apply_delta(model, delta, check_base=True),
        "base",
    )
    _assert_equal_to_reload(model, item, 1)
    load_state(model, item, 1)  # a `context` delta, whose split tensors are placed from every rank's classes
    apply_delta(model, _delta(item, 2, "diff", "context"), current_step=1, check_base=True)
    _assert_equal_to_reload(model, item, 2)


def check_unknown_name_rejected(model, item: Prepared) -> None:
    import deltasync_rs as ds
    from deltasync_rs.vllm import apply_delta

    prev, curr = _state(item, 0), _state(item, 1)
    prev["model.layers.0.mlp.bogus_proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    curr["model.layers.0.mlp.bogus_proj.weight"] = torch.ones(4, 4, dtype=torch.bfloat16)
    for path, values in (("mapped", "diff"), ("mapped", "abs"), ("loader", "abs")):
        delta = ds.diff(prev, curr, values=values, step=1, base_step=0)
        _expect_untouched(
            model,
            snapshot(model),
            ds.BaseMismatchError,
            lambda delta=delta, path=path: apply_delta(model, delta, current_step=0, path=path),
            "bogus_proj",
        )


def check_wrong_base_rejected(model, item: Prepared) -> None:
    import deltasync_rs as ds
    from deltasync_rs.vllm import apply_delta

    before = snapshot(model)
    for values in ("diff", "abs"):
        _expect_untouched(
            model,
            before,
            ds.BaseMismatchError,
            lambda values=values: apply_delta(model, _delta(item, 2, values), current_step=0),
            "step 1",
        )


def check_lm_head_alone(model, item: Prepared) -> None:
    """Tied: rejected like vLLM's loader does, naming the fix. Untied: applied to lm_head only."""
    import deltasync_rs as ds
    from deltasync_rs.vllm import apply_delta

    prev, curr = _state(item, 0), _state(item, 1)
    delta = ds.diff(
        {"lm_head.weight": prev["lm_head.weight"]}, {"lm_head.weight": curr["lm_head.weight"]}, step=1, base_step=0
    )
    if MODELS[item.name][1]["tie_word_embeddings"]:
        _expect_untouched(
            model,
            snapshot(model),
            ds.BaseMismatchError,
            lambda: apply_delta(model, delta, current_step=0),
            "model.embed_tokens.weight",
        )
        return
    apply_delta(model, delta, current_step=0)
    applied = snapshot(model)
    with torch.no_grad():
        model.load_weights([("lm_head.weight", curr["lm_head.weight"])])
    bad = differing(model, applied)
    assert not bad, f"differs from a dense reload of lm_head: {bad}"


def _the_same_changes(prev: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``prev``'s bf16 tensors (of one shape) with the same changes made to each: every 37th element from the 100th
    one bit pattern up."""
    step = torch.zeros_like(next(iter(prev.values())), dtype=torch.int16).view(-1)
    step[100::37] = 1
    return {
        name: (tensor.view(torch.int16).view(-1) + step).view(torch.bfloat16).view(tensor.shape)
        for name, tensor in prev.items()
    }


def check_a_tied_head_made_against_another_base_is_refused_by_check_base(model, item: Prepared) -> None:
    """A served model that ties lm_head to embed_tokens holds one memory for both: a delta whose two tensors have the
    same changes but were made against different bases (a trainer whose lm_head differs) is refused with
    check_base, which used to check the embedding's base alone."""
    import deltasync_rs as ds
    from deltasync_rs.vllm import apply_delta

    if not MODELS[item.name][1]["tie_word_embeddings"]:
        return  # an untied model holds the two apart: each is checked on its own
    embed = _state(item, 0)["model.embed_tokens.weight"]
    head = embed.clone()
    head.view(torch.int16).view(-1)[5] += 3  # the trainer's lm_head, one element off the embedding
    prev = {"model.embed_tokens.weight": embed, "lm_head.weight": head}
    curr = _the_same_changes(prev)
    delta = ds.diff(prev, curr, values="diff", step=1, base_step=0)
    _expect_untouched(
        model,
        snapshot(model),
        ds.BaseMismatchError,
        lambda: apply_delta(model, delta, current_step=0, check_base=True),
        "different bases",
    )
    same = ds.diff(
        {"model.embed_tokens.weight": embed, "lm_head.weight": embed},
        curr | {"lm_head.weight": curr["model.embed_tokens.weight"]},
        values="diff",
        step=1,
        base_step=0,
    )
    apply_delta(model, same, current_step=0, check_base=True)  # the trainer ties them too: checked, applied


def check_a_tied_record_without_a_base_is_checked_through_the_other(model, item: Prepared) -> None:
    """Of a tied pair (one memory, written once through one record), the record written is one that holds a base:
    lm_head's without one, the embedding's (made against another embedding than the served one) was never
    compared with check_base, and the delta applied."""
    import deltasync_rs as ds
    from deltasync_rs.vllm import apply_delta
    from tests.helpers import without_base

    if not MODELS[item.name][1]["tie_word_embeddings"]:
        return  # an untied model holds the two apart: each is checked on its own
    served = _state(item, 0)["model.embed_tokens.weight"]
    other = served.clone()
    other.view(torch.int16).view(-1)[5] += 3  # the trainer's embedding, one element off the served one
    prev = {"lm_head.weight": other, "model.embed_tokens.weight": other}
    curr = _the_same_changes(prev)
    made = ds.diff(prev, curr, values="diff", codec="varint", step=1, base_step=0)  # a record per tensor
    assert made.names.index("lm_head.weight") < made.names.index("model.embed_tokens.weight")
    delta = ds.load(without_base(made.to_bytes(), "lm_head.weight"))
    assert delta.base_identity(delta.names.index("lm_head.weight")) is None
    _expect_untouched(
        model,
        snapshot(model),
        ds.BaseMismatchError,
        lambda: apply_delta(model, delta, current_step=0, check_base=True),
        "model.embed_tokens.weight",
    )


def check_loader_path_abs(model, item: Prepared) -> None:
    from deltasync_rs.vllm import apply_delta

    apply_delta(model, _delta(item, 1, "abs"), current_step=0, path="loader")
    apply_delta(model, _delta(item, 2, "abs"), current_step=1, path="loader")
    _assert_equal_to_reload(model, item, 2)


def check_loader_path_rejects_diff(model, item: Prepared) -> None:
    import deltasync_rs as ds
    from deltasync_rs.vllm import apply_delta

    _expect_untouched(
        model,
        snapshot(model),
        ds.DeltaSyncError,
        lambda: apply_delta(model, _delta(item, 1, "diff"), current_step=0, path="loader"),
        'values="abs"',
    )


def check_loader_path_rejects_context_positions(model, item: Prepared) -> None:
    """`context` positions decode only against the base, which the loader path does not hold: said so, with the
    codecs that work (it was a DeltaFormatError that a pull reads as a malformed stream; found by an adversarial
    helper)."""
    import deltasync_rs as ds
    from deltasync_rs.vllm import apply_delta

    _expect_untouched(
        model,
        snapshot(model),
        ds.DeltaSyncError,
        lambda: apply_delta(model, _delta(item, 1, "abs", "context"), current_step=0, path="loader"),
        "codec='compact' or 'varint'",
    )


def check_unmapped_architecture_falls_back(model, item: Prepared) -> None:
    import deltasync_rs as ds
    from deltasync_rs.vllm import apply_delta, is_mapped

    original = type(model)
    model.__class__ = type("UnmappedForCausalLM", (original,), {})  # same loader, a name outside the mapping
    try:
        assert not is_mapped(model)
        _expect_untouched(
            model,
            snapshot(model),
            ds.DeltaSyncError,
            lambda: apply_delta(model, _delta(item, 1, "diff"), current_step=0),
            'values="abs"',
        )
        apply_delta(model, _delta(item, 1, "abs"), current_step=0)
    finally:
        model.__class__ = original
    _assert_equal_to_reload(model, item, 1)


def check_worker_extension_applies_files(model, item: Prepared) -> None:
    from types import SimpleNamespace

    from deltasync_rs.vllm import DeltaSyncWorkerExtension

    worker = DeltaSyncWorkerExtension()
    worker.model_runner = SimpleNamespace(model=model)
    assert worker.deltasync_set_step(0) == 0
    step = worker.deltasync_apply(
        [item.path("delta_1_diff.safetensors"), open(item.path("delta_2_diff.safetensors"), "rb").read()]
    )
    assert step == 2 == worker.deltasync_step()
    _assert_equal_to_reload(model, item, 2)


def check_weights_reloaded_by_vllm_are_noticed(model, item: Prepared) -> None:
    """vLLM put the step-0 checkpoint back in place (reload_weights runs the model's load_weights) after the worker
    reached step 1: its step tracker still said 1, and the next delta of differences was applied onto step 0's
    weights, silently, at any TP (found by an adversarial helper). The tracker samples the weights it leaves and
    notices: the files are refused on every rank with nothing written, and the step is forgotten."""
    import deltasync_rs as ds

    worker = _fresh_worker(model)
    load_state(model, item, 0)
    assert worker.deltasync_set_step(0) == 0
    assert worker.deltasync_apply([item.path("delta_1_diff.safetensors")]) == 1
    load_state(model, item, 0)  # what vLLM's reload_weights does
    _expect_untouched(
        model,
        snapshot(model),
        ds.BaseMismatchError,
        lambda: worker.deltasync_apply([item.path("delta_2_diff.safetensors")]),
        "step is unknown",
    )
    assert worker.deltasync_step() is None
    # Declared again, it goes on from there.
    assert worker.deltasync_set_step(0) == 0
    assert worker.deltasync_apply([item.path("delta_1_diff.safetensors"), item.path("delta_2_diff.safetensors")]) == 2
    _assert_equal_to_reload(model, item, 2)


def _fresh_worker(model):
    """A worker extension on ``model`` that knows no step (the model's step tracker outlives the checks)."""
    from types import SimpleNamespace

    from deltasync_rs.vllm import DeltaSyncWorkerExtension

    worker = DeltaSyncWorkerExtension()
    worker.model_runner = SimpleNamespace(model=model)
    worker.deltasync_set_step(None)
    return worker


def check_a_wrong_anchor_is_refused_by_every_rank(model, item: Prepared) -> None:
    """The anchor of step 1 holds step 0's weights, every file matching its entry, and delta 2 was made against the
    real step 1. A worker applied that anchor, then delta 2 without a base check (the default), and said it held
    step 2 over other weights. Each rank now compares delta 2's base identities with the anchor's tensors it read
    whole (at TP=2: the replicated and column-split ones), refuses that way and takes anchor 0's: bit-exact."""
    import deltasync_rs as ds
    from deltasync_rs.manifest import entry_key

    store = item.path("store-wrong-anchor")
    assert ds.Subscriber(store).entry(2).anchor is None and ds.Subscriber(store).entry(1).anchor is not None
    assert Path(store, entry_key(2)).exists()
    worker = _fresh_worker(model)
    assert worker.deltasync_pull(store) == 2
    _assert_equal_to_reload(model, item, 2)


def check_a_wrong_anchor_in_row_split_tensors_is_refused(model, item: Prepared) -> None:
    """As above, with an anchor of step 1 that differs from the real one only in tensors split by rows at TP=2: each
    rank reads only its rows of them, so neither could compare them with delta 2's base identities, and at TP=2 the
    ranks took that anchor and said they held step 2 over wrong weights. The ranks now combine the hashes of the
    blocks they hold (and the bytes of blocks their boundary cuts) into each such tensor's identity, refuse the
    anchor together and take anchor 0's way: bit-exact."""
    worker = _fresh_worker(model)
    worker._deltasync_tracker().refused_anchors.clear()  # the model's tracker outlives the checks
    assert worker.deltasync_pull(item.path("store-wrong-rows")) == 2
    _assert_equal_to_reload(model, item, 2)
    assert len(worker._deltasync_tracker().refused_anchors) == 1


def check_a_wrong_newest_anchor_is_refused(model, item: Prepared) -> None:
    """The anchor of the newest step, 2, holds step 1's weights (every file matching its entry but the state
    digest); no delta follows it. At TP=1 the worker reads it whole and its tensors do not make the entry's state
    digest. At TP=2 each rank read only its shard and nothing checked it: the ranks applied it and said they held
    step 2. Now they make the digest together (each hashes the tensors it read whole, and the row-split ones in
    turn, handing the hash on), refuse the anchor and take anchor 1's way: bit-exact."""
    import deltasync_rs as ds

    store = item.path("store-wrong-newest")
    assert ds.Subscriber(store).entry(2).delta is not None
    worker = _fresh_worker(model)
    worker._deltasync_tracker().refused_anchors.clear()  # the model's tracker outlives the checks
    assert worker.deltasync_pull(store) == 2
    _assert_equal_to_reload(model, item, 2)
    assert len(worker._deltasync_tracker().refused_anchors) == 1


def check_ranks_that_start_from_different_anchors_refuse_together(model, item: Prepared) -> None:
    """At TP=2, a rank that refuses a wrong anchor takes an older anchor's way, while a rank that read none of the
    anchor's wrong tensors whole would take it: both reach the same step, one over wrong weights (they crashed in a
    collective of the apply). The ranks compare the anchors their ways start from: what one refused, every rank
    refuses, and they fetch again (here rank 1 is made not to check: both take anchor 0's way). Ranks that still
    start from different anchors (one could not read the anchor another took) refuse together, nothing written."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    import deltasync_rs as ds
    from deltasync_rs.manifest import anchor_key
    from deltasync_rs.subscriber import Subscriber

    if get_tensor_model_parallel_world_size() < 2:
        return
    store = item.path("store-wrong-anchor")
    rank = get_tensor_model_parallel_rank()
    check, read = Subscriber._check_follows, Subscriber._file
    try:
        if rank == 1:
            Subscriber._check_follows = lambda *args: None  # type: ignore[method-assign]
        worker = _fresh_worker(model)
        worker._deltasync_tracker().refused_anchors.clear()  # the model's tracker outlives the checks
        assert worker.deltasync_pull(store) == 2
        _assert_equal_to_reload(model, item, 2)
        # Rank 0 takes the wrong anchor (it does not check), rank 1 cannot read it and takes anchor 0's way.
        Subscriber._check_follows = lambda *args: None  # type: ignore[method-assign]
        if rank == 1:

            def unreadable(self, ref, *args, **kwargs):
                if ref["key"] == anchor_key(1):
                    raise ds.StoreError(f"{ref['key']}: unreadable here")
                return read(self, ref, *args, **kwargs)

            Subscriber._file = unreadable  # type: ignore[method-assign]
        worker = _fresh_worker(model)
        worker._deltasync_tracker().refused_anchors.clear()  # the model's tracker remembers the refusal above
        _expect_untouched(
            model, snapshot(model), ds.IntegrityError, lambda: worker.deltasync_pull(store), "from different anchors"
        )
        assert worker.deltasync_step() is None
    finally:
        Subscriber._check_follows, Subscriber._file = check, read  # type: ignore[method-assign]
    assert worker.deltasync_pull(store) == 2
    _assert_equal_to_reload(model, item, 2)


def check_anchor_pull_reads_only_this_ranks_shard(model, item: Prepared) -> None:
    """Issue 16's "done when": at TP=2 a worker's anchor pull reads (by verified ranges) clearly less than the
    anchor, and the weights equal vLLM's dense reload bit for bit; at TP=1 it reads the anchor whole."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    from deltasync_rs.manifest import anchor_key, pieces_key
    from tests.helpers import counting_store

    store = counting_store(item.path("store-ranged"))
    assert _fresh_worker(model).deltasync_pull(store) == 2
    size = os.path.getsize(item.path(f"store-ranged/{anchor_key(2)}"))
    read = store.read[anchor_key(2)] + store.read[pieces_key(2)]
    tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    Path(item.path(f"anchor-read-tp{tp}-rank{rank}.json")).write_text(json.dumps({"read": read, "size": size}))
    if tp > 1:
        assert read < 0.8 * size, f"this rank read {read} bytes of a {size}-byte anchor (with its pieces sidecar)"
    else:
        assert store.read[anchor_key(2)] == size
    _assert_equal_to_reload(model, item, 2)


def _tampered_store(item: Prepared, tamper) -> str:
    """A private copy of the prepared anchor store, changed by ``tamper(anchor_path, pieces_path, anchor_bytes)``."""
    import shutil
    import tempfile

    from deltasync_rs.manifest import anchor_key, pieces_key

    root = tempfile.mkdtemp(prefix="tampered-")
    shutil.copytree(item.path("store-ranged"), root, dirs_exist_ok=True)
    anchor = os.path.join(root, anchor_key(2))
    raw = bytearray(Path(anchor).read_bytes())
    header_end = 8 + int.from_bytes(raw[:8], "little")
    # a byte of the final norm: replicated, so every rank reads it
    offset = header_end + json.loads(raw[8:header_end])["model.norm.weight"]["data_offsets"][0] + 3
    raw[offset] ^= 0x40
    tamper(anchor, os.path.join(root, pieces_key(2)), bytes(raw))
    return root


def check_tampered_anchor_pieces_refused(model, item: Prepared) -> None:
    """A flipped byte in a piece a rank reads, and a pieces sidecar rewritten to match a changed anchor, are refused
    loudly before any write. At TP=1 the whole file is read: its pieces refuse the flipped byte, and the whole-file
    SHA-256 (taken when the sidecar fails its entry's check) the rewritten sidecar."""
    import hashlib

    from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size

    import deltasync_rs as ds
    from deltasync_rs.manifest import PIECES_HEADER_BYTES

    ranged = get_tensor_model_parallel_world_size() > 1

    def flip_a_byte(anchor, pieces, changed):
        Path(anchor).write_bytes(changed)

    def flip_and_rewrite_the_sidecar(anchor, pieces, changed):
        Path(anchor).write_bytes(changed)
        sidecar = bytearray(Path(pieces).read_bytes())
        piece = int.from_bytes(sidecar[16:24], "little")
        for index in range(-(-len(changed) // piece)):
            digest = hashlib.sha256(changed[index * piece : (index + 1) * piece]).digest()
            sidecar[PIECES_HEADER_BYTES + 32 * index : PIECES_HEADER_BYTES + 32 * index + 32] = digest
        Path(pieces).write_bytes(bytes(sidecar))

    for tamper, why in (
        (flip_a_byte, "do not match its pieces sidecar"),
        (flip_and_rewrite_the_sidecar, ".pieces: content does not match" if ranged else "does not match the digest"),
    ):
        root = _tampered_store(item, tamper)
        _expect_untouched(
            model, snapshot(model), ds.DeltaSyncError, lambda root=root: _fresh_worker(model).deltasync_pull(root), why
        )


def _lm_head_off_by_a_row(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with an lm_head that differs from its embeddings in the last vocabulary row only."""
    state = dict(state)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    state["lm_head.weight"][-1, :3] += 1
    return state


def _without_lm_head(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` as a trainer that ties lm_head to the embeddings publishes it: lm_head left out."""
    return {name: tensor for name, tensor in state.items() if name != "lm_head.weight"}


def check_ranks_refuse_together_what_one_rank_alone_can_see(model, item: Prepared) -> None:
    """A tied model pulls an anchor whose lm_head differs from its embeddings in the last vocabulary row only: at
    TP=2 only the last rank reads that row (each reads its own rows of the anchor), yet every rank must refuse, and
    none write (rank 0 applied the anchor and moved on before, the group left at two steps). Untied: applied."""
    import deltasync_rs as ds

    state = _lm_head_off_by_a_row(_state(item, 2))
    root = item.path("store-tied-anchor")
    if MODELS[item.name][1]["tie_word_embeddings"]:
        _expect_untouched(
            model,
            snapshot(model),
            ds.DeltaSyncError,
            lambda: _fresh_worker(model).deltasync_pull(root),
            "are one parameter in vLLM",
        )
        return
    _pulled_as_dense_reload(model, root, 7, state)


def _pulled_as_dense_reload(model, root: str, step: int, state: dict[str, torch.Tensor]) -> None:
    """A fresh worker pulls ``root`` to ``step``: the weights equal vLLM's own dense load of ``state``."""
    assert _fresh_worker(model).deltasync_pull(root) == step
    applied = snapshot(model)
    with torch.no_grad():
        model.load_weights(list(state.items()))
    bad = differing(model, applied)
    assert not bad, f"differs from a dense reload: {bad[:5]}"


def check_a_tie_the_served_model_does_not_hold_is_refused(model, item: Prepared) -> None:
    """The trainer's model ties lm_head to the embeddings and publishes them once (the entry's ``aliases``). A
    served model that holds lm_head as a parameter of its own (untied) would keep its old lm_head: refused by every
    rank before anything is written, on both paths. A tied served model takes the step."""
    import deltasync_rs as ds

    state = _without_lm_head(_state(item, 2))
    root = item.path("store-tied-trainer")
    if MODELS[item.name][1]["tie_word_embeddings"]:
        _pulled_as_dense_reload(model, root, 7, state)
        return
    # The step's anchor file applied explicitly, without its entry, carries the tie itself (docs/format.md §2.2).
    anchor_file = os.path.join(root, ds.Subscriber(root).entry(7).anchor["key"])
    assert ds.load(anchor_file).aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    for path in ("mapped", "loader"):
        for run in (
            lambda path=path: _fresh_worker(model).deltasync_pull(root, path=path),
            lambda path=path: _fresh_worker(model).deltasync_apply([anchor_file], path=path),
        ):
            _expect_untouched(
                model, snapshot(model), ds.BaseMismatchError, run, "holds 'lm_head.weight' as a parameter of its own"
            )


def check_a_delta_of_another_dtype_or_layout_is_refused(model, item: Prepared) -> None:
    """A delta made from fp16 exports of a bf16-served model, and one of a transposed export (same element count):
    each refused by name with nothing written. The dtype check compares the delta with vLLM's parameter; the shape
    check, the record's shape with the checkpoint shape the parameter maps (mutation testing found neither pinned:
    fp16 bits went into bf16 weights, and the transposed values were written in the wrong order)."""
    import deltasync_rs as ds
    from deltasync_rs.vllm import apply_delta

    load_state(model, item, 0)
    name = "model.layers.0.mlp.down_proj.weight"
    prev, curr = _state(item, 0)[name], _state(item, 1)[name]
    for made, must_contain in (
        (lambda t: t.to(torch.float16), "F16"),
        (lambda t: t.t().contiguous(), "shape"),
    ):
        delta = ds.diff({name: made(prev)}, {name: made(curr)}, values="abs", step=1, base_step=0)
        _expect_untouched(
            model,
            snapshot(model),
            ds.BaseMismatchError,
            lambda delta=delta: apply_delta(model, delta, current_step=0),
            must_contain,
        )


def check_a_partial_anchor_is_applied_only_over_what_was_read(model, item: Prepared) -> None:
    """anchor_ranges that ask for less than this rank's shard (half of each tensor): the unread bytes are zeros in
    the PartialAnchor, and the apply refuses rather than write them (mutation testing found no test of it)."""
    import deltasync_rs as ds
    from deltasync_rs._ranged import PartialAnchor
    from deltasync_rs.vllm import apply_delta

    load_state(model, item, 0)
    halves = ds.Subscriber(
        item.path("store-ranged"), anchor_ranges=lambda ts: [(t.start, t.start + (t.end - t.start) // 2) for t in ts]
    )
    (anchor,) = halves.fetch(None)
    assert isinstance(anchor, PartialAnchor), type(anchor)
    _expect_untouched(
        model, snapshot(model), ds.IntegrityError, lambda: apply_delta(model, anchor), "not read and verified"
    )


def check_the_loader_path_checks_the_chain(model, item: Prepared) -> None:
    """A delta of steps 1 to 2 given to a model at step 0 through vLLM's own loader: refused with nothing written,
    as on the mapped path (mutation testing found only the mapped path pinned)."""
    import deltasync_rs as ds
    from deltasync_rs.vllm import apply_delta

    load_state(model, item, 0)
    _expect_untouched(
        model,
        snapshot(model),
        ds.BaseMismatchError,
        lambda: apply_delta(model, _delta(item, 2, "abs"), current_step=0, path="loader"),
        "step 1",
    )


def check_a_declared_step_then_a_reload_is_noticed(model, item: Prepared) -> None:
    """A step declared (deltasync_set_step, or the weight-transfer engine's current_step) is sampled too: vLLM's
    reload of its checkpoint after the declaration (reload_weights, a wake-up from sleep level 2) is noticed and the
    next delta of differences refused, on both ways in (mutation testing found only reloads after an apply pinned;
    without the sample the differences of 1 to 2 went onto step 0's weights, and the worker said step 2)."""
    import deltasync_rs as ds
    import deltasync_rs.vllm as dv

    load_state(model, item, 1)
    worker = _fresh_worker(model)
    assert worker.deltasync_set_step(1) == 1
    load_state(model, item, 0)  # vLLM puts its checkpoint back
    _expect_untouched(
        model,
        snapshot(model),
        ds.BaseMismatchError,
        lambda: worker.deltasync_apply([item.path("delta_2_diff.safetensors")]),
        "step is unknown",
    )
    from types import SimpleNamespace

    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    dv.register()
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="deltasync"),
        SimpleNamespace(parallel_config=SimpleNamespace(), model_config=SimpleNamespace()),
        torch.device("cpu"),
        model,
    )
    load_state(model, item, 1)
    engine.init_transfer_engine(dv.DeltaSyncInitInfo(current_step=1))
    load_state(model, item, 0)
    _expect_untouched(
        model,
        snapshot(model),
        ds.BaseMismatchError,
        lambda: engine.receive_weights(dv.DeltaSyncUpdateInfo(paths=[item.path("delta_2_diff.safetensors")])),
        "step is unknown",
    )
    _fresh_worker(model)


def check_a_layer_the_cpu_backend_packed_is_refused(model, item: Prepared) -> None:
    """A layer vLLM's CPU backend packed without the unpacked weight deltasync keeps (its plugin did not run)
    computes from a private copy: an in-place write would leave its outputs on the old weights while the step
    advanced. Refused by name, nothing written (mutation testing found no test of it)."""
    import deltasync_rs as ds
    from deltasync_rs.vllm import apply_delta

    load_state(model, item, 0)
    layer = model.model.layers[0].mlp.down_proj
    layer.cpu_linear = object()  # what the backend leaves on a layer it packed
    try:
        _expect_untouched(
            model,
            snapshot(model),
            ds.DeltaSyncError,
            lambda: apply_delta(model, _delta(item, 1, "diff"), current_step=0),
            "packed",
        )
    finally:
        del layer.cpu_linear


def check_a_failure_of_one_rank_alone_is_raised_under_the_mp_executor(model, item: Prepared) -> None:
    """Under vLLM's mp executor the ranks before the last return None for a failure every rank shares (so that every
    reply is read); a failure of this rank alone (its file unreadable here) must still raise, or the caller sees
    success while this rank applied nothing (mutation testing found no test of it). At TP=1, where a missing file
    is this rank's alone; at TP=2 every rank misses it, which is what the ranks before the last may return None for
    (check_ranks_refuse_together_what_one_rank_alone_can_see covers the ranks' agreement)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size

    import deltasync_rs as ds
    import deltasync_rs.vllm as dv

    if get_tensor_model_parallel_world_size() > 1:
        return

    worker = _fresh_worker(model)
    assert worker.deltasync_set_step(0) == 0
    real = dv._replies_before_the_last
    dv._replies_before_the_last = lambda config: True  # as rank 0 of 2 under the mp executor
    try:
        try:
            worker.deltasync_apply([item.path("no_such_delta.safetensors")])
        except ds.DeltaSyncError:
            pass
        else:
            raise AssertionError("a failure of this rank alone returned as if it had applied")
    finally:
        dv._replies_before_the_last = real
    _fresh_worker(model)


CHECKS = [
    check_a_tie_the_served_model_does_not_hold_is_refused,
    check_ranks_refuse_together_what_one_rank_alone_can_see,
    check_anchor_pull_reads_only_this_ranks_shard,
    check_a_wrong_anchor_is_refused_by_every_rank,
    check_a_wrong_anchor_in_row_split_tensors_is_refused,
    check_a_wrong_newest_anchor_is_refused,
    check_ranks_that_start_from_different_anchors_refuse_together,
    check_tampered_anchor_pieces_refused,
    check_diff_then_abs_match_dense_reload,
    check_compact_matches_dense_reload,
    check_compact_checked_by_the_apply,
    check_pull_checks_streams_as_it_applies,
    check_ranks_pull_to_the_same_step,
    check_context_applies_bit_exactly,
    check_a_replicated_context_base_that_differs_on_one_rank_is_refused_by_every_rank,
    check_context_on_a_device,
    check_context_abs_values_at_any_tp,
    check_base_identity_at_any_tp,
    check_a_tied_head_made_against_another_base_is_refused_by_check_base,
    check_a_tied_record_without_a_base_is_checked_through_the_other,
    check_unknown_name_rejected,
    check_wrong_base_rejected,
    check_lm_head_alone,
    check_loader_path_abs,
    check_loader_path_rejects_diff,
    check_loader_path_rejects_context_positions,
    check_unmapped_architecture_falls_back,
    check_worker_extension_applies_files,
    check_weights_reloaded_by_vllm_are_noticed,
    check_a_delta_of_another_dtype_or_layout_is_refused,
    check_a_partial_anchor_is_applied_only_over_what_was_read,
    check_the_loader_path_checks_the_chain,
    check_a_declared_step_then_a_reload_is_noticed,
    check_a_layer_the_cpu_backend_packed_is_refused,
    check_a_failure_of_one_rank_alone_is_raised_under_the_mp_executor,
]


def check_tying_is_as_configured(model, item: Prepared) -> None:
    """The tied model really shares lm_head and embed_tokens in vLLM (else the tied checks would test nothing)."""
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == MODELS[item.name][1]["tie_word_embeddings"], f"lm_head tied: {tied}"


CHECKS.insert(0, check_tying_is_as_configured)
