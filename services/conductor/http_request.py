"""The OpenAI HTTP face's request parsing and validation (``http_api`` serves them).

A body becomes a ``GenerateRequest`` only after every field has been checked against
what the protocol says and what its proto field can hold (``sampling_params.INT32_MAX``
and friends): JSON integers are unbounded, protobuf's are not, and a value set on a
message that does not fit raises deep inside protobuf. So every refusal here is an
:class:`ApiError` (HTTP 4xx in OpenAI's error shape) that names the field and says what
to send instead:

- the body (read by ``http_body``, without unbounded work on the event loop): at most
  :data:`MAX_BODY_BYTES` (413), also once inflated, UTF-8 JSON without NaN/Infinity, an
  object, nested at most as deep as the parser goes (a RecursionError is a 400), with
  a bounded number of values and of keys per object;
- integers within their wire type (``max_tokens``, ``top_k``, token ids: int32; ``seed``:
  64 bits), numbers finite (and within float32 for the SLOs), booleans JSON booleans
  (``"stream": "no"`` is refused, not taken as true);
- strings valid Unicode: a lone surrogate (``"\\ud800"``, legal JSON) cannot be UTF-8.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from aiohttp import web

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.common.sampling_params import FLOAT32_MAX, INT32_MAX, UINT64_MAX

MAX_BODY_BYTES = 16 << 20
COMPLETION_MAX_TOKENS = 16
CHAT_MAX_TOKENS = 256
UNSUPPORTED = ("logprobs", "echo", "suffix", "tools", "functions", "top_logprobs")


class ApiError(Exception):
    """A refusal in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def utf8(s: str, where: str) -> str:
    """``s``, when it can be UTF-8 (and so a proto string); ApiError 400 otherwise."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(
            400,
            f"{where} is not valid Unicode: it holds a lone surrogate "
            f"(U+{ord(s[e.start]):04X} at index {e.start}); a \\u escape of a surrogate must "
            f"come as a high-low pair",
            param=where,
        ) from None
    return s


class Fields:
    """Typed, range-checked reads of a request body's fields."""

    def __init__(self, body: dict) -> None:
        self.body = body

    def integer(self, name: str, default: int, lo: int, hi: int, note: str = "") -> int:
        v = self.body.get(name)
        if v is None:
            return default
        ok = isinstance(v, int) or (isinstance(v, float) and v.is_integer())
        if isinstance(v, bool) or not ok:
            raise ApiError(400, f"{name} must be an integer, got {_show(v)}", param=name)
        if not lo <= v <= hi:
            raise ApiError(
                400,
                f"{name} must be an integer from {lo} to {hi}{note}, got {_show(v)}",
                param=name,
            )
        return int(v)

    def number(self, name: str, default: float, lo: float, hi: float, note: str = "") -> float:
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ApiError(400, f"{name} must be a number, got {_show(v)}", param=name)
        # an int of any size compares exactly; math.isfinite(10**400) would overflow
        if not ((isinstance(v, int) or math.isfinite(v)) and lo <= v <= hi):
            raise ApiError(
                400,
                f"{name} must be a number from {lo:g} to {hi:.3g}{note}, got {_show(v)}",
                param=name,
            )
        return float(v)

    def boolean(self, name: str, default: bool = False, within: str = "") -> bool:
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ApiError(
                400, f"{within}{name} must be true or false, got {_show(v)}", param=within + name
            )
        return v

    def string(self, name: str, default: str = "") -> str:
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise ApiError(400, f"{name} must be a string, got {_show(v)}", param=name)
        return utf8(v, name)


def _text_content(content: Any, i: int) -> str:
    where = f"messages[{i}].content"
    if content is None:
        return ""
    if isinstance(content, str):
        return utf8(content, where)
    if isinstance(content, list):
        parts = []
        for p in content:
            if (
                not isinstance(p, dict)
                or p.get("type") != "text"
                or not isinstance(p.get("text"), str)
            ):
                raise ApiError(400, f"{where}: only text parts are supported", param=where)
            parts.append(utf8(p["text"], where))
        return "".join(parts)
    raise ApiError(400, f"{where} must be a string or a list of text parts", param=where)


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] needs a string role", param=f"messages[{i}]")
        role = utf8(m["role"], f"messages[{i}].role")
        out.append({"role": role, "content": _text_content(m.get("content"), i)})
    return out


def _prompt(prompt: Any, req: pb.GenerateRequest) -> None:
    """Sets ``req.prompt`` or ``req.token_ids`` from the completions ``prompt``."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        req.prompt = utf8(prompt, "prompt")
        return
    if isinstance(prompt, list) and prompt:
        for i, t in enumerate(prompt):
            if not isinstance(t, int) or isinstance(t, bool):
                break
            if not 0 <= t <= INT32_MAX:
                raise ApiError(
                    400,
                    f"prompt[{i}] is {_show(t)}: token ids must be integers from 0 to "
                    f"{INT32_MAX} (and below the model's vocabulary size)",
                    param="prompt",
                )
        else:
            req.token_ids.extend(prompt)
            return
    raise ApiError(
        400,
        "prompt must be a string or a list of token ids (one prompt per request)",
        param="prompt",
    )


def _stops(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(x, str) for x in stop) and len(stop) <= 4):
        raise ApiError(400, "stop must be a string or a list of at most 4 strings", param="stop")
    return [utf8(x, "stop") for x in stop if x]


def build(
    body: dict, chat: bool, render: Callable[[list[dict[str, str]], str], str]
) -> tuple[pb.GenerateRequest, dict]:
    """The ``GenerateRequest`` and the HTTP-only options (stream, stop strings, usage,
    model) of a completions (``chat`` False) or chat completions body; ``render(messages,
    model)`` makes a chat's prompt."""
    f = Fields(body)
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, 0, []):
            raise ApiError(400, f"{name} is not supported by kvmesh", param=name)
    big = 2**63
    if f.integer("n", 1, -big, big) != 1 or f.integer("best_of", 1, -big, big) != 1:
        raise ApiError(400, "only n=1 (and best_of=1) is supported", param="n")
    model = f.string("model")
    req = pb.GenerateRequest(model=model)
    max_tokens = "max_tokens"
    if chat:
        messages = normalize_messages(body.get("messages"))
        req.prompt = utf8(render(messages, model), "messages")
        if body.get("max_completion_tokens") is not None:
            max_tokens = "max_completion_tokens"
        default = CHAT_MAX_TOKENS
    else:
        _prompt(body.get("prompt"), req)
        default = COMPLETION_MAX_TOKENS
    req.max_tokens = f.integer(max_tokens, default, 1, INT32_MAX)
    s = req.sampling
    s.temperature = f.number("temperature", 1.0, 0, 2)
    s.top_p = f.number("top_p", 1.0, 0, 1)
    s.top_k = f.integer("top_k", 0, 0, INT32_MAX, " (0 = off)")
    s.seed = f.integer("seed", 0, -(2**63), UINT64_MAX) & UINT64_MAX
    s.ignore_eos = f.boolean("ignore_eos")
    req.cache_salt = f.string("cache_salt")
    req.request_id = f.string("request_id")
    note = " (0 = the cluster default)"
    req.slo.ttft_ms = f.number("ttft_slo_ms", 0.0, 0, FLOAT32_MAX, note)
    req.slo.tbt_ms = f.number("tbt_slo_ms", 0.0, 0, FLOAT32_MAX, note)
    stops = _stops(body.get("stop"))
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    opts = {
        "stream": f.boolean("stream"),
        "stops": stops,
        "include_usage": Fields(so or {}).boolean("include_usage", within="stream_options."),
        "model": model,
    }
    return req, opts
