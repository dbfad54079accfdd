# fairseq-alma: the two README commands are `make demo` and `make test`; both install first.
#
# Install order matters (see README "Installing"): torch first (the local CPU wheel here, the
# cluster's CUDA build on GPU machines), then fairseq-fixed with --no-deps --no-build-isolation
# so pip never swaps torch for a CUDA download, then fairseq's real dependencies and ours.

PYTHON_BASE ?= python3.11
VENV        ?= .venv
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip
TORCH_SPEC  ?= torch==2.13.0
STAMP       := $(VENV)/.installed
DEMO_DIR    ?= demo_out
PYTEST_ARGS ?=

.PHONY: install demo test bench clean-demo check-torch

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON_BASE) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=23" "setuptools>=68,<81" wheel
	@# torch first, alone: anything installed later sees it and asks for nothing newer.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q "numpy<2" "cython<3.1"
	@# fairseq 0.12 with the Python 3.11 fixes; no build isolation (it would fetch a CUDA torch).
	$(PY) -c "import fairseq" 2>/dev/null || $(PIP) install -q --no-deps --no-build-isolation fairseq-fixed==0.12.3.1
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .
	@$(MAKE) --no-print-directory check-torch
	@touch $(STAMP)

# Fails loudly if any step above replaced the torch build we installed first.
check-torch:
	@$(PY) -c "import torch, fairseq, fairseq_alma; print('torch', torch.__version__, '| fairseq', fairseq.__version__, '| fairseq_alma ok')"

demo: install
	$(VENV)/bin/alma-demo --out $(DEMO_DIR)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

bench: install
	$(PY) benchmarks/switch_ffn.py
