"""Transport selection: ``make_transport("tcp" | "rdma" | "auto", ...)``.

``auto`` (the default everywhere, overridable with ``$KVMESH_TRANSPORT``)
uses RDMA verbs when pyverbs imports and at least one device with an active
port is present, and TCP otherwise; the first fallback in a process is logged
once (INFO) with the reason.  ``rdma`` raises :class:`RuntimeError` with the
reason instead of falling back.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from .tcp import MAX_CONNS, TcpTransport
from .transport import Transport

__all__ = ["KINDS", "make_transport", "rdma_unavailable_reason"]

log = logging.getLogger(__name__)

KINDS = ("auto", "tcp", "rdma")
_fallback_logged = False
_probe_lock = threading.Lock()
_probe_result: tuple[bool, str] | None = None


def rdma_unavailable_reason(refresh: bool = False) -> str | None:
    """None when a verbs device is usable, else a human-readable reason.
    The probe (pyverbs import + device list) runs once per process."""
    global _probe_result
    with _probe_lock:
        if _probe_result is None or refresh:
            from .verbs_layer import probe_devices

            try:
                devs = probe_devices()
            except (RuntimeError, ImportError) as e:  # pyverbs missing, unloadable or failing
                _probe_result = (False, str(e) or repr(e))
            except Exception as e:  # a broken optional install must not break "auto": log it
                log.exception("RDMA probe failed unexpectedly")
                _probe_result = (False, str(e) or repr(e))
            else:
                _probe_result = (
                    (True, "")
                    if devs
                    else (False, "no RDMA device found (ibv_get_device_list is empty)")
                )
        ok, why = _probe_result
    return None if ok else why


def make_transport(
    kind: str = "auto",
    *,
    secret: bytes,
    host: str = "127.0.0.1",
    port: int = 0,
    conns_per_peer: int = 4,
    checksum: bool = False,
    connect_timeout: float = 3.0,
    poll_us: int = 200,
    max_conns: int = MAX_CONNS,
    **verbs_options,
) -> Transport:
    """Build a transport.  ``verbs_options`` go to
    :class:`kvmesh.rdma.verbs.VerbsTransport` (``devices``, ``piece_bytes``, ...)
    and are ignored by TCP."""
    global _fallback_logged
    if kind == "auto":
        kind = os.environ.get("KVMESH_TRANSPORT", "auto") or "auto"
    if kind not in KINDS:
        raise ValueError(f"unknown transport kind {kind!r}; expected one of {KINDS}")
    tcp_kw: dict[str, Any] = dict(
        conns_per_peer=conns_per_peer,
        checksum=checksum,
        connect_timeout=connect_timeout,
        max_conns=max_conns,
    )
    if kind == "tcp":
        return TcpTransport(secret, host, port, poll_us=poll_us, **tcp_kw)
    why = None
    if checksum:
        why = "checksum=True needs the TCP transport (RDMA data bypasses the CPU)"
    elif verbs_options.get("layer") is None:
        why = rdma_unavailable_reason()
    if why is not None:
        if kind == "rdma":
            raise RuntimeError(f"RDMA transport unavailable: {why}")
        if not _fallback_logged:
            _fallback_logged = True
            log.info("kvmesh transfer engine: using TCP transport (%s)", why)
        return TcpTransport(secret, host, port, poll_us=poll_us, **tcp_kw)
    from .verbs import VerbsTransport

    return VerbsTransport(secret, host, port, **tcp_kw, **verbs_options)
