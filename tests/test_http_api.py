"""The OpenAI-compatible HTTP API, driven by the official ``openai`` client against a real
cluster: the tokens equal the gRPC path's, streaming and not; errors map to HTTP."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from kvmesh.services.conductor import http_api
from kvmesh.services.conductor.cluster import NodeInfo
from kvmesh.services.conductor.http_api import (
    DEFAULT_CHAT_TEMPLATE,
    HttpApi,
    load_checkpoint_template,
    render_chat,
    render_default,
)
from kvmesh.services.launcher import LocalCluster
from tests.cluster_util import NODE_ARGS, generate
from tests.etcd_server import free_port

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(120)

PROMPT = "Once upon a time, in a cluster far away,"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    port = free_port()
    cluster = LocalCluster(
        str(tmp_path_factory.mktemp("http")), node_args=NODE_ARGS, http_port=port
    )
    try:
        cluster.start()
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60
        )
        yield cluster, client, port
    finally:
        cluster.stop()


def test_models(api):
    _, client, _ = api
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_completions_equal_the_grpc_path(api):
    cluster, client, _ = api
    ref = generate(cluster.conductor, PROMPT, max_tokens=8)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    choice = out.choices[0]
    assert choice.token_ids == ref.tokens
    assert choice.text == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == ref.usage.prompt_tokens
    assert out.usage.completion_tokens == len(ref.tokens) == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8

    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    ids, text, reasons, usage = [], "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            ids += c.token_ids
            text += c.text
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert ids == ref.tokens and text == ref.text
    assert reasons == [ref.finish_reason]
    assert usage.completion_tokens == 8

    # Token ids as the prompt: the same tokens as gRPC with the same token ids.
    ids_prompt = list(PROMPT.encode())
    ref_ids = generate(cluster.conductor, token_ids=ids_prompt, max_tokens=8)
    by_ids = client.completions.create(model="tiny", prompt=ids_prompt, max_tokens=8, temperature=0)
    assert by_ids.choices[0].token_ids == ref_ids.tokens
    assert by_ids.usage.prompt_tokens == len(ids_prompt)


def test_chat_equals_the_grpc_path(api):
    cluster, client, _ = api
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello!"},
    ]
    prompt = render_default(messages)
    assert prompt == "<|system|>\nYou are terse.\n<|user|>\nHello!\n<|assistant|>\n"
    ref = generate(cluster.conductor, prompt, max_tokens=6)
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].token_ids == ref.tokens
    assert out.usage.prompt_tokens == ref.usage.prompt_tokens  # the BOS + the bytes

    text, ids = "", []
    for chunk in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True
    ):
        for c in chunk.choices:
            text += c.delta.content or ""
            ids += c.token_ids
    assert text == ref.text and ids == ref.tokens


def test_errors(api):
    cluster, client, port = api
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
    assert "max_tokens" in e.value.message
    assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    # An SLO below the floor (no node could ever meet it): 400 naming the floor, no
    # Retry-After (a busy cluster's 429: test_a_busy_cluster_is_a_429_and_a_floor_a_400).
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"ttft_slo_ms": 0.001}
        )
    assert "retry-after" not in e.value.response.headers
    assert "TTFT SLO of 0.001 ms is below the floor" in e.value.message, e.value.message
    assert e.value.body["type"] == "invalid_request_error"
    # Streaming requests are rejected before the stream starts, with the same status.
    with pytest.raises(openai.BadRequestError):
        list(
            client.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=4,
                stream=True,
                extra_body={"ttft_slo_ms": 0.001},
            )
        )
    # Not JSON.
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=b"{nope",
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as h:
        urllib.request.urlopen(req, timeout=10)
    assert h.value.code == 400 and "error" in json.loads(h.value.read())


def test_a_busy_cluster_is_a_429_and_a_floor_a_400():
    """The conductor's refusals in HTTP: RESOURCE_EXHAUSTED (an SLO within reach, queues
    too long: see test_policy) is 429 with Retry-After; INVALID_ARGUMENT (an SLO below
    the floor) is 400 without one, its message kept."""
    import grpc

    from kvmesh.services.conductor.frontend import Rejected

    busy = http_api.from_rejected(
        Rejected(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "estimated TTFT 47.0 ms ... exceeds the TTFT SLO of 40.0 ms; retry after 1500 ms",
            (("retry-after-ms", "1500"), ("kvmesh-reject-reason", "ttft")),
        )
    )
    assert busy.status == 429 and busy.headers["Retry-After"] == "2"
    floor = http_api.from_rejected(
        Rejected(
            grpc.StatusCode.INVALID_ARGUMENT,
            "the TTFT SLO of 0.01 ms is below the floor",
            (("kvmesh-reject-reason", "infeasible"),),
        )
    )
    assert floor.status == 400 and floor.type == "invalid_request_error"
    assert "below the floor" in floor.message and "Retry-After" not in floor.headers


def test_stop_strings(api):
    cluster, client, _ = api
    ref = generate(cluster.conductor, PROMPT, max_tokens=12)
    if len(ref.text) < 4:
        pytest.skip("reference text too short to cut")
    stop = ref.text[2:4]
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop]
    )
    assert out.choices[0].text == ref.text[: ref.text.find(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_checkpoint_chat_template(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>"},
                "eos_token": "</s>",
                "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] "
                "{{ m['content'] }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}",
            }
        )
    )
    tpl = load_checkpoint_template(str(tmp_path))
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(msgs, tpl) == "<s>[user] hi</s>[assistant] "
    assert render_chat(msgs, None) == render_default(msgs)
    assert load_checkpoint_template(str(tmp_path / "missing")) is None
    # The documented default template renders like the Python fallback.
    from jinja2 import Template

    assert Template(DEFAULT_CHAT_TEMPLATE).render(
        messages=msgs, add_generation_prompt=True
    ) == render_default(msgs)


def test_a_chat_template_that_fails_on_the_messages_is_the_clients_400():
    from kvmesh.services.conductor.http_api import ApiError

    msgs = [{"role": "user", "content": "hi"}]
    broken = {
        "bos_token": "",
        "eos_token": "",
        "template": "{% macro loop(n) %}{{ loop(n) }}{% endmacro %}{{ loop(1) }}",  # recursion
    }
    for template in (broken["template"], "{{ messages[5]['content'] }}", "{{ 1 / 0 }}"):
        with pytest.raises(ApiError) as e:
            render_chat(msgs, {**broken, "template": template})
        assert e.value.status == 400 and "chat template" in str(e.value)


def test_missing_jinja2_is_an_error_once_when_a_model_ships_a_template(
    tmp_path, monkeypatch, caplog
):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
    )
    nodes = [
        NodeInfo("d0", "decode", "", {"model": "templated", "model_path": str(tmp_path)}),
        NodeInfo("d1", "decode", "", {"model": "plain"}),
    ]
    view = SimpleNamespace(
        nodes=lambda role=None: nodes, models=lambda: {"templated": ["a"], "plain": ["b"]}
    )
    conductor = SimpleNamespace(view=view)
    msgs = [{"role": "user", "content": "hi"}]

    monkeypatch.setattr(http_api, "HAVE_JINJA2", False)
    api = HttpApi(conductor, "127.0.0.1", 0)
    with caplog.at_level(logging.WARNING, logger=http_api.__name__):
        api.on_member("join", "/c/nodes/decode/d0", b"{}")
        api.on_member("join", "/c/nodes/decode/d1", b"{}")  # said once per model
        errors = [r.getMessage() for r in caplog.records]
        assert len(errors) == 1 and caplog.records[0].levelno == logging.ERROR
        assert "'templated'" in errors[0] and "jinja2" in errors[0]
        # requests quietly get the default template
        caplog.clear()
        assert render_chat(msgs, load_checkpoint_template(str(tmp_path))) == render_default(msgs)
        assert not caplog.records

    monkeypatch.setattr(http_api, "HAVE_JINJA2", True)
    with caplog.at_level(logging.WARNING, logger=http_api.__name__):
        HttpApi(conductor, "127.0.0.1", 0).on_member("join", "/c/nodes/decode/d0", b"{}")
    assert not caplog.records


# ------------------------------------------------------------------ bad input (issue 18)


def _post_raw(port: int, path: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_out_of_range_and_ill_formed_input_is_a_400_naming_the_field(api):
    """Each of these was a 500 (a protobuf range error, UnicodeEncodeError,
    RecursionError) or, for ``stream: "no"``, taken as true."""
    _, client, port = api
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    cases = [
        ({**body, "max_tokens": 10**20}, "/v1/completions", "max_tokens", "2147483647"),
        ({**body, "top_k": 10**20}, "/v1/completions", "top_k", "2147483647"),
        ({**body, "prompt": [1, 2**40]}, "/v1/completions", "prompt[1]", "token ids"),
        ({**body, "prompt": [2**70]}, "/v1/completions", "prompt[0]", "token ids"),
        ({**body, "prompt": "ok \ud800"}, "/v1/completions", "prompt", "surrogate"),
        ({**body, "stream": "no"}, "/v1/completions", "stream", "true or false"),
        ({**body, "top_k": -1}, "/v1/completions", "top_k", "0 = off"),
        ({**body, "ttft_slo_ms": -0.3}, "/v1/completions", "ttft_slo_ms", "cluster default"),
        ({**body, "seed": 2**64}, "/v1/completions", "seed", "an integer from"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "\udfff"}]},
            "/v1/chat/completions",
            "messages[0].content",
            "surrogate",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2**70},
            "/v1/chat/completions",
            "max_tokens",
            "2147483647",
        ),
    ]
    for case, path, field, says in cases:
        code, out = _post_raw(port, path, json.dumps(case).encode())
        assert code == 400, (case, out)
        err = out["error"]
        assert err["type"] == "invalid_request_error" and err["param"] in field, (case, err)
        assert field in err["message"] and says in err["message"], (case, err)
        assert "None" not in err["message"], err
    for raw, says in (
        (b"[" * 100_000, "too deeply"),
        (b'{"prompt": "hi", "temperature": NaN}', "NaN"),
        (b'{"prompt": "hi", "temperature": 1e400}', "temperature"),
        # a JSON integer too big for a float (math.isfinite would overflow)
        (b'{"prompt": "hi", "temperature": 1' + b"0" * 400 + b"}", "temperature"),
        (b'{"prompt": "hi", "top_p": 1' + b"0" * 400 + b"}", "top_p"),
        (b'{"prompt": "hi", "ttft_slo_ms": 1' + b"0" * 400 + b"}", "ttft_slo_ms"),
        (b'{"prompt": "hi", "tbt_slo_ms": 1' + b"0" * 400 + b"}", "tbt_slo_ms"),
        # past Python's 4,300-digit limit for int parsing
        (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "4300 digits"),
    ):
        code, out = _post_raw(port, "/v1/completions", raw)
        assert code == 400 and says in out["error"]["message"], (raw[:40], out)
    # the service keeps serving
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
    assert len(out.choices[0].token_ids) == 2


def test_refusals_of_aiohttp_itself_have_the_openai_error_shape(api):
    _, _, port = api
    code, out = _post_raw(port, "/v1/completions", b"{" + b" " * (17 << 20))
    assert code == 413 and "16 MiB" in out["error"]["message"]
    assert out["error"]["type"] == "invalid_request_error"
    code, out = _post_raw(port, "/v1/nothing-here", b"{}")
    assert code == 404 and "/v1/completions" in out["error"]["message"]


def test_a_huge_prompt_is_refused_by_its_length_before_tokenizing(api):
    """A 15 MB prompt: its bytes alone exceed the context, so it is refused without being
    tokenized (the message says so and names the limit); /health answers meanwhile."""
    import concurrent.futures

    _, _, port = api
    huge = json.dumps({"model": "tiny", "prompt": "x" * 15_000_000, "max_tokens": 4}).encode()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(_post_raw, port, "/v1/completions", huge)
        for _ in range(3):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=60) as r:
                assert r.status == 200
        code, out = fut.result(timeout=120)
    msg = out["error"]["message"]
    assert code == 400, out
    assert "15000000 bytes" in msg and "context of 4096 tokens" in msg, msg


def test_long_prompts_are_tokenized_off_the_event_loop():
    """By ordering: a tokenizer that waits inside ``encode`` until /health has been
    answered. On the event loop it would block the loop, /health could not be answered
    until encode gave up, and the tokens would come first."""
    import asyncio
    import threading

    import aiohttp

    from kvmesh.services.common.tokenizer import ByteTokenizer
    from kvmesh.services.conductor.request_input import tokenize_prompt

    class Gated(ByteTokenizer):
        def __init__(self) -> None:
            self.started, self.release = threading.Event(), threading.Event()

        def encode(self, text: str, add_bos: bool = True) -> list[int]:
            self.started.set()
            self.release.wait(20)  # bounded: the old code path gets here on the loop
            return super().encode(text, add_bos)

    async def main() -> list[str]:
        conductor = SimpleNamespace(health=SimpleNamespace(serving=True))
        server = HttpApi(conductor, "127.0.0.1", 0)
        address = await server.start()
        order: list[str] = []
        tok = Gated()
        try:
            task = asyncio.ensure_future(tokenize_prompt(tok, "y" * 100_000, 8, 200_000, 0))
            task.add_done_callback(lambda _: order.append("tokens"))
            await asyncio.to_thread(tok.started.wait, 20)
            async with aiohttp.ClientSession() as s:
                async with s.get(f"http://{address}/health") as r:
                    assert r.status == 200
                    order.append("health")
            tok.release.set()
            assert len(await task) == 100_001
        finally:
            tok.release.set()
            await server.stop()
        return order

    assert asyncio.run(main()) == ["health", "tokens"]


def test_the_byte_bound_never_refuses_a_prompt_that_fits():
    import asyncio

    import grpc

    from kvmesh.services.common.tokenizer import ByteTokenizer
    from kvmesh.services.conductor.frontend import Rejected
    from kvmesh.services.conductor.request_input import tokenize_prompt

    tok = ByteTokenizer()
    fits = "é" * 50  # 100 bytes + BOS = 101 tokens
    assert len(asyncio.run(tokenize_prompt(tok, fits, 27, 128, 0))) == 101
    with pytest.raises(Rejected) as e:
        asyncio.run(tokenize_prompt(tok, fits, 28, 128, 0))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "context of 128" in e.value.message
    with pytest.raises(Rejected) as e:
        asyncio.run(tokenize_prompt(tok, fits, 1, 128, 100))
    assert "at most 100 prompt tokens" in e.value.message


def test_byte_level_tokenizers_bound_tokens_by_bytes(tmp_path):
    """``max_token_bytes`` of a byte-level BPE: no text makes fewer tokens than its bytes
    allow (so the length check never refuses a prompt that fits); a tokenizer with a
    normalizer gets no bound."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import normalizers, pre_tokenizers, trainers

    from kvmesh.services.common.tokenizer import HFTokenizer

    def write(d, normalizer=None) -> HFTokenizer:
        tok = tokenizers.Tokenizer(tokenizers.models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.normalizer = normalizer
        trainer = trainers.BpeTrainer(
            vocab_size=400,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<s>", "</s>", "<|a-long-special-token|>"],
        )
        tok.train_from_iterator(
            ["the cat sat on the mat; " * 40, "    indented  code\n" * 20], trainer
        )
        d.mkdir()
        tok.save(str(d / "tokenizer.json"))
        (d / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
        return HFTokenizer(str(d))

    t = write(tmp_path / "bpe")
    per = t.max_token_bytes
    assert per is not None and per >= len("<|a-long-special-token|>")
    texts = [
        "the cat sat on the mat; " * 300,
        " " * 5000,
        "<|a-long-special-token|>" * 50,
        "héllo wörld 🙂 " * 100,
        "\n\n    indented  code\n" * 200,
    ]
    for text in texts:
        n = len(text.encode())
        assert len(t.encode(text)) >= -(-n // per) + 1, text[:30]
        assert len(t.encode(text, add_bos=False)) >= -(-n // per), text[:30]
    assert write(tmp_path / "nfkc", normalizers.NFKC()).max_token_bytes is None


def test_with_tls_the_http_api_speaks_https_only(tmp_path):
    """A conductor with a TLS certificate serves the OpenAI API over HTTPS with it (the
    bearer keys never cross in the clear); plain HTTP on that port gets no answer."""
    import http.client
    import ssl

    cluster = LocalCluster(
        str(tmp_path),
        prefill=0,
        decode=0,
        node_args=["--segment-memory", "0"],
        tls=True,
        api_key="tls-key",
        conductor_args=["--api-keys", "tls-key"],
    )
    try:
        cluster.start()
        port = cluster.http_port
        ca = ssl.create_default_context(cafile=cluster.client_tls().ca)
        with urllib.request.urlopen(
            f"https://127.0.0.1:{port}/health", context=ca, timeout=30
        ) as r:
            assert r.status == 200 and json.loads(r.read())["status"] == "SERVING"
        req = urllib.request.Request(
            f"https://localhost:{port}/v1/models", headers={"Authorization": "Bearer tls-key"}
        )
        with urllib.request.urlopen(req, context=ca, timeout=30) as r:
            assert json.loads(r.read())["object"] == "list"
        # the certificate is checked: without the CA the client refuses the server
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=30)
        # plain HTTP: the TLS server answers no HTTP at all
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            with pytest.raises((http.client.HTTPException, ConnectionError)):
                conn.request("GET", "/health")
                conn.getresponse()
        finally:
            conn.close()
    finally:
        cluster.stop()


def test_grpc_slo_values_must_be_numbers(api):
    """gRPC's wire types hold every value it can carry; what they cannot rule out is NaN:
    an SLO of NaN passed the ``< 0`` check and became the request's TTFT budget."""
    import grpc

    from kvmesh.protos import kvmesh_pb2 as pb

    cluster, _, _ = api
    for slo in (pb.SLO(ttft_ms=float("nan")), pb.SLO(tbt_ms=float("nan")), pb.SLO(ttft_ms=-1)):
        with pytest.raises(grpc.RpcError) as e:
            generate(cluster.conductor, PROMPT, max_tokens=2, slo=slo)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "slo.ttft_ms and slo.tbt_ms must be numbers >= 0" in e.value.details()
