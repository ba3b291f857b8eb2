"""Workloads: Mooncake trace replay and synthetic chat / agentic sessions, from a seed.

Every workload is a list of :class:`Item` (one request each) with an arrival time in ms.
Items of a *session* (chat, agent loop) carry ``session``/``turn`` and their new text;
a driver may rebuild a turn's prompt from the previous turn's real output
(:func:`turn_prompt`), so the next turn starts with exactly the previous context.

Trace format (Mooncake, FAST'25): JSON Lines with ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids`` (one id per 512-token block; an id stands for its
block *and everything before it*). A hash id becomes a block of token ids drawn from a
RNG seeded by (seed, id), so two requests share exactly the blocks whose ids they share.
Token ids are in [0, 256): bytes for the byte-level tokenizer of the ``tiny`` preset.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

TRACE_BLOCK = 512  # tokens per hash id in the Mooncake trace
VOCAB = 256  # token ids drawn from [0, VOCAB)
# the Mooncake FAST'25 synthetic trace, vendored beside this module (see traces/README.md)
DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "synthetic_trace.jsonl"


@dataclass
class Item:
    rid: str
    t_ms: float  # scheduled arrival, relative to the start of the run
    token_ids: list[int]  # the prompt (for sessions: with the *planned* outputs)
    max_tokens: int
    hash_ids: list[int] = field(default_factory=list)  # trace items: their (scaled) ids
    session: str = ""  # sessions: id; turns of one session run in order
    turn: int = 0
    new_ids: list[int] = field(default_factory=list)  # sessions: this turn's new text
    planned_output: list[int] = field(default_factory=list)
    think_ms: float = 0.0  # sessions: pause after the previous turn ended

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def block_tokens(hash_id: int, n: int, seed: int = 0) -> list[int]:
    """The ``n`` tokens of the block a hash id stands for: a pure function of (seed, id)."""
    rng = random.Random(seed * 1_000_003 + hash_id * 7_919 + 17)
    return [rng.randrange(VOCAB) for _ in range(n)]


def _text(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


# -- trace --------------------------------------------------------------------------------
def load_trace(path: str | Path = DEFAULT_TRACE) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def trace_items(
    records: Iterable[dict],
    *,
    block_tokens_n: int = 32,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    offset: int = 0,
    every: int = 1,
    max_input: int = 2048,
    min_output: int = 1,
    max_output: int = 32,
    output_scale: float | None = None,
    seed: int = 0,
) -> list[Item]:
    """Trace records -> items.

    ``block_tokens_n``: tokens per trace block after scaling (512 -> e.g. 32: length scale
    1/16); input lengths scale the same way (the last block may be partial) and are capped
    at ``max_input`` (a cap cuts the tail, so prefixes stay shared). Outputs scale by
    ``output_scale`` (default: the same length scale), clamped to [min_output, max_output].
    ``time_scale`` multiplies inter-arrival times (2 = half the rate). ``offset``/``every``
    pick a slice; ``max_requests`` caps it. Arrivals start at 0.
    """
    scale = block_tokens_n / TRACE_BLOCK
    oscale = scale if output_scale is None else output_scale
    recs = list(records)[offset::every]
    if max_requests is not None:
        recs = recs[:max_requests]
    out: list[Item] = []
    t0 = recs[0]["timestamp"] if recs else 0
    for i, r in enumerate(recs):
        n = max(1, min(max_input, round(r["input_length"] * scale)))
        ids = r["hash_ids"]
        toks: list[int] = []
        used: list[int] = []
        for h in ids:
            if len(toks) >= n:
                break
            toks.extend(block_tokens(h, block_tokens_n, seed))
            used.append(h)
        if len(toks) < n:  # a trace whose ids cover less than its length: pad uniquely
            toks.extend(_text(random.Random(f"{seed}-pad-{offset + i * every}"), n - len(toks)))
        toks = toks[:n]
        m = max(min_output, min(max_output, round(r["output_length"] * oscale)))
        out.append(
            Item(
                f"trace-{offset + i * every}",
                (r["timestamp"] - t0) * time_scale,
                toks,
                m,
                hash_ids=used,
            )
        )
    return out


def sample_groups(records: Iterable[dict], share: float, seed: int = 0) -> list[dict]:
    """A bounded subset of a trace that keeps its reuse: whole *prefix groups* (requests
    whose first hash id is equal: only they can share blocks) kept with probability
    ``share`` each, in trace order. A plain slice of a few hundred consecutive requests
    shares almost nothing (the trace's reuse is spread over its 17 minutes: the first
    200 requests could hit 6% of their blocks, the whole trace 64%); a sample of whole
    groups keeps each group's own sharing, so its ideal hit ratio is the trace's."""
    out = []
    for r in records:
        ids = r.get("hash_ids") or [-1]
        u = random.Random(f"group-{seed}-{ids[0]}").random()
        if u < share:
            out.append(r)
    return out


def ideal_hit_ratio(items: list[Item], block: int) -> float:
    """Share of prompt tokens an infinite prefix cache (whole ``block``-token blocks, a
    prompt's last token always computed) could serve: the bound every cache works under."""
    seen: set[tuple] = set()
    hit = total = 0
    for it in sorted(items, key=lambda i: i.t_ms):
        toks = it.token_ids
        total += len(toks)
        n_full = (len(toks) - 1) // block
        keys = [tuple(toks[: (k + 1) * block]) for k in range(n_full)]
        k = 0
        while k < n_full and keys[k] in seen:
            k += 1
        hit += k * block
        seen.update(keys)
    return hit / total if total else 0.0


def at_rate(items: list[Item], rate_rps: float) -> list[Item]:
    """The same requests with their arrival times scaled so that ``len(items)`` of them
    arrive over ``len(items) / rate_rps`` seconds (the trace's bursts kept, in shape)."""
    if not items:
        return []
    span = max(i.t_ms for i in items) - min(i.t_ms for i in items)
    t0 = min(i.t_ms for i in items)
    want = 1000.0 * (len(items) - 1) / rate_rps if len(items) > 1 else 0.0
    k = want / span if span > 0 else 0.0
    return [replace(i, t_ms=(i.t_ms - t0) * k) for i in items]


def shared_prefix_items(
    n_requests: int,
    *,
    rate_rps: float = 2.0,
    prefixes: int = 8,
    prefix_tokens: tuple[int, int] = (1024, 1536),
    user_tokens: tuple[int, int] = (32, 160),
    output: tuple[int, int] = (8, 32),
    zipf: float = 0.8,
    seed: int = 0,
) -> list[Item]:
    """Many users, a few long system prompts and tool schemas: each request is one of
    ``prefixes`` long shared prefixes (picked with Zipf(``zipf``) popularity) + its user's
    own short text; Poisson arrivals at ``rate_rps``. Whichever node computed a prefix
    first, every later request on any node can reuse it."""
    rng = random.Random(f"shared-{seed}")
    heads = [
        _text(random.Random(f"shared-prefix-{seed}-{k}"), rng.randint(*prefix_tokens))
        for k in range(prefixes)
    ]
    weights = [1.0 / (k + 1) ** zipf for k in range(prefixes)]
    items: list[Item] = []
    t = 0.0
    for i in range(n_requests):
        if i:
            t += rng.expovariate(rate_rps) * 1000.0
        k = rng.choices(range(prefixes), weights)[0]
        toks = heads[k] + _text(rng, rng.randint(*user_tokens))
        items.append(Item(f"shared-{i}", t, toks, rng.randint(*output), hash_ids=[k]))
    return items


# -- sessions -------------------------------------------------------------------------------
def turn_prompt(prev_prompt: list[int], prev_output: list[int], new_ids: list[int]) -> list[int]:
    """A session's next prompt: the previous prompt, its output, then the new text."""
    return list(prev_prompt) + list(prev_output) + list(new_ids)


def _sessions(
    kind: str,
    n_sessions: int,
    turns: tuple[int, int],
    first: tuple[int, int],
    growth: tuple[int, int],
    out_of: Callable[[int, random.Random], int],
    rate_per_s: float,
    think_ms: float,
    max_context: int,
    seed: int,
    shared_prefix: int = 0,
) -> list[Item]:
    rng = random.Random(f"{kind}-{seed}")
    system = _text(random.Random(f"{kind}-system-{seed}"), shared_prefix)
    items: list[Item] = []
    t = 0.0
    for s in range(n_sessions):
        t += rng.expovariate(rate_per_s) * 1000.0 if s else 0.0
        sid = f"{kind}-{s}"
        prompt: list[int] = []
        prev_out: list[int] = []
        n_turns = rng.randint(*turns)
        for k in range(n_turns):
            new = (system if k == 0 else []) + _text(
                rng, rng.randint(*(first if k == 0 else growth))
            )
            p = turn_prompt(prompt, prev_out, new)
            m = max(1, out_of(len(p), rng))
            if len(p) + m > max_context:
                break
            out = _text(rng, m)
            items.append(
                Item(
                    f"{sid}-t{k}",
                    t,
                    p,
                    m,
                    session=sid,
                    turn=k,
                    new_ids=new,
                    planned_output=out,
                    think_ms=think_ms if k else 0.0,
                )
            )
            prompt, prev_out = p, out
    return items


def chat_items(
    n_sessions: int = 8,
    *,
    seed: int = 0,
    turns: tuple[int, int] = (3, 6),
    first_tokens: tuple[int, int] = (64, 256),
    turn_tokens: tuple[int, int] = (16, 96),
    output: tuple[int, int] = (8, 32),
    rate_per_s: float = 0.5,
    think_ms: float = 500.0,
    system_prompt: int = 64,
    max_context: int = 3072,
) -> list[Item]:
    """Multi-turn chat: a shared system prompt, a few turns of short user text and answers."""
    return _sessions(
        "chat",
        n_sessions,
        turns,
        first_tokens,
        turn_tokens,
        lambda n, rng: rng.randint(*output),
        rate_per_s,
        think_ms,
        max_context,
        seed,
        shared_prefix=system_prompt,
    )


def agentic_items(
    n_sessions: int = 2,
    *,
    seed: int = 0,
    turns: tuple[int, int] = (30, 32),
    length_scale: float = 1 / 20,
    growth_tokens: int = 2000,
    first_tokens: int = 2000,
    io_ratio: float = 130.0,
    rate_per_s: float = 0.2,
    think_ms: float = 100.0,
    max_context: int = 4000,
) -> list[Item]:
    """Agent loops: 30+ turns; each turn's prompt is the previous prompt + its output + new
    text (tool results), growing ~``growth_tokens`` x ``length_scale`` per turn; outputs
    are ~1/``io_ratio`` of the prompt (public coding-agent traces: ~130:1)."""
    g = max(1, round(growth_tokens * length_scale))
    f = max(1, round(first_tokens * length_scale))

    def out_of(n: int, rng: random.Random) -> int:
        return max(1, round(n / io_ratio * rng.uniform(0.7, 1.3)))

    return _sessions(
        "agent",
        n_sessions,
        turns,
        (f, f),
        (int(g * 0.8), int(g * 1.2)),
        out_of,
        rate_per_s,
        think_ms,
        max_context,
        seed,
    )


def summarize(items: list[Item]) -> dict:
    """Shape of a workload: counts, lengths, input:output ratio, reusable-prefix share."""
    if not items:
        return {"requests": 0}
    ins = [len(i.token_ids) for i in items]
    outs = [i.max_tokens for i in items]
    sessions = {i.session for i in items if i.session}
    reuse = 0
    by_session: dict[str, Item] = {}
    for it in items:
        prev = by_session.get(it.session) if it.session else None
        if prev is not None:
            reuse += len(prev.token_ids) + len(prev.planned_output)
        by_session[it.session] = it
    return {
        "requests": len(items),
        "sessions": len(sessions),
        "span_s": round(max(i.t_ms for i in items) / 1000.0, 2),
        "input_mean": round(sum(ins) / len(ins), 1),
        "input_max": max(ins),
        "output_mean": round(sum(outs) / len(outs), 1),
        "input_output_ratio": round(sum(ins) / max(1, sum(outs)), 1),
        "session_prefix_share": round(reuse / sum(ins), 3) if sessions else None,
    }
