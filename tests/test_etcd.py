"""EtcdClient / Registration / Membership against a real etcd process."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest

from kvmesh.protos.etcd import auth_pb2, rpc_pb2, rpc_pb2_grpc
from kvmesh.services.common.etcd import EtcdClient, EtcdError, EtcdUnavailable, WatchEvent
from kvmesh.services.common.registry import Membership, Registration, node_key, nodes_prefix

try:
    from tests.etcd_server import etcd_server, free_port
except ImportError:  # tests/ not importable as a package (plain `pytest` run)
    from etcd_server import etcd_server, free_port

pytestmark = pytest.mark.timeout(60)
TTL = 2


@pytest.fixture(scope="module")
def shared_etcd():
    with etcd_server() as srv:
        yield srv


@pytest.fixture
def own_etcd():
    """A private etcd for tests that restart it."""
    with etcd_server() as srv:
        yield srv


@pytest.fixture
async def client(shared_etcd):
    c = EtcdClient([shared_etcd.endpoint], timeout=2.0)
    await c.connect()
    yield c
    await c.close()


@pytest.fixture
def cluster() -> str:
    return f"t-{uuid.uuid4().hex[:8]}"


async def eventually(check, timeout: float = 5.0, interval: float = 0.05):
    """Poll async ``check()`` until truthy; return its value or fail."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = await check()
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


class Recorder:
    """Membership listener that records (event, key, value) calls."""

    def __init__(self):
        self.calls: list[tuple[str, str, bytes | None]] = []

    def __call__(self, event, key, value):
        self.calls.append((event, key, value))


def test_node_keys():
    assert node_key("c1", "prefill", "p0") == "/kvmesh/c1/nodes/prefill/p0"
    assert nodes_prefix("c1") == "/kvmesh/c1/nodes/"
    assert node_key("c1", "prefill", "p0").startswith(nodes_prefix("c1"))


async def test_kv_roundtrip(client, cluster):
    p = f"/{cluster}/"
    r1 = await client.put(p + "a", b"1")
    r2 = await client.put(p + "b", "2")
    await client.put(f"/{cluster}0", b"outside")  # shares the string prefix minus the slash
    assert r2 > r1 > 0
    assert await client.get(p + "a") == b"1"
    assert await client.get(p + "missing") is None
    items, rev = await client.get_prefix(p)
    assert items == [(p + "a", b"1"), (p + "b", b"2")] and rev >= r2
    assert await client.delete(p + "a") == 1
    assert await client.get(p + "a") is None
    await client.put(p + "c", b"3")
    assert await client.delete_prefix(p) == 2
    assert (await client.get_prefix(p))[0] == []
    assert await client.get(f"/{cluster}0") == b"outside"


async def test_lease_expiry_removes_key(client, cluster):
    lease = await client.lease_grant(TTL)
    await client.put(f"/{cluster}/leased", b"v", lease=lease)
    assert 0 < await client.lease_ttl(lease) <= TTL
    await eventually(lambda: _is_none(client.get(f"/{cluster}/leased")), timeout=TTL + 3)
    assert await client.lease_ttl(lease) == -1
    # revoke deletes immediately; revoking again reports not-found
    lease2 = await client.lease_grant(30)
    await client.put(f"/{cluster}/leased2", b"v", lease=lease2)
    assert await client.lease_revoke(lease2) is True
    assert await client.get(f"/{cluster}/leased2") is None
    assert await client.lease_revoke(lease2) is False


async def _is_none(coro):
    return (await coro) is None


async def test_errors_are_wrapped(client):
    dead = EtcdClient(f"127.0.0.1:{free_port()}", timeout=0.3)
    with pytest.raises(EtcdUnavailable):
        await dead.get("/x")
    await dead.close()
    with pytest.raises(EtcdError) as exc:
        await client.put("/k", b"v", lease=12345)  # no such lease
    assert not isinstance(exc.value, EtcdUnavailable)
    assert exc.value.code == grpc.StatusCode.NOT_FOUND


async def test_endpoint_failover(shared_etcd):
    c = EtcdClient(f"http://127.0.0.1:{free_port()},{shared_etcd.endpoint}", timeout=0.3)
    with pytest.raises(EtcdUnavailable):
        await c.get("/failover")  # the dead endpoint fails; later calls use the next one
    await c.put("/failover", b"ok")
    assert await c.get("/failover") == b"ok"
    await c.close()


async def test_registration_and_membership(client, cluster):
    members = Membership(client, nodes_prefix(cluster))
    rec = Recorder()
    members.add_listener(rec)
    early = Registration(client, node_key(cluster, "prefill", "p0"), b"early", ttl=TTL)
    await early.start()  # present before the listing
    await members.start()
    assert members.nodes == {early.key: b"early"}

    reg = Registration(client, node_key(cluster, "decode", "d0"), b"v1", ttl=TTL)
    await reg.start()
    assert reg.registered
    assert await members.wait_for(lambda n: reg.key in n, timeout=2)
    await asyncio.sleep(TTL + 1)  # outlive the TTL: keepalive must hold both keys
    assert await client.get(reg.key) == b"v1" and await client.get(early.key) == b"early"
    assert await client.lease_ttl(reg.lease_id) > 0

    await reg.update(b"v2")
    assert await members.wait_for(lambda n: n.get(reg.key) == b"v2", timeout=2)
    await reg.stop()  # revoke -> immediate leave
    assert not reg.registered
    assert await members.wait_for(lambda n: reg.key not in n, timeout=2)
    assert await client.get(reg.key) is None

    # A crashed node (keepalive task cancelled, lease never revoked) leaves after its TTL.
    early._task.cancel()
    assert await members.wait_for(lambda n: not n, timeout=TTL + 3)
    assert [c[0] for c in rec.calls] == ["join", "join", "update", "leave", "leave"]
    assert rec.calls[0] == ("join", early.key, b"early") and rec.calls[-1] == (
        "leave",
        early.key,
        None,
    )
    await members.stop()
    await early.stop()


async def test_registration_recovers_lost_lease(client, cluster):
    """If the lease disappears (expired while unreachable, or revoked), the key is re-registered."""
    reg = Registration(client, node_key(cluster, "engine", "e0"), b"v", ttl=TTL)
    await reg.start()
    old = reg.lease_id
    await client.lease_revoke(old)
    assert await client.get(reg.key) is None
    await eventually(lambda: _async(reg.registered and reg.lease_id != old), timeout=TTL)
    assert await client.get(reg.key) == b"v"
    assert await client.lease_ttl(reg.lease_id) > 0
    await reg.stop()
    assert await client.get(reg.key) is None


async def test_watch_compacted_yields_reset(client, cluster):
    p = f"/{cluster}/"
    first = await client.put(p + "a", b"1")
    last = await client.put(p + "a", b"2")
    await client.compact(last)
    events = [ev async for ev in client.watch_prefix(p, first)]
    assert events == [WatchEvent("reset", p, b"", last)]


async def test_watch_resumes_across_restart_without_loss_or_replay(own_etcd):
    c = EtcdClient(own_etcd.endpoint, timeout=2.0)
    w = EtcdClient(own_etcd.endpoint, timeout=2.0)
    start = await c.put("/other", b"x")
    got: list[WatchEvent] = []

    async def consume():
        async for ev in w.watch_prefix("/w/", start):
            got.append(ev)

    task = asyncio.create_task(consume())
    expected = [("put", "/w/a", b"1"), ("put", "/w/b", b"2")]
    await c.put("/w/a", b"1")
    await c.put("/w/b", b"2")
    await eventually(lambda: _async(len(got) == 2))
    await asyncio.to_thread(own_etcd.restart, 0.5)
    # Written while the watcher is still reconnecting: must be delivered, once.
    await c.put("/w/c", b"3")
    await c.delete("/w/a")
    await c.put("/w/b", b"22")
    expected += [("put", "/w/c", b"3"), ("delete", "/w/a", b""), ("put", "/w/b", b"22")]
    await eventually(lambda: _async(len(got) >= 5))
    await asyncio.sleep(0.3)  # would expose duplicates
    assert [(e.type, e.key, e.value) for e in got] == expected
    revs = [e.mod_revision for e in got]
    assert revs == sorted(set(revs))
    task.cancel()
    await c.close()
    await w.close()


async def _async(value):
    return value


async def test_registry_survives_etcd_restart(own_etcd):
    """etcd down longer than the TTL: the key is held again afterwards, and watching resumes.

    (etcd refreshes persisted leases on restart, so here the old lease usually survives;
    the lease-actually-expired path is covered by the partition and revoke tests.)
    """
    c = EtcdClient(own_etcd.endpoint, timeout=1.0)
    members = Membership(c, nodes_prefix("r"))
    await members.start()
    reg = Registration(c, node_key("r", "prefill", "p0"), b"p0", ttl=TTL)
    await reg.start()
    assert await members.wait_for(lambda n: reg.key in n, timeout=2)

    await asyncio.to_thread(own_etcd.restart, TTL + 1.0)

    late_client = EtcdClient(own_etcd.endpoint, timeout=1.0)
    late = Registration(late_client, node_key("r", "decode", "d0"), b"d0", ttl=TTL)
    await late.start()
    assert await members.wait_for(lambda n: late.key in n, timeout=3)
    await asyncio.sleep(TTL + 0.5)  # reg's keepalive must have resumed (or re-registered)
    assert await c.get(reg.key) == b"p0" and reg.registered
    assert await c.lease_ttl(reg.lease_id) > 0
    assert set(members.nodes) == {reg.key, late.key}

    await late.stop()
    assert await members.wait_for(lambda n: late.key not in n, timeout=2)
    await reg.stop()
    await members.stop()
    await c.close()
    await late_client.close()


async def test_registration_stop_tolerates_etcd_down():
    with etcd_server() as srv:
        c = EtcdClient(srv.endpoint, timeout=0.5)
        reg = Registration(c, "/x/node", b"v", ttl=TTL)
        await reg.start()
        await asyncio.to_thread(srv.stop)
        await asyncio.wait_for(reg.stop(), 3)  # must not raise or hang
        assert not reg.registered
        await c.close()


async def test_password_auth():
    with etcd_server() as srv:
        ch = grpc.aio.insecure_channel(srv.endpoint)
        auth = rpc_pb2_grpc.AuthStub(ch)
        await auth.RoleAdd(rpc_pb2.AuthRoleAddRequest(name="root"))
        await auth.UserAdd(
            rpc_pb2.AuthUserAddRequest(
                name="root", password="s3cret", options=auth_pb2.UserAddOptions()
            )
        )
        await auth.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user="root", role="root"))
        await auth.AuthEnable(rpc_pb2.AuthEnableRequest())
        await ch.close()

        good = EtcdClient(srv.endpoint, user="root", password="s3cret")
        await good.put("/secure", b"ok")
        assert await good.get("/secure") == b"ok"
        good._token = "bogus"  # rejected token -> transparent re-authentication
        assert await good.get("/secure") == b"ok"
        await good.close()

        anon = EtcdClient(srv.endpoint)
        with pytest.raises(EtcdError):
            await anon.get("/secure")
        await anon.close()
        bad = EtcdClient(srv.endpoint, user="root", password="wrong")
        with pytest.raises(EtcdError):
            await bad.connect()
        await bad.close()


class TcpProxy:
    """Loopback TCP proxy to etcd whose link can be cut (partition) and restored."""

    def __init__(self, target_port: int):
        self.target_port, self.port = target_port, free_port()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._handle, "127.0.0.1", self.port, reuse_address=True
        )

    async def cut(self) -> None:
        self._server.close()
        for w in list(self._writers):
            w.transport.abort()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()

    async def _handle(self, reader, writer):
        task = asyncio.current_task()
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}

        async def pipe(r, w):
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                w.transport.abort()
                self._writers.discard(w)

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def test_registration_reregisters_after_partition_longer_than_ttl(
    shared_etcd, client, cluster
):
    """Client cut off from etcd for longer than the TTL: the lease expires, and once the
    link is back the key is registered again under a new lease (and members see it return)."""
    proxy = TcpProxy(shared_etcd.client_port)
    await proxy.start()
    cut_off = EtcdClient(f"127.0.0.1:{proxy.port}", timeout=0.5)
    reg = Registration(cut_off, node_key(cluster, "prefill", "p1"), b"p1", ttl=TTL)
    await reg.start()
    old_lease = reg.lease_id
    members = Membership(client, nodes_prefix(cluster))
    rec = Recorder()
    members.add_listener(rec)
    await members.start()

    await proxy.cut()
    assert await members.wait_for(lambda n: reg.key not in n, timeout=TTL + 3)  # expired
    await proxy.start()
    assert await members.wait_for(lambda n: reg.key in n, timeout=3)
    await eventually(lambda: _async(reg.registered), timeout=1)
    assert reg.lease_id != old_lease
    assert rec.calls == [
        ("join", reg.key, b"p1"),
        ("leave", reg.key, None),
        ("join", reg.key, b"p1"),
    ]
    await reg.stop()
    await members.stop()
    await cut_off.close()
    await proxy.cut()


def test_etcd_starts_on_other_ports_when_its_guess_is_taken(tmp_path, monkeypatch):
    """etcd cannot bind port 0, so the launcher guesses its ports. When the client port it
    guessed is taken meanwhile -- here by an HTTP server that even answers /health -- the
    launcher does not mistake that server for its etcd: it starts etcd on other ports."""
    import http.server
    import threading
    import urllib.request

    from kvmesh.services.launcher import local_etcd

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"health":"true"}')

        def log_message(self, *args):
            pass

    squatter = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    taken = squatter.server_address[1]
    guesses = iter([taken])
    real_guess = local_etcd._unused_port
    monkeypatch.setattr(local_etcd, "_unused_port", lambda: next(guesses, None) or real_guess())
    etcd = local_etcd.Etcd(str(tmp_path / "etcd"))
    try:
        assert etcd.client_port == taken
        etcd.start()
        assert etcd.client_port != taken
        assert taken not in (local_etcd.listening_ports(etcd.proc.pid) or {taken})
        with urllib.request.urlopen(f"http://{etcd.endpoint}/version", timeout=5) as r:
            assert b"etcdserver" in r.read()  # the real etcd answers there
        etcd.restart()  # a restart keeps the ports it settled on
        assert etcd.client_port != taken and etcd.endpoint.endswith(str(etcd.client_port))
    finally:
        etcd.stop()
        squatter.shutdown()
        squatter.server_close()


def test_keepalive_read_that_completes_as_the_task_is_cancelled_still_cancels():
    """Python 3.11's ``asyncio.wait_for`` returns the result when a cancellation lands
    in the same loop turn as the awaited read completing, so a Registration's
    keepalive task, cancelled by ``stop()``, ran on forever and ``stop()`` never
    returned (CI hung on it). The read's deadline must not eat the cancellation."""
    from kvmesh.services.common.etcd import LeaseKeepAliveStream

    class Call:
        def __init__(self):
            self.read_fut = None

        async def write(self, req):
            pass

        def read(self):
            self.read_fut = asyncio.get_running_loop().create_future()
            return self.read_fut

    async def main():
        call = Call()
        stream = LeaseKeepAliveStream(EtcdClient("127.0.0.1:1", timeout=5), call, None)
        task = asyncio.create_task(stream.keepalive(1))
        while call.read_fut is None:
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        call.read_fut.set_result(rpc_pb2.LeaseKeepAliveResponse(ID=1, TTL=5))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
