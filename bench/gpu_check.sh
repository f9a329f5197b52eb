#!/usr/bin/env bash
# The GPU check, as one prepared run for a lent GPU machine (a lease is short: the suite and the
# benchmark in one command). Results are recorded in docs/benchmarks.md, "One GPU".
#
#     bash bench/gpu_check.sh OUTDIR [VARIANTS]
#
# Optional wheels in .whl/ (e.g. torchao, which the machine may lack) are installed first to
# /tmp/site. Writes OUTDIR/device.txt, gpu_suite.log, gpu_bench.log and gpu.json.
set -u
out=${1:-bench/out/gpu}
variants=${2:-bf16,bf16-autocast,bf16-compile,fp8-tensorwise-compile,fp8-rowwise-compile}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,power.limit,driver_version --format=csv \
    | tee "$out/device.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_capability())" \
    | tee -a "$out/device.txt"
python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1 \
    | tee -a "$out/device.txt"
started=$SECONDS
timeout "${SUITE_TIMEOUT:-180}" python3 -m pytest tests/gpu -m gpu -v -s -o addopts="" \
    -p no:cacheprovider ${SUITE_SELECT:+-k "$SUITE_SELECT"} >"$out/gpu_suite.log" 2>&1
echo "suite: exit $? after $((SECONDS - started)) s"
grep -E '(PASSED|FAILED|SKIPPED|ERROR)|^(offload|fp8|cuda|packed|compiled)|passed|failed' \
    "$out/gpu_suite.log" | grep -v 'needs [0-9] GPUs' | cut -c1-240
started=$SECONDS
timeout "${BENCH_TIMEOUT:-330}" python3 bench/gpu.py --steps 6 --warmup 2 --variants "$variants" \
    --out "$out/gpu.json" >"$out/gpu_bench.log" 2>&1
echo "bench: exit $? after $((SECONDS - started)) s"
grep -v '^{' "$out/gpu_bench.log" | tail -14
grep '"error"' "$out/gpu_bench.log" | cut -c1-600
