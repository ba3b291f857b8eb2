"""Long prompts in the engine: prefill attention with no mask tensor (SDPA ``is_causal``
without a cached prefix; prefix and causal parts merged by log-sum-exp on top of one),
chunked prefill, the ``prefill_chunk_tokens`` option, and the model's position limit.
The oracles: an explicit-mask attention (the engine's old path) and the model's
cache-free reference forward, in float32."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from kvmesh.services.common.config import ConfigError, load
from kvmesh.services.common.hashing import prefix_hashes
from kvmesh.services.common.sampling_params import Sampling
from kvmesh.services.decode.batch import BatchScheduler, Reservation, Running
from kvmesh.services.decode.server import DecodeConfig
from kvmesh.services.engine.config import PRESETS
from kvmesh.services.engine.kv_pool import KVPool
from kvmesh.services.engine.model import LlamaModel, PrefillStopped, prefill_attention

BS = 16
ATOL = 1e-4


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel.from_preset("tiny", seed=0)


def prompt(n: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(99 + salt)
    return [256] + torch.randint(0, 256, (n - 1,), generator=g).tolist()


def greedy(model: LlamaModel, logits: torch.Tensor, seq: list[int], table, pool, steps: int):
    """Greedy tokens from prefill ``logits`` on, decoding on the pool."""
    seq, out = list(seq), []
    for _ in range(steps):
        nxt = int(logits.argmax())
        out.append(nxt)
        logits = model.forward_decode([nxt], [len(seq)], [table], pool)[0]
        seq.append(nxt)
    return out


def masked_attention(q, k, v, k_pre, v_pre):
    """The old path: keys = prefix + new, an explicit boolean mask [n, total]."""
    n, heads, d = q.shape
    g = heads // k.shape[1]
    keys = torch.cat((k_pre, k)) if k_pre is not None else k
    vals = torch.cat((v_pre, v)) if v_pre is not None else v
    total, p = keys.shape[0], keys.shape[0] - n
    mask = torch.arange(total)[None, :] <= (p + torch.arange(n))[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        keys.transpose(0, 1).repeat_interleave(g, dim=0),
        vals.transpose(0, 1).repeat_interleave(g, dim=0),
        attn_mask=mask[None],
    )
    return o.transpose(0, 1).reshape(n, -1)


# ------------------------------------------------------------------ attention
@pytest.mark.parametrize("n, p", [(1, 0), (37, 0), (64, 0), (1, 50), (29, 16), (40, 111)])
def test_prefill_attention_matches_the_explicit_mask_in_float32(n, p):
    g = torch.Generator().manual_seed(n * 1000 + p)
    q = torch.randn(n, 6, 32, generator=g)
    k, v = torch.randn(n, 2, 32, generator=g), torch.randn(n, 2, 32, generator=g)
    kp = torch.randn(p, 2, 32, generator=g) if p else None
    vp = torch.randn(p, 2, 32, generator=g) if p else None
    got = prefill_attention(q, k, v, kp, vp)
    assert got.shape == (n, 6 * 32)
    torch.testing.assert_close(got, masked_attention(q, k, v, kp, vp), atol=1e-5, rtol=0)


def test_prefill_attention_bfloat16_stays_close():
    g = torch.Generator().manual_seed(7)
    q, k, v, kp, vp = (
        torch.randn(s, h, 64, generator=g)
        for s, h in ((48, 12), (48, 4), (48, 4), (80, 4), (80, 4))
    )
    ref = masked_attention(q, k, v, kp, vp)
    got = prefill_attention(*(t.bfloat16() for t in (q, k, v, kp, vp)))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=0)


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("cached", [False, True])
def test_no_prefill_tensor_grows_with_the_square_of_the_length(model, cached):
    """Doubling the prompt (and its cached prefix) at most doubles the largest tensor of
    the prefill path; a [n, total] mask would quadruple it."""
    largest = []
    for n in (512, 1024):
        pool = KVPool(model.config, num_blocks=2 * n // BS + 2, block_size=BS)
        table = list(range(pool.num_blocks))
        toks = torch.tensor(prompt(2 * n if cached else n))
        start = n if cached else 0
        if cached:
            model.forward_prefill(toks[:start], 0, pool, table)
        with _Largest() as mode:
            model.forward_prefill(toks[start:], start, pool, table)
        largest.append(mode.numel)
    # the pool (preallocated, fixed) is not created on the path; what is scales with n
    assert largest[1] <= 2 * largest[0] + 1024, largest


# ---------------------------------------------------------- chunked prefill
@pytest.mark.parametrize("chunk", [16, 48, 1000])
def test_chunked_prefill_matches_the_reference(model, chunk):
    toks, steps = prompt(150), 8
    pool = KVPool(model.config, num_blocks=16, block_size=BS)
    table = pool.allocate(math.ceil((len(toks) + steps) / BS))
    calls: list[tuple[int, int, int]] = []
    logits = model.forward_prefill_chunked(
        toks, 0, pool, table, chunk, on_layer_done=lambda l, lo, hi: calls.append((l, lo, hi))
    )
    torch.testing.assert_close(logits, model.reference_logits(toks)[-1], atol=ATOL, rtol=0)
    bounds = [(lo, min(len(toks), lo + chunk)) for lo in range(0, len(toks), chunk)]
    layers = range(model.config.num_layers)
    assert calls == [(l, lo, hi) for lo, hi in bounds for l in layers]
    assert greedy(model, logits, toks, table, pool, steps) == model.reference_generate(toks, steps)


def test_cached_prefix_then_a_long_chunked_suffix_matches_the_reference(model):
    first = prompt(70)  # 4 full blocks + 6
    pool = KVPool(model.config, num_blocks=32, block_size=BS)
    table_a = pool.allocate(math.ceil(len(first) / BS))
    model.forward_prefill(first, 0, pool, table_a)
    hashes = prefix_hashes(b"long", first, BS)
    pool.cache_blocks(hashes, table_a, [first[i * BS : (i + 1) * BS] for i in range(4)])
    pool.free(table_a)

    second = first[: 4 * BS] + prompt(190, salt=3)[1:]  # 64 cached + 189 new tokens
    hit = pool.match_prefix(
        prefix_hashes(b"long", second, BS), [second[i * BS : (i + 1) * BS] for i in range(4)]
    )
    assert len(hit) == 4
    start, steps = 4 * BS, 6
    table = hit + pool.allocate(math.ceil((len(second) + steps) / BS) - 4)
    logits = model.forward_prefill_chunked(second[start:], start, pool, table, 32)
    ref = model.reference_logits(second)
    torch.testing.assert_close(logits, ref[-1], atol=ATOL, rtol=0)
    assert greedy(model, logits, second, table, pool, steps) == model.reference_generate(
        second, steps
    )


def test_a_chunked_prefill_stops_between_chunks_when_asked(model):
    """A cancelled request's prefill stops at the next chunk boundary: the chunks before
    it are in the pool, nothing after it is written."""
    toks = prompt(100)
    pool = KVPool(model.config, num_blocks=8, block_size=BS)
    table = pool.allocate(7)
    asked: list[int] = []
    done: list[int] = []

    def stop() -> bool:
        asked.append(len(done))
        return len(done) >= 2 * model.config.num_layers  # after two chunks

    with pytest.raises(PrefillStopped, match="after 64 of 100"):
        model.forward_prefill_chunked(
            toks,
            0,
            pool,
            table,
            32,
            on_layer_done=lambda l, lo, hi: done.append(hi),
            should_stop=stop,
        )
    assert max(done) == 64 and asked == [4, 8]
    written = [bool(pool.kv[table[p // BS], :, :, p % BS].abs().sum()) for p in range(100)]
    assert written == [True] * 64 + [False] * 36


def test_unaligned_chunks_and_start_match_the_reference(model):
    """The decode node's chunks follow its step budget, not the block size."""
    toks = prompt(101)
    pool = KVPool(model.config, num_blocks=8, block_size=BS)
    table = pool.allocate(7)
    model.forward_prefill(toks[:23], 0, pool, table)
    logits = model.forward_prefill_chunked(toks[23:], 23, pool, table, 19)
    torch.testing.assert_close(logits, model.reference_logits(toks)[-1], atol=ATOL, rtol=0)


# -------------------------------------------------------------------- limits
def test_small_preset_serves_32k_positions_and_the_limit_is_named(model):
    assert PRESETS["small"].max_position_embeddings == 32768
    pool = KVPool(model.config, num_blocks=2, block_size=BS)
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"exceeds max_position_embeddings \\({limit} tokens\\)"):
        model.forward_prefill(prompt(10), limit - 5, pool, [0] * (limit // BS + 1))
    with pytest.raises(ValueError, match=str(limit)):
        model.forward_prefill_chunked(prompt(10), limit - 5, pool, [0] * (limit // BS + 1), 4)
    assert pool.kv.abs().sum() == 0  # refused before any chunk wrote the pool


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--block-size", "64", "--prefill-chunk-tokens", "32"], "prefill_chunk_tokens: 32"),
        (["--prefill-chunk-tokens", "0"], "must be between block_size"),
    ],
)
def test_prefill_chunk_tokens_is_validated(argv, fragment):
    with pytest.raises(ConfigError) as e:
        load(DecodeConfig, argv, env={})
    assert fragment in str(e.value)


def test_prefill_chunk_is_whole_blocks():
    cfg = load(DecodeConfig, ["--block-size", "48", "--prefill-chunk-tokens", "100"], env={})
    assert cfg.prefill_chunk == 96
    assert load(DecodeConfig, [], env={}).prefill_chunk == 2048


# ----------------------------------------------- decode node: steps between chunks
class _Spy:
    """The real model, recording which computation ran in which order."""

    def __init__(self, model: LlamaModel) -> None:
        self.model, self.calls = model, []

    def forward_prefill(self, ids, start, pool, table, on_layer_done=None):
        self.calls.append(("prefill", start, len(ids)))
        return self.model.forward_prefill(ids, start, pool, table, on_layer_done)

    def forward_decode(self, ids, positions, tables, pool, mirror=None, keys=None):
        self.calls.append(("decode", positions[0], len(ids)))
        return self.model.forward_decode(ids, positions, tables, pool, mirror=mirror, keys=keys)


def test_decode_batch_steps_between_the_chunks_of_a_long_prompt(model):
    """A prompt computed on the decode node goes in chunks of at most ``prefill_chunk``
    (here below the step budget), and the running request decodes between them, every
    token still the reference's."""

    async def scenario():
        pool = KVPool(model.config, num_blocks=64, block_size=BS)
        spy = _Spy(model)
        sched = BatchScheduler(
            spy,
            pool,
            BS,
            8,
            512,
            frozenset(),
            lambda *a: None,
            lambda *a: None,
            {"generated": 0},
            prefill_chunk=32,
        )
        loop = asyncio.create_task(sched.run())
        a = prompt(20, salt=1)
        res = Reservation("a", len(a), pool.allocate(4))
        res.prompt_ids, res.hashes = a, prefix_hashes(b"s", a, BS)
        first = int((await sched.compute_prompt(a, 0, res.blocks)).argmax())
        res.kv_ready.set()
        res.generated = [first]
        r = Running(res, first, len(a), 30, 1, Sampling(ignore_eos=True), frozenset())
        sched.admit(r)
        long = prompt(200, salt=2)
        table = pool.allocate(13)
        await asyncio.sleep(0)
        logits = await sched.compute_prompt(long, 0, table)
        out = [first]
        while len(out) < 31:
            tok, reason, _ = await r.out.get()
            out.append(tok)
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop
        return spy.calls, logits, out, a, long

    calls, logits, out, a, long = asyncio.run(scenario())
    torch.testing.assert_close(logits, model.reference_logits(long)[-1], atol=ATOL, rtol=0)
    assert out == model.reference_generate(a, 31)
    long_chunks = [c for c in calls if c[0] == "prefill" and c != ("prefill", 0, 20)]
    assert [c[2] for c in long_chunks] == [32] * 6 + [8]
    # between any two chunks of the long prompt the batch stepped at least once
    idx = [i for i, c in enumerate(calls) if c[0] == "prefill" and c != ("prefill", 0, 20)]
    assert all(any(calls[j][0] == "decode" for j in range(i, k)) for i, k in zip(idx, idx[1:]))
