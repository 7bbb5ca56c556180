#!/usr/bin/env bash
# Installs vitserve with its test extra into ./.venv (CPU torch) and runs the default test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow`, or
# `-n 2 --dist loadscope --no-loadscope-reorder` for pytest-xdist workers (tests/parallel.py).
. "$(dirname "$0")/venv.sh"
python -m pip install -q -e ".[test]"
# The test extra's torchvision (the oracle of --image_resize torch) is PyPI's CUDA build: make it importable
# beside the CPU torch in every process of the venv (the CLI subprocesses the tests start included).
bash scripts/torchvision-shim.sh python
# A real vLLM in a venv of its own for tests/vllm/ (idempotent: returns at once when it is there).
bash scripts/vllm-env.sh
python -m pytest "$@"
