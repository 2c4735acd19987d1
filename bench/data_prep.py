"""Fine-tuning data preparation: tokenization throughput, the cache on a second start, packing.

    PYTHONPATH=src python bench/data_prep.py        # writes bench/results/data_prep.md (~1-2 min)

1. Tokenization: synthetic chat conversations (log-normal turn lengths) in a ``.jsonl``, the
   byte-level tokenizer with a ChatML-like template, assistant-only masks: the first start
   (read + tokenize + write the cache) in-process and with 2 worker processes, and a second start
   (the cache entry opened memory-mapped).
2. Packing: log-normal sample lengths (median ``seq_len / 16``, sigma 1.2, a tail longer than
   ``seq_len``, ``--long-samples split``): blocks, efficiency (real / block tokens) and planning
   time of best-fit-decreasing vs one sample per block. Deterministic counts.
"""

from __future__ import annotations

import datetime
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from chatdata import CHATML, chat_tokenizer, write_jsonl  # noqa: E402

from ulysses_sp.data import plan_blocks, tokenized_corpus  # noqa: E402

CONVERSATIONS = 6000


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


def tokenization(tmp: str) -> list[list]:
    path = write_jsonl(os.path.join(tmp, "chat.jsonl"), _rows(CONVERSATIONS))
    tok = chat_tokenizer(CHATML)
    out = []
    for workers in (1, 2):
        cache = os.path.join(tmp, f"cache{workers}")
        t0 = time.perf_counter()
        corpus = tokenized_corpus(path, tok, cache_dir=cache, workers=workers)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = tokenized_corpus(path, tok, cache_dir=cache, workers=workers)
        int(again.ids[-1])  # touch the memory map
        second = time.perf_counter() - t0
        n = int(corpus.meta["tokens"])
        out.append(
            [
                workers,
                len(corpus),
                n,
                f"{first:.2f}",
                f"{n / first / 1e6:.3f}",
                f"{second:.3f}",
                f"{first / second:.0f}x",
                f"{100 * corpus.meta['scored_tokens'] / n:.1f}%",
            ]
        )
    return out


def packing() -> list[list]:
    out = []
    for seq_len, n in ((8192, 20000), (131072, 20000)):
        rng = np.random.default_rng(0)
        lengths = np.maximum(1, rng.lognormal(np.log(seq_len / 16), 1.2, n).astype(np.int64))
        for mode in ("best-fit", "none"):
            t0 = time.perf_counter()
            plan = plan_blocks(lengths, seq_len, packing=mode, long_samples="split")
            dt = time.perf_counter() - t0
            eff = plan.real_tokens / (len(plan) * seq_len)
            out.append([seq_len, n, plan.split, mode, len(plan), f"{100 * eff:.2f}%", f"{dt:.2f}"])
    return out


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def main() -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()  # fmt: skip
    now = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory() as tmp:
        tok_rows = tokenization(tmp)
    pack_rows = packing()
    md = [
        "# Fine-tuning data preparation (`bench/data_prep.py`)",
        "",
        f"run: `python bench/data_prep.py` on {now:%Y-%m-%d %H:%M UTC}, commit {commit}, host {platform.node()} "
        f"({os.cpu_count()} CPUs, shared), torch {torch.__version__}",
        "",
        f"## Tokenization: {CONVERSATIONS} chat conversations (.jsonl), byte tokenizer, assistant-only masks",
        "",
        _table(
            [
                "workers",
                "samples",
                "tokens",
                "first start s",
                "Mtok/s",
                "second start s",
                "speed-up",
                "scored share",
            ],
            tok_rows,
        ),  # fmt: skip
        "",
        "First start = read (datasets' Arrow conversion) + tokenize + write the cache; second start = the "
        "cache entry found and memory-mapped. Wall times on a busy 2-core machine: compare within the run.",
        "",
        "## Packing: log-normal lengths (median seq_len/16, sigma 1.2), --long-samples split",
        "",
        _table(
            [
                "seq_len",
                "samples",
                "split (longer than seq_len)",
                "packing",
                "blocks",
                "efficiency",
                "plan s",
            ],
            pack_rows,
        ),  # fmt: skip
        "",
        "Efficiency = real tokens / block tokens (deterministic). `none` = one sample per block, padded.",
        "",
    ]
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "data_prep.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
