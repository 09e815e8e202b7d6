# Every habit has one name. `make setup` once, then `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export VIRTUAL_ENV := $(abspath $(VENV))

.PHONY: setup develop test test-rust test-python lint bench demo wheel clean

## setup: one virtualenv with torch 2.14.0, vllm 0.33.0, the test tools and deltasync-rs built in release mode
setup:
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "torch==2.14.0" "vllm==0.33.0" "maturin>=1.7,<2" pytest pytest-benchmark hypothesis safetensors ml_dtypes numpy mypy zstandard matplotlib
	$(MAKE) develop

## develop: rebuild the Rust extension into the virtualenv after a Rust change
develop:
	$(VENV)/bin/maturin develop --release --quiet

## test: the Rust core's tests, then the package's (benchmarks run once on a tiny workload as smoke tests)
test: test-rust test-python

test-rust:
	cargo test --quiet

test-python:
	$(PY) -m pytest --benchmark-disable -q

## lint: clippy on the core and bindings, and stubtest to keep _core.pyi honest against the built module
lint:
	cargo clippy --all-targets --features python -- -D warnings
	$(PY) -m mypy.stubtest deltasync_rs._core

## bench: the CPU comparison on the full Qwen3-0.6B-shaped workload (see docs/benchmarks.md)
bench:
	$(PY) -m pytest benches --benchmark-only --benchmark-columns=median,min,max,rounds

## demo: train a small model, publish an anchor and deltas to ./deltasync-store, replay them, check bit-exactness
demo:
	$(PY) examples/quickstart.py --store deltasync-store

## wheel: an abi3 wheel for CPython >= 3.11 in target/wheels/
wheel:
	$(VENV)/bin/maturin build --release

clean:
	cargo clean
	rm -rf deltasync-store .pytest_cache .hypothesis .benchmarks
