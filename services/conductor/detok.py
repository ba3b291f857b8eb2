"""Incremental detokenizers: token ids in, the new text out, at a cost per token that does
not grow with the output (a stream of n tokens costs O(n), not O(n^2) as decoding the
whole output again for every token does).

The text of a stream, its pieces joined, is the text a full ``decode`` of all its ids
gives. A piece whose last character is U+FFFD (an incomplete UTF-8 sequence so far: a
character split over byte or byte-fallback tokens) is held back until the next tokens
complete it, or the stream ends (:meth:`IncrementalDecoder.flush`), where it comes out as
a full decode has it.

* :class:`WindowDecoder` works with any tokenizer's ``decode(ids) -> str``: it decodes a
  short window, the tokens of the last piece it emitted (the context) followed by the
  tokens not yet emitted, and gives what follows the context's own text (vLLM's
  ``detokenize_incrementally``, with prefix and read offsets). The context begins where
  a piece began, on a character's first token, so a run of byte-fallback tokens decodes
  alike in the window and in the whole. A decoder whose text of a
  window does not begin with the text of its context (a rare cleanup rule) is answered by
  one full decode, so the text stays exact.
* :class:`DecodeStreamDecoder` uses ``tokenizers``' own ``DecodeStream`` (the same rule,
  in Rust) for Hugging Face tokenizers, and the window for what ``DecodeStream`` cannot
  do (its error on a changed prefix, the end of the stream).

A run of tokens that never completes a character (a model emitting stray bytes) is
emitted once it is longer than any character can be (:data:`MAX_PENDING` tokens), up to
its last few tokens, so the window stays short.

Exactness has one limit, the byte-fallback decoder's own: it decodes a run of ``<0xNN>``
tokens as one, and a run holding any invalid UTF-8 becomes one U+FFFD per token, valid
characters included. A stream has emitted the run's valid characters before the stray
byte comes; a model's text has no invalid runs, so its streams match the full decode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# pending tokens after which the text before the last KEEP of them is emitted, even if
# the window's text still ends in U+FFFD (no character spans that many tokens; a UTF-8
# character is at most 4 bytes)
MAX_PENDING = 16
KEEP = 4
REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """The interface: :meth:`step` for each new batch of ids, :meth:`flush` at the end."""

    def step(self, ids: Sequence[int]) -> str:
        """The new text that ``ids`` complete (may be empty)."""
        raise NotImplementedError

    def flush(self) -> str:
        """The text still held back, as a full decode ends (U+FFFD for an incomplete
        sequence); the stream is over."""
        raise NotImplementedError


class WindowDecoder(IncrementalDecoder):
    """The window algorithm over ``decode`` (see the module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self.done = 0  # ids[:done] have their text emitted in full
        self.prev = 0  # where the last emitted piece's tokens begin: the window's start
        self.chars = 0  # characters emitted so far

    def step(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:  # one at a time: a piece may end after any token
            self.ids.append(i)
            out.append(self._emit(final=False))
        return "".join(out)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        n = len(self.ids)
        if n == self.done:
            return ""
        start = self.prev
        prefix = self._decode(self.ids[start : self.done])
        text = self._decode(self.ids[start:])
        if not text.startswith(prefix):
            return self._resync(final)
        if final or (len(text) > len(prefix) and not text.endswith(REPLACEMENT)):
            return self._out(text[len(prefix) :], n)
        if n - self.done > MAX_PENDING:  # stray bytes: emit all but the last few tokens
            mid = self._decode(self.ids[start : n - KEEP])
            if text.startswith(mid) and mid.startswith(prefix):
                return self._out(mid[len(prefix) :], n - KEEP)
        return ""

    def _out(self, piece: str, done: int) -> str:
        self.prev, self.done = self.done, done
        self.chars += len(piece)
        return piece

    def _resync(self, final: bool) -> str:
        """One full decode, for a decoder whose windows disagree with their context."""
        text = self._decode(self.ids)
        if not final and (len(text) <= self.chars or text.endswith(REPLACEMENT)):
            return ""
        return self._out(text[self.chars :], len(self.ids))


class DecodeStreamDecoder(WindowDecoder):
    """``tokenizers.decoders.DecodeStream`` over a Hugging Face ``tokenizers.Tokenizer``
    (special tokens skipped, as :meth:`HFTokenizer.decode` does), the window where it
    cannot serve."""

    def __init__(self, hf_tokenizer) -> None:
        self._tok = hf_tokenizer
        super().__init__(lambda ids: hf_tokenizer.decode(ids, skip_special_tokens=True))
        self._stream = self._new_stream()

    def _new_stream(self):
        """A ``DecodeStream`` that takes the last emitted tokens as its context; None (the
        window serves until its next emission) when their text ends in U+FFFD, which
        ``DecodeStream`` would count as not emitted."""
        from tokenizers.decoders import DecodeStream

        ctx = self.ids[self.prev : self.done]
        if ctx and self._decode(ctx).endswith(REPLACEMENT):
            return None
        try:
            return DecodeStream(ids=ctx, skip_special_tokens=True)
        except TypeError:  # tokenizers < 0.22 takes no context: the window serves
            return DecodeStream(skip_special_tokens=True) if not ctx else None

    def step(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            self.ids.append(i)
            if self._stream is None:
                out.append(self._emit(final=False))
                if self.done == len(self.ids):
                    self._stream = self._new_stream()
                continue
            try:
                piece = self._stream.step(self._tok, i)
            except Exception:  # DecodeStreamError (a changed prefix): the window decides
                out.append(self._emit(final=False))
                self._stream = self._new_stream()
                continue
            if piece is not None:
                out.append(self._out(piece, len(self.ids)))
            elif len(self.ids) - self.done > MAX_PENDING:
                out.append(self._emit(final=False))
                self._stream = self._new_stream()
        return "".join(out)


def incremental_decoder(tokenizer) -> IncrementalDecoder:
    """The fastest exact incremental decoder for ``tokenizer``: ``DecodeStream`` for a
    Hugging Face one (an ``HFTokenizer``, whose ``tokenizers.Tokenizer`` is ``_tok``),
    the window over its ``decode`` for any other."""
    hf = getattr(tokenizer, "_tok", None)
    if hf is not None:
        try:
            from tokenizers.decoders import DecodeStream  # noqa: F401  (tokenizers >= 0.21)
        except ImportError:
            pass
        else:
            return DecodeStreamDecoder(hf)
    return WindowDecoder(tokenizer.decode)
