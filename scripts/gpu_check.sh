#!/usr/bin/env bash
# The GPU checks in one command, at most 8 minutes on one CUDA GPU (a lent GPU has 15 minutes, its start included),
# every log under $OUT (default gpu-logs/). Each part has its own budget in seconds, overridable:
#   install (colozoo, and liger-kernel from .whl/ when present)   ~20
#   tests/test_gpu.py, the CUDA-graph decode tests first     GRAPH_TEST_SECONDS=90
#   tests/test_gpu.py, the rest                              TEST_SECONDS=150
#   bench/gpu.py (cases that would not fit print "skipped")  BENCH_SECONDS=200 (its own --budget 20 s less); first
#     the planner's hardware fields measured on this GPU, written as $OUT/hardware.json (colozoo plan --hardware it)
#
# The peer Liger-Kernel is no package of the GPU machine's image: carry its wheel (pure Python; torch and triton are
# there). Once, in the repository's root on the machine that calls the device:
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#         -d .whl liger-kernel==0.8.5
# then the device tool's call:
#     run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Without .whl/ the training cases print {"skipped": "liger-kernel is not installed ..."} and the rest runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-logs}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "no nvidia-smi: the tests will skip and the bench will say so"
if ls .whl/*.whl > /dev/null 2>&1; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      > "$OUT/install_wheels.log" 2>&1; then
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "the wheels in .whl/ did not install: see $OUT/install_wheels.log"
  fi
fi
if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1; then
  echo "install failed: see $OUT/install.log"; exit 1
fi
GRAPH="graph_decode or draw_is"
timeout "${GRAPH_TEST_SECONDS:-90}" "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/test_gpu.py -k "$GRAPH" \
  > "$OUT/test_gpu_graph.log" 2>&1
echo "tests/test_gpu.py -k '$GRAPH': exit $? ($(tail -n 1 "$OUT/test_gpu_graph.log"))"
timeout "${TEST_SECONDS:-150}" "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/test_gpu.py -k "not ($GRAPH)" \
  > "$OUT/test_gpu.log" 2>&1
echo "tests/test_gpu.py, the rest: exit $? ($(tail -n 1 "$OUT/test_gpu.log"))"
BENCH="${BENCH_SECONDS:-200}"
timeout "$BENCH" "$PY" bench/gpu.py --budget "$((BENCH - 20))" --repeats 3 --hardware-out "$OUT/hardware.json" \
  > "$OUT/bench_gpu.jsonl" 2> "$OUT/bench_gpu.err"
echo "bench/gpu.py: exit $?"
cat "$OUT/bench_gpu.jsonl"
