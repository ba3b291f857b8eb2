"""One table of a request's limits, the same on both faces: the conductor's gRPC
``Generate`` (checked in ``Sampling.validate`` and ``RequestInput``) and the OpenAI HTTP
API (checked in ``http_request`` first, so its 400 names the JSON field). A limit
changed here changes for both.

A value past a limit is refused with INVALID_ARGUMENT (HTTP 400) whose message gives the
limit and never echoes a long value back: a 20,000-character model name echoed in the
status message made the reply's trailing metadata too large for the client, which then
saw RESOURCE_EXHAUSTED (a code that says "retry") instead of the refusal.
"""

from __future__ import annotations

MAX_STOP_STRINGS = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters of one stop string
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids per request
TEMPERATURE_MAX = 2.0  # temperature in [0, TEMPERATURE_MAX] (OpenAI's range)
MAX_REQUEST_ID_CHARS = 256  # a client's request_id
MAX_MODEL_NAME_CHARS = 256  # a request's model name
PENALTY_MAX = 2.0  # presence_penalty and frequency_penalty in [-PENALTY_MAX, PENALTY_MAX]
REPETITION_PENALTY_MAX = 10.0  # repetition_penalty in (0, REPETITION_PENALTY_MAX]; 1 = off
LOGIT_BIAS_MAX = 100.0  # each logit_bias value in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX]
MAX_LOGIT_BIAS_ENTRIES = 300  # token ids in one logit_bias
MAX_N = 16  # choices per HTTP request (n)
MAX_TOP_LOGPROBS = 20  # alternatives per token (top_logprobs; completions' logprobs: 5)


def shown(value: str, most: int = 40) -> str:
    """``repr(value)``, cut to ``most`` characters: safe to put in a status message."""
    r = repr(value)
    return r if len(r) <= most else r[: most - 3] + "..."


def check_names(model: str, request_id: str) -> str | None:
    """A message when the model name or the request_id is too long (neither echoed)."""
    if len(model) > MAX_MODEL_NAME_CHARS:
        return (
            f"model is {len(model)} characters long; a model name has at most "
            f"{MAX_MODEL_NAME_CHARS}"
        )
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        return (
            f"request_id is {len(request_id)} characters long; at most "
            f"{MAX_REQUEST_ID_CHARS} (or none: one is generated)"
        )
    return None
