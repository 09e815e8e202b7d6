"""apply_delta on a CPU vLLM Qwen3 model against vLLM's dense load_weights of the changed tensors, 1% density.

Run as benchmarks:   pytest benches/test_bench_vllm.py --benchmark-only --benchmark-columns=median,min,max,rounds
Run as quick tests:  pytest benches/test_bench_vllm.py --benchmark-disable -q   (a tiny model)

Full scale is a Qwen3-0.6B-shaped model cut to 4 layers (vocab 151936, hidden 1024, 16/8 heads of 128; 218M params).
Both sides start from the same weights (reset outside the timed function) and must end bit-identical; nothing here
asserts on timings. vLLM's parallel state is initialised in this process (TP=1, gloo).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

# vLLM picks its platform once per process, on first use: these CPU tests need the CPU one.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm", reason="vllm is not installed (pip install 'deltasync-rs[vllm]')")

import deltasync_rs as ds  # noqa: E402

GROUP = "vllm-apply"
DENSITY = float(os.environ.get("DELTASYNC_BENCH_DENSITY", "0.01"))


def _config(bench_scale: float):
    from transformers import Qwen3Config

    if bench_scale >= 0.1:
        shape = dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
        )
    else:
        shape = dict(
            vocab_size=200,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    config = Qwen3Config(max_position_embeddings=128, tie_word_embeddings=True, **shape)
    config.architectures = ["Qwen3ForCausalLM"]
    return config


def _states(config, density: float, seed: int = 0):
    """A random bf16 state with HF names, and the next one: `density` of the elements moved by ±1 in their bits."""
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen3ForCausalLM(config).state_dict().items() if k != "lm_head.weight"}
    g = torch.Generator().manual_seed(seed)
    prev, curr = {}, {}
    for name, shape in shapes.items():
        prev[name] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        bits = prev[name].clone().view(torch.int16).view(-1)
        picks = torch.randperm(bits.numel(), generator=g)[: max(1, int(bits.numel() * density))]
        bits[picks] += torch.randint(0, 2, (picks.numel(),), generator=g, dtype=torch.int16) * 2 - 1
        curr[name] = bits.view(shape).view(torch.bfloat16)
    return prev, curr


@pytest.fixture(scope="module")
def vllm_bench(bench_scale):
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = _config(bench_scale)
    folder = tempfile.mkdtemp(prefix="deltasync-vllm-bench-")
    config.save_pretrained(folder)
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=folder, dtype="bfloat16", skip_tokenizer_init=True),
        device_config=DeviceConfig(device="cpu"),
    )
    with set_current_vllm_config(vllm_config):
        if not model_parallel_is_initialized():
            init_distributed_environment(1, 0, f"file://{folder}/init", 0, backend="gloo")
            initialize_model_parallel(1, 1)
        with set_default_torch_dtype(torch.bfloat16):
            model = Qwen3ForCausalLM(vllm_config=vllm_config)
    prev, curr = _states(config, DENSITY)
    delta = ds.diff(prev, curr, step=1, base_step=0)
    changed = {name: curr[name] for name, info in zip(delta.names, delta.tensors) if info.changed}
    with torch.no_grad():
        model.load_weights(curr.items())
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    return model, vllm_config, prev, changed, delta, expected


def _reset(model, prev):
    with torch.no_grad():
        model.load_weights(prev.items())
    return (), {}


def _assert_expected(model, expected):
    bad = [
        n for n, p in model.named_parameters() if not torch.equal(p.view(torch.int16), expected[n].view(torch.int16))
    ]
    assert not bad, f"{len(bad)} parameters differ from the dense load of the new weights, e.g. {bad[:3]}"


def _info(benchmark, delta):
    benchmark.extra_info.update(
        density=DENSITY,
        num_changed=delta.num_changed,
        num_elements=delta.num_elements,
        torch_threads=torch.get_num_threads(),
    )


@pytest.mark.benchmark(group=GROUP)
def test_apply_delta_in_place(benchmark, vllm_bench, pedantic_opts):
    from deltasync_rs.vllm import apply_delta

    model, vllm_config, prev, _, delta, expected = vllm_bench
    _info(benchmark, delta)
    benchmark.pedantic(
        lambda: apply_delta(model, delta, current_step=0), setup=lambda: _reset(model, prev), **pedantic_opts
    )
    _assert_expected(model, expected)


@pytest.mark.benchmark(group=GROUP)
def test_apply_delta_in_place_checking_base(benchmark, vllm_bench, pedantic_opts):
    """The same with check_base=True: every touched tensor is read once more, to compute its base identity."""
    from deltasync_rs.vllm import apply_delta

    model, vllm_config, prev, _, delta, expected = vllm_bench
    _info(benchmark, delta)
    benchmark.pedantic(
        lambda: apply_delta(model, delta, current_step=0, check_base=True),
        setup=lambda: _reset(model, prev),
        **pedantic_opts,
    )
    _assert_expected(model, expected)


@pytest.mark.benchmark(group=GROUP)
def test_dense_load_weights_of_changed_tensors(benchmark, vllm_bench, pedantic_opts):
    model, vllm_config, prev, changed, delta, expected = vllm_bench
    _info(benchmark, delta)

    def load():
        with torch.no_grad():
            model.load_weights(changed.items())

    benchmark.pedantic(load, setup=lambda: _reset(model, prev), **pedantic_opts)
    _assert_expected(model, expected)


@pytest.mark.benchmark(group=GROUP)
def test_worker_apply_with_the_step_trackers_sample(benchmark, vllm_bench, pedantic_opts):
    """What a worker's apply adds to apply_delta: its step tracker compares its sample of every parameter before
    the apply (weights vLLM may have put in place) and takes a new one after (docs/vllm.md §4)."""
    from deltasync_rs.vllm import _StepTracker

    model, vllm_config, prev, _, delta, expected = vllm_bench
    _info(benchmark, delta)

    def setup():
        _reset(model, prev)
        tracker = _StepTracker(0)
        tracker.mark(model)
        return (tracker,), {}

    def apply(tracker):
        tracker.forget_if_changed(model, together=False)
        return tracker.apply(model, [delta])

    benchmark.pedantic(apply, setup=setup, **pedantic_opts)
    _assert_expected(model, expected)
