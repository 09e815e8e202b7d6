"""A realistic delta workload: the bf16 states of a small GPT-2 after each of a few real AdamW fine-tuning steps.

The synthetic workload (``_workload.py``) samples bit flips uniformly. Real steps differ: an Adam step has about the
same size for every weight while bf16's spacing is relative to the weight, so small weights change more often than
large ones; and a real model has many small tensors (biases, LayerNorms) whose per-tensor header cost matters.

``load_run(config)`` returns the states, generated once and cached on disk:

1. A ``transformers`` GPT-2 (``GPT2Config``/``GPT2LMHeadModel``, byte-level, vocab 256; by default 6 layers, width
   384: 10.8M parameters in 76 tensors) is built from ``seed`` and pretrained in fp32 on real text: the ``.py`` and
   ``.txt`` files of the running Python's standard library, in sorted order, up to ``corpus_bytes`` bytes (the first
   90% for pretraining, the rest for fine-tuning). AdamW at ``pretrain_lr`` with linear warmup and a linear decay to
   10%, random windows of ``seq_len`` bytes.
2. From the pretrained fp32 weights a fresh AdamW (``finetune_lr``, no weight decay, gradient clipping at 1.0) takes
   ``finetune_steps`` steps on the held-back text. The fp32 master weights are exported as bf16
   (``.to(torch.bfloat16)``) before the first step and after every step: ``finetune_steps + 1`` states.

Everything is seeded and runs with ``threads`` torch threads (CPU matmul results can depend on the thread count).
The cache key hashes every field of the config, ``GENERATOR_VERSION``, the torch and transformers versions and the
corpus bytes. Files: ``<cache>/realistic-pretrain-<key>.safetensors`` (fp32) and
``<cache>/realistic-<key>/step-NN.safetensors`` (bf16) with ``meta.json`` written last; each file is written to a
temporary name and renamed. Needs torch, transformers and safetensors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Bump when the generated states change for the same config, so stale caches are not reused.
GENERATOR_VERSION = 1


@dataclass(frozen=True)
class RealisticConfig:
    n_layer: int = 6
    n_embd: int = 384
    n_head: int = 6
    seq_len: int = 32  # also GPT-2's n_positions, so every position embedding is trained
    corpus_bytes: int = 4 << 20
    seed: int = 0
    pretrain_steps: int = 150
    pretrain_batch: int = 4
    pretrain_lr: float = 1e-3
    warmup_steps: int = 15
    finetune_steps: int = 12
    finetune_batch: int = 8
    finetune_lr: float = 3e-6
    threads: int = 2


DEFAULT = RealisticConfig()
#: A second run to check conclusions drawn on DEFAULT against: another seed (model, data order) and TRL GRPO's
#: default learning rate.
HELD_OUT = RealisticConfig(seed=1, finetune_lr=1e-6)

_PRETRAIN_FIELDS = (
    "n_layer",
    "n_embd",
    "n_head",
    "seq_len",
    "corpus_bytes",
    "seed",
    "pretrain_steps",
    "pretrain_batch",
    "pretrain_lr",
    "warmup_steps",
    "threads",
)


@dataclass
class RealisticRun:
    config: RealisticConfig
    key: str
    path: Path
    states: list[dict[str, Any]]  # step -> name -> bf16 torch tensor; states[0] is before the first fine-tune step
    meta: dict[str, Any]


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "deltasync-rs"


def read_corpus(limit: int) -> bytes:
    """The first ``limit`` bytes of the standard library's .py and .txt files, concatenated in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p
        for p in root.rglob("*")
        if p.suffix in (".py", ".txt")
        and p.is_file()
        and not {"site-packages", "dist-packages", "__pycache__"} & set(p.relative_to(root).parts)
    )
    parts, size = [], 0
    for path in paths:
        data = path.read_bytes()
        parts.append(data)
        size += len(data)
        if size >= limit:
            break
    corpus = b"".join(parts)[:limit]
    if len(corpus) < limit:
        raise RuntimeError(f"{root}: only {len(corpus)} bytes of .py/.txt files, {limit} asked for")
    return corpus


def _key(fields: dict[str, Any], corpus: bytes) -> str:
    import torch
    import transformers

    document = {
        "generator_version": GENERATOR_VERSION,
        "config": fields,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "corpus_sha256": hashlib.sha256(corpus).hexdigest(),
    }
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()[:16]


def _build_model(config: RealisticConfig):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(config.seed)
    gpt2 = GPT2Config(
        vocab_size=256,
        n_positions=config.seq_len,
        n_embd=config.n_embd,
        n_layer=config.n_layer,
        n_head=config.n_head,
        bos_token_id=None,
        eos_token_id=None,
    )
    return GPT2LMHeadModel(gpt2)


def _batch(data, generator, batch: int, seq_len: int):
    import torch

    starts = torch.randint(0, data.numel() - seq_len, (batch,), generator=generator)
    return torch.stack([data[s : s + seq_len] for s in starts.tolist()]).long()


def _save_atomic(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _pretrain(config: RealisticConfig, model, data, log: Callable[[str], None]) -> list[float]:
    import torch

    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.pretrain_lr, weight_decay=0.1)

    def schedule(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        rest = max(1, config.pretrain_steps - config.warmup_steps)
        return 1.0 - 0.9 * (step - config.warmup_steps) / rest

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    losses = []
    start = time.perf_counter()
    for step in range(config.pretrain_steps):
        tokens = _batch(data, generator, config.pretrain_batch, config.seq_len)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == config.pretrain_steps - 1:
            log(f"pretrain step {step}: loss {losses[-1]:.3f}, {time.perf_counter() - start:.0f} s")
    return losses


def _bf16_state(model) -> dict:
    import torch

    return {name: p.detach().to(torch.bfloat16).contiguous() for name, p in model.named_parameters()}


def _load_states(path: Path, steps: int) -> list[dict]:
    from safetensors.torch import load_file

    return [load_file(str(path / f"step-{i:02d}.safetensors")) for i in range(steps + 1)]


def load_run(
    config: RealisticConfig = DEFAULT,
    cache_dir: str | os.PathLike[str] | None = None,
    log: Callable[[str], None] = print,
) -> RealisticRun:
    """The run's ``finetune_steps + 1`` bf16 states, read from the cache, else generated there (see the module
    docstring). Tied weights appear once (``named_parameters``): GPT-2's ``lm_head.weight`` is ``transformer.wte``."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    corpus = read_corpus(config.corpus_bytes)
    fields = dataclasses.asdict(config)
    key = _key(fields, corpus)
    path = cache / f"realistic-{key}"
    meta_path = path / "meta.json"
    if meta_path.exists():
        return RealisticRun(
            config, key, path, _load_states(path, config.finetune_steps), json.loads(meta_path.read_text())
        )

    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        split = len(corpus) * 9 // 10
        pretrain_data, finetune_data = data[:split], data[split:]
        model = _build_model(config)
        pretrain_key = _key({name: fields[name] for name in _PRETRAIN_FIELDS}, corpus)
        pretrain_path = cache / f"realistic-pretrain-{pretrain_key}.safetensors"
        pretrain_losses: list[float]
        if pretrain_path.exists():
            model.load_state_dict(load_file(str(pretrain_path)), strict=False)
            model.tie_weights()
            with safe_open(str(pretrain_path), "pt") as saved:
                pretrain_losses = json.loads(saved.metadata()["losses"])
                pretrain_seconds = float(saved.metadata()["seconds"])
            log(f"pretrained weights from {pretrain_path}")
        else:
            start = time.perf_counter()
            pretrain_losses = _pretrain(config, model, pretrain_data, log)
            pretrain_seconds = time.perf_counter() - start
            cache.mkdir(parents=True, exist_ok=True)
            weights = {name: p.detach().contiguous() for name, p in model.named_parameters()}
            _save_atomic(
                weights, pretrain_path, {"losses": json.dumps(pretrain_losses), "seconds": str(pretrain_seconds)}
            )

        start = time.perf_counter()
        generator = torch.Generator().manual_seed(config.seed + 1_000_003)
        torch.manual_seed(config.seed + 1_000_003)  # dropout
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.finetune_lr, weight_decay=0.0)
        model.train()
        states = [_bf16_state(model)]
        finetune_losses = []
        for _ in range(config.finetune_steps):
            tokens = _batch(finetune_data, generator, config.finetune_batch, config.seq_len)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            finetune_losses.append(loss.item())
            states.append(_bf16_state(model))
        finetune_seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)

    path.mkdir(parents=True, exist_ok=True)
    for step, state in enumerate(states):
        _save_atomic(state, path / f"step-{step:02d}.safetensors")
    meta = {
        "generator_version": GENERATOR_VERSION,
        "config": fields,
        "pretrain_key": pretrain_key,
        "corpus_bytes": len(corpus),
        "num_parameters": sum(t.numel() for t in states[0].values()),
        "num_tensors": len(states[0]),
        "pretrain_losses": pretrain_losses,
        "finetune_losses": finetune_losses,
        "pretrain_seconds": pretrain_seconds,
        "finetune_seconds": finetune_seconds,
    }
    _write_text_atomic(meta_path, json.dumps(meta, indent=1))  # written last: its presence marks a complete run
    log(f"wrote {len(states)} states to {path}")
    # Read back, so that the first run hands out the states as every later run does (the same tensors, in the
    # files' order, which is not the model's): the same deltas, byte for byte.
    return RealisticRun(config, key, path, _load_states(path, config.finetune_steps), meta)


def _main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Generate (and cache) the realistic workload's states.")
    parser.add_argument("--held-out", action="store_true", help="the held-out config (seed 1, lr 1e-6)")
    parser.add_argument("--lr", type=float, help="fine-tuning learning rate")
    parser.add_argument("--steps", type=int, help="fine-tuning steps")
    args = parser.parse_args()
    config = HELD_OUT if args.held_out else DEFAULT
    if args.lr is not None:
        config = dataclasses.replace(config, finetune_lr=args.lr)
    if args.steps is not None:
        config = dataclasses.replace(config, finetune_steps=args.steps)
    start = time.perf_counter()
    run = load_run(config)
    print(
        f"{run.path}: {len(run.states)} states, {run.meta['num_parameters']:,} parameters, "
        f"{run.meta['num_tensors']} tensors, {time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":  # python -m deltasync_rs._realistic [--held-out] [--lr LR] [--steps N]
    _main()
