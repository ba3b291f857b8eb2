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
    _StopCutter,
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
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    # Early rejection: 429 with Retry-After in whole seconds.
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"ttft_slo_ms": 0.001}
        )
    retry = e.value.response.headers["retry-after"]
    assert retry.isdigit() and int(retry) >= 1
    assert "TTFT" in e.value.message or "SLO" in e.value.message.upper()
    # Streaming requests are rejected before the stream starts, with the same status.
    with pytest.raises(openai.RateLimitError):
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


def test_stop_cutter_holds_partial_matches():
    c = _StopCutter(["END"])
    assert c.feed("abcE") == ("abc", False)
    assert c.feed("N") == ("", False)
    assert c.feed("Dxyz") == ("", True)
    c = _StopCutter(["END"])
    assert c.feed("abE") == ("ab", False)
    assert c.feed("x", final=True) == ("Ex", False)


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
