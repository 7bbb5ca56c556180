#!/usr/bin/env bash
# Every benchmark at its standard settings, in one sitting, then bench/report.py (tables + serving plots).
#
#   bash bench/run_all.sh            # standard settings: the numbers for bench/RESULTS.md
#   bash bench/run_all.sh --quick    # each benchmark's smoke mode (~1 min each)
#   bash bench/run_all.sh --write    # standard, then fill the tables into bench/RESULTS.md
#
# Each benchmark appends its record (commit, machine, load before/after) to bench/out/<name>.jsonl.
# Prints how long each took. Uses .venv/bin/python if there is one (PYTHON=... overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
quick=() write=()
for arg in "$@"; do
  case $arg in
    --quick) quick=(--quick) ;;
    --write) write=(--write) ;;
    *) echo "usage: bench/run_all.sh [--quick] [--write]" >&2; exit 2 ;;
  esac
done
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "warning: uncommitted changes; the records will say dirty" >&2
fi
declare -A took
step() {  # name, command...
  local name=$1 start=$SECONDS; shift
  echo "=== $name: $* (load $(cut -d' ' -f1-3 /proc/loadavg))"
  "$@"
  took[$name]=$((SECONDS - start))
  echo "=== $name took ${took[$name]} s"
}
step encoder "$PY" bench/encoder.py "${quick[@]}"
step transfer "$PY" bench/transfer.py "${quick[@]}"
step jpeg_draft "$PY" bench/jpeg_draft.py "${quick[@]}"
step cache "$PY" bench/cache.py "${quick[@]}"
step serve "$PY" bench/serve.py "${quick[@]}"
step startup "$PY" bench/startup.py
step scaling "$PY" bench/scaling.py "${quick[@]}"
step latency "$PY" bench/latency.py "${quick[@]}"
step preprocess "$PY" bench/preprocess.py "${quick[@]}"
step gateway "$PY" bench/gateway.py "${quick[@]}"
step ec_handover "$PY" bench/ec_handover.py "${quick[@]}"
step inline_body "$PY" bench/inline_body.py "${quick[@]}"
step gateway_widths "$PY" bench/gateway.py --widths "${quick[@]}"
step video_decode "$PY" bench/video_decode.py "${quick[@]}"
step video_fairness "$PY" bench/video_fairness.py "${quick[@]}"
step video_memory "$PY" bench/video_memory.py "${quick[@]}"
step report "$PY" bench/report.py "${write[@]}"
echo "=== seconds per step:"
for name in encoder transfer jpeg_draft cache serve startup scaling latency preprocess gateway ec_handover inline_body \
  gateway_widths video_decode video_fairness video_memory report; do printf '  %-10s %5d\n' "$name" "${took[$name]}"; done
echo "  total      $SECONDS"
