"""Installed by scripts/torchvision-shim.sh into a venv (the test venv, the vLLM venv) as a .pth hook.

PyPI's torchvision is a CUDA build; beside the CPU build of torch its import fails only because the ops
torchvision::nms and torchvision::qnms are then undefined. This import hook defines the two schemas the first
time torchvision is imported (and imports nothing before that), so transformers' torchvision ("fast") image
processors, whose resize code is pure torch, work in every process of that venv. vitserve itself never needs
torchvision (tests/integration/test_fresh_interpreter.py runs it with torchvision unimportable).
"""

import importlib.abc
import sys


class _TorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return
        sys.meta_path.remove(self)
        import torch

        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            try:
                getattr(torch.ops.torchvision, op)
            except (AttributeError, RuntimeError):
                lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        sys.modules["_vitserve_torchvision_ops"] = lib  # the definitions live as long as the library object
        return  # the regular finders import torchvision itself


if not any(isinstance(f, _TorchvisionOps) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionOps())
