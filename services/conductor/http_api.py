"""OpenAI-compatible HTTP API of the conductor (aiohttp, same process and event loop).

Endpoints (``--http-port``; default 8000, 0 = any free port, -1 = off; the bound address
is advertised in etcd as ``"http"`` and shown by ``kvmesh status``; HTTPS, and only HTTPS,
with the service's ``--tls-cert``/``--tls-key``, no client certificate asked for):

  GET  /v1/models              the models this cluster serves
  POST /v1/completions         prompt: a string, a list of token ids, or a one-element
                               list of either; stream (SSE) or not
  POST /v1/chat/completions    messages rendered by the chat template (below); stream or not
  GET  /health                 200 when the conductor is SERVING, 503 otherwise
  GET  /metrics, GET /version, POST /tokenize, POST /detokenize
                               as ``vllm serve`` has them (``http_vllm``)

Every request calls ``Conductor.generate`` directly (no gRPC hop), through the same
metrics wrapper as the gRPC API. Every field is implemented or refused with a 400 naming
it (an allow-list: ``http_request.IMPLEMENTED``; OpenAI's fields kvmesh does not build,
such as ``response_format``, ``tools`` and ``echo``, pass only with a value that asks for
nothing: ``http_request.NEUTRAL``). Implemented: model, max_tokens
(``max_completion_tokens`` for chat), temperature (default 1.0, as OpenAI), top_p, seed
(none: fresh randomness, drawn once by the conductor), stop (the text is cut before the
stop string), n (choices share the prompt's KV: choice 0 first, the rest once its prompt
is cached; with a seed, choice i samples with seed + i), presence_penalty,
frequency_penalty, logit_bias, logprobs (each token's log-probability under the raw
logits, and its most likely alternatives: completions ``logprobs`` 0-5, chat
``logprobs=true`` with ``top_logprobs`` 0-20), stream,
stream_options.include_usage, user (ignored). vLLM's: top_k, min_p, repetition_penalty,
stop_token_ids, min_tokens, ignore_eos. kvmesh's: cache_salt, request_id, ttft_slo_ms,
tbt_slo_ms. Each choice also carries ``token_ids`` (the generated token ids), and usage
``computed_tokens`` (the prompt tokens the nodes computed, over all choices). Limits
shared with the gRPC face: ``kvmesh.services.common.limits``.

Errors follow OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: bad input
-> 400 ``invalid_request_error`` (what is checked: ``http_request``, ``http_body``), a body
over 16 MiB, also once inflated (gzip or deflate; other encodings 415) -> 413, a model the
cluster does not serve -> 404 ``model_not_found``, unknown paths 404 and methods 405 (a
reply that leaves the body unread closes the connection); early rejection (the TTFT SLO
cannot be met, or no KV room) -> 429 with ``Retry-After`` (whole seconds, rounded up) and
``retry-after-ms``;
no node for the model -> 503; a failure after streaming began ends the SSE stream with
an error event in the same shape, then ``data: [DONE]``. With conductor ``--api-keys``
every /v1 endpoint wants ``Authorization: Bearer <key>`` (missing or wrong -> 401
``authentication_error``); the key's tenant salts the request's prefix hashes (see
``kvmesh.services.common.auth``).

Chat template: the checkpoint's ``chat_template`` from ``tokenizer_config.json`` (found
through the nodes' ``model_path``) rendered with jinja2 (a dependency: should it be
missing, an error is logged when such a model joins, and its chats get the default
template); otherwise the default template for the byte tokenizer::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n ... <|assistant|>\\n

i.e. for each message ``<|{role}|>`` newline content newline, then ``<|assistant|>``
newline to prompt the reply.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import ssl
import sys
import time
import uuid
from typing import Any

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.common import telemetry
from kvmesh.services.common.auth import Unauthenticated, current_principal
from kvmesh.services.common.channels import TlsFiles, bind_error
from kvmesh.services.common.tokenizer import load_tokenizer
from kvmesh.services.conductor.frontend import ConductorApi, Rejected, client_id
from kvmesh.services.conductor.http_body import close_unread, read_body
from kvmesh.services.conductor.http_choices import FanOut, Shape
from kvmesh.services.conductor.http_request import MAX_BODY_BYTES, ApiError, build
from kvmesh.services.conductor.http_vllm import PATHS, VllmEndpoints, model_cards

try:
    import jinja2
    import jinja2.sandbox

    HAVE_JINJA2 = True
except ImportError:  # a declared dependency; HttpApi.on_member says so loudly when it matters
    HAVE_JINJA2 = False

log = logging.getLogger(__name__)

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def from_rejected(e: Rejected) -> ApiError:
    """Maps a conductor ``Rejected`` (gRPC code + message + trailing metadata) to HTTP."""
    md = dict(e.metadata or ())
    if e.code == grpc.StatusCode.INVALID_ARGUMENT:
        return ApiError(400, e.message)
    if e.code == grpc.StatusCode.NOT_FOUND:  # (the conductor's only NOT_FOUND: the model)
        return ApiError(404, e.message, "invalid_request_error", "model", "model_not_found")
    if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        ms = float(md.get("retry-after-ms", 1000) or 1000)
        return ApiError(
            429,
            e.message,
            "rate_limit_exceeded",
            code="rate_limit_exceeded",
            headers={
                "Retry-After": str(max(1, math.ceil(ms / 1000))),
                "retry-after-ms": f"{ms:.0f}",
            },
        )
    if e.code == grpc.StatusCode.UNAVAILABLE:
        return ApiError(503, e.message, "service_unavailable", code="service_unavailable")
    if e.code == grpc.StatusCode.ALREADY_EXISTS:  # a request_id already in flight
        return ApiError(409, e.message, "invalid_request_error", "request_id", "conflict")
    return ApiError(500, e.message, "server_error")


# ------------------------------------------------------------------ chat templates


def render_default(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """The default template in plain Python (same output as DEFAULT_CHAT_TEMPLATE)."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def _token_text(tok: Any) -> str:
    if isinstance(tok, dict):
        return str(tok.get("content", ""))
    return tok or ""


def load_checkpoint_template(model_path: str) -> dict[str, Any] | None:
    """``{"template", "bos_token", "eos_token"}`` from ``model_path/tokenizer_config.json``
    when it has a ``chat_template``; None otherwise."""
    if not model_path or not os.path.isdir(model_path):
        return None
    path = os.path.join(model_path, "tokenizer_config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    if not isinstance(tpl, str) or not tpl:
        return None
    return {
        "template": tpl,
        "bos_token": _token_text(cfg.get("bos_token")),
        "eos_token": _token_text(cfg.get("eos_token")),
    }


def render_chat(messages: list[dict[str, str]], checkpoint: dict[str, Any] | None) -> str:
    """The prompt for ``messages``: the checkpoint's template (from
    ``load_checkpoint_template``) rendered in a jinja2 sandbox, else the default template.
    Without jinja2 the default one is used (``HttpApi.on_member`` logged an error)."""
    if checkpoint is None or not HAVE_JINJA2:
        return render_default(messages)

    def raise_exception(msg: str):
        raise ApiError(400, f"chat template: {msg}", param="messages")

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(checkpoint["template"]).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=checkpoint["bos_token"],
            eos_token=checkpoint["eos_token"],
        )
    except ApiError:
        raise
    # the template is the checkpoint's code run on the client's messages: its own errors,
    # and those of the Python operations it may apply to them, are the client's 400
    except (
        jinja2.TemplateError,
        TypeError,
        ValueError,
        LookupError,
        AttributeError,
        ArithmeticError,
        RecursionError,  # a template's macro calling itself, on these messages
    ) as e:
        raise ApiError(
            400, f"the model's chat template failed on these messages: {e}", param="messages"
        ) from None


# ------------------------------------------------------------------ the server


class QuietClientErrors(logging.LoggerAdapter):
    """aiohttp's server logger, except that malformed HTTP and a client gone in the middle
    of its request are the client's doing: one INFO line each, not an ERROR with a stack
    trace."""

    def exception(self, msg: Any, *args: Any, exc_info: Any = True, **kw: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, (HttpProcessingError, ConnectionError)):
            self.logger.info("%s: %s", msg % args if args else msg, exc)
            return
        self.logger.exception(msg, *args, exc_info=exc_info, **kw)


# the request's key for when it arrived (perf_counter); a typed key where aiohttp has them
ARRIVAL: Any = (
    web.RequestKey("kvmesh_arrival", float) if hasattr(web, "RequestKey") else "kvmesh_arrival"
)


@web.middleware
async def stamp_arrival(request: web.Request, handler) -> web.StreamResponse:
    """Notes when a request arrived (its headers read, before its body): its TTFT counts
    from there, the conductor's reading and parsing of the body included."""
    request[ARRIVAL] = time.perf_counter()
    return await handler(request)


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own refusals (unknown path, wrong method, a body over the limit) in
    OpenAI's error shape too."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        if e.status == 413:
            msg = f"the request body is larger than the {MAX_BODY_BYTES >> 20} MiB limit"
        elif e.status in (404, 405):
            msg = (
                f"no {request.method} {request.path}: this API serves GET /v1/models, "
                f"POST /v1/completions, POST /v1/chat/completions, GET /health, "
                f"{', '.join(PATHS)}"
            )
        else:
            msg = e.text or e.reason
        return ApiError(
            e.status, msg, headers={"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        ).response()


class HttpApi:
    """The HTTP server (module docstring) over the conductor ``conductor``; a connection
    idle for ``idle_timeout_s`` (no request yet, or none since the last reply) is
    closed."""

    def __init__(
        self,
        conductor: ConductorApi,
        host: str,
        port: int,
        tls: TlsFiles | None = None,
        idle_timeout_s: float = 10.0,
    ) -> None:
        self.c = conductor
        self.host, self.port = host, port
        self.idle_timeout_s = idle_timeout_s
        self.tls = tls if tls is not None and tls.cert else None
        self.scheme = "https" if self.tls else "http"
        self.address = ""
        self._runner: web.AppRunner | None = None
        self._templates: dict[str, dict | None] = {}
        self._templates_checked: set[str] = set()
        self._tokenizers: dict[str, Any] = {}

    def _ssl_context(self) -> ssl.SSLContext | None:
        """HTTPS with the service's own certificate (``--tls-cert/--tls-key``), so API keys
        never cross in the clear. No client certificate is asked for, even with
        ``--tls-ca``: HTTP clients authenticate with their bearer key."""
        if self.tls is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.tls.cert, self.tls.key)
        return ctx

    async def start(self) -> str:
        app = web.Application(
            client_max_size=MAX_BODY_BYTES,
            middlewares=[stamp_arrival, close_unread, openai_errors],
        )
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        VllmEndpoints(
            self.c,
            self._authenticate,
            lambda r: read_body(r, self._largest_context),
            self._render,
            from_rejected,
        ).add_routes(app)
        runner = self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            # a client that closes its connection cancels its handler, so a non-streamed
            # completion stops and frees its KV at once (aiohttp's default runs it on)
            handler_cancellation=True,
            # bodies are inflated by http_body, only when read and with a cap; an unread
            # one is not drained after the reply (close_unread closes the connection)
            auto_decompress=False,
            lingering_time=0,
            # idle keep-alive connections, and ones that never finish their headers,
            # are closed after this long (aiohttp's default holds them for an hour)
            keepalive_timeout=self.idle_timeout_s,
            logger=QuietClientErrors(logging.getLogger("aiohttp.server"), {}),
        )
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, ssl_context=self._ssl_context())
        try:
            await site.start()
        except OSError:
            await runner.cleanup()
            raise bind_error(f"{self.host}:{self.port}", "the HTTP API", "--http-port") from None
        port = runner.addresses[0][1]
        self.address = f"{self.host}:{port}"
        log.info("OpenAI-compatible HTTP API on %s://%s/v1", self.scheme, self.address)
        return self.address

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- endpoints ---------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        ok = self.c.health.serving
        return web.json_response(
            {"status": "SERVING" if ok else "NOT_SERVING"}, status=200 if ok else 503
        )

    def _authenticate(self, request: web.Request) -> None:
        """Checks the bearer API key (conductor ``--api-keys``) and sets the request's
        tenant; raises ApiError 401. Open when no key is configured."""
        keys = self.c.api_keys
        if not keys.enabled:
            return
        try:
            current_principal.set(keys.authenticate(request.headers.get("Authorization")))
        except Unauthenticated as e:
            raise ApiError(
                401,
                str(e),
                "authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            ) from None

    async def models(self, request: web.Request) -> web.Response:
        try:
            self._authenticate(request)
        except ApiError as e:
            return e.response()
        return web.json_response({"object": "list", "data": model_cards(self.c)})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind

        path = request.path
        with telemetry.tracer().start_as_current_span(
            f"POST {path}",
            context=propagate.extract(dict(request.headers)),
            kind=SpanKind.SERVER,
            attributes={"http.route": path},
        ):
            try:
                self._authenticate(request)
                body = await read_body(request, self._largest_context)
                req, opts = build(body, chat, self._render)
                return await self._run(request, req, opts, chat)
            except ApiError as e:
                return e.response()

    def _largest_context(self) -> int:
        """The largest context, in tokens, of the models served (0: none known yet)."""
        return max((int(n.raw.get("max_context") or 0) for n in self.c.view.nodes()), default=0)

    def _model_path(self, model: str) -> str:
        for n in self.c.view.nodes():
            if n.model == model and n.raw.get("model_path"):
                return n.raw["model_path"]
        return ""

    def _chat_template(self, model: str) -> dict | None:
        if model not in self._templates:
            self._templates[model] = load_checkpoint_template(self._model_path(model))
        return self._templates[model]

    def on_member(self, event: str, key: str, value: bytes | None) -> None:
        """Membership listener: without jinja2, logs an error once for each model that
        joins shipping a chat template (its chat requests get the default template)."""
        if HAVE_JINJA2 or event == "leave":
            return
        for model in self.c.view.models():
            if model in self._templates_checked:
                continue
            self._templates_checked.add(model)
            path = self._model_path(model)
            if load_checkpoint_template(path) is not None:
                log.error(
                    "model %r ships a chat template (%s/tokenizer_config.json) but the "
                    "jinja2 package is not installed: its chat requests get kvmesh's default "
                    "template instead; install jinja2",
                    model,
                    path,
                )

    def _render(self, messages: list[dict[str, str]], model: str) -> str:
        """A chat's prompt: the model's template (the only model's when none is named)."""
        served = self.c.view.models()
        name = model or (next(iter(served)) if len(served) == 1 else "")
        return render_chat(messages, self._chat_template(name) if name else None)

    async def _run(
        self, request: web.Request, req: pb.GenerateRequest, opts: dict, chat: bool
    ) -> web.StreamResponse:
        client_id.set(
            current_principal.get().tenant if self.c.api_keys.enabled else (request.remote or "")
        )
        created = int(time.time())
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        model = opts["model"] or self._model_name()
        fan = FanOut(self.c, req, opts["n"], request.get(ARRIVAL))
        try:
            try:
                await fan.start()
            except Rejected as e:
                raise from_rejected(e) from None
            shape = Shape(rid, created, model, chat, self._token_texts(model, opts))
            if not opts["stream"]:
                return await self._collect(fan, shape)
            return await self._stream(request, fan, shape, opts["include_usage"])
        finally:
            await fan.aclose()

    def _model_name(self) -> str:
        return self.c.model_label("")

    def _token_texts(self, model: str, opts: dict):
        """``ids -> [text of each token]`` for logprobs (None when none are asked for):
        by the tokenizer of the model's nodes."""
        if not opts["logprobs"]:
            return None
        info = next((n.raw for n in self.c.view.nodes() if n.model == model), None)
        if info is None:
            return None
        inp = getattr(self.c, "input", None)  # the conductor's own tokenizers, if it has them
        if inp is not None:
            tok = inp.tokenizer(info)
        else:
            spec = info.get("model_path") or info.get("model", "")
            tok = self._tokenizers.get(spec)
            if tok is None:
                tok = self._tokenizers[spec] = load_tokenizer(spec)
        return lambda ids: [tok.decode([t]) for t in ids]

    @staticmethod
    def _usage(usages: list[pb.Usage | None], completion: int) -> dict:
        """One request's usage over its choices: the prompt counted once, the completions
        summed; ``computed_tokens`` (a kvmesh extension) sums the prompt tokens the nodes
        computed over all choices (n choices share the prompt's KV: about one prompt)."""
        first = usages[0]
        prompt = first.prompt_tokens if first is not None else 0
        done = [u for u in usages if u is not None]
        if len(done) == len(usages):
            completion = sum(u.completion_tokens for u in done)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {
                "cached_tokens": first.cached_tokens if first is not None else 0
            },
            "computed_tokens": sum(u.computed_tokens for u in done),
        }

    async def _collect(self, fan: FanOut, shape: Shape) -> web.Response:
        n = fan.n
        text = [""] * n
        ids: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        tops: list[list[pb.TopLogprobs]] = [[] for _ in range(n)]
        reasons: list[str] = [""] * n
        usages: list[pb.Usage | None] = [None] * n
        try:
            async for i, resp in fan:
                ids[i].extend(resp.token_ids)
                lps[i].extend(resp.logprobs)
                tops[i].extend(resp.top_logprobs)
                text[i] += resp.text
                if resp.finish_reason:
                    reasons[i], usages[i] = resp.finish_reason, resp.usage
        except Rejected as e:
            raise from_rejected(e) from None
        choices = []
        for i in range(n):
            choice: dict[str, Any] = {
                "index": i,
                "finish_reason": reasons[i] or "stop",
                "token_ids": ids[i],
                "logprobs": shape.logprobs(ids[i], lps[i], tops[i], 0),
            }
            if shape.chat:
                choice["message"] = {"role": "assistant", "content": text[i]}
            else:
                choice["text"] = text[i]
            choices.append(choice)
        return web.json_response(
            {
                "id": shape.rid,
                "object": "chat.completion" if shape.chat else "text_completion",
                "created": shape.created,
                "model": shape.model,
                "choices": choices,
                "usage": self._usage(usages, sum(map(len, ids))),
                "system_fingerprint": None,
            }
        )

    async def _stream(
        self, request, fan: FanOut, shape: Shape, include_usage: bool
    ) -> web.StreamResponse:
        out = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            },
        )
        await out.prepare(request)
        n = fan.n
        n_ids, offset = [0] * n, [0] * n
        usages: list[pb.Usage | None] = [None] * n
        first = [True] * n
        try:
            try:
                async for i, resp in fan:
                    ids = list(resp.token_ids)
                    reason = resp.finish_reason or None
                    if reason:
                        usages[i] = resp.usage
                    lp = shape.logprobs(ids, list(resp.logprobs), resp.top_logprobs, offset[i])
                    n_ids[i] += len(ids)
                    offset[i] += len(resp.text)
                    await out.write(shape.chunk(i, resp.text, ids, reason, first[i], lp))
                    first[i] = False
                if include_usage:
                    await out.write(shape.usage_chunk(self._usage(usages, sum(n_ids))))
            except Rejected as e:
                # ended mid-stream (a node failed, the conductor shut down): an error event
                # in OpenAI's shape, then [DONE], so a client sees why the text stopped
                await out.write(shape.event(from_rejected(e).body()))
            except (ConnectionError, asyncio.CancelledError):
                raise
            except Exception as e:  # a bug, not the client's: said, logged, and ended
                log.exception("stream %s failed", shape.rid)
                err = ApiError(500, f"the stream failed: {type(e).__name__}", "server_error")
                await out.write(shape.event(err.body()))
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
        except ConnectionError:
            log.info("client of %s went away", shape.rid)
        return out
