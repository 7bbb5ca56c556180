#!/usr/bin/env bash
# Installs vitserve with its test extra into ./.venv (CPU torch) and runs the default test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`, or
# `-n 2 --dist loadscope --no-loadscope-reorder` for pytest-xdist workers (tests/parallel.py).
#
# `bash scripts/test.sh --quick [pytest args]`: the quick tier only, tests/unit without the tests marked
# `heavy` (tests/unit/conftest.py): in-process, no vLLM, about a minute on 2 cores.
#
# The install is skipped while .venv is current: .venv/.test-install holds a hash of the files that decide it
# (pyproject.toml, docker/versions.env, these scripts); change one, or delete .venv, and it runs again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
quick=false
if [ "${1:-}" = "--quick" ]; then
  quick=true
  shift
fi
stamp=.venv/.test-install
fingerprint() {
  cat pyproject.toml docker/versions.env scripts/venv.sh scripts/test.sh scripts/torchvision-shim.sh \
    scripts/torchvision_shim.py | sha256sum | cut -d' ' -f1
}
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$(fingerprint)" ]; then
  # shellcheck source=/dev/null
  . .venv/bin/activate
else
  . scripts/venv.sh
  python -m pip install -q -e ".[test]"
  # The test extra's torchvision (the oracle of --image_resize torch) is PyPI's CUDA build: make it importable
  # beside the CPU torch in every process of the venv (the CLI subprocesses the tests start included).
  bash scripts/torchvision-shim.sh python
  fingerprint > "$stamp"
fi
# Cache bytecode even where the caller's environment says not to: every CLI and rank the suite starts would
# otherwise compile vitserve's modules again, and collection alone takes twice as long.
unset PYTHONDONTWRITEBYTECODE
if "$quick"; then
  exec python -m pytest tests/unit -m "not slow and not heavy" "$@"
fi
# A real vLLM in a venv of its own for tests/vllm/ (idempotent: returns at once when it is there).
bash scripts/vllm-env.sh
# A real nginx (Debian's package) in front of several vLLMs for the pull tests (idempotent).
bash scripts/nginx.sh
python -m pytest "$@"
