"""Trains the ``demo`` model: a small Llama that writes English, shipped with kvmesh.

    apt-get install dict-devil            # the text (public domain, see below)
    python scripts/train_demo.py          # ~5 minutes on 2 busy cores; writes services/engine/demo/

The text is Ambrose Bierce's *The Devil's Dictionary* (1911; "A Public Domain Text,
Copyright Expired", as the Debian package ``dict-devil`` says in its copyright file), read
from the installed package's ``/usr/share/dictd/devil.dict.dz`` (gzip). The script keeps
the prose from the preface on, one paragraph or dictionary entry per document.

It trains, all offline and deterministic for a given torch build and thread count:

* a byte-level BPE tokenizer (``tokenizers``, 4096 ids with ``<s>`` and ``</s>``), saved
  as ``tokenizer.json`` + ``tokenizer_config.json``: what
  :class:`kvmesh.services.common.tokenizer.HFTokenizer` loads;
* a Llama (``transformers.LlamaForCausalLM``: 4 layers, hidden 128, GQA 4/2 heads, tied
  embeddings, 1.3 M parameters) on the text, float32 AdamW on one thread (the fastest on
  busy cores), then saved in bfloat16 safetensors (2.5 MiB) with its ``config.json``.
  Greedy decoding writes English words (and repeats itself, as small greedy models do).

The output folder also gets ``SOURCE.md``: the text's source, license and sha256, the
training settings, the final loss and greedy samples from kvmesh's own engine. The
weights are committed, so installing kvmesh never trains; ``--model demo`` loads them.
Training needs the test extra (``transformers``); serving does not.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TEXT = "/usr/share/dictd/devil.dict.dz"
DEFAULT_OUT = ROOT / "services" / "engine" / "demo"
SOURCE = {
    "title": "The Devil's Dictionary, by Ambrose Bierce (1911)",
    "package": "dict-devil (Debian), file /usr/share/dictd/devil.dict.dz",
    "license": "public domain: 'Copyright 1911 by Albert and Charles Boni, Inc. A Public "
    "Domain Text, Copyright Expired' (/usr/share/doc/dict-devil/copyright)",
}
BOS, EOS = "<s>", "</s>"
SAMPLE_PROMPTS = ["Hello, kvmesh", "The cat", "A lawyer is", "LOVE, n."]


def documents(raw: bytes) -> list[str]:
    """Paragraphs of the dictionary's prose (from the preface on), whitespace collapsed."""
    text = raw.decode("utf-8", errors="replace").replace("\r", "")
    start = text.find("PREFACE")
    if start < 0:
        raise SystemExit("the text has no PREFACE: is it The Devil's Dictionary?")
    docs = []
    for para in re.split(r"\n\s*\n", text[start:]):
        words = para.split()
        if len(words) >= 3:  # headings and lone names carry no prose
            docs.append(" ".join(words))
    return docs


def train_tokenizer(docs: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    return tok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--text", default=DEFAULT_TEXT, help="devil.dict.dz (gzip) or plain text")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="checkpoint folder to write")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per training sequence")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--vocab", type=int, default=4096, help="BPE ids, <s> and </s> included")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 is fastest on busy cores)"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    if not os.path.isfile(args.text):
        print(
            f"error: {args.text} not found: install the text with `apt-get install dict-devil` "
            f"or pass --text",
            file=sys.stderr,
        )
        return 1
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    raw = Path(args.text).read_bytes()
    source_sha = hashlib.sha256(raw).hexdigest()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    docs = documents(raw)
    text_sha = hashlib.sha256("\n\n".join(docs).encode()).hexdigest()

    t0 = time.monotonic()
    tok = train_tokenizer(docs, args.vocab)
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids += [bos, *enc.ids, eos]
    data = torch.tensor(ids, dtype=torch.long)
    print(
        f"{len(docs)} documents, {len(raw)} bytes, {len(ids)} tokens (vocab {tok.get_vocab_size()})"
    )

    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    gen = torch.Generator().manual_seed(args.seed)
    span = args.seq_len
    losses: list[float] = []
    model.train()
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - span, (args.batch,), generator=gen)
        batch = torch.stack([data[s : s + span] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss  # transformers shifts the labels
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == args.steps - 1:
            recent = sum(losses[-25:]) / len(losses[-25:])
            print(f"step {step:4d}  loss {recent:.3f}  {time.monotonic() - t0:6.1f}s", flush=True)
    train_s = time.monotonic() - t0
    final_loss = sum(losses[-25:]) / len(losses[-25:])

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.iterdir():
        if old.is_file():
            old.unlink()
    model.eval()
    model.to(torch.bfloat16).save_pretrained(str(out_dir), safe_serialization=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "add_bos_token": True}, indent=2) + "\n"
    )
    for f in out_dir.iterdir():
        f.chmod(0o644)  # safetensors writes 0600

    sys.path.insert(0, str(ROOT))
    from kvmesh.services.engine.checkpoint import load_model

    lm = load_model(str(out_dir))
    samples = []
    for prompt in SAMPLE_PROMPTS:
        got = lm.model.reference_generate(lm.tokenizer.encode(prompt), 24, lm.tokenizer.eos_id)
        samples.append((prompt, lm.tokenizer.decode(got)))
        print(f">>> {prompt}{samples[-1][1]}")
    weights = out_dir / "model.safetensors"
    (out_dir / "SOURCE.md").write_text(
        "# The `demo` model\n\n"
        "Written by `python scripts/train_demo.py` (do not edit by hand).\n\n"
        f"- text: {SOURCE['title']}\n"
        f"- from: {SOURCE['package']}, sha256 `{source_sha}`\n"
        f"- license: {SOURCE['license']}\n"
        f"- training text (paragraphs joined by blank lines): {len(docs)} documents, "
        f"sha256 `{text_sha}`\n"
        f"- tokenizer: byte-level BPE, {tok.get_vocab_size()} ids, `<s>`/`</s>`; "
        f"{len(ids)} training tokens\n"
        f"- model: Llama, {n_params / 1e6:.2f} M parameters, bfloat16, "
        f"`model.safetensors` sha256 `{hashlib.sha256(weights.read_bytes()).hexdigest()}`\n"
        f"- shape: hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
        f"({args.kv_heads} KV), MLP {args.intermediate}, tied embeddings\n"
        f"- training: {args.steps} steps x {args.batch} x {args.seq_len} tokens, AdamW lr "
        f"{args.lr}, seed {args.seed}, {args.threads} threads, torch {torch.__version__}, "
        f"transformers {transformers.__version__}; {train_s:.0f} s; final loss "
        f"{final_loss:.3f}\n\n"
        "Greedy samples (kvmesh's engine, float32):\n\n"
        + "".join(f"- `{p}` -> `{s.strip()}`\n" for p, s in samples)
    )
    print(f"wrote {out_dir} in {time.monotonic() - t0:.0f}s; final loss {final_loss:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
