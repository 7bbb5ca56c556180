#!/usr/bin/env bash
# Installs vitserve with its test extra into ./.venv (CPU torch) and runs the static checks CI runs:
# ruff (lint and format), mypy (strict on vitserve/), import-linter (the layer contracts in pyproject.toml),
# hadolint on the Dockerfiles and shellcheck on the container scripts (both installed by the test extra).
. "$(dirname "$0")/venv.sh"
python -m pip install -q -e ".[test]"
ruff check .
ruff format --check .
mypy
lint-imports
hadolint docker/Dockerfile.cpu docker/Dockerfile.cuda
shellcheck docker/*.sh
