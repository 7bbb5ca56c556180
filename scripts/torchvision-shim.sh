#!/usr/bin/env bash
# Usage: bash scripts/torchvision-shim.sh VENV_PYTHON
# Installs scripts/torchvision_shim.py into that venv's site-packages with a .pth line that loads it at every
# interpreter start, so PyPI's (CUDA) torchvision imports beside the CPU torch in every process of the venv.
set -euo pipefail
here=$(dirname "${BASH_SOURCE[0]}")
site=$("$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp "$here/torchvision_shim.py" "$site/_vitserve_torchvision_shim.py"
echo "import _vitserve_torchvision_shim" > "$site/_vitserve_torchvision_shim.pth"
