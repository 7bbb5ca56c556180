"""vitserve's vLLM connector needs nothing beyond vLLM's own environment (docs/vllm.md: `pip install --no-deps
vitserve`): a fresh interpreter of vLLM's venv, with vitserve's package alone on its path, imports
`vitserve.vllm_connector`; what that import adds to what vLLM's connector base already loaded is vitserve's light
modules and the standard library, nothing of a package vitserve depends on and vLLM may lack (transformers,
fastapi, starlette, pydantic, numpy, PIL, httpx, msgpack). And vitserve's own venv imports the store (the
connector less its vLLM glue) without any of them either."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.vllm_server import vllm_python

pytestmark = pytest.mark.timeout(300)
FORBIDDEN = (
    "transformers",
    "fastapi",
    "starlette",
    "pydantic",
    "numpy",
    "PIL",
    "httpx",
    "msgpack",
    "safetensors",
)
ALLOWED_VITSERVE = {
    "vitserve",
    "vitserve.lazy",
    "vitserve.errors",
    "vitserve.endpoints",
    "vitserve.vllm_connector",
}

PROBE = textwrap.dedent(
    """
    import json, sys
    {before}
    before = set(sys.modules)
    import {module}
    added = sorted(set(sys.modules) - before)
    print(json.dumps({{"added": added, "stdlib": sorted(sys.stdlib_module_names)}}))
    """
)


def _added(python: str, module: str, before: str, path: str) -> tuple[list[str], set[str]]:
    code = PROBE.format(before=before, module=module)
    env = {"PYTHONPATH": path, "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=240, env=env, cwd=path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["added"], set(result["stdlib"])


def _foreign(added: list[str], stdlib: set[str], allowed: tuple[str, ...]) -> list[str]:
    """Modules of neither the standard library, vitserve's light modules nor the allowed packages."""
    out = []
    for name in added:
        top = name.split(".")[0].lstrip("_")
        light = name in ALLOWED_VITSERVE or name.startswith(("vitserve.rpc", "vitserve.connector"))
        if not (light or top in stdlib or name.split(".")[0] in stdlib or top in allowed):
            out.append(name)
    return out


def test_the_connector_imports_in_vllms_env_with_vitserve_alone(tmp_path):
    python = str(vllm_python())
    (tmp_path / "vitserve").symlink_to(Path("vitserve").resolve())  # what pip install --no-deps puts there
    added, stdlib = _added(
        python,
        "vitserve.vllm_connector",
        "import vllm.distributed.ec_transfer.ec_connector.base",
        str(tmp_path),
    )
    assert "vitserve.vllm_connector" in added  # the probe did import it, from the package alone
    assert [m for m in added if m.split(".")[0] in FORBIDDEN] == []
    assert _foreign(added, stdlib, ("torch", "zmq", "msgspec")) == []


def test_the_store_imports_no_heavy_package_in_vitserves_env(tmp_path):
    (tmp_path / "vitserve").symlink_to(Path("vitserve").resolve())
    added, stdlib = _added(sys.executable, "vitserve.connector.store", "", str(tmp_path))
    assert "vitserve.connector.store" in added
    heavy = [m for m in added if m.split(".")[0] in FORBIDDEN and m.split(".")[0] not in ("msgpack", "numpy")]
    assert heavy == []  # msgpack is vitserve's own dependency here; torch may pull numpy in
