"""The `vitserve` entry point (placeholder until the HTTP front door lands)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("vitserve: the HTTP server is not built yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
