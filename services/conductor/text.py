"""Incremental detokenization: token ids in, the new text out, for any tokenizer with
``decode(ids) -> str``. A trailing U+FFFD (an incomplete UTF-8 sequence so far) is held
back until the next tokens complete it or the stream ends."""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, ids: list[int], final: bool = False) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        end = len(text)
        if not final:
            while end > self.emitted and text[end - 1] == "\ufffd":
                end -= 1
        out = text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out
