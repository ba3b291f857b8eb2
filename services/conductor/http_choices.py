"""One HTTP request's choices: :class:`FanOut` runs its ``n`` generations (sharing the
prompt's KV) and :class:`Shape` writes their OpenAI JSON (choices, stream chunks,
logprobs in the completions and chat shapes). ``http_api`` serves them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from typing import Any

from kvmesh.protos import kvmesh_pb2 as pb
from kvmesh.services.conductor.frontend import ConductorApi
from kvmesh.services.conductor.http_request import ApiError
from kvmesh.services.conductor.observe import observed


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else -9999.0


def _by_text(alts: list[tuple[str, float]]) -> dict[str, float]:
    """Completions' ``{text: logprob}`` of one token's alternatives (most likely first):
    two ids with the same text make one key, the more likely one's."""
    out: dict[str, float] = {}
    for text, lp in alts:
        out.setdefault(text, lp)
    return out


class Shape:
    """The JSON of one request's responses: its id, time, model, endpoint (chat or not)
    and ``texts`` (``ids -> token texts``, for logprobs; None: none asked for)."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, texts) -> None:
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        self.texts = texts

    def logprobs(self, ids: list[int], lps: list[float], tops, offset: int) -> dict | None:
        """The choice's ``logprobs`` for ``ids`` and their alternatives ``tops`` (one
        ``TopLogprobs`` per token, or none): chat's ``content`` list, or completions'
        ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset`` from ``offset``;
        None when not asked for. A log-probability of -inf (a token the model gave no
        mass) is -9999.0, as JSON has no infinity."""
        if self.texts is None:
            return None
        toks = self.texts(ids)
        vals = [_finite(lp) for lp in lps]
        alts = [
            list(zip(self.texts(list(t.token_ids)), map(_finite, t.logprobs), strict=True))
            for t in tops
        ]
        if self.chat:
            return {
                "content": [
                    {
                        "token": t,
                        "logprob": v,
                        "bytes": list(t.encode("utf-8", "replace")),
                        "top_logprobs": [
                            {"token": a, "logprob": b, "bytes": list(a.encode("utf-8", "replace"))}
                            for a, b in (alts[j] if j < len(alts) else [])
                        ],
                    }
                    for j, (t, v) in enumerate(zip(toks, vals, strict=False))
                ]
            }
        offsets = []
        for t in toks:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": toks,
            "token_logprobs": vals,
            "top_logprobs": [_by_text(a) for a in alts] if tops else None,
            "text_offset": offsets,
        }

    def event(self, data: dict) -> bytes:
        return f"data: {json.dumps(data)}\n\n".encode()

    def _frame(self, choices: list, usage: dict | None = None, with_usage: bool = False) -> bytes:
        data: dict[str, Any] = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if with_usage:
            data["usage"] = usage
        return self.event(data)

    def chunk(self, i, piece, ids, reason, role, logprobs) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            delta["content"] = piece
            c: dict[str, Any] = {"index": i, "delta": delta}
        else:
            c = {"index": i, "text": piece}
        c.update(finish_reason=reason, logprobs=logprobs, token_ids=ids)
        return self._frame([c])

    def usage_chunk(self, usage: dict) -> bytes:
        return self._frame([], usage, with_usage=True)


class FanOut:
    """``n`` generations of one request, as ``(choice index, response)`` in the order
    they come. Choice 0 starts first; the others once its first response is in (its
    prompt's KV is then in the prefix caches, so theirs is nearly free). With a seed,
    choice ``i`` samples with seed + i (reproducible, and the choices differ); without,
    each gets its own from the conductor."""

    def __init__(
        self, c: ConductorApi, req: pb.GenerateRequest, n: int, t_arrival: float | None = None
    ) -> None:
        self.c, self.req, self.n = c, req, n
        self.t_arrival = t_arrival  # when the request arrived (its choices' TTFT counts from it)
        self.gens: list = []
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.first: pb.GenerateResponse | None = None

    def _request(self, i: int) -> pb.GenerateRequest:
        if i == 0:
            return self.req
        r = pb.GenerateRequest()
        r.CopyFrom(self.req)
        if self.req.sampling.HasField("seed"):
            r.sampling.seed = (self.req.sampling.seed + i) & ((1 << 64) - 1)
        if self.req.request_id:
            r.request_id = f"{self.req.request_id}.{i}"
        return r

    async def start(self) -> None:
        """Waits for choice 0's first response (raises its Rejected), then starts the rest."""
        g = observed(self.c, self._request(0), self.t_arrival)
        self.gens.append(g)
        try:
            self.first = await g.__anext__()
        except StopAsyncIteration:
            raise ApiError(500, "the conductor returned no tokens", "server_error") from None
        self.tasks.append(asyncio.ensure_future(self._pump(0, g, self.first)))
        for i in range(1, self.n):
            gi = observed(self.c, self._request(i), self.t_arrival)
            self.gens.append(gi)
            self.tasks.append(asyncio.ensure_future(self._pump(i, gi, None)))

    async def _pump(self, i: int, g, first) -> None:
        try:
            if first is not None:
                self.queue.put_nowait((i, first))
                if first.finish_reason:
                    return
            async for resp in g:
                self.queue.put_nowait((i, resp))
                if resp.finish_reason:
                    return
        except Exception as e:  # (Rejected, or a bug): the request ends with it
            self.queue.put_nowait((i, e))
            return
        finally:
            self.queue.put_nowait((i, None))

    def __aiter__(self):
        return self._items()

    async def _items(self):
        ended = 0
        while ended < self.n:
            i, item = await self.queue.get()
            if item is None:
                ended += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item

    async def aclose(self) -> None:
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(BaseException):
                await t
        for g in self.gens:
            await g.aclose()
