"""The cache index's block table. Compiled (setup.py), ``index.py`` keeps, beside its
dicts, a mirror of them in C (``_blocktable.h``): one open-addressing table keyed by the
block hash whose slot holds a block's pool holder and its store and SSD replica counts,
so that a lookup costs one cache miss per block instead of two dict probes in each of
two dicts. Plain Python has no table: ``new_table`` answers None and the index's dicts
answer every lookup (the same answers).

Each write answers 1 once the table is broken (a key that is not bytes, out of memory):
the index then drops the table, which frees it, and logs a warning."""

from __future__ import annotations

from typing import Any


def new_table() -> Any:
    """No table, in plain Python (see the module's docstring)."""
    return None


def set_holder(t: Any, key: bytes, holder: Any) -> int:  # pragma: no cover - compiled only
    return 0


def set_store(t: Any, key: bytes, store: int, ssd: int) -> int:  # pragma: no cover
    return 0


def clear_store(t: Any) -> int:  # pragma: no cover - compiled only
    return 0


def lookup(t: Any, keys: list[bytes], per_node: dict[str, int]) -> Any:  # pragma: no cover
    return None
