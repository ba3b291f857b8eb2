"""Prefetch hints for the cache index's lookups. Compiled (setup.py), ``index.py``
calls the C function in ``_prefetch.h`` instead, which asks the CPU for the dict slots
and entries of all of a request's block hashes at once, so that their cache misses
overlap (it never changes a result). Plain Python has no such hint: this does nothing."""

from __future__ import annotations

from typing import Any


def prefetch(d: dict[Any, Any], keys: list[Any]) -> int:
    """Nothing, in plain Python (see the module's docstring)."""
    return 0
