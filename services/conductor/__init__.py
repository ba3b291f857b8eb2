"""The conductor. Its scheduler's modules (``COMPILED``) may be compiled by setup.py
(Cython, from the same ``.py`` files, typed by the ``.pxd`` beside each). They are used
only all together and only when current: where any ``.so`` is older than its ``.py`` or
``.pxd`` (the source changed since the last ``pip install -e .``), or with
``KVMESH_PURE_PYTHON=1`` in the environment, every one of them is imported from its
``.py`` instead (same decisions, slower)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import warnings
from pathlib import Path

COMPILED = ("rolling", "estimator", "index", "queue_order", "policy")
_HERE = Path(__file__).parent


def _compiled_current() -> bool | None:
    """True if every compiled module is there and current; None if none is there (plain
    Python, nothing to say); False if some are missing or stale."""
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    seen = current = 0
    for m in COMPILED:
        so = next((p for s in suffixes if (p := _HERE / f"{m}{s}").exists()), None)
        if so is None:
            continue
        seen += 1
        built = so.stat().st_mtime
        sources = (_HERE / f"{m}.py", _HERE / f"{m}.pxd")
        current += all(not p.exists() or p.stat().st_mtime <= built for p in sources)
    if not seen:
        return None
    return seen == current == len(COMPILED)


class _PurePython:
    """Imports the compiled modules from their ``.py`` (a meta path finder)."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> object:
        prefix, _, m = name.rpartition(".")
        if prefix != __name__ or m not in COMPILED:
            return None
        return importlib.util.spec_from_file_location(name, _HERE / f"{m}.py")


def _choose() -> None:
    if os.environ.get("KVMESH_PURE_PYTHON") == "1":
        sys.meta_path.insert(0, _PurePython())  # type: ignore[arg-type]
        return
    state = _compiled_current()
    if state is False:
        warnings.warn(
            "kvmesh: the conductor's compiled scheduler is older than its source (or "
            "incomplete); using the plain Python modules. Rebuild: pip install -e .",
            RuntimeWarning,
            stacklevel=2,
        )
        sys.meta_path.insert(0, _PurePython())  # type: ignore[arg-type]


_choose()
