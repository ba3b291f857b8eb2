"""The life of a kvmesh service process: start the gRPC server, register in etcd under a
lease, serve, and on SIGINT/SIGTERM shut down once, gracefully:
health NOT_SERVING -> deregister from etcd -> grace period -> drain (transfers, streams)
-> stop server -> free. A second signal during shutdown is logged and ignored.

Every service also gets (here, so the four roles share them):
  * the standard gRPC health service (``grpc.health.v1.Health``; SERVING only once the
    node is registered in etcd and its model is loaded) and server reflection;
  * a Prometheus ``/metrics`` HTTP endpoint on ``--metrics-port`` (0 = any free port;
    advertised in etcd as ``"metrics"``; -1 = off), see ``kvmesh.services.common.metrics``;
  * OpenTelemetry tracing with W3C context over gRPC metadata, on only when an exporter
    is configured (see ``kvmesh.services.common.telemetry``)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import Callable
from typing import Any

import grpc

from kvmesh.services.common import channels, metrics, telemetry
from kvmesh.services.common.etcd import EtcdClient, EtcdError, etcd_credentials
from kvmesh.services.common.health import Health
from kvmesh.services.common.registry import Registration, node_key
from kvmesh.services.common.settings import ServiceConfig

log = logging.getLogger(__name__)


def setup_logging(level: str, role: str) -> None:
    logging.basicConfig(
        level=level.upper(), format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("grpc").setLevel(logging.WARNING)


class Service:
    """Base of the four services. Subclasses set ``role``, add their servicers in
    ``setup()`` and may extend ``node_info()``, ``drain()`` and ``teardown()``."""

    role = "service"

    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.node_id = cfg.default_node_id(self.role)
        channels.configure(cfg)  # TLS / mTLS for every gRPC channel and port of this process
        interceptors = (
            [telemetry.ServerInterceptor()]
            if telemetry.setup_tracing(self.role, self.node_id)
            else []
        )
        interceptors += self.server_interceptors()
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
            ],
            interceptors=interceptors,
        )
        self.health = Health(self.server, self.role)
        self.metrics_address = ""
        self._metrics_server = None
        self.etcd = EtcdClient(
            cfg.etcd_endpoints,
            user=cfg.etcd_user or None,
            password=cfg.etcd_password or None,
            credentials=etcd_credentials(cfg.etcd_ca, cfg.etcd_cert, cfg.etcd_key),
        )
        self.grpc_address = ""
        self.http_address = ""  # set by a service that also serves HTTP (the conductor's API)
        self.registration: Registration | None = None
        self._stop = asyncio.Event()
        self._shutting_down = False

    # -- hooks -----------------------------------------------------------------------
    def server_interceptors(self) -> list:
        """Extra gRPC server interceptors (called from ``__init__`` once ``cfg`` is set),
        e.g. the conductor's API-key check."""
        return []

    async def setup(self) -> None:
        """Adds servicers to ``self.server`` and prepares state (before the port opens)."""

    async def after_start(self) -> None:
        """Runs once the server listens and the node is registered."""

    def node_info(self) -> dict[str, Any]:
        """What peers learn about this node from etcd."""
        info = {"id": self.node_id, "role": self.role, "grpc": self.grpc_address}
        if self.metrics_address:
            info["metrics"] = self.metrics_address
        if self.http_address:
            info["http"] = self.http_address
        return info

    async def drain(self) -> None:
        """Finishes in-flight work after deregistering (transfers, streams)."""

    async def teardown(self) -> None:
        """Frees what ``setup`` took."""

    # -- life --------------------------------------------------------------------------
    async def start(self) -> None:
        await self.setup()
        port = channels.add_server_port(self.server, f"{self.cfg.host}:{self.cfg.port}")
        if port == 0:
            raise RuntimeError(f"cannot bind gRPC port {self.cfg.host}:{self.cfg.port}")
        self.grpc_address = f"{self.cfg.host}:{port}"
        self._start_metrics()
        await self.server.start()
        key = node_key(self.cfg.cluster, self.role, self.node_id)
        self.registration = Registration(self.etcd, key, self._info_bytes(), ttl=self.cfg.lease_ttl)
        await self.registration.start()
        await self.after_start()
        await self.health.set_serving(True)
        log.info(
            "%s %s serving on %s%s",
            self.role,
            self.node_id,
            self.grpc_address,
            f" (metrics on http://{self.metrics_address}/metrics)" if self.metrics_address else "",
        )

    def _start_metrics(self) -> None:
        if self.cfg.metrics_port < 0:
            return
        try:
            self._metrics_server, port = metrics.start_metrics_server(
                self.cfg.host, self.cfg.metrics_port
            )
        except OSError as e:
            raise RuntimeError(
                f"cannot bind the metrics port {self.cfg.host}:{self.cfg.metrics_port}: {e}"
            ) from None
        self.metrics_address = f"{self.cfg.host}:{port}"
        metrics.track(self)

    def _info_bytes(self) -> bytes:
        return json.dumps(self.node_info(), sort_keys=True).encode()

    async def update_registration(self) -> None:
        if self.registration is not None:
            await self.registration.update(self._info_bytes())

    def request_stop(self) -> None:
        if self._stop.is_set():
            log.warning("%s already shutting down; ignoring the repeated signal", self.role)
            return
        self._stop.set()

    async def shutdown(self) -> None:
        if self._shutting_down:
            return
        self._shutting_down = True
        log.info("%s %s shutting down", self.role, self.node_id)
        # The shutdown sequence must run to its end whatever one step raises: each broad
        # catch below logs the step's failure with its traceback and goes on.
        try:
            await self.health.set_serving(False)
        except Exception:
            log.exception("setting health NOT_SERVING failed")
        if self.registration is not None:
            try:
                async with asyncio.timeout(3):
                    await self.registration.stop()
            except (TimeoutError, EtcdError) as e:  # etcd is gone: the lease expires itself
                log.warning("deregistering failed (%s); the lease will expire", e)
        await asyncio.sleep(self.cfg.grace_s)
        try:
            async with asyncio.timeout(30):
                await self.drain()
        except TimeoutError:
            log.warning("drain did not finish in 30 s")
        except Exception:  # a subclass's drain() may raise anything
            log.exception("drain did not finish cleanly")
        await self.health.shutdown()
        await self.server.stop(grace=2)
        await self.teardown()
        await self.etcd.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        telemetry.shutdown_tracing()

    async def run_forever(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)
        await self.start()
        await self._stop.wait()
        await self.shutdown()


def run(factory: Callable[[], Service]) -> None:
    """The one place a service enters asyncio (on uvloop); the service is built inside
    the loop so its gRPC server and events bind to it."""
    import uvloop

    async def main() -> None:
        await factory().run_forever()

    uvloop.run(main())
