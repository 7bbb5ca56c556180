#!/usr/bin/env bash
# Issue 40's device run: the CUDA unit tests, then bench/gpu_check.py (every figure in $OUT/gpu_check.json).
#
# From a session lent a GPU, in the main checkout, once (transformers >= 5.23 travels as a wheel, ~12 MB; the
# device's image has 5.17 and every other package vitserve's model code needs):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl transformers==5.23.0
# then the device tool's run, exactly (one call; 15 minutes of device time hold the start, ~3 min, and
# this twice: pytest <= 45 s, gpu_check.py <= 270 s, its parts' timeouts below adding up to 240 s):
#   run(command="bash bench/gpu_check.sh --commit COMMIT", carry=[".whl"], timeout_s=330)
# with COMMIT the output of `git rev-parse --short HEAD` here (the device's copy of the tree has no .git).
# What comes back: $OUT/gpu_check.json, $OUT/check.log, $OUT/pytest.log. Fetch them before the next run.
# Extra arguments go to bench/gpu_check.py (e.g. --parts speed --towers qwen3_vl-8b).
#
# CPU dry run (tests/integration/test_gpu_check.py): GPU_CHECK_DRY_RUN=1 bash bench/gpu_check.sh skips the tests and
# runs the tiny towers on the CPU.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-bench/out/gpu_check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
if [ "${GPU_CHECK_DRY_RUN:-0}" = 1 ]; then
    exec "$PY" bench/gpu_check.py --small --device cpu --out "$OUT" "$@"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv | tee "$OUT/gpu.txt"
# --noconftest: the suite's conftest imports what only the serving tests need (zmq, the vLLM helpers)
timeout 45 "$PY" -m pytest -q -p no:cacheprovider --noconftest -o addopts="" -k cuda \
    tests/unit/test_tower_graphs.py tests/unit/test_reservation.py 2>&1 | tee "$OUT/pytest.log"
# seconds per part (speed, graphs and exact: per tower), the headline first; a part past its time is recorded in the
# JSON's errors and the next one starts; the outer timeout ends a hung device call (rows so far are saved)
TIMEOUTS="speed=40 graphs=30 exact=15 reserve=35 visual_mem_gb=20 handoff=5 profile=10"
# shellcheck disable=SC2086
timeout 270 "$PY" bench/gpu_check.py --out "$OUT" --timeouts $TIMEOUTS "$@" 2>&1 | tee "$OUT/check.log"
