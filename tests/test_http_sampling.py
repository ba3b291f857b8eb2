"""Issue 33 part 1, "no silent wrong answers", and issue 34's shared limits, against a
real cluster with the ``openai`` client: fresh randomness without a seed, every field
implemented or refused by name, the sampling features' effects, logprobs, n > 1, usage
in every ending, 404 for an unknown model, and the same limits on both faces."""

from __future__ import annotations

import json
import signal
import threading
import urllib.error
import urllib.request

import grpc
import pytest

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.protos import kvmesh_pb2_grpc as pbg
from kvmesh.services.common import limits
from kvmesh.services.conductor.http_request import NEUTRAL
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import DISAGG_ONLY, NODE_ARGS, generate, status
from tests.etcd_server import free_port

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(180)

PROMPT = "Once upon a time, in a cluster far away,"
MESSAGES = [{"role": "user", "content": "Tell me about the cluster."}]


def _client(port: int):
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60
    )


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    port = free_port()
    cluster = LocalCluster(
        str(tmp_path_factory.mktemp("sampling")), node_args=NODE_ARGS, http_port=port
    )
    try:
        cluster.start()
        yield cluster, _client(port), port
    finally:
        cluster.stop()


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _complete(client, **kw):
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, **kw}
    extra = {k: kw.pop(k) for k in list(kw) if k not in _OPENAI_ARGS}
    return client.completions.create(**kw, extra_body=extra or None)


_OPENAI_ARGS = {
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "n",
    "logprobs",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "stream",
    "stream_options",
}


def _ids(out, i: int = 0) -> list[int]:
    return out.choices[i].token_ids


# ------------------------------------------------------------------ seeds


def test_unseeded_sampling_differs_and_a_seed_reproduces(api):
    _, client, port = api
    a = _ids(_complete(client, temperature=1.0))
    b = _ids(_complete(client, temperature=1.0))
    assert a != b  # (was seed 0 for both: the same text)
    s1 = _ids(_complete(client, temperature=1.0, seed=1234))
    s2 = _ids(_complete(client, temperature=1.0, seed=1234))
    assert s1 == s2
    # over gRPC too: no seed field set draws fresh; seed 0 is a seed like any other
    cluster = api[0]
    samp = pb.SamplingParams(temperature=1.0)
    g1 = generate(cluster.conductor, PROMPT, max_tokens=16, sampling=samp).tokens
    g2 = generate(cluster.conductor, PROMPT, max_tokens=16, sampling=samp).tokens
    assert g1 != g2
    zero = pb.SamplingParams(temperature=1.0, seed=0)
    z1 = generate(cluster.conductor, PROMPT, max_tokens=16, sampling=zero).tokens
    assert z1 == generate(cluster.conductor, PROMPT, max_tokens=16, sampling=zero).tokens


# ------------------------------------------------------------------ the allow-list


def test_unknown_and_unimplemented_fields_are_refused_by_name(api):
    _, client, port = api
    comp = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    chat = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    bad_values = {
        "echo": True,
        "suffix": "after",
        "response_format": {"type": "json_object"},
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "functions": [{"name": "f"}],
        "tool_choice": "required",
        "function_call": {"name": "f"},
        "parallel_tool_calls": "yes",
        "audio": {"voice": "alloy"},
        "modalities": ["text", "audio"],
        "prediction": {"type": "content", "content": "x"},
        "reasoning_effort": "high",
        "verbosity": "low",
        "web_search_options": {},
        "store": True,
        "prompt_cache_key": "k",
    }
    assert set(bad_values) == set(NEUTRAL)  # every refused field is tried
    for name, value in bad_values.items():
        for path, body in (("/v1/completions", comp), ("/v1/chat/completions", chat)):
            code, out = _post(port, path, {**body, name: value})
            assert code == 400, (name, out)
            assert out["error"]["param"] == name and name in out["error"]["message"], out
    for path, body in (("/v1/completions", comp), ("/v1/chat/completions", chat)):
        code, out = _post(port, path, {**body, "frobnicate": 1})
        assert code == 400 and "frobnicate" in out["error"]["message"], out
        assert out["error"]["param"] == "frobnicate"
    for so in ({"frobnicate": True}, {"continuous_usage_stats": True}):
        code, out = _post(port, "/v1/completions", {**comp, "stream": True, "stream_options": so})
        assert code == 400 and out["error"]["param"] == "stream_options", out
        assert next(iter(so)) in out["error"]["message"]
    # a field of the other endpoint is unknown here
    code, out = _post(port, "/v1/completions", {**comp, "messages": MESSAGES})
    assert code == 400 and "messages" in out["error"]["message"]
    # the neutral values ask for nothing and pass
    ok = {
        "echo": False,
        "response_format": {"type": "text"},
        "tools": [],
        "tool_choice": "none",
        "store": False,
        "user": "someone",
    }
    code, out = _post(port, "/v1/chat/completions", {**chat, **ok})
    assert code == 200, out
    # out of range, or alternatives without logprobs: refused by name, not ignored
    code, out = _post(port, "/v1/completions", {**comp, "logprobs": 6})
    assert code == 400 and out["error"]["param"] == "logprobs"
    code, out = _post(port, "/v1/chat/completions", {**chat, "top_logprobs": 3})
    assert code == 400 and out["error"]["param"] == "top_logprobs"


# ------------------------------------------------------------------ sampling features


def test_logit_bias_forces_a_token(api):
    _, client, _ = api
    plain = _ids(_complete(client, temperature=0))
    forced = _ids(_complete(client, temperature=0, logit_bias={"65": 100}))
    assert forced == [65] * 16 and plain != forced
    barred = _ids(_complete(client, temperature=0, logit_bias={str(plain[0]): -100}))
    assert barred[0] != plain[0]
    sampled = _ids(_complete(client, temperature=1.0, logit_bias={"66": 100}))
    assert sampled == [66] * 16


def _repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


def test_penalties_reduce_repeats(api):
    _, client, _ = api
    kw = dict(temperature=0, max_tokens=48, ignore_eos=True)
    plain = _ids(_complete(client, **kw))
    assert _repeats(plain) > 10  # the tiny model loops
    for extra in (
        {"repetition_penalty": 3.0},
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
    ):
        got = _ids(_complete(client, **kw, **extra))
        assert _repeats(got) < _repeats(plain), (extra, got, plain)


def test_stop_token_ids_and_min_tokens(api):
    _, client, _ = api
    plain = _ids(_complete(client, temperature=0, ignore_eos=True))
    stop = plain[2]
    cut = _complete(client, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    k = plain.index(stop) + 1
    assert _ids(cut) == plain[:k] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens == k
    held = _complete(client, temperature=0, ignore_eos=True, stop_token_ids=[stop], min_tokens=8)
    ids = _ids(held)
    assert len(ids) >= 8 and stop not in ids[:8]
    assert ids[: k - 1] == plain[: k - 1]  # the same until the barred token


def test_min_p_one_keeps_only_the_top_token(api):
    _, client, _ = api
    greedy = _ids(_complete(client, temperature=0))
    assert _ids(_complete(client, temperature=1.0, min_p=1.0)) == greedy


def _grpc_logprobs(conductor: str, prompt: str, max_tokens: int) -> tuple[list, list]:
    req = pb.GenerateRequest(
        prompt=prompt, max_tokens=max_tokens, sampling=pb.SamplingParams(logprobs=True)
    )
    ids, lps = [], []
    with grpc.insecure_channel(conductor) as ch:
        for r in pbg.ConductorStub(ch).Generate(req, timeout=60):
            ids += r.token_ids
            lps += r.logprobs
    return ids, lps


def test_logprobs_match_the_engines_on_both_endpoints(api):
    cluster, client, _ = api
    ids, lps = _grpc_logprobs(cluster.conductor, PROMPT, 8)
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0
    )
    lp = out.choices[0].logprobs
    assert out.choices[0].token_ids == ids
    assert lp.token_logprobs == pytest.approx(lps, abs=1e-6)
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # streamed: the same, chunk by chunk
    got = []
    for chunk in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0, stream=True
    ):
        for c in chunk.choices:
            got += c.logprobs.token_logprobs if c.logprobs else []
    assert got == pytest.approx(lps, abs=1e-6)
    # chat's shape: content entries with token, logprob, bytes
    from kvmesh.services.conductor.http_api import render_default

    cids, clps = _grpc_logprobs(cluster.conductor, render_default(MESSAGES), 6)
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True
    )
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(clps, abs=1e-6)
    assert all(bytes(c.bytes).decode("utf-8", "replace") == c.token for c in content)
    assert (
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
        .choices[0]
        .logprobs
        is None
    )  # not asked for


def test_top_logprobs_are_the_engines_most_likely_tokens(api):
    cluster, client, _ = api
    req = pb.GenerateRequest(
        prompt=PROMPT,
        max_tokens=6,
        sampling=pb.SamplingParams(logprobs=True, top_logprobs=3),
    )
    tops = []
    with grpc.insecure_channel(cluster.conductor) as ch:
        for r in pbg.ConductorStub(ch).Generate(req, timeout=60):
            assert len(r.top_logprobs) == len(r.token_ids)
            tops += r.top_logprobs
    assert len(tops) == 6 and all(len(t.token_ids) == 3 for t in tops)
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.top_logprobs) == 6
    for j, alts in enumerate(lp.top_logprobs):
        assert 1 <= len(alts) <= 3  # (two ids whose texts coincide make one key)
        assert all(min(abs(v - w) for w in tops[j].logprobs) < 1e-5 for v in alts.values())
        assert max(alts.values()) == pytest.approx(tops[j].logprobs[0], abs=1e-5)
        # greedy: the chosen token is the most likely one
        assert lp.token_logprobs[j] == pytest.approx(tops[j].logprobs[0], abs=1e-5)
        assert list(tops[j].logprobs) == sorted(tops[j].logprobs, reverse=True)
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    for c in chat.choices[0].logprobs.content:
        assert len(c.top_logprobs) == 2
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-5)
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob


# ------------------------------------------------------------------ n > 1


def _computed(conductor: str) -> int:
    return sum(n.computed_tokens_total for n in status(conductor).nodes)


def test_n_choices_share_the_prompt(api):
    cluster, client, _ = api
    prompt = "A long shared prompt for three choices. " * 12  # ~480 tokens
    before = _computed(cluster.conductor)
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=77, n=3
    )
    computed = _computed(cluster.conductor) - before
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.choices}) == 3  # seeds 77, 78, 79
    p = out.usage.prompt_tokens
    assert p > 400
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in out.choices) == 24
    # the prompt computed once: the others computed at most their last partial block
    assert computed < p + 2 * 16 + 2, (computed, p)
    assert out.usage.model_extra["computed_tokens"] == computed
    # choice i is the single request with seed 77 + i
    single = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=79
    )
    by_index = {c.index: c.token_ids for c in out.choices}
    assert by_index[2] == single.choices[0].token_ids
    # streamed: three indices, each with its finish reason
    reasons = {}
    for chunk in client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, n=3, stream=True
    ):
        for c in chunk.choices:
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert set(reasons) == {0, 1, 2}


# ------------------------------------------------------------------ usage, errors


def test_usage_is_right_when_a_stop_string_ends_the_output(api):
    cluster, client, _ = api
    ref = generate(cluster.conductor, PROMPT, max_tokens=12)
    stop = next(ch for ch in ref.text[1:] if ch.isascii() and ch.isprintable())
    cut = ref.text.find(stop)
    out = _complete(client, temperature=0, max_tokens=12, stop=[stop])
    assert out.choices[0].text == ref.text[:cut] and out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens == ref.usage.prompt_tokens > 0  # (was 0)
    assert out.usage.completion_tokens == len(out.choices[0].token_ids) > 0
    usage = None
    for chunk in _complete(
        client,
        temperature=0,
        max_tokens=12,
        stop=[stop],
        stream=True,
        stream_options={"include_usage": True},
    ):
        usage = chunk.usage or usage
    assert usage.prompt_tokens == ref.usage.prompt_tokens


def test_an_unknown_model_is_404(api):
    cluster, client, port = api
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt=PROMPT, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "gpt-17" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=MESSAGES, max_tokens=2)
    with pytest.raises(grpc.RpcError) as g:
        generate(cluster.conductor, PROMPT, max_tokens=2, model="gpt-17")
    assert g.value.code() == grpc.StatusCode.NOT_FOUND


def test_limits_are_the_same_on_both_faces(api):
    """Issue 34: a 20,000-character model name over gRPC was RESOURCE_EXHAUSTED (its echo
    overflowed the reply's metadata); HTTP took 4 x 3 MiB stop strings and gRPC 16 x 256;
    temperature was capped at 2 over HTTP and 100 over gRPC; a 1 MiB request_id was
    accepted and echoed."""
    cluster, _, port = api
    long_name = "m" * 20_000
    with pytest.raises(grpc.RpcError) as g:
        generate(cluster.conductor, PROMPT, max_tokens=2, model=long_name)
    assert g.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "mmmmmmmmmm" not in g.value.details() and "model" in g.value.details()
    code, out = _post(port, "/v1/completions", {"model": long_name, "prompt": PROMPT})
    assert code == 400 and "mmmmmmmmmm" not in json.dumps(out)
    big_id = "r" * (1 << 20)
    with pytest.raises(grpc.RpcError) as g:
        generate(cluster.conductor, PROMPT, max_tokens=2, request_id=big_id)
    assert g.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rrrrrrrrrr" not in g.value.details()
    code, out = _post(port, "/v1/completions", {"prompt": PROMPT, "request_id": big_id})
    assert code == 400 and "rrrrrrrrrr" not in json.dumps(out)
    n, chars = limits.MAX_STOP_STRINGS, limits.MAX_STOP_CHARS
    cases = [
        ({"stop": ["x"] * (n + 1)}, pb.SamplingParams(stop=["x"] * (n + 1))),
        ({"stop": ["x" * (chars + 1)]}, pb.SamplingParams(stop=["x" * (chars + 1)])),
        ({"temperature": 2.5}, pb.SamplingParams(temperature=2.5)),
    ]
    for body, samp in cases:
        code, out = _post(port, "/v1/completions", {"prompt": PROMPT, **body})
        assert code == 400, (body, out)
        with pytest.raises(grpc.RpcError) as g:
            generate(cluster.conductor, PROMPT, max_tokens=2, sampling=samp)
        assert g.value.code() == grpc.StatusCode.INVALID_ARGUMENT, body
    # at the limits: accepted on both
    edge = {"stop": ["x" * chars] * n, "temperature": limits.TEMPERATURE_MAX}
    code, out = _post(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **edge})
    assert code == 200, out
    samp = pb.SamplingParams(stop=edge["stop"], temperature=edge["temperature"])
    assert generate(cluster.conductor, PROMPT, max_tokens=2, sampling=samp).tokens


# ------------------------------------------------------------------ a node dies mid-stream


def test_a_stream_cut_by_a_node_death_ends_with_an_error_event_and_done(tmp_path):
    port = free_port()
    cluster = LocalCluster(
        str(tmp_path), node_args=NODE_ARGS, http_port=port, conductor_args=DISAGG_ONLY
    )
    try:
        cluster.start()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(
                {"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        events: list[str] = []
        with urllib.request.urlopen(req, timeout=60) as r:
            killed = False
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 5 and not killed:
                    killed = True
                    threading.Thread(
                        target=cluster.stop_process, args=("decode-0", signal.SIGKILL)
                    ).start()
        assert killed and events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])
        assert set(err["error"]) >= {"message", "type", "code"}, err
        assert "decode node" in err["error"]["message"]
        tokens = sum(len(json.loads(e)["choices"][0]["token_ids"]) for e in events[:-2])
        assert 5 <= tokens < 3000
    finally:
        cluster.stop()
