"""The store client's argument rules and size thresholds, shared by its put and get
paths (one place, so a test or a deployment changes each in one place)."""

from __future__ import annotations

from collections.abc import Sequence

MAX_KEY_LEN = 256
# a put of many values copies them into the staging region and sends each run of this
# many bytes while it copies the next (the copy and the wire overlap); gets read in runs
# of this many bytes per holder and copy one run out while the next is on the wire
PIPELINE_BYTES = 4 << 20
# a remote value this large is read by ``get`` straight into the bytes it returns (on the
# TCP transport, where registering a buffer is a table entry; RDMA verbs would pin it)
DIRECT_GET_MIN = 256 << 10
# a located replica: (key index, data address, region id, node id, offset, size)
Loc = tuple[int, str, int, str, int, int]


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    """``keys`` as a list of ``bytes``; ValueError for a key not 1..MAX_KEY_LEN long."""
    out = [k if type(k) is bytes else bytes(k) for k in keys]
    for k in out:
        if not 1 <= len(k) <= MAX_KEY_LEN:
            raise ValueError(f"store keys must be 1..{MAX_KEY_LEN} bytes, got {len(k)}")
    return out


def bytes_view(v) -> memoryview:
    """A flat byte view of a value (bytes, bytearray, memoryview or an array)."""
    mv = memoryview(v)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
