"""A stream's text: token ids in, the new text out (:class:`TextStream`, over the
incremental decoders of :mod:`.detok`). A trailing U+FFFD (an incomplete UTF-8 sequence
so far) is held back until the next tokens complete it or the stream ends; so is a tail
that could be the start of a stop string. When a stop string appears, the text ends just
before it. And the ``GenerateResponse`` each step of a stream sends (:func:`generate_response`)."""

from __future__ import annotations

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.common.sampling_params import find_stop
from kvmesh.services.conductor.detok import incremental_decoder


class TextStream:
    """A stream's text with its stop strings: the new text of each batch of tokens, from
    an incremental decoder (:mod:`.detok`: the cost per token does not grow with the
    output), less a tail as long as the longest stop string but one, held back until the
    next tokens show it is no stop string's start."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.detok = incremental_decoder(tokenizer)
        self.pending = ""  # decoded, not yet sent: the held-back tail
        self.stopped = False

    def push(self, ids: list[int], final: bool = False) -> str:
        """New text for ``ids``; sets ``stopped`` when a stop string was found."""
        if self.stopped:
            return ""
        text = self.pending + self.detok.step(ids)
        if final:
            text += self.detok.flush()
        if self.stops:
            cut = find_stop(text, self.stops)
            if cut is not None:
                self.pending, self.stopped = "", True
                return text[:cut]
        end = len(text) if final else max(0, len(text) - self.hold)
        self.pending = text[end:]
        return text[:end]


def generate_response(
    rid, token_ids, decoder, usage, presp, route, req, eos_ids, reason="", logprobs=(), tops=()
):
    """The client's next ``GenerateResponse``: ``token_ids`` and their new text from
    ``decoder``; with the prefill's answer ``presp`` (the first token's message) the
    usage's cached and computed tokens and a finish reason if the first token ends it;
    ``usage`` and the finish reason on the last message."""
    if presp is not None:
        usage.cached_tokens = presp.cached_tokens + presp.fetched_tokens
        usage.computed_tokens = presp.computed_tokens
        first = token_ids[0]
        if (
            first in eos_ids and not req.sampling.ignore_eos
        ) or first in req.sampling.stop_token_ids:
            reason = "stop"
        elif req.max_tokens == 1:
            reason = "length"
        if req.sampling.logprobs:
            logprobs = [presp.first_logprob]
            tops = [presp.first_top] if presp.HasField("first_top") else []
    usage.completion_tokens += len(token_ids)
    text = decoder.push(token_ids, final=bool(reason))
    if decoder.stopped:
        reason = "stop"
    return pb.GenerateResponse(
        request_id=rid,
        token_ids=token_ids,
        text=text,
        finish_reason=reason,
        usage=usage if reason else None,
        route=route,
        logprobs=list(logprobs),
        top_logprobs=list(tops),
    )
