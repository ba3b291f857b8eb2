"""What the conductor's front ends need from it, so that they depend on this small module
and not on ``server`` (which builds them and wires them to the ``Conductor``):

- ``observe`` wraps :meth:`ConductorApi.generate` with the request metrics and fills the
  status summary;
- ``http_api`` (the OpenAI-compatible HTTP API) and the gRPC servicer in ``server`` call
  it through ``observe.observed``.

``server.Conductor`` implements :class:`ConductorApi`; a request it refuses raises
:class:`Rejected`.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.common.auth import ApiKeys
from kvmesh.services.common.health import Health
from kvmesh.services.common.metrics import RequestStats
from kvmesh.services.conductor.cluster import ClusterView

# who is calling, for the per-client stream limit: the API key's tenant, or the peer address
client_id: contextvars.ContextVar[str] = contextvars.ContextVar("kvmesh_client", default="")


class Rejected(Exception):
    """A request the conductor refuses or ends: the gRPC status code, the message, and the
    trailing metadata (``retry-after-ms``, ``kvmesh-reject-reason``, ...)."""

    def __init__(
        self, code: grpc.StatusCode, message: str, metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.metadata = code, message, metadata


class SloDefaults(Protocol):
    """The cluster's SLOs; a request may only tighten them."""

    @property
    def ttft_slo_ms(self) -> float: ...

    @property
    def tbt_slo_ms(self) -> float: ...


class ConductorApi(Protocol):
    """The conductor as its front ends see it."""

    @property
    def cfg(self) -> SloDefaults: ...

    @property
    def request_stats(self) -> RequestStats: ...

    @property
    def view(self) -> ClusterView: ...

    @property
    def api_keys(self) -> ApiKeys: ...

    @property
    def health(self) -> Health: ...

    @property
    def input(self) -> Any:
        """The request checks (``request_input.RequestInput``: served names, context)."""
        ...

    def model_info(self, requested: str) -> tuple[str, dict, Any]:
        """(model, a node's registration, tokenizer) of the model ``requested`` names
        (empty: the only one); raises :class:`Rejected`."""
        ...

    def model_label(self, requested: str) -> str:
        """The name a request for model ``requested`` (empty: the only one) is reported
        under: the first --served-model-name, else the model's own."""
        ...

    def generate(self, req: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """The request's life; raises :class:`Rejected`."""
        ...
