# Sourced by serve.sh, test.sh and lint.sh: create ./.venv and install the CPU build of torch into it,
# first, so nothing installed after it pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# docker/versions.env pins torch and transformers for the images; the suite runs on the same versions.
. docker/versions.env
python -m pip install -q "torch==${TORCH_VERSION}" "transformers==${TRANSFORMERS_VERSION}"
