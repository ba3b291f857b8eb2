"""The conductor's detokenizer: CPU time per output token of a stream's text
(``conductor.text.TextStream``, one token per push, one stop string watched) at 256, 4,096
and 32,768 output tokens, for the shipped ``demo`` tokenizer (byte-level BPE, through
``tokenizers.DecodeStream``) and the byte tokenizer of the random presets (the window
decoder), against the algorithm it replaced (the whole output decoded again for every
token, kept here only for this comparison). Both give the same text (checked).

    python -m kvmesh.loadtest.bench_detok [--lengths 256,4096,32768] [--runs 3] [--old-full]

The old algorithm costs O(n) per token, so a whole 32,768-token stream of it takes
minutes; unless ``--old-full``, its figure at lengths over 4,096 is the mean of pushes
timed at 64 positions spread evenly over the stream (each push's cost depends only on
its position), marked ``sampled``. Medians of ``--runs``; CPU time is the process's
(``time.process_time``). Writes ``loadtest/results/detok.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from kvmesh.services.common.sampling_params import find_stop
from kvmesh.services.common.tokenizer import ByteTokenizer, HFTokenizer
from kvmesh.services.conductor.text import TextStream
from kvmesh.services.engine.model_spec import shipped_model_dir

RESULTS = Path(__file__).resolve().parent / "results" / "detok.json"
STOPS = ("\n\n\n",)
SAMPLES = 64  # pushes timed per run when the old algorithm is sampled


class OldTextStream:
    """The algorithm before the incremental detokenizer (``text.py`` at fb142ee): the
    whole output decoded again for every push."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.emitted = 0
        self.stopped = False

    def push(self, ids: list[int], final: bool = False) -> str:
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


def output_ids(tok, n: int, seed: int = 0) -> list[int]:
    """``n`` ids of model-like output: words of English and other scripts, encoded."""
    rng = random.Random(seed)
    words = (
        "the of and to in is was that for it with as his on be at by had are but from or "
        "cache token prefill decode cluster über café naïve 東京 数据 données 🚀 ✓ — "
    ).split()
    ids: list[int] = []
    while len(ids) < n:
        text = " ".join(rng.choice(words) for _ in range(200)) + ".\n"
        ids += tok.encode(text, add_bos=False)
    return ids[:n]


def _whole(cls, tok, ids: list[int]) -> tuple[float, str]:
    ts = cls(tok, STOPS)
    last = len(ids) - 1
    t0 = time.process_time()
    text = "".join(ts.push([i], final=k == last) for k, i in enumerate(ids))
    return (time.process_time() - t0) / len(ids), text


def _old_sampled(tok, ids: list[int]) -> float:
    """Mean CPU of the old push over SAMPLES positions spread evenly over the stream."""
    total = 0.0
    positions = [int((k + 0.5) * len(ids) / SAMPLES) for k in range(SAMPLES)]
    for p in positions:
        ts = OldTextStream(tok, STOPS)
        ts.ids = ids[:p]
        ts.emitted = max(0, len(tok.decode(ts.ids)) - ts.hold - 1)
        t0 = time.process_time()
        ts.push([ids[p]])
        total += time.process_time() - t0
    return total / SAMPLES


def run(lengths: list[int], runs: int, old_full: bool) -> list[dict]:
    rows = []
    for name, tok in (
        ("demo", HFTokenizer(shipped_model_dir("demo"))),
        ("byte", ByteTokenizer()),
    ):
        for n in lengths:
            ids = output_ids(tok, n)
            want = tok.decode(ids)
            new, old = [], []
            sampled = n > 4096 and not old_full
            for _ in range(runs):
                cpu, text = _whole(TextStream, tok, ids)
                assert text == want, f"{name} {n}: the new text differs from a full decode"
                new.append(cpu)
                if sampled:
                    old.append(_old_sampled(tok, ids))
                else:
                    cpu, text = _whole(OldTextStream, tok, ids)
                    assert text == want, f"{name} {n}: the old text differs from a full decode"
                    old.append(cpu)
            row = {
                "tokenizer": name,
                "tokens": n,
                "new_us_per_token": round(statistics.median(new) * 1e6, 2),
                "old_us_per_token": round(statistics.median(old) * 1e6, 2),
                "old_sampled": sampled,
            }
            row["speedup"] = round(row["old_us_per_token"] / row["new_us_per_token"], 1)
            rows.append(row)
            print(
                f"{name:5} {n:>6} tokens: new {row['new_us_per_token']:8.2f} us/token, "
                f"old {row['old_us_per_token']:9.2f} us/token"
                f"{' (sampled)' if sampled else ''}  x{row['speedup']}",
                flush=True,
            )
    for name in ("demo", "byte"):
        per = [r["new_us_per_token"] for r in rows if r["tokenizer"] == name]
        print(f"{name}: new cost per token, longest / shortest stream = {per[-1] / per[0]:.2f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="256,4096,32768", help="output lengths, tokens")
    ap.add_argument("--runs", type=int, default=3, help="runs per figure (median)")
    ap.add_argument(
        "--old-full", action="store_true", help="time the old algorithm's whole long streams"
    )
    ap.add_argument("--out", default=str(RESULTS), help="results file")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    rows = run(lengths, a.runs, a.old_full)
    out = {
        "what": "conductor CPU per output token of TextStream (one token per push)",
        "cpu": os.cpu_count(),
        "load_average": os.getloadavg(),
        "results": rows,
    }
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
