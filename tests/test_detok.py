"""The conductor's incremental detokenizer (services/conductor/detok.py) and the stream's
text over it (text.TextStream): the pieces, joined, are exactly a full decode of the ids,
for the byte tokenizer, the shipped demo's byte-level BPE and a Llama-style tokenizer
with byte-fallback tokens; random ids (stray bytes, specials, characters split over
tokens) and unicode-heavy text, in batches of any size; stop strings split over tokens are
still found; and a long stream does not decode its whole output again for every token."""

from __future__ import annotations

import random

import pytest

from kvmesh.services.common.sampling_params import find_stop
from kvmesh.services.common.tokenizer import ByteTokenizer, HFTokenizer
from kvmesh.services.conductor.detok import (
    MAX_PENDING,
    DecodeStreamDecoder,
    WindowDecoder,
    incremental_decoder,
)
from kvmesh.services.conductor.text import TextStream
from kvmesh.services.engine.model_spec import shipped_model_dir

UNICODE_TEXT = (
    "Hello wörld! 你好，世界。 🎉🚀 naïve café — Ελληνικά, русский, עברית, العربية, "
    "हिन्दी, 日本語のテキスト, 한국어, emoji 👩‍👩‍👧‍👦 flags 🇫🇷🇯🇵, math ∮ E⋅da = Q, "
    "combining e\u0301 a\u0308, zero\u200bwidth, tabs\tand\nnew lines\r\n"
)


class _Counting:
    """A tokenizer wrapper that counts the ids its ``decode`` is given."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.decoded = 0

    def decode(self, ids):
        ids = list(ids)
        self.decoded += len(ids)
        return self.tok.decode(ids)


def _llama_style(tmp_path) -> HFTokenizer:
    """A SentencePiece-like BPE in ``tokenizer.json`` form: ``▁`` for spaces, the 256
    ``<0xNN>`` byte-fallback tokens for anything outside its small vocabulary, and the
    Llama decoder chain (Replace, ByteFallback, Fuse, Strip)."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyzHWéö,.!":
        vocab.setdefault(ch, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("l", "l"), ("▁", "w"), ("o", "r")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    return HFTokenizer(str(tmp_path))


@pytest.fixture(scope="module", params=["byte", "demo", "llama"])
def tok(request, tmp_path_factory):
    if request.param == "byte":
        return ByteTokenizer()
    if request.param == "demo":
        return HFTokenizer(shipped_model_dir("demo"))
    return _llama_style(tmp_path_factory.mktemp("llama"))


def _gpt2_byte_char(b: int) -> str:
    """The character GPT-2's byte-level alphabet writes byte ``b`` as."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    if b in keep:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in keep].index(b))


def _byte_id(tok, b: int) -> int:
    """The id of the token that stands for the one byte ``b``."""
    if isinstance(tok, ByteTokenizer):
        return b
    hf = tok._tok
    tid = hf.token_to_id(f"<0x{b:02X}>")
    if tid is None:
        tid = hf.token_to_id(_gpt2_byte_char(b))
    assert tid is not None
    return tid


def _batches(ids: list[int], rng: random.Random):
    i = 0
    while i < len(ids):
        n = rng.choice((1, 1, 1, 2, 3, 7))
        yield ids[i : i + n]
        i += n


def _stream(dec, ids: list[int], rng: random.Random) -> str:
    return "".join(dec.step(b) for b in _batches(ids, rng)) + dec.flush()


def _random_text(rng: random.Random, n: int) -> str:
    planes = ((0x20, 0x7F), (0xA0, 0x800), (0x800, 0xD800), (0xE000, 0x10000), (0x10000, 0x1FAFF))
    return "".join(chr(rng.randrange(*rng.choice(planes))) for _ in range(n))


def _sequences(tok, rng: random.Random):
    """Token sequences to decode: unicode-heavy text and random code points (characters
    over several tokens), random ids over the whole vocabulary (specials, stray and split
    bytes), runs of byte tokens, and their tails cut off. A byte-fallback tokenizer gets no
    invalid runs of byte tokens (see the detok module: its full decode is not local)."""
    text_ids = tok.encode(UNICODE_TEXT * 3, add_bos=False)
    yield text_ids
    for cut in (1, 2, 3, 5):
        yield text_ids[:-cut]  # may end inside a character: flush gives U+FFFD as decode
    for _ in range(20):
        yield tok.encode(_random_text(rng, rng.randrange(1, 60)), add_bos=False)
    fallback = isinstance(tok, HFTokenizer) and tok._tok.token_to_id("<0x80>") is not None
    if fallback:
        byte_ids = {tok._tok.token_to_id(f"<0x{b:02X}>") for b in range(256)}
        others = [i for i in range(tok.vocab_size) if i not in byte_ids]
        for _ in range(30):
            yield [rng.choice(others) for _ in range(rng.randrange(1, 200))]
        return
    for _ in range(30):
        yield [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 200))]
    # byte-like ids only (the byte tokenizer's bytes, the llama's <0xNN>): many split and
    # invalid sequences, longer runs than any character
    for _ in range(10):
        yield [_byte_id(tok, rng.choice((0x80, 0xBF, 0xE2, 0xF0, 0x9F, 0x41))) for _ in range(300)]
    yield [_byte_id(tok, 0x80)] * (5 * MAX_PENDING)  # continuation bytes: never a character
    yield [tok.eos_id] * 40 + text_ids[:20]  # skipped specials first


def test_pieces_join_to_the_full_decode(tok):
    rng = random.Random(7)
    for ids in _sequences(tok, rng):
        want = tok.decode(ids)
        assert _stream(incremental_decoder(tok), ids, rng) == want
        assert _stream(WindowDecoder(tok.decode), ids, rng) == want


def test_hf_tokenizers_use_decode_stream(tok):
    dec = incremental_decoder(tok)
    assert isinstance(dec, DecodeStreamDecoder) == isinstance(tok, HFTokenizer)


def test_a_split_character_waits_for_its_last_token():
    tok = ByteTokenizer()
    dec = incremental_decoder(tok)
    euro = list("€".encode())
    assert dec.step(euro[:1]) == "" and dec.step(euro[1:2]) == ""
    assert dec.step(euro[2:]) == "€"
    assert dec.step(euro[:2]) == "" and dec.flush() == "\ufffd"


def test_text_stream_equals_full_decode_and_cuts_at_stops(tok):
    rng = random.Random(11)
    ids = tok.encode(UNICODE_TEXT * 2, add_bos=False)
    full = tok.decode(ids)
    for stops in ((), ("世界",), ("café", "🚀"), ("zzz-never",), ("d = Q, comb",)):
        for _ in range(5):
            ts = TextStream(tok, stops)
            out = ""
            batches = list(_batches(ids, rng))
            for k, b in enumerate(batches):
                out += ts.push(b, final=k == len(batches) - 1)
                if ts.stopped:
                    break
            cut = find_stop(full, [s for s in stops if s])
            assert out == (full if cut is None else full[:cut])
            assert ts.stopped == (cut is not None)


def test_stop_string_split_over_byte_tokens():
    tok = ByteTokenizer()
    ts = TextStream(tok, ("🎉!",))
    out = ""
    for b in "ok 🎉! never".encode():
        out += ts.push([b])
        if ts.stopped:
            break
    assert out == "ok " and ts.stopped


@pytest.mark.parametrize("which", ["byte", "demo"])
def test_decoding_work_per_token_does_not_grow(which):
    """The ids handed to ``decode`` per token stay bounded: the old algorithm handed it
    the whole output each time (n^2 / 2 ids over a stream of n)."""
    base = ByteTokenizer() if which == "byte" else HFTokenizer(shipped_model_dir("demo"))
    ids = base.encode(UNICODE_TEXT * 40, add_bos=False)[:4000]
    counting = _Counting(base)
    ts = TextStream(counting, ("never seen",))
    text = "".join(ts.push([i], final=k == len(ids) - 1) for k, i in enumerate(ids))
    assert text == base.decode(ids)
    # two decodes per token of a window of at most 2 * MAX_PENDING + 1 tokens (the old
    # algorithm: ~8 million ids here)
    assert counting.decoded <= 2 * (2 * MAX_PENDING + 1) * len(ids)
