"""Builds the conductor's compiled core: the scheduler's modules compiled by Cython in
"pure Python mode" (each ``.py`` stays plain Python; a ``.pxd`` beside it types its hot
state and functions). Everything else is in pyproject.toml.

The extensions are optional: without Cython or a C compiler (or with
``KVMESH_PURE_PYTHON=1`` set at build time) the same modules run as plain Python, with
the same decisions, only slower. ``pip install -e .`` builds them in place
(``services/conductor/*.so``); ``services/conductor/__init__.py`` falls back to the
``.py`` of every module when a ``.so`` is missing or was built from other sources
(``_compiled.json``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# the scheduler's hot path (bench_conductor); each has a .pxd beside it
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


def _extensions() -> list[Extension]:
    if os.environ.get("KVMESH_PURE_PYTHON") == "1":
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:  # no Cython: plain Python modules
        return []
    # the .pxd files under their installed names (the repository keeps services/ at its
    # top), so that one module cimports another's types: kvmesh.services.conductor.*
    root = Path(__file__).resolve().parent
    inc = root / "build" / "cython_include"
    pkg = inc / "kvmesh" / "services" / "conductor"
    pkg.mkdir(parents=True, exist_ok=True)
    for d in (inc / "kvmesh", inc / "kvmesh" / "services", pkg):
        (d / "__init__.pxd").touch()
    for m in (*COMPILED, "_sorted", "_prefetch", "_blocktable"):  # (cimported only, not compiled)
        src, dst = root / "services" / "conductor" / f"{m}.pxd", pkg / f"{m}.pxd"
        if not dst.exists() or dst.read_bytes() != src.read_bytes():  # (else: no rebuild)
            shutil.copyfile(src, dst)
    exts = [
        Extension(
            f"kvmesh.services.conductor.{m}",
            [f"services/conductor/{m}.py"],
            include_dirs=["services/conductor"],  # _prefetch.h, _blocktable.h
            # float results must equal Python's bit for bit: no fused multiply-add
            extra_compile_args=["-O2", "-ffp-contract=off"],
        )
        for m in COMPILED
    ]
    try:
        return cythonize(
            exts,
            # types come from the .pxd files alone, not from the annotations of the .py
            compiler_directives={"language_level": 3, "binding": False, "annotation_typing": False},
            include_path=[str(inc)],
            quiet=True,
        )
    except Exception as e:  # a Cython error: the plain Python modules, said so
        print(f"kvmesh: not compiling the conductor's scheduler ({e!r}); plain Python")
        return []


# what the compiled modules are built from: their .py and .pxd, and the typed helpers
# they cimport. The build stamps the sha256 of each beside the modules (_compiled.json),
# which services/conductor/__init__.py checks at import, so that a source changed since
# the build is never shadowed by a stale .so, whatever the files' times (a wheel install
# writes a .py after its .so)
SOURCES = (
    *(f"{m}{ext}" for m in COMPILED for ext in (".py", ".pxd")),
    "_sorted.py",
    "_sorted.pxd",
    "_prefetch.py",
    "_prefetch.pxd",
    "_prefetch.h",
    "_blocktable.py",
    "_blocktable.pxd",
    "_blocktable.h",
)
STAMP = "_compiled.json"


class _OptionalBuildExt(build_ext):
    """All or none: if a module does not compile (no C compiler, an error), none is
    installed, said so, and services/conductor/__init__.py uses the plain Python ones.
    When all compile, ``_compiled.json`` goes beside them: the sha256 of each source."""

    def run(self) -> None:
        super().run()
        if not self.extensions:
            return
        src = Path(__file__).resolve().parent / "services" / "conductor"
        stamp = {
            "modules": [e.name.rsplit(".", 1)[1] for e in self.extensions],
            "sha256": {
                f: hashlib.sha256((src / f).read_bytes()).hexdigest()
                for f in SOURCES
                if (src / f).exists()
            },
        }
        text = json.dumps(stamp, indent=1, sort_keys=True) + "\n"
        # beside the built modules (the build dir a wheel is made of) and, for an
        # in-place (editable) build, beside the copies in the source tree
        outs = {Path(self.get_ext_fullpath(self.extensions[0].name)).parent}
        if self.inplace:
            outs.add(src)
        for out in outs:
            out.mkdir(parents=True, exist_ok=True)
            (out / STAMP).write_text(text)

    def build_extensions(self) -> None:
        self.check_extensions_list(self.extensions)
        for ext in self.extensions:
            try:
                self.build_extension(ext)
            except Exception as e:
                print(f"kvmesh: {ext.name} not compiled ({e}); plain Python modules instead")
                self.extensions = []  # (nothing is copied or installed)
                return


setup(ext_modules=_extensions(), cmdclass={"build_ext": _OptionalBuildExt})
