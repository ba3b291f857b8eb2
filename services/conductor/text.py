"""Incremental detokenization: token ids in, the new text out, for any tokenizer with
``decode(ids) -> str``. A trailing U+FFFD (an incomplete UTF-8 sequence so far) is held
back until the next tokens complete it or the stream ends; so is a tail that could be the
start of a stop string. When a stop string appears, the text ends just before it."""

from __future__ import annotations

from kvmesh.services.common.sampling_params import find_stop


class TextStream:
    def __init__(self, tokenizer, stops: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.emitted = 0
        self.stopped = False

    def push(self, ids: list[int], final: bool = False) -> str:
        """New text for ``ids``; sets ``stopped`` when a stop string was found."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        if self.stops:
            cut = find_stop(text, self.stops, start=max(0, self.emitted - self.hold))
            if cut is not None:
                out, self.emitted, self.stopped = text[self.emitted : cut], cut, True
                return out
        end = len(text)
        if not final:
            end -= self.hold
            while end > self.emitted and text[end - 1] == "\ufffd":
                end -= 1
        out = text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out
