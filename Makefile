# kimi: two commands do all the set-up on a fresh machine.
#   make serve   venv + install + (no MODEL given) a tiny random K2.6-layout checkpoint, then serve on 127.0.0.1:8000
#   make test    venv + install + the CPU test suite
#   make lint    the gates CI runs before the tests: ruff (lint, format), mypy, clang-format (docs/development.md)
PY         ?= python3
VENV       ?= .venv
BIN        := $(VENV)/bin
TINY       := models/tiny-k2.6
MODEL      ?= $(TINY)
HOST       ?= 127.0.0.1
PORT       ?= 8000
ARGS       ?=
# A CPU build of torch on machines without a GPU; on a GPU host install your CUDA torch first (it is kept).
TORCH_SPEC ?= torch==2.13.0
# pyproject extras installed: dev (tests, the openai client); EXTRAS=dev,gpu adds the GPU kernels (FlashInfer,
# humming-kernels, DeepEP) on a GPU host with a package index
EXTRAS     ?= dev
comma      := ,
STAMP      := $(BIN)/.installed-$(subst $(comma),-,$(EXTRAS))
PYTEST_ARGS ?=

# Triton's CPU interpreter runs the kernel tests (tests/unit/triton_interp.py) from a side venv: it needs a numpy
# older than the test venv's. Best effort: if it cannot be built, those tests skip and say why.
TVENV      ?= .venv-triton
TRITON_SPEC ?= triton==3.6.0

.PHONY: install serve test test-gpu tiny wheelhouse clean triton-venv lint

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

install: $(STAMP)

# The tiny checkpoint's generation_config.json caps a chat reply that sets no max_tokens at TINY_MAX_NEW_TOKENS (the
# random model rarely stops, and its context is K2.6's 262144 tokens): seconds on a CPU, not hours.
TINY_MAX_NEW_TOKENS ?= 256
$(TINY)/config.json: $(STAMP) tools/make_tiny_checkpoint.py kimi/tiny_checkpoint.py
	$(BIN)/python tools/make_tiny_checkpoint.py $(TINY) --max-new-tokens $(TINY_MAX_NEW_TOKENS)

tiny: $(TINY)/config.json

serve: install $(if $(filter $(TINY),$(MODEL)),$(TINY)/config.json)
	$(BIN)/kimi serve --model $(MODEL) --host $(HOST) --port $(PORT) $(ARGS)

$(TVENV)/.installed:
	-(test -x $(TVENV)/bin/python || $(PY) -m venv $(TVENV)) && $(TVENV)/bin/python -m pip install -q \
		"$(TORCH_SPEC)" "$(TRITON_SPEC)" "numpy<2.3" && touch $@

triton-venv: $(TVENV)/.installed

test: install triton-venv
	KIMI_TRITON_PYTHON=$(CURDIR)/$(TVENV)/bin/python $(BIN)/python -m pytest -q -m "not gpu" tests $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/clang-format --dry-run --Werror kimi/kernels/cuda/csrc/*.cu kimi/kernels/cuda/csrc/*.cpp

test-gpu: install
	$(BIN)/python -m pytest -q -m gpu tests $(PYTEST_ARGS)

# Wheels for an offline x86-64 Python 3.12 GPU host (everything but PyTorch): scripts/wheelhouse.sh says how to install.
WHEELHOUSE ?= .whl
wheelhouse:
	bash scripts/wheelhouse.sh $(WHEELHOUSE)

clean:
	rm -rf $(VENV) $(TVENV) models build *.egg-info
