#!/usr/bin/env bash
# The GPU checks in one command, for a machine with a CUDA GPU and a python that holds torch (a lent GPU has 15
# minutes; this takes about 10): install colozoo into that python (no downloads: its dependencies are the image's),
# run tests/test_gpu.py and bench/gpu.py, and keep every log under $OUT (default gpu-logs/).
#     OUT=/tmp/out bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-logs}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi: the tests will skip and the bench will say so"
if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1; then
  echo "install failed: see $OUT/install.log"; exit 1
fi
timeout "${TEST_SECONDS:-360}" "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py > "$OUT/test_gpu.log" 2>&1
echo "tests/test_gpu.py: exit $? ($(tail -n 1 "$OUT/test_gpu.log"))"
timeout "${BENCH_SECONDS:-240}" "$PY" bench/gpu.py > "$OUT/bench_gpu.jsonl" 2> "$OUT/bench_gpu.err"
echo "bench/gpu.py: exit $?"
cat "$OUT/bench_gpu.jsonl"
