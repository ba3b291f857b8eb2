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
    is configured (see ``kvmesh.services.common.telemetry``);
  * under mutual TLS, the per-RPC role check of callers' certificates
    (``kvmesh.services.common.roles``)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from kvmesh.services.common import channels, metrics, telemetry
from kvmesh.services.common.cpu_budget import CpuBudgetError
from kvmesh.services.common.election import LeaderElection
from kvmesh.services.common.etcd import EtcdClient, EtcdError, etcd_credentials
from kvmesh.services.common.health import Health
from kvmesh.services.common.registry import Registration, node_key
from kvmesh.services.common.roles import RoleInterceptor, check_own_role
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
        if channels.current().mutual:  # every caller shows a certificate: check its role
            interceptors.append(RoleInterceptor())
            if warning := check_own_role(channels.current().cert, self.role):
                log.warning("%s", warning)
        interceptors += self.server_interceptors()
        self.server = channels.make_server(interceptors)  # refuses a port in use
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
        self.registration: Registration | LeaderElection | None = None
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

    async def register(self) -> None:
        """Makes the node known in etcd once its server listens: a lease-backed
        ``Registration`` of its node key (the store-master campaigns for leadership
        instead)."""
        key = node_key(self.cfg.cluster, self.role, self.node_id)
        self.registration = Registration(self.etcd, key, self._info_bytes(), ttl=self.cfg.lease_ttl)
        await self.registration.start()

    async def drain(self) -> None:
        """Finishes in-flight work after deregistering (transfers, streams)."""

    async def teardown(self) -> None:
        """Frees what ``setup`` took."""

    # -- life --------------------------------------------------------------------------
    async def start(self) -> None:
        # the port first: a port in use fails the start before a model loads
        port = channels.add_server_port(self.server, f"{self.cfg.host}:{self.cfg.port}")
        self.grpc_address = self.cfg.advertise(f"{self.cfg.host}:{port}")
        await self.setup()
        self._start_metrics()
        await self.server.start()
        await self.register()
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
        except OSError:
            raise channels.bind_error(
                f"{self.cfg.host}:{self.cfg.metrics_port}", "/metrics", "--metrics-port"
            ) from None
        self.metrics_address = self.cfg.advertise(f"{self.cfg.host}:{port}")
        metrics.track(self)

    def _info_bytes(self) -> bytes:
        return json.dumps(self.node_info(), sort_keys=True).encode()

    async def update_registration(self) -> None:
        if self.registration is not None:
            await self.registration.update(self._info_bytes())

    def request_stop(self) -> None:
        launcher = os.environ.get("KVMESH_LAUNCHER_PID", "")
        if launcher.isdigit() and os.getppid() != int(launcher):
            # the parent-death signal of a local cluster's launcher: etcd and the other
            # services go with it, there is no one to deregister from or drain for; the
            # kernel frees the ports at once (a first signal may come while the dying
            # launcher's last threads still hold this process, then one more comes)
            log.warning("%s %s: the launcher is gone; exiting now", self.role, self.node_id)
            logging.shutdown()
            os._exit(0)
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
        try:
            await self.start()
        except channels.PortInUse:
            await self._abort_start()
            raise
        await self._stop.wait()
        await self.shutdown()

    async def _abort_start(self) -> None:
        """Frees what a start that failed had taken (best effort: the process exits)."""
        for step in (lambda: self.server.stop(None), self.teardown, self.etcd.close):
            try:
                async with asyncio.timeout(5):
                    await step()
            except Exception as e:  # a half-done setup may lack what teardown frees
                log.debug("cleanup after the failed start: %r", e)
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()


def run(factory: Callable[[], Service]) -> None:
    """The one place a service enters asyncio (on uvloop); the service is built inside
    the loop so its gRPC server and events bind to it. A port that cannot be bound ends
    the process with exit status 1 and a message naming the port, not a traceback."""
    import uvloop

    async def main() -> None:
        await factory().run_forever()

    try:
        uvloop.run(main())
    except (channels.PortInUse, CpuBudgetError) as e:
        sys.exit(f"error: {e}")
