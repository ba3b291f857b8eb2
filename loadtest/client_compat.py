"""Standard clients against a live kvmesh cluster: the ``openai`` client (completions and
chat, streamed and not, ``/v1/models``) and, when it is installed, NVIDIA's aiperf
replaying a slice of the vendored Mooncake trace (``loadtest/traces``) through
``/v1/completions`` with streaming. Checks that every request succeeds, that the
``openai`` client's usage adds up to the conductor's own counters exactly, and that
aiperf's token counts and mean TTFT agree with the conductor's ``vllm:`` series (scraped
from ``/metrics`` on the API port before and after) within ``--tolerance`` (10%).

    python -m kvmesh.loadtest.client_compat                  # starts a demo cluster
    python -m kvmesh.loadtest.client_compat --url http://127.0.0.1:8000 \\
        --model demo --tokenizer services/engine/demo [--api-key KEY]

aiperf is looked up as ``--aiperf PATH`` or on ``PATH``; without it that part is skipped
(said so, not failed). aiperf counts tokens with a Hugging Face tokenizer; offline it
takes a hub id from the HF cache only, so ``--tokenizer DIR`` (a model directory, by
default the shipped demo's) is laid out as a one-snapshot cache under the run's work
directory and handed to aiperf as ``kvmesh-local/<name>`` with ``HF_HUB_OFFLINE=1``.
Prints a table; writes ``loadtest/results/client_compat.json``; exit status 1 when a
check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TRACE = HERE / "traces" / "synthetic_trace.jsonl"
RESULTS = HERE / "results" / "client_compat.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")


def scrape(base: str) -> dict[str, float]:
    """``name{labels}`` -> value from ``base``/metrics (Prometheus text)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def series(before: dict, after: dict, name: str) -> float:
    """The increase of series ``name`` over every label set."""

    def total(m: dict) -> float:
        return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))

    return total(after) - total(before)


def trace_slice(dst: Path, n: int, block: int, max_blocks: int, max_output: int) -> int:
    """The trace's first ``n`` requests, each prompt cut to ``max_blocks`` blocks of
    ``block`` tokens (its hash ids with it) and its output to ``max_output`` tokens, so
    they fit a small model's context. Returns the requests written."""
    rows = []
    with open(TRACE) as f:
        for line in f:
            if len(rows) == n:
                break
            r = json.loads(line)
            k = max(1, min(len(r["hash_ids"]), max_blocks))
            rows.append(
                {
                    "timestamp": r["timestamp"],
                    "input_length": k * block,
                    "output_length": max(1, min(int(r["output_length"]), max_output)),
                    "hash_ids": r["hash_ids"][:k],
                }
            )
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def local_hub_cache(model_dir: str, cache: Path) -> str:
    """Lays ``model_dir``'s tokenizer files out as a Hugging Face hub cache with one
    snapshot (``models--kvmesh-local--<name>``); returns the hub id that names it."""
    name = Path(model_dir).resolve().name
    repo = cache / f"models--kvmesh-local--{name}"
    commit = "0" * 40
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for f in (*TOKENIZER_FILES, "generation_config.json", "special_tokens_map.json"):
        if (Path(model_dir) / f).is_file():
            shutil.copy(Path(model_dir) / f, snap / f)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return f"kvmesh-local/{name}"


def openai_checks(base: str, model: str, key: str) -> dict[str, Any]:
    """Completions and chat, streamed and not, and /v1/models through the ``openai``
    client; every call must succeed; their usage against the conductor's counters."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key or "none", max_retries=0)
    before = scrape(base)
    calls: list[dict[str, Any]] = []
    prompt = "The cache holds each prefix once, and"
    usage = {"prompt": 0, "completion": 0}

    def record(kind: str, u, text: str) -> None:
        calls.append({"call": kind, "ok": u is not None, "text_chars": len(text)})
        if u is not None:
            usage["prompt"] += u.prompt_tokens
            usage["completion"] += u.completion_tokens

    ids = [m.id for m in client.models.list().data]
    calls.append({"call": "models.list", "ok": model in ids, "models": ids})
    out = client.completions.create(model=model, prompt=prompt, max_tokens=16)
    record("completions", out.usage, out.choices[0].text)
    u, text = None, ""
    for c in client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    ):
        u = c.usage or u
        text += c.choices[0].text if c.choices else ""
    record("completions stream", u, text)
    msgs = [{"role": "user", "content": "Say something about caches."}]
    chat = client.chat.completions.create(model=model, messages=msgs, max_tokens=16)
    record("chat", chat.usage, chat.choices[0].message.content or "")
    u, text = None, ""
    for c in client.chat.completions.create(
        model=model,
        messages=msgs,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    ):
        u = c.usage or u
        text += (c.choices[0].delta.content or "") if c.choices else ""
    record("chat stream", u, text)
    after = scrape(base)
    gen = series(before, after, "vllm:generation_tokens_total")
    prompt_tokens = series(before, after, "vllm:prompt_tokens_total")
    return {
        "calls": calls,
        "usage": usage,
        "vllm:generation_tokens": gen,
        "vllm:prompt_tokens": prompt_tokens,
        "ok": all(c["ok"] for c in calls)
        and gen == usage["completion"]
        and prompt_tokens == usage["prompt"],
    }


def find_aiperf(path: str) -> str | None:
    return path or shutil.which("aiperf")


def aiperf_run(
    exe: str,
    base: str,
    model: str,
    key: str,
    tokenizer: str,
    work: Path,
    n: int,
    tol: float,
    concurrency: int = 1,
) -> dict[str, Any]:
    """aiperf over a trace slice; its figures against the ``vllm:`` series' increase."""
    trace = work / "trace.jsonl"
    n = trace_slice(trace, n, block=16, max_blocks=24, max_output=32)
    env = {**os.environ}
    if os.path.isdir(tokenizer):
        cache = work / "hf-hub"
        tokenizer = local_hub_cache(tokenizer, cache)
        env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache))
    art = work / "aiperf"
    argv = [
        exe,
        "profile",
        "--model",
        model,
        "--url",
        base,
        "--endpoint-type",
        "completions",
        "--streaming",
        "--input-file",
        str(trace),
        "--custom-dataset-type",
        "mooncake_trace",
        "--isl-block-size",
        "16",
        "--request-count",
        str(n),
        "--concurrency",
        str(concurrency),
        "--no-fixed-schedule",
        "--tokenizer",
        tokenizer,
        "--artifact-dir",
        str(art),
        *(["--api-key", key] if key else []),
    ]
    before = scrape(base)
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    after = scrape(base)
    out: dict[str, Any] = {"command": " ".join(argv[1:]), "exit": p.returncode}
    export = art / "profile_export_aiperf.json"
    if p.returncode != 0 or not export.is_file():
        out["ok"] = False
        out["error"] = (p.stdout + p.stderr)[-2000:]
        return out
    a = json.loads(export.read_text())

    def fig(name: str, key: str = "avg") -> float:
        return float((a.get(name) or {}).get(key) or 0.0)

    requests = fig("completed_request_count")
    served = series(before, after, "vllm:e2e_request_latency_seconds_count")
    ttft_n = series(before, after, "vllm:time_to_first_token_seconds_count")
    rows = {
        "requests": (requests, served),
        "output tokens (aiperf's tokenizer)": (
            fig("total_output_tokens"),
            series(before, after, "vllm:generation_tokens_total"),
        ),
        "output tokens (usage)": (
            fig("total_usage_completion_tokens"),
            series(before, after, "vllm:generation_tokens_total"),
        ),
        "prompt tokens (usage)": (
            fig("total_usage_prompt_tokens"),
            series(before, after, "vllm:prompt_tokens_total"),
        ),
        "mean TTFT ms": (
            fig("time_to_first_token"),
            1000 * series(before, after, "vllm:time_to_first_token_seconds_sum") / ttft_n
            if ttft_n
            else 0.0,
        ),
    }
    checks = []
    for name, (theirs, ours) in rows.items():
        err = abs(theirs - ours) / ours if ours else float("inf")
        checks.append(
            {
                "figure": name,
                "aiperf": round(theirs, 3),
                "kvmesh": round(ours, 3),
                "diff": round(err, 4),
                "ok": err <= tol,
            }
        )
    # where aiperf's TTFT goes before the conductor sees the request: opening the
    # connection and sending the body (its own clock, on a loaded host its own CPU too)
    out["aiperf_ttft_parts_ms"] = {
        k: round(fig(k), 3) for k in ("http_req_connecting", "http_req_sending", "http_req_waiting")
    }
    errors = fig("request_error_rate")
    out.update(
        requests=n,
        error_rate_pct=errors,
        checks=checks,
        ok=requests == n and errors == 0 and all(c["ok"] for c in checks),
    )
    return out


def start_cluster(workdir: str, model: str):
    """A local 1P+1D cluster of ``model`` (block size 16) with its HTTP API on a free
    port; returns (cluster, base URL)."""
    import socket

    from kvmesh.services.launcher import LocalCluster

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node_args = ["--model", model, "--block-size", "16"]
    node_args += ["--kv-memory", "64MiB", "--segment-memory", "64MiB"]
    cluster = LocalCluster(workdir, node_args=node_args, http_port=port)
    cluster.start()
    return cluster, f"http://127.0.0.1:{port}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="", help="a live cluster's HTTP API (default: start one)")
    ap.add_argument("--model", default="demo", help="model to ask for (and to start)")
    ap.add_argument("--api-key", default=os.environ.get("KVMESH_API_KEY", ""), help="API key")
    ap.add_argument(
        "--tokenizer",
        default="",
        help="aiperf's tokenizer: a model directory (default: the shipped demo's) or a hub "
        "id in the Hugging Face cache",
    )
    ap.add_argument("--aiperf", default="", help="the aiperf executable (default: on PATH)")
    ap.add_argument("--requests", type=int, default=20, help="trace requests aiperf replays")
    ap.add_argument("--concurrency", type=int, default=1, help="aiperf's requests at once")
    ap.add_argument("--tolerance", type=float, default=0.10, help="agreement asked for")
    ap.add_argument("--out", default=str(RESULTS), help="results file")
    a = ap.parse_args()
    from kvmesh.services.common.tokenizer import shipped_dir

    tokenizer = a.tokenizer or shipped_dir("demo")
    work = Path(tempfile.mkdtemp(prefix="kvmesh-compat-"))
    cluster = None
    try:
        base = a.url.rstrip("/")
        if not base:
            print(f"starting a local cluster of {a.model} ...", flush=True)
            cluster, base = start_cluster(str(work / "cluster"), a.model)
        result: dict[str, Any] = {
            "url": base,
            "model": a.model,
            "when": time.time(),
            "cpus": os.cpu_count(),
            "load_average_at_start": os.getloadavg(),
        }
        result["openai"] = openai_checks(base, a.model, a.api_key)
        for c in result["openai"]["calls"]:
            print(f"openai {c['call']:20} {'ok' if c['ok'] else 'FAILED'}")
        o = result["openai"]
        print(
            f"openai usage: {o['usage']['completion']} completion, {o['usage']['prompt']} "
            f"prompt tokens; vllm:generation_tokens +{o['vllm:generation_tokens']:g}, "
            f"vllm:prompt_tokens +{o['vllm:prompt_tokens']:g}"
        )
        exe = find_aiperf(a.aiperf)
        if exe is None:
            print("aiperf is not installed (pip install aiperf): skipped")
            result["aiperf"] = {"skipped": "not installed"}
        else:
            print(f"aiperf: {a.requests} trace requests ...", flush=True)
            r = result["aiperf"] = aiperf_run(
                exe,
                base,
                a.model,
                a.api_key,
                tokenizer,
                work,
                a.requests,
                a.tolerance,
                a.concurrency,
            )
            if "checks" not in r:
                print(f"aiperf FAILED (exit {r['exit']}):\n{r.get('error', '')}")
            else:
                print(f"aiperf: {r['requests']} requests, error rate {r['error_rate_pct']}%")
                parts = ", ".join(f"{k} {v:g}" for k, v in r["aiperf_ttft_parts_ms"].items())
                print(f"aiperf's TTFT parts (mean ms): {parts}")
                print(f"{'figure':36} {'aiperf':>10} {'kvmesh':>10} {'diff':>7}")
                for c in r["checks"]:
                    print(
                        f"{c['figure']:36} {c['aiperf']:>10g} {c['kvmesh']:>10g} "
                        f"{100 * c['diff']:>6.1f}% {'ok' if c['ok'] else 'FAILED'}"
                    )
        ok = result["openai"]["ok"] and result["aiperf"].get("ok", True)
        result["ok"] = ok
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"{'all checks passed' if ok else 'SOME CHECKS FAILED'}; wrote {a.out}")
        return 0 if ok else 1
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
