"""The endpoints ``vllm serve`` has beside the OpenAI API, in vLLM's request and response
shapes, on the conductor's HTTP port (``http_api.HttpApi`` adds them):

  GET  /metrics      Prometheus text: kvmesh's series and vLLM's (``vllm_metrics``); open,
                     as /health is
  GET  /version      ``{"version": "<kvmesh's version>"}``; open
  POST /tokenize     ``{"model"?, "prompt", "add_special_tokens"?}`` or ``{"model"?,
                     "messages", "add_special_tokens"?}`` (the chat template applied) ->
                     ``{"count", "max_model_len", "tokens", "token_strs"}``: the tokens a
                     request with that prompt is served with (BOS included unless
                     ``add_special_tokens`` is false); ``return_token_strs`` adds each
                     token's text
  POST /detokenize   ``{"model"?, "tokens"}`` -> ``{"prompt"}``

/tokenize and /detokenize want the API key when the conductor has keys, as /v1 does.
Bad input is a 400 in OpenAI's error shape naming the field.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import kvmesh
from kvmesh.services.common.metrics import REGISTRY
from kvmesh.services.conductor.frontend import Rejected
from kvmesh.services.conductor.http_request import ApiError, normalize_messages

PATHS = ("GET /metrics", "GET /version", "POST /tokenize", "POST /detokenize")


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{name} must be true or false", param=name)
    return v


def _model(body: dict) -> str:
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise ApiError(400, "model must be a string", param="model")
    return model


class VllmEndpoints:
    """The handlers over the conductor ``c`` (a ``frontend.ConductorApi``), with the HTTP
    API's ``authenticate(request)`` (raises ApiError 401), ``read(request)`` (the body's
    JSON object, or ApiError), ``render(messages, model)`` (a chat's prompt) and
    ``from_rejected`` (a conductor refusal as HTTP)."""

    def __init__(
        self,
        c: Any,
        authenticate: Callable[[web.Request], None],
        read: Callable[[web.Request], Awaitable[dict]],
        render: Callable[[list[dict[str, str]], str], str],
        from_rejected: Callable[[Rejected], ApiError],
    ) -> None:
        self.c = c
        self.authenticate, self.read = authenticate, read
        self.render, self.from_rejected = render, from_rejected

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/version", self.version)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)

    async def metrics(self, request: web.Request) -> web.Response:
        # collected in a thread, as the metrics port's server does: the loop serves on
        body = await asyncio.to_thread(generate_latest, REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": kvmesh.__version__})

    def _model(self, name: str):
        """(model, node info, tokenizer) of the model a request names."""
        try:
            return self.c.model_info(name)
        except Rejected as e:
            raise self.from_rejected(e) from None

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            self.authenticate(request)
            body = await self.read(request)
            _, info, tok = self._model(_model(body))
            add_special = _flag(body, "add_special_tokens", True)
            prompt: Any = body.get("prompt")
            if "messages" in body:
                prompt = self.render(normalize_messages(body["messages"]), _model(body))
            elif not isinstance(prompt, str):
                raise ApiError(400, "prompt must be a string (or give messages)", param="prompt")
            ids = await asyncio.to_thread(tok.encode, prompt, add_special)
            strs = None
            if _flag(body, "return_token_strs", False):
                strs = [tok.decode([i]) for i in ids]
            return web.json_response(
                {
                    "count": len(ids),
                    "max_model_len": self.c.input.context(info),
                    "tokens": ids,
                    "token_strs": strs,
                }
            )
        except ApiError as e:
            return e.response()

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            self.authenticate(request)
            body = await self.read(request)
            _, info, tok = self._model(_model(body))
            ids = body.get("tokens")
            vocab = int(info.get("vocab_size", 0))
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids
            ):
                raise ApiError(
                    400, f"tokens must be a list of token ids in [0, {vocab})", param="tokens"
                )
            return web.json_response({"prompt": tok.decode(ids)})
        except ApiError as e:
            return e.response()


def model_cards(c: Any, created: int = 0) -> list[dict]:
    """``/v1/models``' entries: each name clients may use (the --served-model-name
    aliases first, then the models' own), with vLLM's ``root`` (the model it names) and
    ``max_model_len``."""
    cards = []
    models = c.view.models()
    names = [*c.input.served_names, *sorted(models)] if len(models) == 1 else sorted(models)
    for name in dict.fromkeys(names):
        model = c.input.alias(name)
        info: dict = next((n.raw for n in c.view.nodes("decode") if n.model == model), {})
        cards.append(
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "kvmesh",
                "root": model,
                "parent": None,
                "max_model_len": c.input.context(info),
            }
        )
    return cards
