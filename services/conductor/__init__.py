"""The conductor. Its scheduler's modules (``COMPILED``) may be compiled by setup.py
(Cython, from the same ``.py`` files, typed by the ``.pxd`` beside each). They are used
only all together and only when current: where any ``.so`` is missing or a ``.py`` or
``.pxd`` differs from the one it was built from (``_compiled.json``: the source changed
since the last ``pip install -e .``), or with
``KVMESH_PURE_PYTHON=1`` in the environment, every one of them is imported from its
``.py`` instead (same decisions, slower)."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

COMPILED = (
    "rolling",
    "normal_fit",
    "estimator",
    "index",
    "queue_order",
    "nodes",
    "candidates",
    "policy",
)
_HERE = Path(__file__).parent


def _compiled_current() -> bool | None:
    """True if every compiled module is there and was built from the sources beside it
    (``_compiled.json``, written by setup.py: the sha256 of each source file; a file not
    installed, such as a ``.pxd`` in a wheel, is not compared); None if none is there
    (plain Python, nothing to say); False if some are missing or a source changed."""
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    seen = sum(any((_HERE / f"{m}{s}").exists() for s in suffixes) for m in COMPILED)
    if not seen:
        return None
    if seen != len(COMPILED):
        return False
    try:
        stamp = json.loads((_HERE / "_compiled.json").read_text())
        sums = dict(stamp["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return False  # built before the stamp, or by hand: cannot tell
    if any(f"{m}.py" not in sums for m in COMPILED):
        return False
    for name, digest in sums.items():
        try:
            data = (_HERE / name).read_bytes()
        except FileNotFoundError:
            continue
        if hashlib.sha256(data).hexdigest() != digest:
            return False
    return True


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
            "kvmesh: the conductor's compiled scheduler was built from other sources (or "
            "incomplete); using the plain Python modules. Rebuild: pip install -e .",
            RuntimeWarning,
            stacklevel=2,
        )
        sys.meta_path.insert(0, _PurePython())  # type: ignore[arg-type]


_choose()
