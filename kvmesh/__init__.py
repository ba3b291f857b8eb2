"""kvmesh: a KVCache-centric, prefill/decode-disaggregated LLM serving cluster.

Everything installs under this one namespace. The repository keeps its agreed layout
(``services/``, ``rdma/``, ``protos/``, ``loadtest/`` at the top); ``pyproject.toml``
maps them to ``kvmesh.services``, ``kvmesh.rdma``, ``kvmesh.protos`` and
``kvmesh.loadtest`` with setuptools' ``package-dir``, for wheels and editable installs
alike. See ``docs/architecture.md``.
"""

__version__ = "0.1.0"
