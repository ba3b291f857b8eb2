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
metrics wrapper as the gRPC API. Supported parameters: model, max_tokens
(``max_completion_tokens`` for chat), temperature (default 1.0, as OpenAI), top_p, seed,
stop (strings; the text is cut before the stop string), n=1, stream,
stream_options.include_usage, user (ignored). kvmesh extensions (``extra_body``): top_k,
ignore_eos, cache_salt, request_id, ttft_slo_ms, tbt_slo_ms. Each choice also carries
``token_ids`` (the generated token ids). Unsupported options (n > 1, logprobs, echo,
best_of, suffix, tools) are refused with 400.

Errors follow OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: bad input
-> 400 ``invalid_request_error`` (what is checked: ``http_request``), a body over 16 MiB
-> 413, unknown paths 404 and methods 405 (the same shape); early rejection (the TTFT SLO cannot be met, or no KV
room) -> 429 with ``Retry-After`` (whole seconds, rounded up) and ``retry-after-ms``;
no node for the model -> 503; a failure after streaming began ends the SSE stream with
an ``error`` event. With conductor ``--api-keys`` every /v1 endpoint wants
``Authorization: Bearer <key>`` (missing or wrong -> 401 ``authentication_error``); the
key's tenant salts the request's prefix hashes (see ``kvmesh.services.common.auth``).

Chat template: the checkpoint's ``chat_template`` from ``tokenizer_config.json`` (found
through the nodes' ``model_path``) rendered with jinja2 (a dependency: should it be
missing, an error is logged when such a model joins, and its chats get the default
template); otherwise the default template for the byte tokenizer::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n ... <|assistant|>\\n

i.e. for each message ``<|{role}|>`` newline content newline, then ``<|assistant|>``
newline to prompt the reply.
"""

from __future__ import annotations

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
from kvmesh.services.conductor.frontend import ConductorApi, Rejected, client_id
from kvmesh.services.conductor.http_request import (
    MAX_BODY_BYTES,
    ApiError,
    build,
    read_body,
)
from kvmesh.services.conductor.http_vllm import PATHS, VllmEndpoints, model_cards
from kvmesh.services.conductor.observe import observed

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
    """The HTTP server (module docstring) over the conductor ``conductor``."""

    def __init__(
        self, conductor: ConductorApi, host: str, port: int, tls: TlsFiles | None = None
    ) -> None:
        self.c = conductor
        self.host, self.port = host, port
        self.tls = tls if tls is not None and tls.cert else None
        self.scheme = "https" if self.tls else "http"
        self.address = ""
        self._runner: web.AppRunner | None = None
        self._templates: dict[str, dict | None] = {}
        self._templates_checked: set[str] = set()

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
            client_max_size=MAX_BODY_BYTES, middlewares=[stamp_arrival, openai_errors]
        )
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        VllmEndpoints(self.c, self._authenticate, self._render, from_rejected).add_routes(app)
        runner = self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            # a client that closes its connection cancels its handler, so a non-streamed
            # completion stops and frees its KV at once (aiohttp's default runs it on)
            handler_cancellation=True,
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
                body = await read_body(request)
                req, opts = build(body, chat, self._render)
                return await self._run(request, req, opts, chat)
            except ApiError as e:
                return e.response()

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
        agen = observed(self.c, req, request.get(ARRIVAL))
        cutter = _StopCutter(opts["stops"])
        try:
            try:
                first = await agen.__anext__()
            except Rejected as e:
                raise from_rejected(e) from None
            except StopAsyncIteration:
                raise ApiError(500, "the conductor returned no tokens", "server_error") from None
            model = opts["model"] or self._model_name()
            if not opts["stream"]:
                return await self._collect(agen, first, cutter, rid, created, model, chat)
            return await self._stream(
                request, agen, first, cutter, rid, created, model, chat, opts["include_usage"]
            )
        finally:
            await agen.aclose()

    def _model_name(self) -> str:
        return self.c.model_label("")

    @staticmethod
    def _usage(u: pb.Usage | None, completion: int) -> dict:
        prompt = u.prompt_tokens if u is not None else 0
        completion = u.completion_tokens if u is not None else completion
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens if u is not None else 0},
        }

    async def _collect(self, agen, first, cutter, rid, created, model, chat) -> web.Response:
        text, ids, reason, usage = "", [], "", None
        resp = first
        try:
            while True:
                ids.extend(resp.token_ids)
                piece, stopped = cutter.feed(resp.text, final=bool(resp.finish_reason))
                text += piece
                if stopped:
                    reason = "stop"
                    usage = resp.usage if resp.finish_reason else None
                    break
                if resp.finish_reason:
                    reason, usage = resp.finish_reason, resp.usage
                    break
                resp = await agen.__anext__()
        except Rejected as e:
            raise from_rejected(e) from None
        except StopAsyncIteration:
            reason = reason or "stop"
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "token_ids": ids}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = None
            obj = "chat.completion"
        else:
            choice["text"] = text
            choice["logprobs"] = None
            obj = "text_completion"
        return web.json_response(
            {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": self._usage(usage, len(ids)),
                "system_fingerprint": None,
            }
        )

    async def _stream(
        self, request, agen, first, cutter, rid, created, model, chat, include_usage
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
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(
            piece: str | None,
            ids: list[int],
            reason: str | None,
            role: bool = False,
            usage: dict | None = None,
            empty: bool = False,
        ) -> bytes:
            if empty:
                choices = []
            elif chat:
                delta: dict[str, Any] = {}
                if role:
                    delta["role"] = "assistant"
                if piece is not None:
                    delta["content"] = piece
                choices = [
                    {
                        "index": 0,
                        "delta": delta,
                        "finish_reason": reason or None,
                        "logprobs": None,
                        "token_ids": ids,
                    }
                ]
            else:
                choices = [
                    {
                        "index": 0,
                        "text": piece or "",
                        "finish_reason": reason or None,
                        "logprobs": None,
                        "token_ids": ids,
                    }
                ]
            data: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": choices,
            }
            if include_usage:
                data["usage"] = usage
            return f"data: {json.dumps(data)}\n\n".encode()

        n_ids = 0
        usage = None
        resp = first
        first_chunk = True
        try:
            while True:
                n_ids += len(resp.token_ids)
                piece, stopped = cutter.feed(resp.text, final=bool(resp.finish_reason))
                reason = "stop" if stopped else resp.finish_reason
                if reason:
                    usage = resp.usage if resp.finish_reason else None
                await out.write(chunk(piece, list(resp.token_ids), reason, role=first_chunk))
                first_chunk = False
                if reason:
                    break
                resp = await agen.__anext__()
            if include_usage:
                await out.write(chunk(None, [], None, usage=self._usage(usage, n_ids), empty=True))
            await out.write(b"data: [DONE]\n\n")
        except Rejected as e:
            err = from_rejected(e)
            await out.write(f"data: {json.dumps(err.body())}\n\n".encode())
        except StopAsyncIteration:
            await out.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, ConnectionError):
            log.info("client of %s went away", rid)
            return out
        await out.write_eof()
        return out


class _StopCutter:
    """Cuts streamed text before the first stop string, holding back any tail that may
    be the start of one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.pending = ""
        self.done = False

    def feed(self, text: str, final: bool = False) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        if self.done:
            return "", True
        buf = self.pending + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.done = True
            self.pending = ""
            return buf[:cut], True
        if final:
            self.pending = ""
            return buf, False
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False
