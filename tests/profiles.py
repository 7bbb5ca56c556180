"""Hypothesis profiles: `quick` for the default run, `slow` for a thorough one.

    python -m pytest --hypothesis-profile slow    # every property at its thorough example count

A property states its thorough count as `@settings(max_examples=examples(N))`; the quick profile runs a
tenth of it (at least 10). tests/conftest.py registers both and loads `quick`; pytest's
--hypothesis-profile option, read after it, switches. In CI (CI set) `quick` is derandomized: the same examples
on every run, so a run's verdict does not depend on its seed; locally and under `slow` each run draws anew.
"""

from __future__ import annotations

import os

from hypothesis import settings

QUICK_SHARE = 10  # the quick profile runs 1/QUICK_SHARE of each property's thorough examples
QUICK_FLOOR = 10
THOROUGH = 1000  # max_examples of a property that names no count, under `slow`

settings.register_profile(
    "quick", max_examples=THOROUGH // QUICK_SHARE, deadline=None, derandomize=bool(os.environ.get("CI"))
)
settings.register_profile("slow", max_examples=THOROUGH, deadline=None)


def examples(thorough: int) -> int:
    """The example count under the loaded profile for a property that wants `thorough` examples under `slow`."""
    if settings.default.max_examples >= THOROUGH:
        return thorough
    return max(QUICK_FLOOR, thorough // QUICK_SHARE)
