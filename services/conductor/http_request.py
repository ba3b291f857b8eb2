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
- strings valid Unicode: a lone surrogate (``"\\ud800"``, legal JSON) cannot be UTF-8;
- every field known (an allow-list, :data:`IMPLEMENTED`): an unknown one, or one of
  OpenAI's that kvmesh does not implement (:data:`NEUTRAL`) given a value that asks for
  something, is a 400 naming it, never a silent no-op;
- the limits shared with the gRPC face (``kvmesh.services.common.limits``): stop strings,
  temperature, penalties, logit_bias, model name and request_id lengths.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from aiohttp import web

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.common import limits
from kvmesh.services.common.limits import check_names
from kvmesh.services.common.sampling_params import FLOAT32_MAX, INT32_MAX, UINT64_MAX

MAX_BODY_BYTES = 16 << 20
COMPLETION_MAX_TOKENS = 16
CHAT_MAX_TOKENS = 256


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
    n, chars = limits.MAX_STOP_STRINGS, limits.MAX_STOP_CHARS
    if not (isinstance(stop, list) and all(isinstance(x, str) for x in stop) and len(stop) <= n):
        raise ApiError(400, f"stop must be a string or a list of at most {n} strings", param="stop")
    if any(len(x) > chars for x in stop):
        raise ApiError(400, f"stop: each stop string has at most {chars} characters", param="stop")
    return [utf8(x, "stop") for x in stop if x]


def _token_ids(v: Any, name: str, most: int) -> list[int]:
    if v is None:
        return []
    if not (
        isinstance(v, list)
        and len(v) <= most
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX for t in v)
    ):
        raise ApiError(
            400, f"{name} must be a list of at most {most} token ids (integers >= 0)", param=name
        )
    return v


def _logit_bias(v: Any) -> dict[int, float]:
    if v is None:
        return {}
    most, cap = limits.MAX_LOGIT_BIAS_ENTRIES, limits.LOGIT_BIAS_MAX
    say = (
        f"logit_bias must map at most {most} token ids (as strings, e.g. "
        f'{{"50256": -100}}) to numbers from -{cap:g} to {cap:g}'
    )
    if not isinstance(v, dict) or len(v) > most:
        raise ApiError(400, say, param="logit_bias")
    out = {}
    for k, b in v.items():
        try:
            t = int(k)
        except ValueError:
            raise ApiError(400, f"{say}; got the key {_show(k)}", param="logit_bias") from None
        ok = isinstance(b, (int, float)) and not isinstance(b, bool)
        if not (0 <= t <= INT32_MAX and ok and (isinstance(b, int) or math.isfinite(b))):
            raise ApiError(400, f"{say}; got {_show(k)}: {_show(b)}", param="logit_bias")
        if not -cap <= b <= cap:
            raise ApiError(400, f"{say}; got {_show(k)}: {_show(b)}", param="logit_bias")
        out[t] = float(b)
    return out


def _check_fields(body: dict, chat: bool) -> None:
    """Every field is one this API implements (:data:`IMPLEMENTED`) or one of OpenAI's it
    refuses unless given its neutral value (:data:`NEUTRAL`); any other is a 400 that
    names it: a field this API does not know would otherwise do nothing, silently."""
    known = IMPLEMENTED | (CHAT_FIELDS if chat else COMPLETION_FIELDS)
    unknown = sorted(k for k in body if k not in known and k not in NEUTRAL)
    if unknown:
        names = ", ".join(_show(k) for k in unknown[:5])
        raise ApiError(
            400,
            f"unknown field{'s' if len(unknown) > 1 else ''} {names}: this API does not "
            f"implement {'them' if len(unknown) > 1 else 'it'}; remove "
            f"{'them' if len(unknown) > 1 else 'it'} from the request",
            param=str(unknown[0])[:64],
        )
    for name, (neutral, why) in NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise ApiError(400, f"{name} is not supported by kvmesh: {why}", param=name)


# fields either endpoint implements (chat- or completion-only ones below)
IMPLEMENTED = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "n",
        "max_tokens",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "user",  # (informational: ignored, as OpenAI's abuse-monitoring id)
        "safety_identifier",  # (the same)
        "metadata",  # (tags of a stored completion; nothing is stored)
        "service_tier",  # (one tier here)
        # vLLM's extensions
        "top_k",
        "min_p",
        "repetition_penalty",
        "stop_token_ids",
        "min_tokens",
        "ignore_eos",
        # kvmesh's
        "cache_salt",
        "request_id",
        "ttft_slo_ms",
        "tbt_slo_ms",
    }
)
CHAT_FIELDS = frozenset({"messages", "max_completion_tokens", "top_logprobs"})
COMPLETION_FIELDS = frozenset({"prompt", "best_of"})
_NO_TOOLS = "tool and function calling is not built yet"
# OpenAI's fields kvmesh does not implement: refused unless given a value that asks for
# nothing (null, or what the field's default does)
NEUTRAL: dict[str, tuple[tuple, str]] = {
    "echo": ((None, False), "the prompt is not echoed; send echo=false"),
    "suffix": ((None, ""), "no insertion (suffix) mode"),
    "response_format": (
        (None, {"type": "text"}),
        "structured output (json_object, json_schema) is not built yet; send "
        '{"type": "text"} or leave it out',
    ),
    "tools": ((None, []), _NO_TOOLS),
    "functions": ((None, []), _NO_TOOLS),
    "tool_choice": ((None, "none", "auto"), f"{_NO_TOOLS}; send none or auto, without tools"),
    "function_call": ((None, "none", "auto"), _NO_TOOLS),
    "parallel_tool_calls": ((None, True, False), _NO_TOOLS),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), 'text is the only output modality; send ["text"]'),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "the served models have no reasoning effort setting"),
    "verbosity": ((None,), "the served models have no verbosity setting"),
    "web_search_options": ((None,), "web search is not supported"),
    "store": ((None, False), "completions are not stored"),
    "prompt_cache_key": ((None,), "prefix caching needs no key; use cache_salt to isolate"),
}


def _logprobs(f: Fields, body: dict, chat: bool) -> tuple[bool, int]:
    """Whether each token's log-probability is asked for, and how many alternatives per
    token: chat's ``logprobs`` (true/false) and ``top_logprobs`` (0-20, with logprobs
    only), completions' ``logprobs`` (null, or 0-5 alternatives)."""
    most = limits.MAX_TOP_LOGPROBS
    if chat:
        want = f.boolean("logprobs")
        top = f.integer("top_logprobs", 0, 0, most)
        if body.get("top_logprobs") is not None and not want:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return want, top
    if body.get("logprobs") is None:
        return False, 0
    return True, f.integer("logprobs", 0, 0, 5, " (alternatives per token)")


def build(
    body: dict, chat: bool, render: Callable[[list[dict[str, str]], str], str]
) -> tuple[pb.GenerateRequest, dict]:
    """The ``GenerateRequest`` and the HTTP-only options (stream, usage, n, logprobs,
    model) of a completions (``chat`` False) or chat completions body; ``render(messages,
    model)`` makes a chat's prompt."""
    _check_fields(body, chat)
    f = Fields(body)
    n = f.integer("n", 1, 1, limits.MAX_N)
    if not chat and f.integer("best_of", n, n, n, " (best_of, when given, must equal n)") != n:
        raise ApiError(400, "best_of must equal n", param="best_of")
    model = f.string("model")
    request_id = f.string("request_id")
    if err := check_names(model, request_id):
        raise ApiError(400, err, param="model" if err.startswith("model") else "request_id")
    if n > 1 and len(request_id) > limits.MAX_REQUEST_ID_CHARS - 3:
        raise ApiError(
            400,
            f"with n > 1 a request_id has at most {limits.MAX_REQUEST_ID_CHARS - 3} characters "
            f"(choice i is sent as request_id.i)",
            param="request_id",
        )
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
    s.temperature = f.number("temperature", 1.0, 0, limits.TEMPERATURE_MAX)
    s.top_p = f.number("top_p", 1.0, 0, 1)
    s.top_k = f.integer("top_k", 0, 0, INT32_MAX, " (0 = off)")
    if body.get("seed") is not None:  # none: the conductor draws one (fresh randomness)
        s.seed = f.integer("seed", 0, -(2**63), UINT64_MAX) & UINT64_MAX
    s.ignore_eos = f.boolean("ignore_eos")
    pen = limits.PENALTY_MAX
    s.presence_penalty = f.number("presence_penalty", 0.0, -pen, pen)
    s.frequency_penalty = f.number("frequency_penalty", 0.0, -pen, pen)
    rep = f.number("repetition_penalty", 1.0, 0, limits.REPETITION_PENALTY_MAX, " (1 = off)")
    if rep <= 0:
        raise ApiError(400, "repetition_penalty must be > 0 (1 = off)", param="repetition_penalty")
    s.repetition_penalty = rep
    s.min_p = f.number("min_p", 0.0, 0, 1, " (0 = off)")
    for t, b in _logit_bias(body.get("logit_bias")).items():
        s.logit_bias[t] = b
    s.stop_token_ids.extend(
        _token_ids(body.get("stop_token_ids"), "stop_token_ids", limits.MAX_STOP_TOKEN_IDS)
    )
    s.min_tokens = f.integer("min_tokens", 0, 0, INT32_MAX)
    if s.min_tokens > req.max_tokens:
        raise ApiError(
            400,
            f"min_tokens ({s.min_tokens}) must not exceed {max_tokens} ({req.max_tokens})",
            param="min_tokens",
        )
    s.stop.extend(_stops(body.get("stop")))  # the conductor cuts the text before one
    s.logprobs, s.top_logprobs = _logprobs(f, body, chat)
    req.cache_salt = f.string("cache_salt")
    req.request_id = request_id
    note = " (0 = the cluster default)"
    req.slo.ttft_ms = f.number("ttft_slo_ms", 0.0, 0, FLOAT32_MAX, note)
    req.slo.tbt_ms = f.number("tbt_slo_ms", 0.0, 0, FLOAT32_MAX, note)
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    so_known = {"include_usage", "continuous_usage_stats"}
    if so and set(so) - so_known:
        bad = sorted(set(so) - so_known)[0]
        raise ApiError(
            400,
            f"stream_options.{_show(bad)} is not supported (only include_usage)",
            param="stream_options",
        )
    if so and so.get("continuous_usage_stats") not in (None, False):
        raise ApiError(
            400,
            "stream_options.continuous_usage_stats is not supported: usage comes in the "
            "last chunk (include_usage)",
            param="stream_options",
        )
    opts = {
        "stream": f.boolean("stream"),
        "include_usage": Fields(so or {}).boolean("include_usage", within="stream_options."),
        "model": model,
        "n": n,
        "logprobs": s.logprobs,
    }
    return req, opts
