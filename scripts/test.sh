#!/usr/bin/env bash
# Installs vitserve with its test extra into ./.venv (CPU torch) and runs the default test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`.
. "$(dirname "$0")/venv.sh"
python -m pip install -q -e ".[test]"
python -m pytest "$@"
