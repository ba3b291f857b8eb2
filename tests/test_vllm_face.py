"""vLLM's conventions on the conductor, against a real cluster and the ``openai`` client:
``--host 0.0.0.0 --advertise-host 127.0.0.1``, ``--served-model-name`` aliases,
``--api-key``, ``--max-model-len``; ``/metrics`` on the API port with the ``vllm:`` series
(their values after a request agree with its usage), ``/version``, ``/tokenize`` and
``/detokenize``; ``--dtype float16`` on a CPU refused with the reason; a wildcard
``--host`` without ``--advertise-host`` refused."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

import kvmesh
from kvmesh.services.common.config import ConfigError, load
from kvmesh.services.conductor.config import ConductorConfig
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import NODE_ARGS
from tests.etcd_server import free_port

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(180)

KEY = "sekret-key"
ALIASES = ["my-llm", "other-name"]
MAX_LEN = 200
PROMPT = "The cluster computes each token's KV once,"


@pytest.fixture(scope="module")
def face(tmp_path_factory):
    port = free_port()
    cluster = LocalCluster(
        str(tmp_path_factory.mktemp("vllm")),
        node_args=NODE_ARGS,
        http_port=port,
        api_key=KEY,
        conductor_args=[
            "--host",
            "0.0.0.0",
            "--advertise-host",
            "127.0.0.1",
            "--served-model-name",
            ",".join(ALIASES),
            "--api-key",
            KEY,
            "--max-model-len",
            str(MAX_LEN),
        ],
    )
    try:
        cluster.start()
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=60
        )
        yield cluster, client, port
    finally:
        cluster.stop()


def _http(port: int, path: str, body: dict | None = None, key: str | None = KEY):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) listening on ``port``."""
    out = set()
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(f).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":  # LISTEN
                out.add(addr)
    return out


WILDCARDS = {"00000000", "0" * 32}  # 0.0.0.0, ::


def _samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value of a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _metrics(port: int) -> dict[str, float]:
    status, ctype, body = _http(port, "/metrics", key=None)  # open, as /health
    assert status == 200 and ctype.startswith("text/plain")
    return _samples(body.decode())


def test_binds_every_address_and_advertises_another(face):
    cluster, client, port = face
    assert cluster.conductor == f"127.0.0.1:{cluster.conductor_port}"  # as registered
    for p in (cluster.conductor_port, port):
        assert _listening_addresses(p) and _listening_addresses(p) <= WILDCARDS, p
    http = [n.http_address for n in cluster.status().nodes if n.http_address]
    assert http == [f"127.0.0.1:{port}"]
    out = client.completions.create(model=ALIASES[0], prompt=PROMPT, max_tokens=4)
    assert len(out.choices[0].token_ids) == 4


def test_served_model_names_are_aliases(face):
    _, client, _ = face
    ids = [m.id for m in client.models.list().data]
    assert ids == [*ALIASES, "tiny"]
    for name in (*ALIASES, "tiny"):
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=2, temperature=0)
        assert out.model == name and len(out.choices[0].token_ids) == 2
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert "no-such-model" in str(e.value)


def test_api_key_is_enforced(face):
    _, _, port = face
    body = {"model": ALIASES[0], "prompt": PROMPT, "max_tokens": 2}
    assert _http(port, "/v1/completions", body, key=None)[0] == 401
    assert _http(port, "/v1/completions", body, key="wrong")[0] == 401
    assert _http(port, "/tokenize", {"prompt": "x"}, key="wrong")[0] == 401
    assert _http(port, "/v1/completions", body)[0] == 200


def test_max_model_len_caps_the_context(face):
    _, client, port = face
    models = json.loads(_http(port, "/v1/models")[2])["data"]
    assert {m["max_model_len"] for m in models} == {MAX_LEN}
    assert {m["root"] for m in models} == {"tiny"}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=ALIASES[0], prompt=PROMPT, max_tokens=MAX_LEN)
    assert f"context of {MAX_LEN} tokens" in str(e.value)


def test_metrics_on_the_api_port_carry_vllm_series(face):
    _, client, port = face
    label = f'{{model_name="{ALIASES[0]}"}}'
    before = _metrics(port)
    stream = client.completions.create(
        model=ALIASES[1],
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
    after = _metrics(port)

    def delta(name: str) -> float:
        return after.get(name + label, 0.0) - before.get(name + label, 0.0)

    assert usage is not None and usage.completion_tokens == 12
    assert delta("vllm:generation_tokens_total") == usage.completion_tokens
    assert delta("vllm:prompt_tokens_total") == usage.prompt_tokens > 0
    assert delta("vllm:prefix_cache_queries_total") == usage.prompt_tokens
    cached = usage.prompt_tokens_details.cached_tokens
    assert delta("vllm:prefix_cache_hits_total") == cached
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == usage.completion_tokens - 1
    assert (
        0
        < delta("vllm:time_to_first_token_seconds_sum")
        < delta("vllm:e2e_request_latency_seconds_sum")
    )
    assert after["vllm:num_requests_running" + label] == 0
    assert after["vllm:num_requests_waiting" + label] == 0
    assert 0 <= after["vllm:kv_cache_usage_perc" + label] <= 1
    # kvmesh's own series beside them, on the same port
    assert (
        after["kvmesh_request_completion_tokens_total"]
        - before.get("kvmesh_request_completion_tokens_total", 0)
        == usage.completion_tokens
    )


def test_version(face):
    _, _, port = face
    status, _, body = _http(port, "/version", key=None)
    assert status == 200 and json.loads(body) == {"version": kvmesh.__version__}


def test_tokenize_and_detokenize(face):
    _, client, port = face
    status, _, body = _http(port, "/tokenize", {"model": ALIASES[0], "prompt": PROMPT})
    out = json.loads(body)
    assert status == 200
    assert out["tokens"] == [256, *PROMPT.encode()]  # the tiny preset's byte tokenizer + BOS
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == MAX_LEN
    served = client.completions.create(model=ALIASES[0], prompt=PROMPT, max_tokens=1)
    assert served.usage.prompt_tokens == out["count"]
    bare = json.loads(_http(port, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})[2])
    assert bare["tokens"] == out["tokens"][1:]
    chat = json.loads(
        _http(port, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})[2]
    )
    assert bytes(chat["tokens"][1:]).decode() == "<|user|>\nhi\n<|assistant|>\n"
    status, _, body = _http(port, "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and json.loads(body) == {"prompt": PROMPT}
    for path, bad, field in (
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, "nope"),
    ):
        status, _, body = _http(port, path, bad)
        want = 404 if field == "nope" else 400  # an unknown model is model_not_found
        assert status == want and field in json.loads(body)["error"]["message"]


def test_float16_on_a_cpu_is_refused_with_the_reason():
    p = subprocess.run(
        [sys.executable, "-m", "kvmesh.services.cli", "decode", "--dtype", "float16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    assert re.search(r"float16 runs on CUDA only: a CPU has no native half-precision", p.stderr)
    assert "use float32" in p.stderr


def test_advertise_host_and_the_conductors_vllm_options(caplog):
    assert load(ConductorConfig, ["--host", "0.0.0.0"], env={}).advertised_host == "0.0.0.0"
    assert "--advertise-host" in caplog.text  # a warning: only this machine can dial it
    with pytest.raises(ConfigError, match="wildcard"):
        load(ConductorConfig, ["--advertise-host", "0.0.0.0"], env={})
    cfg = load(ConductorConfig, ["--host", "0.0.0.0", "--advertise-host", "10.1.2.3"], env={})
    assert cfg.advertise("0.0.0.0:8000") == "10.1.2.3:8000"
    with pytest.raises(ConfigError, match="repeats"):
        load(ConductorConfig, ["--served-model-name", "a,b,a"], env={})
    cfg = load(ConductorConfig, ["--api-key", "k1", "--api-keys", "k2:t2"], env={})
    assert cfg.api_key_entries == "k2:t2,k1"
    # KVMESH_API_KEY is the key the command line sends, not one the conductor takes
    assert load(ConductorConfig, [], env={"KVMESH_API_KEY": "k"}).api_key_entries == ""
    assert load(ConductorConfig, [], env={"KVMESH_CONDUCTOR_API_KEY": "k"}).api_key == "k"


def test_kvmesh_up_takes_vllm_serve_flags():
    import argparse

    from kvmesh.services.launcher import add_up_arguments
    from kvmesh.services.launcher.up import vllm_style_args

    p = argparse.ArgumentParser()
    add_up_arguments(p)
    argv = ["--host", "0.0.0.0", "--api-key", "k", "--served-model-name", "a,b"]
    argv += ["--max-model-len", "512", "--dtype", "bfloat16"]
    conductor, nodes = vllm_style_args(p.parse_args(argv))
    assert conductor == [
        "--host",
        "0.0.0.0",
        "--advertise-host",
        "127.0.0.1",  # the other services of the machine dial it there
        "--api-key",
        "k",
        "--served-model-name",
        "a,b",
        "--max-model-len",
        "512",
    ]
    assert nodes == ["--dtype", "bfloat16"]
    load(ConductorConfig, conductor, env={})  # the conductor takes them
    assert vllm_style_args(p.parse_args([])) == ([], [])


def test_client_compat_openai_part(face, tmp_path):
    """``python -m kvmesh.loadtest.client_compat``'s checks with the openai client pass on
    this cluster (aliases, key), and its trace slice fits the model's context."""
    from kvmesh.loadtest.client_compat import openai_checks, trace_slice

    _, _, port = face
    out = openai_checks(f"http://127.0.0.1:{port}", ALIASES[0], KEY)
    assert out["ok"] and len(out["calls"]) == 5, out
    assert out["vllm:generation_tokens"] == out["usage"]["completion"] > 0
    n = trace_slice(tmp_path / "t.jsonl", 7, block=16, max_blocks=4, max_output=8)
    rows = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert n == len(rows) == 7
    assert all(r["input_length"] == 16 * len(r["hash_ids"]) <= 64 for r in rows)
    assert all(1 <= r["output_length"] <= 8 for r in rows)
