# Sourced by serve.sh and test.sh: create ./.venv and install the CPU build of torch into it, first,
# so nothing installed after it pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
