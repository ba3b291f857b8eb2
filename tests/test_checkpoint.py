"""Hugging Face checkpoints: our engine vs transformers on tiny random Llama/Qwen2/Mistral
checkpoints built offline, tokenizers, fingerprints, broken-checkpoint errors, sampling."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from kvmesh.services.common.hashing import prefix_hashes  # noqa: E402
from kvmesh.services.common.sampling_params import Sampling, find_stop  # noqa: E402
from kvmesh.services.common.tokenizer import (  # noqa: E402
    ByteTokenizer,
    HFTokenizer,
    TokenizerError,
    load_tokenizer,
)
from kvmesh.services.engine.checkpoint import CheckpointError, LoadedModel, load_model  # noqa: E402
from kvmesh.services.engine.config import rope_inv_freq  # noqa: E402
from kvmesh.services.engine.kv_pool import KVPool  # noqa: E402
from kvmesh.services.engine.sampling import sample, sample_with_logprob  # noqa: E402

ATOL = 1e-4
BS = 8
VOCAB = 320
WORDS = (
    "the cat dog sat on mat a kv cache block prefill decode node model token "
    "serving cluster mesh prefix hash fast slow red blue green over under"
).split()
MAX_DIFF: list[float] = []  # largest |ours - transformers| seen, reported at the end


# ----------------------------------------------------------------- builders
def corpus(n: int = 2000):
    rng = random.Random(0)
    for _ in range(n):
        yield " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + "."


def train_tokenizer(vocab_size: int = VOCAB) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    return tok


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations and non-trivial logits (HF's 0.02 init makes logits ~0)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1:
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
        elif "embed_tokens" in name:
            p.copy_(
                torch.randn(p.shape, generator=g)
                * (0.3 if getattr(model.config, "tie_word_embeddings", False) else 1.0)
            )
        else:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def build(
    path,
    family: str = "llama",
    seed: int = 0,
    shard: str | None = None,
    tok: Tokenizer | None = None,
    **overrides,
):
    """Save a tiny random HF checkpoint + tokenizer in ``path``; return the transformers model."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=[1, 2],
    )
    common.update(overrides)
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    torch.manual_seed(seed)
    hf = cls[1](cls[0](**common, attn_implementation="eager")).eval()
    randomize(hf, seed)
    kw = {"max_shard_size": shard} if shard else {}
    hf.save_pretrained(str(path), safe_serialization=True, **kw)
    (tok or train_tokenizer()).save(os.path.join(path, "tokenizer.json"))
    return hf


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_tokenizer()


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("llama")
    return d, build(d, "llama", seed=1, tok=tok, rope_theta=50000.0)


@pytest.fixture(scope="module")
def qwen_sharded(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("qwen2")
    return d, build(d, "qwen2", seed=2, shard="40KB", tok=tok)


def hf_logits(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([list(ids)])).logits[0].float()


def close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    diff = float((ours - ref).abs().max())
    MAX_DIFF.append(diff)
    assert diff <= ATOL, f"max |diff| {diff:.3g} > {ATOL}"


def ids_of(n: int, salt: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(100 + salt)
    return [0] + torch.randint(3, VOCAB, (n - 1,), generator=g).tolist()


def per_block(tokens):
    return [tuple(tokens[i * BS : (i + 1) * BS]) for i in range(len(tokens) // BS)]


def blocks(n: int) -> int:
    return -(-n // BS)


# ------------------------------------------------- logits vs transformers
def check_prompt_prefix_decode(lm: LoadedModel, hf) -> None:
    m = lm.model
    pool = KVPool(lm.config, num_blocks=64, block_size=BS)
    # 1. whole prompt (and the oracle path, every position)
    p = ids_of(45)
    table = pool.allocate(blocks(len(p)))
    close(m.forward_prefill(p, 0, pool, table), hf_logits(hf, p)[-1])
    close(m.reference_logits(p), hf_logits(hf, p))
    # 2. suffix prefill after a prefix taken from the pool's prefix cache
    seed = b"ckpt"
    pool.cache_blocks(prefix_hashes(seed, p, BS), table, per_block(p))
    pool.free(table)
    q = p[: 4 * BS] + ids_of(19, salt=9)[1:]
    hit = pool.match_prefix(prefix_hashes(seed, q, BS), per_block(q))
    assert hit == table[:4]
    tq = hit + pool.allocate(blocks(len(q)) - len(hit))
    close(m.forward_prefill(q[len(hit) * BS :], len(hit) * BS, pool, tq), hf_logits(hf, q)[-1])
    pool.free(tq)
    # 3. batched decode of requests of different lengths, every step
    prompts = [ids_of(n, salt=n) for n in (3, 17, 30)]
    steps = 5
    tables, seqs, nxt = [], [], []
    for pr in prompts:
        t = pool.allocate(blocks(len(pr) + steps))
        nxt.append(int(m.forward_prefill(pr, 0, pool, t).argmax()))
        tables.append(t)
        seqs.append(list(pr))
    for _ in range(steps):
        logits = m.forward_decode(nxt, [len(s) for s in seqs], tables, pool)
        for i, s in enumerate(seqs):
            s.append(nxt[i])
            close(logits[i], hf_logits(hf, s)[-1])
        nxt = logits.argmax(-1).tolist()


def test_llama_matches_transformers(llama):
    d, hf = llama
    lm = load_model(str(d), "float32")
    assert (
        lm.config.rope_theta == 50000.0
        and not lm.config.attention_bias
        and lm.model.lm_head is not None
    )
    assert lm.name == os.path.basename(d) and lm.path == os.path.abspath(d)
    check_prompt_prefix_decode(lm, hf)


def test_qwen2_sharded_biases_match_transformers(qwen_sharded):
    d, hf = qwen_sharded
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    lm = load_model(str(d), "float32")
    assert lm.config.attention_bias and not lm.config.attention_out_bias
    assert lm.model.layers[0].q_proj.bias is not None and lm.model.layers[0].o_proj.bias is None
    assert lm.model.layers[0].k_proj.bias.abs().sum() > 0
    check_prompt_prefix_decode(lm, hf)


@pytest.mark.parametrize(
    "scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "linear", "factor": 4.0},
    ],
)
def test_rope_scaling_matches_transformers(tmp_path, tok, scaling):
    hf = build(
        tmp_path,
        "llama",
        seed=3,
        tok=tok,
        rope_theta=500000.0,
        rope_scaling=scaling,
        head_dim=32,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    lm = load_model(str(tmp_path), "float32")
    rs = lm.config.rope_scaling
    assert (
        rs is not None and rs.rope_type == scaling["rope_type"] and rs.factor == scaling["factor"]
    )
    assert lm.config.head_dim == 32
    assert torch.equal(lm.model.inv_freq, hf.model.rotary_emb.inv_freq.float())
    assert not torch.equal(
        lm.model.inv_freq, rope_inv_freq(dataclasses.replace(lm.config, rope_scaling=None))
    )
    p = ids_of(150, salt=5)
    pool = KVPool(lm.config, num_blocks=32, block_size=BS)
    table = pool.allocate(blocks(len(p) + 1))
    close(lm.model.forward_prefill(p, 0, pool, table), hf_logits(hf, p)[-1])
    nxt = int(hf_logits(hf, p)[-1].argmax())
    close(lm.model.forward_decode([nxt], [len(p)], [table], pool)[0], hf_logits(hf, p + [nxt])[-1])


def test_tied_embeddings_match_transformers(tmp_path, tok):
    hf = build(tmp_path, "llama", seed=4, tok=tok, tie_word_embeddings=True)
    keys = load_file(str(tmp_path / "model.safetensors")).keys()
    assert "lm_head.weight" not in keys
    lm = load_model(str(tmp_path), "float32")
    assert lm.config.tie_word_embeddings and lm.model.lm_head is None
    p = ids_of(20, salt=1)
    close(lm.model.reference_logits(p), hf_logits(hf, p))


def test_mistral_sliding_window_caps_context(tmp_path, tok):
    hf = build(tmp_path, "mistral", seed=5, tok=tok, sliding_window=64)
    lm = load_model(str(tmp_path), "float32")
    assert lm.config.max_position_embeddings == 64
    p = ids_of(40, salt=2)
    close(lm.model.reference_logits(p), hf_logits(hf, p))
    pool = KVPool(lm.config, num_blocks=16, block_size=BS)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        lm.model.forward_prefill(ids_of(65), 0, pool, pool.allocate(9))


def test_bfloat16_load_runs(llama):
    d, hf = llama
    lm = load_model(str(d), "bfloat16")
    assert lm.dtype == torch.bfloat16
    p = ids_of(30)
    pool = KVPool(lm.config, num_blocks=8, block_size=BS, dtype=torch.bfloat16)
    out = lm.model.forward_prefill(p, 0, pool, pool.allocate(blocks(len(p))))
    ref = hf_logits(hf, p)[-1]
    assert out.dtype == torch.float32 and float((out - ref).abs().max()) < 0.25 * float(
        ref.abs().max()
    )


# --------------------------------------------------------- tokenizer / fingerprint
def test_hf_tokenizer(llama, tmp_path):
    d, _ = llama
    t = load_tokenizer(str(d))
    assert isinstance(t, HFTokenizer) and t.vocab_size == VOCAB
    assert t.bos_id == 0 and t.eos_id == 1 and t.eos_ids == {1, 2}
    text = "the cat sat on the mat."
    ids = t.encode(text)
    assert ids[0] == 0 and len(ids) < len(text) and t.decode(ids + [1]) == text
    assert t.encode(text, add_bos=False) == ids[1:]
    assert t.name.startswith("hf-") and t.name == HFTokenizer(str(d)).name
    assert t.name == "hf-" + hashlib.sha256((d / "tokenizer.json").read_bytes()).hexdigest()[:32]
    # generation_config.json overrides the primary eos; tokenizer_config decides BOS
    other = tmp_path / "m"
    shutil.copytree(d, other)
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    (other / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": None, "eos_token": "<|end|>"})
    )
    t2 = HFTokenizer(str(other))
    assert t2.eos_id == 2 and t2.eos_ids == {1, 2, 7} and t2.bos_id is None
    assert t2.encode(text) == ids[1:]
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer) and ByteTokenizer.eos_ids == {257}
    with pytest.raises(TokenizerError, match="not a model directory"):
        load_tokenizer(str(tmp_path / "nope"))
    (other / "tokenizer.json").write_text("{ not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        HFTokenizer(str(other))


def test_tokenizer_module_is_torch_free():
    code = (
        "import sys; import services.common.tokenizer as t; t.load_tokenizer('tiny'); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__))
    )


def test_fingerprint(llama, tmp_path):
    d, _ = llama
    a, b = load_model(str(d)), load_model(str(d))
    assert a.weights_digest == b.weights_digest and len(a.weights_digest) == 32
    fp = a.fingerprint("float32", 16)
    assert fp == b.fingerprint("float32", 16)
    assert fp != a.fingerprint("bfloat16", 16) and fp != a.fingerprint("float32", 32)
    changed = tmp_path / "c"
    shutil.copytree(d, changed)
    w = load_file(str(changed / "model.safetensors"))
    w["model.norm.weight"] = w["model.norm.weight"] + 1e-3
    save_file(w, str(changed / "model.safetensors"))
    assert load_model(str(changed)).fingerprint("float32", 16) != fp
    tiny = load_model("tiny", "float32", seed=0)
    assert tiny.name == tiny.path == "tiny" and isinstance(tiny.tokenizer, ByteTokenizer)
    assert tiny.fingerprint("float32", 16) == tiny.model.fingerprint("byte-v1", 16)
    assert tiny.fingerprint("float32", 16) != load_model("tiny", seed=1).fingerprint("float32", 16)


# ------------------------------------------------------------ broken checkpoints
@pytest.fixture()
def broken(llama, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(llama[0], d)
    return d


def test_error_missing_config(broken):
    (broken / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        load_model(str(broken))


def test_error_bad_json_and_unsupported_arch(broken):
    cfg = (broken / "config.json").read_text()
    (broken / "config.json").write_text(cfg[:-10])
    with pytest.raises(CheckpointError, match=r"config\.json: malformed JSON"):
        load_model(str(broken))
    data = json.loads(cfg)
    data["architectures"] = ["GPT2LMHeadModel"]
    (broken / "config.json").write_text(json.dumps(data))
    with pytest.raises(
        CheckpointError, match=r"config\.json: unsupported architecture \['GPT2LMHeadModel'\]"
    ):
        load_model(str(broken))
    data["architectures"] = ["LlamaForCausalLM"]
    data["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (broken / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="unsupported rope scaling type 'dynamic'"):
        load_model(str(broken))


def test_error_missing_tensor_and_shape(broken):
    f = broken / "model.safetensors"
    w = load_file(str(f))
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, str(f))
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'",
    ):
        load_model(str(broken))
    data = json.loads((broken / "config.json").read_text())
    data["intermediate_size"] = 96
    (broken / "config.json").write_text(json.dumps(data))
    with pytest.raises(
        CheckpointError, match=r"'model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight' has shape"
    ):
        load_model(str(broken))


def test_error_bad_dtype(broken):
    with pytest.raises(ValueError, match="float16"):
        load_model(str(broken), "float16")
    f = broken / "model.safetensors"
    w = load_file(str(f))
    w["model.norm.weight"] = w["model.norm.weight"].to(torch.int64)
    save_file(w, str(f))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has dtype torch\.int64"):
        load_model(str(broken))
    f.write_bytes(b"garbage" * 10)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: malformed safetensors"):
        load_model(str(broken))


def test_error_missing_shard_and_weights(qwen_sharded, tmp_path):
    d = tmp_path / "q"
    shutil.copytree(qwen_sharded[0], d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (d / victim).unlink()
    with pytest.raises(
        CheckpointError, match=rf"index\.json: shard '{victim}' listed in the index is missing"
    ):
        load_model(str(d))
    (d / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        load_model(str(d))
    with pytest.raises(CheckpointError, match="neither a preset"):
        load_model(str(tmp_path / "absent"))


def test_error_missing_tokenizer(broken):
    (broken / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: file not found"):
        load_model(str(broken))


# ------------------------------------------------------------------- sampling
def test_stop_strings():
    assert find_stop("hello world. bye", ["bye", "."]) == 11
    assert find_stop("hello", ["x"]) is None and find_stop("hello", []) is None
    assert find_stop("abcabc", ["bc", "abc"]) == 0  # earliest start wins
    assert find_stop("abc", ["", "c"]) == 2  # empty stop strings are ignored


def test_sampling_seeded_batch_independent_and_logprob():
    g = torch.Generator().manual_seed(0)
    batch = torch.randn(6, 50, generator=g)
    s = Sampling(temperature=0.8, top_p=0.9, top_k=20, seed=42)
    alone = [sample(batch[2], s, step=5) for _ in range(3)]
    assert len(set(alone)) == 1
    for rows in (batch, batch[1:4], batch[2:3], batch.t().contiguous().t()):  # same row, any batch
        row = rows[{6: 2, 3: 1, 1: 0}[rows.shape[0]]]
        others = [
            sample(r, Sampling(temperature=1.0, seed=7), step=5) for r in rows
        ]  # other requests
        assert sample(row, s, step=5) == alone[0], others
    tok, lp = sample_with_logprob(batch[2], s, step=5)
    assert tok == alone[0] and lp <= 0 and math.isfinite(lp)
    greedy = Sampling()
    tok, lp = sample_with_logprob(batch[0], greedy)
    assert tok == int(batch[0].argmax())
    assert lp == pytest.approx(float(torch.log_softmax(batch[0], -1)[tok]), abs=1e-6)
    draws = {sample(batch[0], Sampling(temperature=1.0, seed=1), step=i) for i in range(30)}
    assert len(draws) > 1
    assert Sampling(top_p=1.5).validate(50).startswith("sampling.top_p")
    assert Sampling(top_k=99).validate(50).startswith("sampling.top_k")
    assert Sampling(temperature=-1).validate(50).startswith("sampling.temperature")


def test_report_max_diff():
    assert MAX_DIFF, "no comparisons ran"
    print(
        f"\n[checkpoint] {len(MAX_DIFF)} logit comparisons vs transformers; "
        f"largest |diff| = {max(MAX_DIFF):.3g}"
    )
