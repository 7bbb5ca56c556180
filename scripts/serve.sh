#!/usr/bin/env bash
# Installs vitserve into ./.venv (CPU torch) and runs the service; arguments go to `vitserve`
# (default: the built-in demo model on 127.0.0.1:8100).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e .
exec vitserve "$@"
