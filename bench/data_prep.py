"""Fine-tuning data preparation: tokenization throughput, the cache on a second start, packing.

    python -m bench.data_prep [--conversations 6000] [--out bench/results/data_prep.md]   # ~1-2 min

1. Tokenization: synthetic chat conversations (log-normal turn lengths) in a ``.jsonl``, the
   byte-level tokenizer with a ChatML-like template, assistant-only masks: the first start
   (read + tokenize + write the cache) in-process and with 2 worker processes, and a second start
   (the cache entry opened memory-mapped).
2. Packing: log-normal sample lengths (median ``seq_len / 16``, sigma 1.2, a tail longer than
   ``seq_len``, ``--long-samples split``): blocks, efficiency (real / block tokens) and planning
   time of best-fit-decreasing vs one sample per block. Deterministic counts.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # `python bench/data_prep.py`; tests/chatdata.py
from chatdata import CHATML, chat_tokenizer, write_jsonl  # noqa: E402

from bench import md  # noqa: E402
from ulysses_sp.data import plan_blocks, tokenized_corpus  # noqa: E402


def _rows(n: int) -> list[dict]:
    rng = random.Random(0)
    words = [w for w in "the of and to in a is that for it as was with be by on not he this are".split()]

    def text(mean: float) -> str:
        return " ".join(rng.choice(words) for _ in range(max(1, int(rng.lognormvariate(np.log(mean), 0.8)))))

    rows = []
    for _ in range(n):
        msgs = [{"role": "system", "content": "You are helpful."}]
        for _ in range(rng.randint(1, 4)):
            msgs += [{"role": "user", "content": text(30)}, {"role": "assistant", "content": text(60)}]
        rows.append({"messages": msgs})
    return rows


def tokenization(tmp: str, conversations: int) -> list[list]:
    path = write_jsonl(str(Path(tmp) / "chat.jsonl"), _rows(conversations))
    tok = chat_tokenizer(CHATML)
    out = []
    for workers in (1, 2):
        cache = str(Path(tmp) / f"cache{workers}")
        t0 = time.perf_counter()
        corpus = tokenized_corpus(path, tok, cache_dir=cache, workers=workers)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = tokenized_corpus(path, tok, cache_dir=cache, workers=workers)
        int(again.ids[-1])  # touch the memory map
        second = time.perf_counter() - t0
        n = int(corpus.meta["tokens"])
        out.append([workers, len(corpus), n, f"{first:.2f}", f"{n / first / 1e6:.3f}", f"{second:.3f}",
                    f"{first / second:.0f}x", f"{100 * corpus.meta['scored_tokens'] / n:.1f}%"])  # fmt: skip
    return out


def packing(n: int) -> list[list]:
    out = []
    for seq_len in (8192, 131072):
        rng = np.random.default_rng(0)
        lengths = np.maximum(1, rng.lognormal(np.log(seq_len / 16), 1.2, n).astype(np.int64))
        for mode in ("best-fit", "none"):
            t0 = time.perf_counter()
            plan = plan_blocks(lengths, seq_len, packing=mode, long_samples="split")
            dt = time.perf_counter() - t0
            eff = plan.real_tokens / (len(plan) * seq_len)
            out.append([seq_len, n, plan.split, mode, len(plan), f"{100 * eff:.2f}%", f"{dt:.2f}"])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=6000)
    ap.add_argument("--samples", type=int, default=20000, help="packing: sample lengths drawn")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "data_prep.md"))
    args = ap.parse_args(argv)
    run = md.provenance(" ".join(["python -m bench.data_prep", *(argv if argv is not None else sys.argv[1:])]))
    with tempfile.TemporaryDirectory() as tmp:
        tok_rows = tokenization(tmp, args.conversations)
    md.page(args.out, "Fine-tuning data preparation (`bench/data_prep.py`)", run, [
        f"## Tokenization: {args.conversations} chat conversations (.jsonl), byte tokenizer, assistant-only masks",
        md.table(["workers", "samples", "tokens", "first start s", "Mtok/s", "second start s", "speed-up",
                  "scored share"], tok_rows),
        "First start = read (datasets' Arrow conversion) + tokenize + write the cache; second start = the "
        "cache entry found and memory-mapped. Wall times on a busy 2-core machine: compare within the run.",
        "## Packing: log-normal lengths (median seq_len/16, sigma 1.2), --long-samples split",
        md.table(["seq_len", "samples", "split (longer than seq_len)", "packing", "blocks", "efficiency", "plan s"],
                 packing(args.samples)),
        "Efficiency = real tokens / block tokens (deterministic). `none` = one sample per block, padded."])  # fmt: skip


if __name__ == "__main__":
    main()
