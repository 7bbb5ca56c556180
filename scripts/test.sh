#!/usr/bin/env bash
# Installs vitserve with its test extra into ./.venv (CPU torch) and runs the default test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU wheel first, so nothing below pulls a multi-GB CUDA build of torch.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
python -m pytest "$@"
