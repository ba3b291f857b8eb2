"""Tests for the kvmesh model engine (services/engine) and block hashing."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time

import pytest
import torch

from kvmesh.services.common.hashing import model_fingerprint, prefix_hashes, preset_weights_digest
from kvmesh.services.common.tokenizer import ByteTokenizer
from kvmesh.services.engine.config import PRESETS, resolve_dtype
from kvmesh.services.engine.kv_pool import KVPool, OutOfBlocks
from kvmesh.services.engine.model import LlamaModel, apply_rope
from kvmesh.services.engine.prefix_cache import PrefixCache

BS = 16
ATOL = 1e-4
SEED = b"test-model"


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel.from_preset("tiny", seed=0)


def blocks_for(n_tokens: int, block_size: int = BS) -> int:
    return math.ceil(n_tokens / block_size)


def prompt(n: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(1234 + salt)
    return [256] + torch.randint(0, 256, (n - 1,), generator=g).tolist()


def per_block(tokens, block_size=BS):
    return [
        tuple(tokens[i * block_size : (i + 1) * block_size])
        for i in range(len(tokens) // block_size)
    ]


# --------------------------------------------------------------- correctness
def test_prefill_then_decode_matches_reference(model):
    toks, steps = prompt(37), 10
    pool = KVPool(model.config, num_blocks=16, block_size=BS)
    table = pool.allocate(blocks_for(len(toks) + steps))
    logits = model.forward_prefill(torch.tensor(toks), 0, pool, table)
    assert logits.dtype == torch.float32 and logits.shape == (model.config.vocab_size,)
    seq, out = list(toks), []
    for _ in range(steps):
        ref = model.reference_logits(seq)[-1]
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
        nxt = int(logits.argmax())
        out.append(nxt)
        logits = model.forward_decode(torch.tensor([nxt]), [len(seq)], [table], pool)[0]
        seq.append(nxt)
    assert out == model.reference_generate(toks, steps)


def test_prefill_reuses_cached_prefix_blocks(model):
    pool = KVPool(model.config, num_blocks=32, block_size=BS)
    first = prompt(53)  # 3 full blocks + 5
    table_a = pool.allocate(blocks_for(len(first)))
    model.forward_prefill(torch.tensor(first), 0, pool, table_a)
    hashes_a = prefix_hashes(SEED, first, BS)
    assert pool.cache_blocks(hashes_a, table_a, per_block(first)) == 3
    pool.free(table_a)  # request A done; its full blocks stay cached

    second = first[: 3 * BS] + prompt(30, salt=7)[1:]  # shares 3 full blocks
    hit = pool.match_prefix(prefix_hashes(SEED, second, BS), per_block(second))
    assert hit == table_a[:3]
    start = len(hit) * BS
    table_b = hit + pool.allocate(blocks_for(len(second) + 6) - len(hit))

    embedded: list[int] = []
    hook = model.embed_tokens.register_forward_hook(lambda m, i, o: embedded.append(i[0].numel()))
    try:
        logits = model.forward_prefill(torch.tensor(second[start:]), start, pool, table_b)
    finally:
        hook.remove()
    assert embedded == [len(second) - start]  # only the new tokens were computed
    torch.testing.assert_close(logits, model.reference_logits(second)[-1], atol=ATOL, rtol=0)

    seq, out = list(second), []
    for _ in range(6):
        nxt = int(logits.argmax())
        out.append(nxt)
        logits = model.forward_decode([nxt], [len(seq)], [table_b], pool)[0]
        seq.append(nxt)
    assert out == model.reference_generate(second, 6)


def test_batched_decode_matches_individual(model):
    pool = KVPool(model.config, num_blocks=32, block_size=BS)
    prompts = [prompt(5, 1), prompt(20, 2), prompt(41, 3)]
    tables, firsts = [], []
    for p in prompts:
        t = pool.allocate(blocks_for(len(p) + 1))
        firsts.append(int(model.forward_prefill(p, 0, pool, t).argmax()))
        tables.append(t)
    snapshot = pool.kv.clone()
    positions = [len(p) for p in prompts]
    batched = model.forward_decode(firsts, positions, tables, pool)
    assert batched.shape == (3, model.config.vocab_size) and batched.dtype == torch.float32
    after_batch = pool.kv.clone()
    for i in range(3):
        pool.kv.copy_(snapshot)
        alone = model.forward_decode([firsts[i]], [positions[i]], [tables[i]], pool)[0]
        torch.testing.assert_close(batched[i], alone, atol=ATOL, rtol=0)
        ref = model.reference_logits(prompts[i] + [firsts[i]])[-1]
        torch.testing.assert_close(batched[i], ref, atol=ATOL, rtol=0)
        blk, off = tables[i][positions[i] // BS], positions[i] % BS
        torch.testing.assert_close(
            pool.kv[blk, :, :, off], after_batch[blk, :, :, off], atol=1e-6, rtol=0
        )


def test_layer_callback_order_and_kv_visible(model):
    pool = KVPool(model.config, num_blocks=8, block_size=BS)
    toks = prompt(21)
    table = pool.allocate(blocks_for(len(toks)))
    slots = [(table[p // BS], p % BS) for p in range(len(toks))]
    seen, snaps = [], {}

    def on_layer_done(layer: int) -> None:
        seen.append(layer)
        snaps[layer] = torch.stack([pool.kv[b, layer, :, o] for b, o in slots]).clone()
        assert all(snaps[layer][i].abs().sum() > 0 for i in range(len(slots)))
        if layer + 1 < model.config.num_layers:  # next layer not written yet
            assert all(pool.kv[b, layer + 1, :, o].abs().sum() == 0 for b, o in slots)

    model.forward_prefill(toks, 0, pool, table, on_layer_done=on_layer_done)
    assert seen == list(range(model.config.num_layers))
    for layer, snap in snaps.items():
        assert torch.equal(snap, torch.stack([pool.kv[b, layer, :, o] for b, o in slots]))


def test_bfloat16_model_runs(model):
    m = LlamaModel.from_preset("tiny", seed=0, dtype="bfloat16")
    assert m.dtype == torch.bfloat16
    pool = KVPool(m.config, num_blocks=8, block_size=BS, dtype=torch.bfloat16)
    toks = prompt(30)
    table = pool.allocate(blocks_for(len(toks) + 2))
    logits = m.forward_prefill(toks, 0, pool, table)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    dec = m.forward_decode([int(logits.argmax())], [len(toks)], [table], pool)
    assert torch.isfinite(dec).all()
    assert torch.isfinite(m.reference_logits(toks)).all()
    view = pool.bytes_view()
    assert len(view) == pool.nbytes == pool.kv.numel() * 2 and not view.readonly


def test_weights_deterministic_and_outputs_vary(model):
    again = LlamaModel.from_preset("tiny", seed=0)
    other = LlamaModel.from_preset("tiny", seed=1)
    for (n, a), b, _c in zip(
        model.state_dict().items(), again.state_dict().values(), other.state_dict().values()
    ):
        assert torch.equal(a, b), n
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)
    outs = {tuple(model.reference_generate(prompt(12, s), 6)) for s in range(4)}
    assert len(outs) == 4
    assert (
        model.fingerprint("byte-v1", BS)
        == again.fingerprint("byte-v1", BS)
        != other.fingerprint("byte-v1", BS)
    )


def test_rope_depends_on_relative_position(model):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 16, generator=g)
    k = torch.randn(1, 1, 16, generator=g)

    def dot(pq: int, pk: int) -> float:
        cq, sq = model._rope(torch.tensor([pq]))
        ck, sk = model._rope(torch.tensor([pk]))
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    assert dot(7, 3) == pytest.approx(dot(104, 100), abs=1e-4)
    assert dot(7, 3) != pytest.approx(dot(7, 5), abs=1e-3)


# -------------------------------------------------------------- prefix cache
def small_pool(num_blocks=6, block_size=4) -> KVPool:
    return KVPool(PRESETS["tiny"], num_blocks=num_blocks, block_size=block_size)


def cache_chain(
    pool: KVPool, tokens: list[int], seed: bytes = SEED
) -> tuple[list[int], list[bytes]]:
    hashes = prefix_hashes(seed, tokens, pool.block_size)
    blocks = pool.allocate(len(hashes))
    pool.cache_blocks(hashes, blocks, per_block(tokens, pool.block_size))
    return blocks, hashes


def test_prefix_cache_chained_hit_and_miss():
    pool = small_pool()
    toks = list(range(12))
    blocks, hashes = cache_chain(pool, toks)
    assert pool.drain_events() == [("stored", h) for h in hashes]
    assert pool.match_prefix(hashes, per_block(toks, 4)) == blocks
    assert [pool.refcount(b) for b in blocks] == [2, 2, 2]
    changed = toks[:4] + [99] + toks[5:]  # differs in block 1 -> chain diverges from there
    h2 = prefix_hashes(SEED, changed, 4)
    assert h2[0] == hashes[0] and h2[1] != hashes[1] and h2[2] != hashes[2]
    assert pool.match_prefix(h2, per_block(changed, 4)) == blocks[:1]
    assert pool.match_prefix(prefix_hashes(b"other", toks, 4), per_block(toks, 4)) == []
    # same hash but different token ids (collision guard) is a miss
    bad = [tuple(t + 1 for t in b) for b in per_block(toks, 4)]
    assert pool.match_prefix(hashes, bad) == []


def test_prefix_cache_lru_eviction_tails_first_and_refcounts():
    pool = small_pool(num_blocks=6)
    a_blocks, a_hashes = cache_chain(pool, list(range(8)))  # chain A: 2 blocks
    b_blocks, b_hashes = cache_chain(pool, list(range(100, 108)))  # chain B: 2 blocks
    c_blocks, _ = cache_chain(pool, list(range(200, 208)))  # chain C: held
    pool.drain_events()
    assert pool.num_free == 0 and pool.num_used == 6
    pool.free(a_blocks)  # A becomes evictable first (head released before tail)
    pool.free(b_blocks)
    assert pool.num_free == 4 and pool.num_used == 2 and pool.num_cached == 6

    got = pool.allocate(1)
    assert got == [a_blocks[1]]  # LRU chain A, tail before its (older) head
    assert pool.drain_events() == [("removed", a_hashes[1])]
    got += pool.allocate(2)
    assert got[1:] == [a_blocks[0], b_blocks[1]]
    assert pool.drain_events() == [("removed", a_hashes[0]), ("removed", b_hashes[1])]
    # B's head is still cached and matchable
    assert pool.match_prefix(b_hashes, per_block(list(range(100, 108)), 4)) == b_blocks[:1]
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)  # everything is referenced
    assert pool.num_cached == 3 and all(pool.refcount(b) == 1 for b in c_blocks)


def test_pool_free_list_refcounts_and_errors():
    pool = small_pool(num_blocks=4)
    blocks = pool.allocate(3)
    assert pool.num_free == 1 and pool.num_used == 3
    pool.ref(blocks[:1])
    pool.free(blocks)
    assert pool.num_free == 3 and pool.refcount(blocks[0]) == 1
    pool.free(blocks[:1])
    assert pool.num_free == 4 and pool.num_used == 0 and pool.num_cached == 0
    with pytest.raises(ValueError):
        pool.free(blocks[:1])
    with pytest.raises(ValueError):
        pool.ref(blocks[:1])
    with pytest.raises(OutOfBlocks):
        pool.allocate(5)
    assert pool.num_free == 4  # failed allocation changes nothing


def test_prefix_cache_standalone_events_callback():
    events = []
    cache = PrefixCache(on_event=events.append)
    assert cache.insert(b"h0", 3, (1, 2))
    assert cache.insert(b"h1", 4, (3, 4), parent_hash=b"h0")
    assert not cache.insert(b"h1", 5, (3, 4))  # already cached elsewhere
    assert cache.match([b"h0", b"h1"], [(1, 2), (3, 4)]) == [3, 4]
    assert cache.release(3) and cache.release(4) and not cache.release(9)
    assert cache.evict(5) == [4, 3]
    assert events == [("stored", b"h0"), ("stored", b"h1"), ("removed", b"h1"), ("removed", b"h0")]
    assert cache.drain_events() == []


def test_pool_byte_layout():
    cfg = PRESETS["tiny"]
    pool = KVPool(cfg, num_blocks=3, block_size=BS)
    assert pool.block_nbytes == cfg.num_layers * 2 * BS * cfg.num_kv_heads * cfg.head_dim * 4
    assert pool.layer_nbytes * cfg.num_layers == pool.block_nbytes
    assert pool.layer_offset(2, 1) == 2 * pool.block_nbytes + pool.layer_nbytes
    view = pool.bytes_view()
    off = pool.layer_offset(1, 2)
    src = torch.arange(pool.layer_nbytes // 4, dtype=torch.float32)
    view[off : off + pool.layer_nbytes] = src.numpy().tobytes()
    assert torch.equal(pool.kv[1, 2].reshape(-1), src)
    assert pool.kv[1, 1].abs().sum() == 0 and pool.kv[1, 3].abs().sum() == 0
    big = KVPool.from_memory(cfg, 10 * pool.block_nbytes + 5, BS, "float32")
    assert big.num_blocks == 10


# ------------------------------------------------------------ misc / hashing
def test_prefix_hashes_properties():
    toks = list(range(40))
    h = prefix_hashes(SEED, toks, BS)
    assert len(h) == 2 and all(len(x) == 16 for x in h)  # partial third block not hashed
    assert prefix_hashes(SEED, toks[:32] + [7, 7], BS) == h
    assert prefix_hashes(SEED, toks[:16] + [0] * 16, BS)[0] == h[0]
    assert prefix_hashes(SEED, toks[:16] + [0] * 16, BS)[1] != h[1]
    assert prefix_hashes(b"other", toks, BS)[0] != h[0]
    assert prefix_hashes(SEED, toks[:15], BS) == []
    fp = model_fingerprint(
        PRESETS["tiny"], preset_weights_digest("tiny", 0), "float32", "byte-v1", BS
    )
    assert fp != model_fingerprint(
        PRESETS["tiny"], preset_weights_digest("tiny", 0), "bfloat16", "byte-v1", BS
    )
    assert fp != model_fingerprint(
        PRESETS["tiny"], preset_weights_digest("tiny", 0), "float32", "byte-v1", 32
    )


def test_dtype_and_tokenizer():
    assert resolve_dtype("float32") is torch.float32 and resolve_dtype("bfloat16") is torch.bfloat16
    for bad in ("float16", torch.float16, "int8"):
        with pytest.raises(ValueError):
            resolve_dtype(bad, cuda=False)
    with pytest.raises(ValueError, match="CUDA only"):
        resolve_dtype("float16", cuda=False)
    assert resolve_dtype("float16", cuda=True) is torch.float16
    assert resolve_dtype("auto", cuda=False) is torch.float32
    assert resolve_dtype("auto", cuda=True) is torch.bfloat16
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids[0] == tok.bos_id and tok.decode(ids + [tok.eos_id]) == "héllo"
    assert tok.encode("a", add_bos=False) == [97] and tok.vocab_size <= PRESETS["tiny"].vocab_size


def test_timing_report(model):
    """Prints (does not assert) tiny-model CPU timings: prefill 512, decode 32 steps x batch 4."""
    pool = KVPool(model.config, num_blocks=256, block_size=BS)
    toks = prompt(512)
    table = pool.allocate(blocks_for(512 + 32))
    model.forward_prefill(toks[:32], 0, pool, table)  # warm-up
    t0 = time.perf_counter()
    model.forward_prefill(toks, 0, pool, table)
    prefill_s = time.perf_counter() - t0
    tables = [pool.allocate(blocks_for(n + 32)) for n in (100, 200, 300, 400)]
    for n, t in zip((100, 200, 300, 400), tables):
        model.forward_prefill(toks[:n], 0, pool, t)
    lens, cur = [100, 200, 300, 400], [1, 2, 3, 4]
    t0 = time.perf_counter()
    for _ in range(32):
        cur = model.forward_decode(cur, lens, tables, pool).argmax(-1).tolist()
        lens = [n + 1 for n in lens]
    decode_s = time.perf_counter() - t0
    print(
        f"\n[timing] tiny prefill 512 tokens: {prefill_s * 1e3:.1f} ms; "
        f"decode 32 steps x batch 4: {decode_s * 1e3:.1f} ms ({decode_s / 32 * 1e3:.2f} ms/step)"
    )


def test_prefix_cache_head_with_referenced_tail_is_last_resort():
    pool = small_pool(num_blocks=3)
    toks = list(range(8))
    blocks, hashes = cache_chain(pool, toks)
    pool.free(blocks[:1])  # head unreferenced, tail still held
    assert pool.num_free == 2
    first = pool.allocate(1)  # the free block goes first
    assert pool.num_cached == 2 and first[0] not in blocks
    assert pool.allocate(1) == blocks[:1]  # then the head, as a last resort
    assert pool.num_cached == 1 and pool.match_prefix(hashes, per_block(toks, 4)) == []
    pool.free(blocks[1:])
    assert pool.num_free == 1 and pool.allocate(1) == blocks[1:]


def test_tied_embeddings_paged_matches_reference():
    cfg = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=True, num_layers=2)
    m = LlamaModel(cfg)
    m.init_weights(3)
    assert m.lm_head is None
    pool = KVPool(cfg, num_blocks=4, block_size=BS)
    toks = prompt(20)
    table = pool.allocate(2)
    logits = m.forward_prefill(toks[:9], 0, pool, table)
    torch.testing.assert_close(logits, m.reference_logits(toks[:9])[-1], atol=ATOL, rtol=0)
    logits = m.forward_prefill(toks[9:], 9, pool, table)  # chunked continuation
    torch.testing.assert_close(logits, m.reference_logits(toks)[-1], atol=ATOL, rtol=0)


def test_pool_single_block_insert_api():
    pool = small_pool(num_blocks=3)
    toks = list(range(8))
    hashes = prefix_hashes(SEED, toks, 4)
    blocks = pool.allocate(2)
    assert pool.insert(hashes[0], blocks[0], toks[:4])
    assert pool.insert(hashes[1], blocks[1], toks[4:], parent_hash=hashes[0])
    assert pool.match(hashes, per_block(toks, 4)) == blocks
    pool.free(blocks)
    pool.free(blocks)
    other = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.insert(hashes[0], blocks[0], toks[:4])  # unreferenced block
    assert not pool.insert(hashes[0], other[0], toks[:4])  # hash already cached elsewhere
    assert pool.allocate(1) == [blocks[1]]  # tail evicted first
    assert (
        preset_weights_digest("tiny", 0)
        == hashlib.blake2b(b"preset:tiny:seed:0", digest_size=16).digest()
    )
