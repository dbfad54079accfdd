#!/usr/bin/env bash
# One GPU session's checks and measurements, in the order that matters when time runs out:
# install offline (../shared/gpu-node/README.md: wheels in .whl/, the node's own CUDA torch),
# the cuda test suite, the end-to-end training throughput (eager and compiled Switch kernels), the
# Switch layer benchmark (eager, then compiled), then a profile of one training step.  Everything is logged under OUTDIR
# (run.log, cuda_tests.log, train_throughput.json, switch_ffn_cuda.json, switch_ffn_compiled_cuda.json,
# profile.log).
#
# Usage: bash benchmarks/gpu_node.sh OUTDIR [SECONDS]      (SECONDS: the whole budget, default 520)
#        STREAM=DIR  a prepared alma-data-prep stream for train_throughput.py (default: it builds one)
#        PY=python   the Python that holds the node's CUDA torch (default python3); SKIP_INSTALL=1
# Wheels: ../shared/gpu-node/fetch_wheels.sh, and pytest-xdist with execnet beside them (the cuda tests
# run 6 at a time then; one at a time they may not fit their 160 s):
#   pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl pytest-xdist execnet
set -uo pipefail
out=${1:?usage: gpu_node.sh OUTDIR [SECONDS]}
budget=${2:-520}
mkdir -p "$out"
exec > >(tee -a "$out/run.log") 2>&1
start=$SECONDS
export PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
py=${PY:-python3}

left() { echo $(( budget - (SECONDS - start) )); }
step() {  # step NAME CAP command...: run with timeout min(CAP, time left), say how it ended
    local name=$1 cap=$2; shift 2
    local limit; limit=$(left); (( limit > cap )) && limit=$cap
    if (( limit < 10 )); then echo "== $name: skipped, $(left)s left"; return 0; fi
    echo "== $name (at $((SECONDS - start))s, limit ${limit}s)"
    timeout "$limit" "$@"; local rc=$?
    echo "== $name: exit $rc after $((SECONDS - start))s"
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
[ -n "${SKIP_INSTALL:-}" ] || step install 90 bash -c "$py -m pip install -q --no-index --no-deps --no-compile .whl/*.whl && \
    $py -m pip install -q --no-index --no-deps --no-build-isolation -e . && \
    $py -c 'import torch, fairseq, fairseq_alma; print(\"torch\", torch.__version__, \"fairseq\", fairseq.__version__, torch.cuda.get_device_name())'"
parallel=(); $py -c "import xdist" 2>/dev/null && parallel=(-p xdist.plugin -n 6)  # fairseq-train runs side by side
step cuda_tests 160 $py -m pytest "${parallel[@]}" -m cuda -rs -q -p no:cacheprovider tests \
    > "$out/cuda_tests.log" 2>&1
tail -25 "$out/cuda_tests.log"
# end to end: stock, Switch E=1/E=8 eager and compiled (--moe-expert-kernel compiled), fp16 and bf16
# (the compiled runs first after stock: each run prints its line as it ends, so a cut-off step still says them)
step train_throughput 300 $py benchmarks/train_throughput.py ${STREAM:+--data "$STREAM"} \
    --models "transformer_lm,switch E=8 compiled,switch E=1 compiled,switch E=8,switch E=1" \
    --json "$out/train_throughput.json"
step switch_ffn 110 $py benchmarks/switch_ffn.py --device cuda --ops --json "$out/switch_ffn_cuda.json"
# the compiled kernel alone: one compilation per configuration, so the paper's d 768 at E = 4, 8, 12
step switch_ffn_compiled 60 $py benchmarks/switch_ffn.py --device cuda --kernels compiled --dims 768 \
    --experts 4,8,12 --precisions fp16,bf16 --rounds 2 --json "$out/switch_ffn_compiled_cuda.json"
step profile 60 $py benchmarks/profile_lm_step.py --precision bf16 > "$out/profile.log" 2>&1
grep -v "^    " "$out/profile.log" | tail -5
echo "== done at $((SECONDS - start))s"
