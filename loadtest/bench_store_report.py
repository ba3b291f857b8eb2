"""The store benchmark's report (``python -m kvmesh.loadtest.bench_store``): the table of
every size and API side by side, where a single call's time goes, and the issue's goals
read off the results. The rows it reports (``SIZES`` x ``APIS``) are the benchmark's shape."""

from __future__ import annotations

import json

SIZES = [("4KiB", 4 << 10), ("256KiB", 256 << 10), ("4MiB", 4 << 20), ("16MiB", 16 << 20)]
APIS = (
    "put",
    "get",
    "batch_put",
    "batch_get",
    "put_from",
    "get_into",
    "batch_put_from",
    "batch_get_into",
)


def _fmt(label: str, r: dict) -> str:
    return f"{r['ops_s']:,.0f} op/s" if label == "4KiB" else f"{r['gb_s']:.2f} GB/s"


def table(res: dict) -> str:
    sides = res["sides"]
    if not sides:
        return "no results: " + json.dumps(res["skipped"])
    kv = [s for s in sides if s != "mooncake"]
    mc = "mooncake" if "mooncake" in sides else None
    head = f"{'size':>6} {'api':<15}" + "".join(f"{s:>19}" for s in sides)
    if mc:
        head += f" {'ratio':>6}"
    head += f" {'cpu ms/op':>24}"
    lines = [head]
    for label, _ in SIZES:
        row = res["sizes"].get(label)
        if row is None:
            continue
        for api in APIS:
            cells = "".join(f"{_fmt(label, row[s][api]):>19}" for s in sides)
            if mc:
                a, b = row[kv[0]][api]["ops_s"], row[mc][api]["ops_s"]
                cells += f" {a / b:>5.2f}x"
            cpu = "/".join(f"{row[s][api]['cpu_ms_op']:.2f}" for s in sides)
            bad = {s: row[s][api]["bad"] for s in sides if row[s][api]["bad"]}
            lines.append(
                f"{label:>6} {api:<15}{cells} {cpu:>24}" + (f"  FAILED/WRONG: {bad}" if bad else "")
            )
    lines.append("")
    lines.append("latency p50/p99 (us) of single calls, 4 KiB:")
    r4 = res["sizes"].get("4KiB", {})
    for api in ("put", "get", "put_from", "get_into"):
        if not r4:
            break
        cells = "".join(f"{r4[s][api]['p50_us']:>9.0f}/{r4[s][api]['p99_us']:<9.0f}" for s in sides)
        lines.append(f"{'4KiB':>6} {api:<15}{cells}")
    lines.append(
        "control round trip p50 (exists): "
        + ", ".join(f"{s} {us:.0f} us" for s, us in res.get("rtt_us", {}).items())
    )
    fl = res.get("floor")
    if fl:
        lines.append(
            "host floor (a raw round trip between two processes, blocking sockets, 4 KiB "
            + (
                f"reply): p50 {fl['p50_us']:.0f} us, p99 {fl['p99_us']:.0f} us"
                if "p50_us" in fl
                else f"reply): not measured ({fl.get('error', '?')})"
            )
        )
    return "\n".join(lines)


def breakdown(res: dict) -> str:
    """Where a single put's and get's time goes (kvmesh, first side): control round
    trips, wire (the engine alone), copies, and the rest (Python on the client path)."""
    sides = [s for s in res["sides"] if s != "mooncake"]
    if not sides or "engine" not in next(iter(res["sizes"].values()), {}):
        return ""
    s = sides[0]
    rtt = res["rtt_us"][s]
    lines = [
        f"where the time goes ({s}, single calls, p50 us): rtt = one control round trip "
        f"({rtt:.0f} us), wire = the engine alone, copy = one bytes<->buffer copy",
        f"{'size':>6} {'api':<9} {'total':>8} {'rtts':>5} {'ctrl':>8} {'wire':>8} "
        f"{'copy':>8} {'rest':>8}",
    ]
    from kvmesh.services.store.client import StoreClient
    from kvmesh.services.store.direct import DIRECT_PUT_MIN
    from kvmesh.services.store.limits import DIRECT_GET_MIN
    from kvmesh.services.store.remote_pool import REMOTE_SLOT_MAX

    for label, size in SIZES:
        row = res["sizes"].get(label)
        if row is None or "engine" not in row:
            continue
        eng = row["engine"]
        for api, op, copies in (
            ("put", "write", 1),
            ("get", "read", 1),
            ("put_from", "write", 0),
            ("get_into", "read", 0),
        ):
            total = row[s][api]["p50_us"]
            kind = api.split("_")[0]
            if kind == "put" and size <= REMOTE_SLOT_MAX:
                kind = "put_pooled"  # into a slot held before: the commit only
            n = StoreClient.CONTROL_ROUND_TRIPS[kind]
            wire = eng[f"{op}_single_p50_us"]
            if size >= (DIRECT_PUT_MIN if api.startswith("put") else DIRECT_GET_MIN):
                copies = 0  # sent from / read into the caller's bytes
            copy = copies * row["copy_us"]
            rest = total - n * rtt - wire - copy
            lines.append(
                f"{label:>6} {api:<9} {total:>8.0f} {n:>5} {n * rtt:>8.0f} {wire:>8.0f} "
                f"{copy:>8.0f} {rest:>8.0f}"
            )
    return "\n".join(lines)


def goals(res: dict) -> str:
    sides = res["sides"]
    if "mooncake" not in sides:
        return ""
    kv = [s for s in sides if s != "mooncake"][0]
    lines = [f"goals ({kv} vs mooncake; engine = transfer engine alone, same run):"]
    worst = min(
        (res["sizes"][lb][kv][a]["ops_s"] / res["sizes"][lb]["mooncake"][a]["ops_s"], lb, a)
        for lb in res["sizes"]
        for a in APIS
    )
    lines.append(f"  lowest ratio: {worst[0]:.2f}x ({worst[1]} {worst[2]}); goal >= 1.5x")
    r4 = res["sizes"].get("4KiB")
    if r4:
        k, m = r4[kv]["get"], r4["mooncake"]["get"]
        lines.append(
            f"  4 KiB get p50 {k['p50_us']:.0f} vs {m['p50_us']:.0f} us, "
            f"p99 {k['p99_us']:.0f} vs {m['p99_us']:.0f} us; goal: both below"
        )
    fl = res.get("floor")
    if fl and r4 and "p50_us" in fl:
        per = ", ".join(
            f"{s} get {r4[s]['get']['p50_us'] / fl['p50_us']:.1f} put "
            f"{r4[s]['put']['p50_us'] / fl['p50_us']:.1f}"
            for s in (kv, "mooncake")
        )
        lines.append(f"  4 KiB single calls in host-floor round trips (p50): {per}")
    for lb, size in SIZES:
        row = res["sizes"].get(lb)
        if row is None or size < (1 << 20) or "engine" not in row:
            continue
        eng = row["engine"]
        parts = []
        for api, ref in (
            ("put_from", "write_single"),
            ("get_into", "read_single"),
            ("batch_put_from", "write_batch"),
            ("batch_get_into", "read_batch"),
            ("put", "write_single"),
            ("get", "read_single"),
        ):
            parts.append(f"{api} {row[kv][api]['gb_s'] / eng[ref]['gb_s'] * 100:.0f}%")
        lines.append(f"  {lb} share of the engine's rate: " + ", ".join(parts) + "; goal >= 75%")
    return "\n".join(lines)
