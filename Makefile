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

.PHONY: install demo test test-deps bench check-torch

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

# Fails loudly if any step above replaced the torch build we installed first, or if torch has no
# kernels for the GPU it sees (e.g. a V100 with a non-CUDA-12.6 wheel of torch >= 2.11).
check-torch:
	@$(PY) -c "import torch, fairseq, fairseq_alma; print('torch', torch.__version__, '| fairseq', fairseq.__version__, '| fairseq_alma ok')"
	@$(PY) -m fairseq_alma.cli.check_torch

demo: install
	$(VENV)/bin/alma-demo --out $(DEMO_DIR)

test: install test-deps
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

# The Slurm tests start a real single-node cluster (slurmctld, slurmd, munge from Debian's
# packages). Install them when missing and possible; otherwise those tests skip with the reason.
test-deps:
	@command -v slurmctld >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "installing Slurm (slurmctld slurmd slurm-client) for the Slurm tests"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      slurmctld slurmd slurm-client >/dev/null) || echo "Slurm could not be installed: its tests will skip"; \
	  else echo "Slurm missing and not installable here (needs root + apt-get): its tests will skip"; fi; }

bench: install
	$(PY) benchmarks/switch_ffn.py
	$(PY) benchmarks/stream_overhead.py
	$(PY) benchmarks/data_prep_throughput.py
	$(PY) benchmarks/vision_stream.py
