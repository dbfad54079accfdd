# fairseq-alma: the two README commands are `make demo` and `make test`; both install first.
#
# Install order matters (see README "Installing"): torch first (the local CPU wheel here, the
# cluster's CUDA build on GPU machines), then fairseq-fixed with --no-deps --no-build-isolation
# so pip never swaps torch for a CUDA download, then fairseq's real dependencies and ours.
#
# Offline, on a GPU machine (README "Installing on a GPU machine (offline)"):
#   here:  make wheelhouse WHEELHOUSE=dir          every wheel except torch, fairseq built once
#   there: make install WHEELHOUSE=dir TORCH_FROM=system PYTHON_BASE=/path/to/python3.11
#          make gpu-check

PYTHON_BASE ?= python3.11
VENV        ?= .venv
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip
TORCH_SPEC  ?= torch==2.13.0
# pip: install TORCH_SPEC unless torch already imports in the venv (from the index, or from the
# wheelhouse when it holds a torch wheel). system: the venv sees PYTHON_BASE's own torch
# (--system-site-packages) and never installs one; everything else is installed into the venv
# (--ignore-installed), so a system numpy 2 or scipy cannot mix with our numpy<2.
TORCH_FROM  ?= pip
# A directory of wheels (`make wheelhouse`): when set, `make install` reads only from it.
WHEELHOUSE  ?=
STAMP       := $(VENV)/.installed
DEMO_DIR    ?= demo_out
PYTEST_ARGS ?=
# Test files run on this many processes (pytest-xdist; one file stays on one process, so a
# module's fixtures are built once). 2 matches CI's two cores; TEST_WORKERS=0 runs them in one.
TEST_WORKERS ?= 2

SYSTEM_TORCH := $(filter system,$(TORCH_FROM))
PIP_INSTALL  := $(PIP) install -q $(if $(WHEELHOUSE),--no-index --find-links $(abspath $(WHEELHOUSE))) $(if $(SYSTEM_TORCH),--ignore-installed)
FAIRSEQ_SPEC := fairseq-fixed==0.12.3.1

.PHONY: install demo test test-deps bench check-torch gpu-check wheelhouse

install: $(STAMP)

QUIET_PTH   := fairseq_alma/fairseq_glue/quiet_imports.pth

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml $(QUIET_PTH)
	@test -x $(PY) || $(PYTHON_BASE) -m venv $(if $(SYSTEM_TORCH),--system-site-packages) $(VENV)
	$(PIP_INSTALL) --upgrade "pip>=23" "setuptools>=68,<81" wheel
	@# torch first, alone: anything installed later sees it and asks for nothing newer.
ifeq ($(SYSTEM_TORCH),system)
	@$(PY) -c "import torch" || { echo "TORCH_FROM=system: $(PYTHON_BASE) has no torch that imports (PYTHON_BASE must be a Python install with torch, not a venv)"; exit 1; }
else
	$(PY) -c "import torch" 2>/dev/null || $(PIP_INSTALL) "$(TORCH_SPEC)"
endif
	$(PIP_INSTALL) "numpy<2" "cython<3.1"
	@# fairseq 0.12 with the Python 3.11 fixes; no build isolation (it would fetch a CUDA torch).
	$(PY) -c "import fairseq" 2>/dev/null || $(PIP_INSTALL) --no-deps --no-build-isolation $(FAIRSEQ_SPEC)
	$(PIP_INSTALL) -r requirements.txt
	$(PIP_INSTALL) --no-deps -r requirements-nodeps.txt
	$(PIP_INSTALL) --no-deps --no-build-isolation -e .
	@# fairseq-train imports fairscale, whose torch.cuda.amp FutureWarnings would print in front
	@# of every run and every one-line refusal, before the plugin can filter them: filter there
	cp $(QUIET_PTH) "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/fairseq_alma_quiet_imports.pth"
	@$(MAKE) --no-print-directory check-torch
	@touch $(STAMP)

# Every wheel `make install WHEELHOUSE=dir` needs except torch, built with this venv (installed
# first from the configured index). The wheels fit only this platform (Linux x86_64) and this
# Python minor version: numpy, regex, scipy, sentencepiece, ... are binary wheels for one Python
# version, and fairseq-fixed is compiled here, once (pip's wheel cache keeps the build from
# `make install`), against this venv's numpy and cython (its Cython modules, cp311 for
# python3.11) and torch (its C++ extensions libbase/libnat, used only by fairseq's
# non-autoregressive models, which fairseq-alma never imports). So run it with a PYTHON_BASE of
# the target machine's minor version. The project's own wheel is included for a venv without this
# checkout; `make install` installs the checkout itself (editable) as usual.
wheelhouse:
	@test -n "$(WHEELHOUSE)" || { echo "usage: make wheelhouse WHEELHOUSE=dir [PYTHON_BASE=python3.X]"; exit 2; }
	@$(MAKE) --no-print-directory install WHEELHOUSE=
	$(PIP) wheel -q -w $(WHEELHOUSE) "pip>=23" "setuptools>=68,<81" wheel "cython<3.1" -r requirements.txt
	$(PIP) wheel -q -w $(WHEELHOUSE) --no-deps --no-build-isolation $(FAIRSEQ_SPEC) -r requirements-nodeps.txt .
	@echo "$(WHEELHOUSE): $$(ls $(WHEELHOUSE)/*.whl | wc -l) wheels for $$($(PY) -c 'import sys; print("Python %d.%d" % sys.version_info[:2])') (no torch: the GPU machine brings its own, see README)"

# Fails loudly if any step above replaced the torch build we installed first, or if torch has no
# kernels for the GPU it sees (e.g. a V100 with a non-CUDA-12.6 wheel of torch >= 2.11).
check-torch:
	@$(PY) -c "import torch, fairseq, fairseq_alma; print('torch', torch.__version__, '| fairseq', fairseq.__version__, '| fairseq_alma ok')"
	@$(PY) -m fairseq_alma.cli.check_torch

# The main job (Table 2 at toy scale), then the drifting-stream variant on the same corpus
# (no replay vs 25% vs full replay, every stage scored on every period; outputs in DEMO_DIR/drift).
demo: install
	$(VENV)/bin/alma-demo --out $(DEMO_DIR)
	$(VENV)/bin/alma-demo --drift --out $(DEMO_DIR)

test: install test-deps
	$(PY) -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) --durations=15 $(PYTEST_ARGS) tests

# The Slurm tests start a real single-node cluster (slurmctld, slurmd, munge from Debian's
# packages). Install them when missing and possible; otherwise those tests skip with the reason.
test-deps:
	@command -v slurmctld >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "installing Slurm (slurmctld slurmd slurm-client) for the Slurm tests"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	      slurmctld slurmd slurm-client >/dev/null) || echo "Slurm could not be installed: its tests will skip"; \
	  else echo "Slurm missing and not installable here (needs root + apt-get): its tests will skip"; fi; }

# The tests marked `cuda` (SwitchFFN against a float64 reference in fp32/fp16/AMP, fp16/AMP/FSDP
# streams, the vision learners, expert parallelism over NCCL with 2+ GPUs) on this machine.
# Fails if one fails, or if nvidia-smi lists a GPU that torch cannot use (a CPU build of torch);
# without any GPU each test skips with its reason and the summary says how many did.
gpu-check: install
	@$(MAKE) --no-print-directory check-torch
	@if nvidia-smi -L >/dev/null 2>&1 && ! $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
	  echo "gpu-check: nvidia-smi lists a GPU but torch cannot use it (a CPU build of torch? README: Installing on a GPU machine)"; exit 1; fi
	$(PY) -m pytest -m cuda -rs -q $(PYTEST_ARGS) tests

bench: install
	$(PY) benchmarks/switch_ffn.py
	$(PY) benchmarks/stream_overhead.py
	$(PY) benchmarks/data_prep_throughput.py
	$(PY) benchmarks/vision_stream.py
