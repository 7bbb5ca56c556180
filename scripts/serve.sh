#!/usr/bin/env bash
# Installs vitserve into ./.venv (CPU torch) and runs the service; arguments go to `vitserve`
# (default: the built-in demo model on 127.0.0.1:8100).
. "$(dirname "$0")/venv.sh"
python -m pip install -q -e .
exec vitserve "$@"
