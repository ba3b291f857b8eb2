"""The store-master's raw-TCP control path: framing and compact codecs of the hot calls.

gRPC (``StoreMaster`` in protos/kvmesh.proto) stays the reference API; this path serves
the same metadata object, for clients that found its address in ``StoreHello``. It
exists because a grpc.aio unary call costs ~0.3-0.5 ms of Python on each side, more
than a whole 4 KiB local get should take.

Frames (little-endian)::

    request:  u32 body_len | u32 req_id | u8 method | body
    response: u32 body_len | u32 req_id | u8 status | body   (status 0 = ok, else a
              grpc.StatusCode value and body = the error text in UTF-8)

Methods with a compact body (the hot ones): GET (GetReplicas), EXISTS, PUT_LOCAL, REMOVE,
PUT_START and PUT_END (a remote put: place, write over the transfer engine, commit), and
PUT_RESERVE / PUT_SLOTS / PUT_RELEASE (a remote writer's pool of reserved slots: a small
put is one transfer-engine write into a slot it holds, then one commit that also refills
the pool; slots it will not write are given back; these have no gRPC twin: without the fast path a client puts with PutStart/PutEnd).
Others carry the serialized protobuf request/response of the gRPC method (PB_BASE + i).
Keys: u32 count | u16 key length (0 = each key is u16 length + bytes) | keys.
Strings: u8 length + UTF-8.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Protocol

from kvmesh.services.store_master.validation import MAX_HASHES

HEAD = struct.Struct("<IIB")
HEAD_SIZE = HEAD.size
MAX_FRAME = 64 << 20


def split_frames(buf: bytearray, data: bytes) -> tuple[list[tuple[int, int, bytes]], int]:
    """Appends ``data`` to what ``buf`` held and cuts off every complete frame:
    ([(id, method or status, body)], oversized). ``buf`` keeps the incomplete rest.
    ``oversized`` is 0, or the length a frame's header declared past :data:`MAX_FRAME`:
    that frame is refused at its header, before its body arrives, and ends the list (the
    caller closes the connection).

    Linear in the bytes received: a frame arriving in many reads is appended to ``buf``
    once per read and copied out once when whole (never the whole buffer per read, which
    made a 63 MiB frame cost ~8 s of the loop: issue 34)."""
    view: bytes | memoryview
    if buf:
        buf += data
        src: bytes | bytearray = buf
        view = memoryview(buf)  # bodies are copied out of it once; released below
    else:  # the usual case: whole frames in one read, sliced straight out of it
        src = view = data
    frames: list[tuple[int, int, bytes]] = []
    pos, end, oversized = 0, len(src), 0
    try:
        while end - pos >= HEAD_SIZE:
            n, rid, code = HEAD.unpack_from(src, pos)
            if n > MAX_FRAME:
                oversized = n
                break
            if end - pos - HEAD_SIZE < n:
                break
            start = pos + HEAD_SIZE
            frames.append((rid, code, bytes(view[start : start + n])))
            pos = start + n
    finally:
        if src is buf:
            view.release()  # type: ignore[union-attr]
    if src is buf:
        del buf[: end if oversized else pos]  # from the front: no copy of the rest
    elif pos < end and not oversized:
        buf += data[pos:]
    return frames, oversized


GET, EXISTS, PUT_LOCAL, REMOVE, PUT_START, PUT_END, PUT_RESERVE, PUT_SLOTS = 1, 2, 3, 4, 5, 6, 7, 8
PUT_RELEASE = 9
PB_BASE = 16
PB_METHODS = ("PutStart", "PutEnd", "Pin", "Unpin", "Stats")

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_KEYS = struct.Struct("<IH")
_REP = struct.Struct("<IHQQ")  # key index, segment index, offset, size
_SEG = struct.Struct("<IH")  # region id, address length
_SLOT = struct.Struct("<QQ")


def pack_str(s: str) -> bytes:
    b = s.encode()
    return _U8.pack(len(b)) + b


def unpack_str(buf, pos: int) -> tuple[str, int]:
    n = buf[pos]
    return bytes(buf[pos + 1 : pos + 1 + n]).decode(), pos + 1 + n


def pack_keys(keys: list[bytes]) -> bytes:
    if not keys:
        return _KEYS.pack(0, 0)
    n = len(keys[0])
    if all(len(k) == n for k in keys):
        return _KEYS.pack(len(keys), n) + b"".join(keys)
    return _KEYS.pack(len(keys), 0) + b"".join(_U16.pack(len(k)) + k for k in keys)


def unpack_keys(buf, pos: int) -> tuple[list[bytes], int]:
    count, n = _KEYS.unpack_from(buf, pos)
    pos += _KEYS.size
    if count > MAX_HASHES:  # before any list is built: the frame may claim millions
        raise ValueError(f"at most {MAX_HASHES} keys per call, got {count}")
    if n:
        raw = bytes(buf[pos : pos + n * count])
        if len(raw) != n * count:
            raise ValueError("short key list")
        return [raw[i : i + n] for i in range(0, n * count, n)], pos + n * count
    out = []
    for _ in range(count):
        (k,) = _U16.unpack_from(buf, pos)
        key = bytes(buf[pos + 2 : pos + 2 + k])
        if len(key) != k:
            raise ValueError("short key")
        out.append(key)
        pos += 2 + k
    return out, pos


# -- GET: flags(u8: 1 any_order, 2 with generations) | node_id | keys
#    ->  u32 lease_ms | u16 n_segments | (u32 region | u16 len + data address | node_id)*
#        | u32 n | (u32 key index | u16 segment index | u64 offset | u64 size)*
#        [| u64 generation * n: with flag 2]
# A replica's generation names it for its life: a client that remembers where a key is
# (and its generation) may read the bytes there while it asks, and uses them only if the
# answer names the same replica (a master without generations answers without them).
GET_ANY_ORDER, GET_GENS = 1, 2
_GEN = struct.Struct("<Q")


def slot_gen(token: int, offset: int) -> int:
    """The generation of a replica committed into a remote slot held under ``token`` at
    ``offset`` (PUT_SLOTS): its writer knows it without asking, and a GET answer that
    carries it does not give the token away (the token still holds the writer's other
    slots). Never 0."""
    x = (token ^ (offset * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF
    # splitmix64's finalizer: a bijection, so distinct (token, offset) stay distinct
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) or 1


def pack_get(keys: list[bytes], node_id: str, any_order: bool, gens: bool = False) -> bytes:
    flags = (GET_ANY_ORDER if any_order else 0) | (GET_GENS if gens else 0)
    return _U8.pack(flags) + pack_str(node_id) + pack_keys(keys)


def unpack_get(buf) -> tuple[list[bytes], str, bool]:
    node, pos = unpack_str(buf, 1)
    keys, _ = unpack_keys(buf, pos)
    return keys, node, bool(buf[0] & GET_ANY_ORDER)


def get_wants_gens(buf) -> bool:
    return bool(buf[0] & GET_GENS)


class SegmentInfo(Protocol):
    """What a GET answer tells of the segment holding a replica."""

    data_address: str
    region_id: int
    node_id: str


def pack_get_resp(
    lease_ms: int,
    got: Sequence[tuple[int, SegmentInfo, int, int]],
    gens: Sequence[int] | None = None,
) -> bytes:
    """``got``: (key index, segment, offset, size); ``gens``: one generation each."""
    segs: dict[int, int] = {}
    seg_parts: list[bytes] = []
    reps: list[bytes] = []
    for i, seg, off, size in got:
        j = segs.get(id(seg))
        if j is None:
            j = segs[id(seg)] = len(seg_parts)
            addr = seg.data_address.encode()
            seg_parts.append(_SEG.pack(seg.region_id, len(addr)) + addr + pack_str(seg.node_id))
        reps.append(_REP.pack(i, j, off, size))
    tail = [struct.pack(f"<{len(gens)}Q", *gens)] if gens is not None else []
    return b"".join(
        [
            _U32.pack(lease_ms),
            _U16.pack(len(seg_parts)),
            *seg_parts,
            _U32.pack(len(reps)),
            *reps,
            *tail,
        ]
    )


def unpack_get_resp(buf) -> tuple[int, list[tuple[int, str, int, str, int, int]]]:
    """-> (lease_ms, [(key index, data_address, region_id, node_id, offset, size)])."""
    (lease_ms,) = _U32.unpack_from(buf, 0)
    return lease_ms, _unpack_placements(buf, 4)[0]


def unpack_get_resp_gens(
    buf,
) -> tuple[int, list[tuple[int, str, int, str, int, int]], list[int] | None]:
    """As :func:`unpack_get_resp`, and the replicas' generations: None where the answer
    has none (a master without them) or not exactly one each."""
    (lease_ms,) = _U32.unpack_from(buf, 0)
    locs, pos = _unpack_placements(buf, 4)
    n = len(locs)
    if len(buf) - pos != n * _GEN.size:
        return lease_ms, locs, None
    return lease_ms, locs, list(struct.unpack_from(f"<{n}Q", buf, pos))


def _unpack_placements(buf, pos: int) -> tuple[list[tuple[int, str, int, str, int, int]], int]:
    (nseg,) = _U16.unpack_from(buf, pos)
    pos += 2
    segs = []
    for _ in range(nseg):
        region, alen = _SEG.unpack_from(buf, pos)
        pos += _SEG.size
        addr = bytes(buf[pos : pos + alen]).decode()
        node, pos = unpack_str(buf, pos + alen)
        segs.append((addr, region, node))
    (n,) = _U32.unpack_from(buf, pos)
    pos += 4
    raw = bytes(buf[pos : pos + n * _REP.size])
    if len(raw) != n * _REP.size:
        raise ValueError("short placement list")
    out = []
    for i, j, off, size in _REP.iter_unpack(raw):
        addr, region, node = segs[j]
        out.append((i, addr, region, node, off, size))
    return out, pos + len(raw)


# -- PUT_START: node_id | u64 size (0: one u64 size per key follows the keys) | keys
#               [| u64 size*]
#    ->  placements as in a GET answer (u16 n_segments | segments | u32 n | replicas)
#        | u32 n_present | u32 key index* (keys present or being put: not placed)
_U64 = struct.Struct("<Q")


def pack_put_start(node_id: str, keys: list[bytes], sizes: Sequence[int]) -> bytes:
    same = all(z == sizes[0] for z in sizes)
    head = pack_str(node_id) + _U64.pack(sizes[0] if same else 0) + pack_keys(keys)
    return head if same else head + struct.pack(f"<{len(sizes)}Q", *sizes)


def unpack_put_start(buf) -> tuple[str, list[bytes], list[int]]:
    """-> (node_id, keys, one size per key); ValueError on a truncated frame, trailing
    bytes or a size of 0."""
    node, pos = unpack_str(buf, 0)
    (size,) = _U64.unpack_from(buf, pos)
    keys, pos = unpack_keys(buf, pos + 8)
    if size:
        sizes = [size] * len(keys)
    else:
        raw = bytes(buf[pos : pos + 8 * len(keys)])
        if len(raw) != 8 * len(keys):
            raise ValueError("PutStart: one u64 size per key is missing")
        sizes = list(struct.unpack(f"<{len(keys)}Q", raw))
        pos += len(raw)
    if pos != len(buf):
        raise ValueError("PutStart frame has trailing bytes")
    if any(z <= 0 for z in sizes):
        raise ValueError("PutStart: size must be > 0")
    return node, keys, sizes


def pack_put_start_resp(
    placed: Sequence[tuple[int, SegmentInfo, int, int]], present: list[int]
) -> bytes:
    """``placed``: (key index, segment, offset, size); ``present``: key indices."""
    body = pack_get_resp(0, placed)[4:]
    return body + _U32.pack(len(present)) + struct.pack(f"<{len(present)}I", *present)


def unpack_put_start_resp(buf) -> tuple[list[tuple[int, str, int, str, int, int]], list[int]]:
    """-> ([(key index, data_address, region_id, node_id, offset, size)], present)."""
    placed, pos = _unpack_placements(buf, 0)
    (n,) = _U32.unpack_from(buf, pos)
    return placed, list(struct.unpack_from(f"<{n}I", buf, pos + 4))


# -- PUT_END: u8 flags (1 abort) | keys  ->  u32 committed | u32 n | u32 failed key index*
def pack_put_end(keys: list[bytes], abort: bool) -> bytes:
    return _U8.pack(1 if abort else 0) + pack_keys(keys)


def unpack_put_end(buf) -> tuple[list[bytes], bool]:
    keys, pos = unpack_keys(buf, 1)
    if pos != len(buf):
        raise ValueError("PutEnd frame has trailing bytes")
    return keys, bool(buf[0] & 1)


def pack_put_end_resp(committed: int, failed: list[int]) -> bytes:
    return _U32.pack(committed) + _U32.pack(len(failed)) + struct.pack(f"<{len(failed)}I", *failed)


def unpack_put_end_resp(buf) -> tuple[int, list[int]]:
    """-> (committed, indices of the keys that failed: no pending put any more)."""
    committed, n = struct.unpack_from("<II", buf, 0)
    return committed, list(struct.unpack_from(f"<{n}I", buf, 8))


# -- EXISTS: flags(u8: 1 any_order) | keys  ->  u32 prefix | n bytes present (0/1)
def pack_exists(keys: list[bytes], any_order: bool) -> bytes:
    return _U8.pack(1 if any_order else 0) + pack_keys(keys)


def unpack_exists(buf) -> tuple[list[bytes], bool]:
    """-> (keys, any_order)."""
    keys, _ = unpack_keys(buf, 1)
    return keys, bool(buf[0] & 1)


def pack_exists_resp(prefix: int, present: list[bool]) -> bytes:
    """``present``: one flag per key (any_order), or empty (prefix only)."""
    return _U32.pack(prefix) + bytes(present)


def unpack_exists_resp(buf) -> tuple[int, list[bool]]:
    """-> (prefix, present per key; empty when the call asked for the prefix only)."""
    return _U32.unpack_from(buf, 0)[0], [bool(b) for b in buf[4:]]


# -- REMOVE: keys  ->  u32 removed
def pack_count(n: int) -> bytes:
    return _U32.pack(n)


def unpack_count(buf) -> int:
    return _U32.unpack_from(buf, 0)[0]


# -- PUT_LOCAL: node_id | u32 region | keys | (u64 offset, u64 size) per key
#               | u64 reserve_size | u32 reserve_count | u32 reserve_spare
#               | u32 n_release | (u64 offset, u64 size)*
#    -> n bytes status | u32 n | u64 offset*
_RES = struct.Struct("<QII")


def pack_put_local(
    node_id: str,
    region: int,
    keys: list[bytes],
    slots: list[tuple[int, int]],
    reserve_size: int,
    reserve_count: int,
    reserve_spare: int,
    release: list[tuple[int, int]],
) -> bytes:
    return b"".join(
        [
            pack_str(node_id),
            _U32.pack(region),
            pack_keys(keys),
            *(_SLOT.pack(o, s) for o, s in slots),
            _RES.pack(reserve_size, reserve_count, reserve_spare),
            _U32.pack(len(release)),
            *(_SLOT.pack(o, s) for o, s in release),
        ]
    )


def unpack_put_local(buf):
    node, pos = unpack_str(buf, 0)
    (region,) = _U32.unpack_from(buf, pos)
    keys, pos = unpack_keys(buf, pos + 4)
    n = len(keys)
    slots = list(_SLOT.iter_unpack(bytes(buf[pos : pos + n * _SLOT.size])))
    pos += n * _SLOT.size
    rsize, rcount, rspare = _RES.unpack_from(buf, pos)
    pos += _RES.size
    (nrel,) = _U32.unpack_from(buf, pos)
    pos += 4
    if nrel > MAX_HASHES:
        raise ValueError(f"PutLocal: at most {MAX_HASHES} slots to release, got {nrel}")
    release = list(_SLOT.iter_unpack(bytes(buf[pos : pos + nrel * _SLOT.size])))
    if len(slots) != n or len(release) != nrel or pos + nrel * _SLOT.size != len(buf):
        raise ValueError("PutLocal frame is truncated or has trailing bytes")
    return node, region, keys, slots, rsize, rcount, rspare, release


def pack_put_local_resp(status: list[int], reserved: list[int]) -> bytes:
    return bytes(status) + _U32.pack(len(reserved)) + struct.pack(f"<{len(reserved)}Q", *reserved)


def unpack_put_local_resp(buf, n: int) -> tuple[list[int], list[int]]:
    status = list(buf[:n])
    (m,) = _U32.unpack_from(buf, n)
    return status, list(struct.unpack_from(f"<{m}Q", buf, n + 4))


# -- PUT_RESERVE: writer node_id | u64 size | u32 count (>= 1) | u32 spare
#    ->  u32 ttl_ms | u32 region | u16 len + data address | node_id | u64 token
#        | u32 n | u64 offset*   (n = 0 and empty strings when nothing could be reserved)
#    The token (random, 64-bit) is the reservation's: a commit of a slot must present it,
#    so a slot that expired and went to another writer is never committed by the first.
_RESERVE = struct.Struct("<QII")


def pack_put_reserve(node_id: str, size: int, count: int, spare: int) -> bytes:
    return pack_str(node_id) + _RESERVE.pack(size, count, spare)


def unpack_put_reserve(buf) -> tuple[str, int, int, int]:
    """-> (writer, size, count, spare); ValueError on a truncated frame or trailing bytes."""
    node, pos = unpack_str(buf, 0)
    if len(buf) - pos != _RESERVE.size:
        raise ValueError("PutReserve frame is truncated or has trailing bytes")
    size, count, spare = _RESERVE.unpack_from(buf, pos)
    return node, size, count, spare


def pack_put_reserve_resp(
    ttl_ms: int, region: int, address: str, node_id: str, token: int, offsets: Sequence[int]
) -> bytes:
    addr = address.encode()
    return b"".join(
        [
            _U32.pack(ttl_ms),
            _SEG.pack(region, len(addr)),
            addr,
            pack_str(node_id),
            _U64.pack(token),
            _U32.pack(len(offsets)),
            struct.pack(f"<{len(offsets)}Q", *offsets),
        ]
    )


def unpack_put_reserve_resp(buf) -> tuple[int, int, str, str, int, list[int]]:
    """-> (ttl_ms, region, data address, node_id, token, offsets)."""
    (ttl_ms,) = _U32.unpack_from(buf, 0)
    region, alen = _SEG.unpack_from(buf, 4)
    pos = 4 + _SEG.size
    addr = bytes(buf[pos : pos + alen]).decode()
    node, pos = unpack_str(buf, pos + alen)
    (token,) = _U64.unpack_from(buf, pos)
    (n,) = _U32.unpack_from(buf, pos + 8)
    return ttl_ms, region, addr, node, token, list(struct.unpack_from(f"<{n}Q", buf, pos + 12))


# -- PUT_SLOTS: segment node_id | u32 region | keys | u64 size | u64 offset per key
#               | u64 token per key | u32 refill
#    ->  n bytes status (1 stored, 2 present: the slot stays yours, 0 no such slot held
#        under that token) | u64 token | u32 m | u64 offset* (slots refilled in the same
#        segment, same size, held under that token)
_SLOTS_TAIL = struct.Struct("<I")


def pack_put_slots(
    node_id: str,
    region: int,
    keys: list[bytes],
    size: int,
    offsets: Sequence[int],
    tokens: Sequence[int],
    refill: int,
) -> bytes:
    return b"".join(
        [
            pack_str(node_id),
            _U32.pack(region),
            pack_keys(keys),
            _U64.pack(size),
            struct.pack(f"<{len(offsets)}Q", *offsets),
            struct.pack(f"<{len(tokens)}Q", *tokens),
            _SLOTS_TAIL.pack(refill),
        ]
    )


def unpack_put_slots(buf) -> tuple[str, int, list[bytes], int, list[int], list[int], int]:
    """-> (segment node_id, region, keys, size, offsets, tokens, refill); ValueError on
    a truncated frame, trailing bytes or a size of 0."""
    node, pos = unpack_str(buf, 0)
    (region,) = _U32.unpack_from(buf, pos)
    keys, pos = unpack_keys(buf, pos + 4)
    (size,) = _U64.unpack_from(buf, pos)
    pos += 8
    n = len(keys)
    if len(buf) - pos != 16 * n + _SLOTS_TAIL.size:
        raise ValueError(
            "PutSlots frame: one u64 offset per key, one u64 token per key, then u32 refill"
        )
    offsets = list(struct.unpack_from(f"<{n}Q", buf, pos))
    tokens = list(struct.unpack_from(f"<{n}Q", buf, pos + 8 * n))
    (refill,) = _SLOTS_TAIL.unpack_from(buf, pos + 16 * n)
    if size <= 0:
        raise ValueError("PutSlots: size must be > 0")
    return node, region, keys, size, offsets, tokens, refill


def pack_put_slots_resp(status: list[int], token: int, offsets: Sequence[int]) -> bytes:
    return (
        bytes(status)
        + _U64.pack(token)
        + _U32.pack(len(offsets))
        + struct.pack(f"<{len(offsets)}Q", *offsets)
    )


def unpack_put_slots_resp(buf, n: int) -> tuple[list[int], int, list[int]]:
    """-> (status per key, token of the refilled slots, refilled offsets)."""
    status = list(buf[:n])
    (token,) = _U64.unpack_from(buf, n)
    (m,) = _U32.unpack_from(buf, n + 8)
    return status, token, list(struct.unpack_from(f"<{m}Q", buf, n + 12))


# -- PUT_RELEASE: segment node_id | u32 region | u64 size | u32 n | (u64 offset, u64 token)*
#    ->  u32 count freed (slots not held under that token are ignored)
_RELEASE = struct.Struct("<IQI")


def pack_put_release(
    node_id: str, region: int, size: int, slots: Sequence[tuple[int, int]]
) -> bytes:
    flat = [x for s in slots for x in s]
    return (
        pack_str(node_id)
        + _RELEASE.pack(region, size, len(slots))
        + struct.pack(f"<{len(flat)}Q", *flat)
    )


def unpack_put_release(buf) -> tuple[str, int, int, list[tuple[int, int]]]:
    """-> (segment node_id, region, size, [(offset, token)]); ValueError on a truncated
    frame, trailing bytes, a lying slot count or a size of 0."""
    node, pos = unpack_str(buf, 0)
    if len(buf) - pos < _RELEASE.size:
        raise ValueError("PutRelease frame is truncated")
    region, size, n = _RELEASE.unpack_from(buf, pos)
    pos += _RELEASE.size
    if n > MAX_HASHES:
        raise ValueError(f"PutRelease: at most {MAX_HASHES} slots per call, got {n}")
    if len(buf) - pos != 16 * n:
        raise ValueError("PutRelease frame: u32 n then n (u64 offset, u64 token) pairs")
    if size <= 0:
        raise ValueError("PutRelease: size must be > 0")
    flat = struct.unpack_from(f"<{2 * n}Q", buf, pos)
    return node, region, size, list(zip(flat[0::2], flat[1::2]))
