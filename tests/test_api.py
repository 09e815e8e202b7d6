"""The Python API: inputs of every kind, all-or-nothing apply, clear errors, anchors, metadata and threads."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import deltasync_rs as ds
from tests.helpers import assert_bits_equal, assert_states_equal, clone_state


def _pair(seed=0, shape=(64, 48), dtype=torch.bfloat16, every=9):
    g = torch.Generator().manual_seed(seed)
    prev = torch.randn(shape, generator=g).to(dtype)
    curr = prev.clone()
    flat = curr.view(-1)
    flat[::every] = (flat[::every].float() * 1.01 + 0.001).to(dtype)
    return prev, curr


@pytest.fixture
def states():
    names = ["model.embed.weight", "model.layers.0.weight", "model.norm.weight"]
    shapes = [(50, 16), (16, 16), (16,)]
    prev, curr = {}, {}
    for i, (name, shape) in enumerate(zip(names, shapes)):
        prev[name], curr[name] = _pair(i, shape)
    return prev, curr


def test_diff_mapping_and_apply(states):
    prev, curr = states
    delta = ds.diff(prev, curr, step=5, base_step=4, metadata={"run": "abc"})
    assert delta.names == list(curr)
    assert delta.step == 5 and delta.base_step == 4 and delta.metadata == {"run": "abc"}
    assert delta.num_elements == sum(t.numel() for t in curr.values())
    assert delta.num_changed == sum(int((prev[k] != curr[k]).sum()) for k in curr)
    assert delta.nbytes == sum(t.nbytes for t in delta.tensors)
    assert "model.norm.weight" in delta and "nope" not in delta
    assert "3 tensors" in repr(delta)
    loaded = ds.load(delta.to_bytes())
    assert (loaded.step, loaded.base_step, loaded.metadata) == (5, 4, {"run": "abc"})
    target = clone_state(prev)
    assert loaded.apply_(target) is None  # in place; returning the state would fill a REPL
    assert_states_equal(target, curr)


def test_non_contiguous_inputs_and_targets():
    prev, curr = _pair(shape=(40, 30), dtype=torch.float32, every=7)
    delta = ds.diff(prev.t(), curr.t())  # transposed views: positions are row-major in the view's shape
    target = prev.clone().t()
    assert not target.is_contiguous()
    delta.apply_(target)
    assert_bits_equal(target, curr.t())
    # numpy strided target
    prev_np, curr_np = prev.numpy(), curr.numpy()
    delta_np = ds.diff(prev_np[:, ::2], curr_np[:, ::2])
    base = prev_np.copy()
    delta_np.apply_(base[:, ::2])
    assert np.array_equal(base[:, ::2].view(np.uint32), curr_np[:, ::2].view(np.uint32))
    assert np.array_equal(base[:, 1::2], prev_np[:, 1::2])


def test_torch_tensors_are_read_and_written_in_place_at_their_offset():
    """CPU contiguous tensors go to the core as themselves (data_ptr/nbytes): views into a larger storage must be
    read and written at their own offset, and nothing outside them touched."""
    prev, curr = _pair(shape=(300,), dtype=torch.bfloat16, every=4)
    big_prev, big_curr = torch.zeros(1000, dtype=torch.bfloat16), torch.zeros(1000, dtype=torch.bfloat16)
    big_prev[500:800], big_curr[500:800] = prev, curr
    delta = ds.diff(big_prev[500:800], big_curr[500:800])
    assert delta.num_changed == int((prev != curr).sum())
    target = torch.full((1000,), 7.0, dtype=torch.bfloat16)
    target[500:800] = prev
    delta.apply_(target[500:800])
    assert_bits_equal(target[500:800], curr)
    assert torch.all(target[:500] == 7.0) and torch.all(target[800:] == 7.0)


def test_lazily_negated_views_are_diffed_by_value():
    prev, curr = _pair(dtype=torch.float32)
    negated = torch._neg_view(prev)
    assert negated.is_neg() and negated.is_contiguous()
    delta = ds.diff(negated, -curr)  # the view's memory holds prev, its values are -prev
    assert delta.num_changed == int((prev != curr).sum())
    target = -prev
    delta.apply_(target)
    assert_bits_equal(target, -curr)


def test_core_refuses_tensors_it_cannot_read_in_place():
    """The private core binding names the tensor when handed a tensor whose memory is not its values."""
    prev, curr = _pair(shape=(40, 30), dtype=torch.float32)
    raw = ds._core.RawDelta()
    with pytest.raises(ds.DeltaSyncError, match=r'tensor "w" \(current\): tensor is not contiguous'):
        raw.add_diff([("w", "F32", [30, 40], prev.t().contiguous(), curr.t())], "diff")
    with pytest.raises(ds.DeltaSyncError, match=r'tensor "w" \(previous\): tensor has a lazy negation'):
        raw.add_diff([("w", "F32", [40, 30], torch._neg_view(prev), curr)], "diff")
    with pytest.raises(ds.DeltaSyncError, match=r'tensor "w" \(current\): not a byte buffer'):
        raw.add_diff([("w", "F32", [40, 30], prev, [1, 2, 3])], "diff")


def test_large_file_bytes_match_the_saved_file(tmp_path):
    """Files over 1 MiB are copied out by several threads, into a bytes object that is never zeroed first."""
    g = torch.Generator().manual_seed(3)
    prev = {f"w{i}": torch.randint(-(2**15), 2**15, (300_000,), generator=g, dtype=torch.int16) for i in range(8)}
    curr = {k: v ^ (torch.rand(v.shape, generator=g) < 0.5).to(torch.int16) for k, v in prev.items()}
    delta = ds.diff(prev, curr, values="abs")
    blob = delta.to_bytes()
    assert len(blob) > 2 << 20
    delta.save(tmp_path / "d.safetensors")
    assert blob == (tmp_path / "d.safetensors").read_bytes()
    target = clone_state(prev)
    ds.load(blob).apply_(target)
    assert_states_equal(target, curr)


def test_mixed_torch_and_numpy():
    prev, curr = _pair()
    delta = ds.diff(prev.view(torch.int16).numpy(), curr.view(torch.int16))
    target = prev.view(torch.int16).clone()
    delta.apply_(target)
    assert torch.equal(target, curr.view(torch.int16))


def test_parameters_with_grad_are_updated_in_place():
    prev, curr = _pair()
    param = torch.nn.Parameter(prev.clone())
    ds.diff(prev, curr).apply_({ds.DEFAULT_NAME: param})
    assert_bits_equal(param.detach(), curr)
    assert param.requires_grad


def test_base_mismatch_leaves_target_untouched(states):
    prev, curr = states
    delta = ds.diff(prev, curr)
    target = clone_state(prev)
    target["model.norm.weight"] = torch.zeros(17, dtype=torch.bfloat16)
    before = clone_state(target)
    with pytest.raises(ds.BaseMismatchError, match="model.norm.weight"):
        delta.apply_(target)
    assert_states_equal(target, before)

    target = clone_state(prev)
    target["model.layers.0.weight"] = target["model.layers.0.weight"].float()
    before = clone_state(target)
    with pytest.raises(ds.BaseMismatchError, match="BF16.*F32|model.layers.0.weight"):
        delta.apply_(target)
    assert_states_equal(target, before)

    target = clone_state(prev)
    del target["model.embed.weight"]
    before = clone_state(target)
    with pytest.raises(ds.BaseMismatchError, match="model.embed.weight"):
        delta.apply_(target)
    assert_states_equal(target, before)


def test_diff_rejects_mismatched_inputs(states):
    prev, curr = states
    with pytest.raises(ds.BaseMismatchError, match="only in curr"):
        ds.diff({k: v for k, v in prev.items() if k != "model.norm.weight"}, curr)
    bad = dict(prev)
    bad["model.norm.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(ds.BaseMismatchError, match="model.norm.weight"):
        ds.diff(bad, curr)
    with pytest.raises(ds.DeltaSyncError, match="values"):
        ds.diff(prev, curr, values="nope")
    with pytest.raises(ds.DeltaSyncError, match="not supported"):
        ds.diff(torch.zeros(2, dtype=torch.complex64), torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ds.DeltaSyncError, match="list"):
        ds.diff([1, 2], [1, 2])
    with pytest.raises(ds.DeltaSyncError, match="reserved"):
        ds.diff({"a:pos": torch.zeros(2)}, {"a:pos": torch.ones(2)})
    with pytest.raises(ds.DeltaSyncError, match="big-endian"):
        ds.diff(np.zeros(3, ">f4"), np.zeros(3, ">f4"))


def test_inputs_nobody_can_read_are_refused_by_name(tmp_path):
    """Meta and sparse tensors, names that are not strings, a state that is not a mapping where one is needed, a
    store that is neither a path nor a URL: each a DeltaSyncError naming what is wrong, not torch's or Python's own
    error from deep inside."""
    dense = torch.zeros(3)
    refused = {
        "a meta tensor has no data": lambda: ds.diff({"w": torch.zeros(3, device="meta")}, {"w": dense}),
        "sparse_coo tensors are not supported": lambda: ds.diff({"w": dense.to_sparse()}, {"w": dense.to_sparse()}),
        r"tensor names must be strings, not int \(1\)": lambda: ds.diff({1: dense}, {1: dense}),
        "'w': a meta tensor": lambda: ds.anchor({"w": torch.zeros(3, device="meta")}),
        "state must be a mapping": lambda: ds.Publisher(tmp_path / "a", background=False).publish(0, dense),
        "state: tensor names must be strings": lambda: ds.Publisher(tmp_path / "b").publish(0, {("w",): dense}),
        "a store is a path, a URL or a Store, not int": lambda: ds.Publisher(12345),
        "state must be a mapping of tensor names": lambda: ds.Subscriber(tmp_path / "a").pull(dense),
    }
    for message, call in refused.items():
        with pytest.raises(ds.DeltaSyncError, match=message):
            call()


def test_read_only_numpy_target_is_refused():
    prev, curr = np.zeros(10, np.float32), np.ones(10, np.float32)
    target = prev.copy()
    target.flags.writeable = False
    with pytest.raises(ds.DeltaSyncError, match="read-only"):
        ds.diff(prev, curr).apply_(target)


def test_tied_weights_apply_once():
    prev, curr = _pair()
    delta = ds.diff({"embed": prev, "lm_head": prev}, {"embed": curr, "lm_head": curr})
    shared = prev.clone()
    delta.apply_({"embed": shared, "lm_head": shared})  # a diff applied twice would drift by two steps
    assert_bits_equal(shared, curr)
    other = curr.clone()
    other.view(-1)[1] += 1
    conflicting = ds.diff({"embed": prev, "lm_head": prev}, {"embed": curr, "lm_head": other})
    target = prev.clone()
    with pytest.raises(ds.DeltaSyncError, match="share memory"):
        conflicting.apply_({"embed": target, "lm_head": target})
    assert_bits_equal(target, prev)


def test_overlapping_targets_are_refused():
    prev, curr = _pair(shape=(100,), dtype=torch.float32, every=3)
    delta = ds.diff({"a": prev[:60], "b": prev[40:]}, {"a": curr[:60], "b": curr[40:]})
    base = prev.clone()
    with pytest.raises(ds.DeltaSyncError, match="overlap"):
        delta.apply_({"a": base[:60], "b": base[40:]})
    assert_bits_equal(base, prev)


def test_single_tensor_delta_needs_single_target(states):
    prev, curr = states
    with pytest.raises(ds.BaseMismatchError, match="3 tensors"):
        ds.diff(prev, curr).apply_(torch.zeros(3))
    with pytest.raises(ds.DeltaSyncError, match="mapping"):
        ds.diff(prev, curr).apply_([1])


def test_anchor_is_a_plain_checkpoint(tmp_path, states):
    _, curr = states
    anchor = ds.anchor(curr, step=10)
    assert anchor.is_anchor and anchor.step == 10 and anchor.num_changed == anchor.num_elements
    path = tmp_path / "anchor.safetensors"
    anchor.save(path)
    assert_states_equal(load_file(path), curr)
    target = {k: torch.zeros_like(v) for k, v in curr.items()}
    ds.load(path).apply_(target)
    assert_states_equal(target, curr)


def test_dense_fallback_when_everything_changes():
    prev = torch.zeros(1000, dtype=torch.uint8)
    curr = torch.arange(1000).to(torch.uint8) + 1
    delta = ds.diff(prev, curr)
    assert delta.tensors[0].positions == "all" and delta.nbytes == 1000
    target = prev.clone()
    delta.apply_(target)
    assert torch.equal(target, curr)


def test_save_is_atomic_and_load_errors(tmp_path, states):
    prev, curr = states
    path = tmp_path / "d.safetensors"
    ds.diff(prev, curr).save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["d.safetensors"]
    with pytest.raises(ds.DeltaSyncError, match="missing.safetensors"):
        ds.load(tmp_path / "missing.safetensors")
    with pytest.raises(ds.DeltaSyncError, match="no-such-dir"):
        ds.diff(prev, curr).save(tmp_path / "no-such-dir" / "d.safetensors")
    with pytest.raises(ds.DeltaSyncError, match="path or bytes"):
        ds.load(42)
    plain = tmp_path / "plain.safetensors"
    from safetensors.torch import save_file

    save_file(curr, plain)
    with pytest.raises(ds.DeltaFormatError, match="plain checkpoint"):
        ds.load(plain)


@pytest.mark.parametrize("step", [-1, 2**64, 1.5, True])
def test_bad_step_numbers_are_refused(states, step):
    prev, curr = states
    with pytest.raises(ds.DeltaSyncError, match="step"):
        ds.diff(prev, curr, step=step)
    with pytest.raises(ds.DeltaSyncError, match="base_step"):
        ds.diff(prev, curr, base_step=step)
    delta = ds.diff(prev, curr, step=3)
    with pytest.raises(ds.DeltaSyncError, match="step"):
        delta.step = step
    assert delta.step == 3


@pytest.mark.parametrize("step", [-1, 2**64, 1.5, True, "3"])
def test_a_bad_step_leaves_a_mirror_where_it_was(states, step):
    """A step refused after the scan had moved the mirror to the new state with its step unchanged: the next
    delta then held none of that step's changes (found by an adversarial helper). Refused before the scan now, in
    the constructors too (they named `base_step`, later, for a step never given as one)."""
    import deltasync_rs.torch as dst

    prev, curr = states
    changed = ds.diff(prev, curr).num_changed
    mirror = ds.Mirror(prev, step=0)
    with pytest.raises(ds.DeltaSyncError, match="step"):
        mirror.advance(curr, step=step)
    assert mirror.step == 0 and mirror.advance(curr, step=1).num_changed == changed

    model = torch.nn.Linear(8, 4)
    tracked = dst.Mirror(model, step=0)
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(ds.DeltaSyncError, match="step"):
        tracked.step(step)
    assert tracked.current_step == 0 and tracked.step(1).num_changed == 32

    for make in (lambda: ds.Mirror(prev, step=step), lambda: dst.Mirror(model, step=step)):
        with pytest.raises(ds.DeltaSyncError, match="step must be"):
            make()
    with pytest.raises(ds.DeltaSyncError, match="step must be"):
        ds.Mirror().share(prev, step=step)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("swap", ["meta", "sparse_coo", "sparse_csr"])
def test_a_tensor_without_dense_data_is_refused_before_the_torch_mirror_moves(swap):
    """A model tensor swapped for a meta or sparse one after the mirror was made: the step raised a bare torch error
    naming nothing after it had copied the tensors before it into the mirror, so the next delta lacked their
    changes (found by an adversarial helper). Refused first now, naming it, with nothing moved."""
    import deltasync_rs.torch as dst

    source = {"a": torch.zeros(8), "b": torch.zeros(4, 4)}
    mirror = dst.Mirror(source, step=0)
    source["a"] += 1
    good = source["b"]
    source["b"] = {
        "meta": lambda: torch.zeros(4, 4, device="meta"),
        "sparse_coo": lambda: good.to_sparse(),
        "sparse_csr": lambda: good.to_sparse_csr(),
    }[swap]()
    with pytest.raises(ds.DeltaSyncError, match="'b'"):
        mirror.step(1)
    assert mirror.current_step == 0
    source["b"] = good
    delta = mirror.step(1)
    target = {"a": torch.zeros(8, dtype=torch.bfloat16), "b": torch.zeros(4, 4, dtype=torch.bfloat16)}
    delta.apply_(target, check_base=True)
    assert torch.equal(target["a"], torch.ones(8, dtype=torch.bfloat16))


def test_a_tensor_subclass_without_storage_is_refused_by_the_torch_mirror_naming_it():
    """A wrapper subclass (a quantized weight that reports bf16) has no storage of its own: the mirror raised
    torch's bare RuntimeError about "an invalid python storage", naming no tensor (found by an adversarial helper);
    ds.diff and ds.state_digest already refused it by name."""
    import deltasync_rs.torch as dst

    class Wrapped(torch.Tensor):
        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

        def __init__(self, inner):
            self.inner = inner

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            unwrap = lambda x: x.inner if isinstance(x, Wrapped) else x  # noqa: E731
            return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})

    with pytest.raises(ds.DeltaSyncError, match="tensor 'w': a Wrapped without storage of its own"):
        dst.Mirror({"w": Wrapped(torch.zeros(4, 4, dtype=torch.bfloat16))})


def test_tensor_indexes_and_thread_counts_are_checked(states, tmp_path):
    """decoded(-1) decoded the last tensor, decoded(True) the second, decoded(99) raised a bare IndexError;
    set_num_threads("2") a TypeError from inside and True meant one thread; a numpy-only program got KeyError
    'torch' from decoded (found by an adversarial helper)."""
    prev, curr = states
    delta = ds.diff(prev, curr)
    for call in (delta.decoded, delta.holds_differences, delta.base_identity):
        for bad in (-1, len(delta), True, "0", 1.0):
            with pytest.raises(ds.DeltaSyncError, match="index must be an integer from 0 to"):
                call(bad)
    positions, values = delta.decoded(len(delta) - 1)
    assert values is not None
    for bad in ("2", True, 2.0):
        with pytest.raises(ds.DeltaSyncError, match="number of threads must be an integer"):
            ds.set_num_threads(bad)
    with pytest.raises(ds.DeltaSyncError, match="number of threads must be 0 or more"):
        ds.set_num_threads(-1)  # a ValueError, while 1.5 was a DeltaSyncError
    # Metadata that is not strings to strings raised a bare TypeError naming no key, and a reserved key was refused
    # only when the file was written (both found by an adversarial helper).
    for bad, match in [
        ({"k": 1}, "'k': keys and values must be strings"),
        ({1: "v"}, "1: keys and values"),
        ({"step": "7"}, "'step' is reserved"),
        (["k"], "must be a mapping"),
    ]:
        with pytest.raises(ds.DeltaSyncError, match=match):
            ds.diff(prev, curr, metadata=bad)
        with pytest.raises(ds.DeltaSyncError, match=match):
            delta.metadata = bad
    assert delta.metadata == {}
    with pytest.warns(RuntimeWarning, match="more threads than this machine"):
        ds.set_num_threads(2**70)
    ds.set_num_threads(0)
    path = tmp_path / "d.safetensors"
    delta.save(path)
    script = f"import deltasync_rs as ds, sys; p, v = ds.load({str(path)!r}).decoded(0); print(type(v).__module__)"
    import subprocess

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "torch", done.stderr


def test_metadata_reserved_keys(states):
    prev, curr = states
    with pytest.raises(ds.DeltaSyncError, match="reserved"):
        ds.diff(prev, curr, metadata={"format": "x"})


def test_threads_setting_gives_same_bytes(states):
    prev, curr = states
    default = ds.get_num_threads()
    try:
        ds.set_num_threads(1)
        assert ds.get_num_threads() == 1
        one = ds.diff(prev, curr).to_bytes()
        ds.set_num_threads(2)
        two = ds.diff(prev, curr).to_bytes()
    finally:
        ds.set_num_threads(0)
    assert ds.get_num_threads() == default
    assert one == two


@pytest.mark.skipif(sys.platform == "win32", reason="fork is POSIX-only")
def test_pool_works_after_fork():
    prev, curr = _pair(shape=(600, 1000))
    expected = ds.diff(prev, curr).num_changed  # also starts the pool in the parent
    assert expected == int((prev != curr).sum())
    pid = os.fork()
    if pid == 0:
        # Only our code runs in the child: torch's OpenMP pool is not fork-safe.
        try:
            ok = ds.diff(prev, curr).num_changed == expected
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_cuda_apply_matches_cpu(cuda, states):
    prev, curr = states
    delta = ds.diff(prev, curr)
    target = {k: v.to(cuda) for k, v in prev.items()}
    delta.apply_(target)
    assert_states_equal({k: v.cpu() for k, v in target.items()}, curr)


def test_cuda_state_digest_matches_cpu(cuda):
    """The state digest of tensors on a GPU is made there (round sums, deltasync_rs._identity): the CPU's digest."""
    g = torch.Generator().manual_seed(4)
    state = {
        "embed": torch.randn(2048, 1031, generator=g).bfloat16(),  # over STATE_HOST_BELOW: rounds on the device
        "norm": torch.randn(96, generator=g),
        "odd": torch.randn(3, 700, 999, generator=g).bfloat16()[:, ::2],
    }
    assert ds.state_digest({k: v.to(cuda) for k, v in state.items()}) == ds.state_digest(state)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float8_e5m2, torch.int64])
@pytest.mark.parametrize("values", ["diff", "abs"])
def test_device_path_runs_on_cpu(monkeypatch, dtype, values):
    """The path CUDA targets take (decode, one transfer, index_select + wrapping add, index_copy_), forced on CPU."""
    import deltasync_rs._arrays as arrays

    monkeypatch.setattr(arrays, "writable_bytes", lambda target: None)
    g = torch.Generator().manual_seed(1)
    width = torch.empty((), dtype=dtype).element_size()
    int_view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    prev = torch.randint(-(2**15), 2**15, (300,), generator=g).to(int_view).view(dtype)
    curr = prev.clone()
    bits = curr.view(int_view)
    bits[::7] += 1
    bits[3] -= 1000  # escaped difference, and a wrap for narrow types
    bits[10] = torch.iinfo(int_view).min if int_view is not torch.uint8 else 0
    everything = torch.randint(0, 255, (50,), generator=g).to(torch.uint8)
    state = {"w": prev.clone(), "dense": torch.zeros(50, dtype=torch.uint8), "w_t": prev.clone().view(20, 15).t()}
    target_curr = {"w": curr, "dense": everything, "w_t": curr.clone().view(20, 15).t()}
    delta = ds.diff(state, target_curr, values=values)
    assert delta.tensors[1].positions == "all"
    delta.apply_(state)
    for name in state:
        assert_bits_equal(state[name], target_curr[name], name)


def test_an_option_given_a_whole_state_is_named_by_its_type_not_printed():
    """A state passed where a step or an option goes: the error names what was given in a few words; its repr (every
    tensor's values) made a message of 86,000 lines for 8,000 small tensors, and took longer than the work."""
    state = {f"t{i}": torch.zeros(100, dtype=torch.bfloat16) for i in range(50)}
    calls = {
        "step must be": lambda: ds.torch.Mirror(state).step(state),
        "codec must be": lambda: ds.diff(state, state, codec=state),
        "index must be": lambda: ds.diff(state, state).decoded(state),
        "retries must be": lambda: ds.Subscriber("unused", retries=state),
    }
    for start, call in calls.items():
        with pytest.raises(ds.DeltaSyncError) as info:
            call()
        message = str(info.value)
        assert message.startswith(start) and message.endswith("not a dict of 50 items"), message
    with pytest.raises(ds.DeltaSyncError, match=r"not 'x{99}\.\.\.$"):
        ds.diff(state, state, codec="x" * 1000)


def test_name_in_delta_asks_the_core_about_that_name_alone():
    state = {f"t{i}": np.zeros(4, np.float32) for i in range(3)}
    delta = ds.diff(state, state)
    assert "t1" in delta and "t3" not in delta and 1 not in delta and None not in delta
    assert all(name in delta for name in delta.names)
