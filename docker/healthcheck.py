"""The containers' HEALTHCHECK: exit 0 when vitserve's /ready answers 200, else 1.

/ready (not /health) because only /ready says the encoder ranks have passed a real encode: /health is
200 from the moment the HTTP server listens. Standard library only. The port is VITSERVE_PORT (default
8100) and, when the service requires a key, VITSERVE_API_KEY is sent as a bearer token: set the port
and the key through those variables (not --port/--api_key) so this check follows them.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    port = os.environ.get("VITSERVE_PORT", "8100")
    request = urllib.request.Request(f"http://127.0.0.1:{port}/ready")
    key = os.environ.get("VITSERVE_API_KEY")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=3) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:  # HTTPError (503 while starting) is a URLError
        print(f"not ready: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
