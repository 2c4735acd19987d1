"""``ulysses-sp plan ... --rehearse``: the recommended ``train`` command rehearsed, and with ``--max``
the longest length confirmed by rehearsal.

``rehearse_plan(ns, doc)`` takes the plan's document (``cli.plan.candidates``), turns its
recommended command into the ``RunConfig`` ``train`` would make, and rehearses one step
(``rehearse.run.rehearse_run``: the real step on fake tensors) on the plan's GPUs and memory. With
``--max`` (what ``plan`` does without ``--seq-len``) the recommended length is the planner's longest;
the rehearsal checks it and walks to the longest length that fits by its own measure: up while it
fits (to the model's positions limit), down while it does not, in steps of 1/8 that double each
time, then bisects to 2 % (multiples of the run's sequence granularity; ``search_longest``). Each probe prints a progress line; the last fitting
length is rehearsed on every rank the report shows.

A named shape (``llama-8b``) has no ``config.json``: a Llama config of that shape is written to a
temporary directory for the rehearsal. Where it sits: beside ``cli.plan`` (the planner's table);
imports ``rehearse`` lazily.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

STEP = 0.125
"""Relative step of the walk up or down from the planner's longest length."""
TOLERANCE = 0.02
"""The bisection stops when the bracket is within this fraction of its lower end."""


def _config_dir(model: str, shape: Any) -> str:
    """``model`` itself, or for a named shape a directory with a Llama ``config.json`` of that shape."""
    from ulysses_sp.plan.inputs import SHAPES

    if model not in SHAPES:
        return model
    from transformers import LlamaConfig

    d = tempfile.mkdtemp(prefix="ulysses-sp-shape-")
    LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                vocab_size=shape.vocab, tie_word_embeddings=shape.tied,
                max_position_embeddings=shape.max_positions or 131072).save_pretrained(d)  # fmt: skip
    return d


def _run_config(settings: dict[str, Any], model_dir: str) -> Any:
    from ulysses_sp.run.config import config_from_dict

    fields = {k: v for k, v in settings.items() if k != "nproc"}
    return config_from_dict({**fields, "model": model_dir, "progress": False})


def rehearse_plan(ns: argparse.Namespace, doc: dict[str, Any], shape: Any, hw: Any) -> dict[str, Any]:
    """Rehearse ``doc``'s recommended command (see the module docstring). Returns ``{"rehearsal":
    Rehearsal.as_dict(), "report": text, "probes": [(seq_len, fits, peak bytes)], "longest": S or
    None, "planned": S}``; raises ``ValueError`` when nothing was recommended."""
    from dataclasses import replace

    from ulysses_sp.rehearse.report import format_rehearsal
    from ulysses_sp.rehearse.run import rehearse_run

    best = doc["recommended"]
    if best is None:
        raise ValueError("--rehearse: the planner recommends nothing to rehearse (nothing fits); see the table")
    if best["settings"]["zero_stage"] < 2:  # DDP: its C++ reducer reads memory fake tensors do not have
        fsdp = [c for c in doc["candidates"] if c["fits"] and c["settings"]["zero_stage"] >= 2]
        if not fsdp:
            raise ValueError("--rehearse: the recommended command runs ZeRO 0/1 (DDP), which cannot be rehearsed, "
                             "and no ZeRO 2/3 setting fits")  # fmt: skip
        key = (lambda c: c["tokens_per_s"]) if ns.seq_len is not None else (
            lambda c: (c["settings"]["seq_len"], c["tokens_per_s"]))  # fmt: skip
        best = max(fsdp, key=key)
        doc["notes"].append("--rehearse: the recommended ZeRO 0/1 (DDP) command cannot be rehearsed; rehearsing the "
                            "best ZeRO 2/3 setting: " + " ".join(best["train_args"]))  # fmt: skip
    settings = dict(best["settings"])
    gpus = ns.gpus * ns.nodes
    cfg = _run_config(settings, _config_dir(ns.model, shape))
    memory = dict(gpu_memory=hw.memory_bytes, host_memory=getattr(ns, "host_memory", None), reserve=hw.reserve_bytes,
                  device="cpu" if hw.name == "cpu" else "cuda")  # fmt: skip
    planned = cfg.seq_len
    multiple = 256 * cfg.sp  # the sequence granularity: divisible by sp, and by 2 sp for a ring

    def probe(seq_len: int, ranks: tuple[int, ...] | None = (0,)) -> Any:
        print(f"rehearsing {seq_len:,} tokens on {gpus} fake rank(s) ...", file=sys.stderr, flush=True)
        r = rehearse_run(replace(cfg, seq_len=seq_len), gpus=gpus, ranks=ranks, **memory)
        verdict = "fits" if r.fits else "does not fit"
        print(f"  {seq_len:,} tokens: {verdict} (device peak {r.device_peak / 2**30:,.2f} GiB, "
              f"{sum(x.seconds for x in r.ranks):.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
        probes.append((seq_len, r.fits, r.device_peak))
        return r

    probes: list[tuple[int, bool, int]] = []
    if ns.seq_len is not None:  # rehearse the recommended command as it is
        r = probe(planned, None)
        return {"rehearsal": r.as_dict(), "report": format_rehearsal(r), "probes": probes,
                "longest": None, "planned": planned}  # fmt: skip
    top = None if shape.max_positions is None else _round(shape.max_positions, multiple)
    lo = search_longest(lambda n: probe(n).fits, planned, multiple, top)
    if lo is None:
        return {"rehearsal": None, "report": "rehearsal: no length fits (down to the run's granularity)",
                "probes": probes, "longest": None, "planned": planned}  # fmt: skip
    final = rehearse_run(replace(cfg, seq_len=lo), gpus=gpus, **memory)
    return {"rehearsal": final.as_dict(), "report": format_rehearsal(final), "probes": probes, "longest": lo,
            "planned": planned}  # fmt: skip


def search_longest(fits: Any, planned: int, multiple: int, top: int | None = None) -> int | None:
    """The longest multiple of ``multiple`` (at most ``top``) for which ``fits(n)`` holds, found
    from the planner's ``planned``: steps of 1/8 that double while the verdict holds (up while it
    fits, down while it does not), then a bisection of the bracket to ``TOLERANCE``. ``None`` when
    not even ``multiple`` fits. ``fits`` must be monotone (memory grows with the length)."""
    planned = _round(planned, multiple)
    if top is not None:
        planned = min(planned, top)
    lo: int | None = None
    hi: int | None = None
    step = STEP
    if fits(planned):
        lo = planned
        while hi is None and (top is None or lo < top):
            nxt = _round(lo * (1 + step), multiple)
            nxt = max(nxt, lo + multiple) if top is None else min(max(nxt, lo + multiple), top)
            lo, hi = (nxt, None) if fits(nxt) else (lo, nxt)
            step *= 2
    else:
        hi = planned
        while lo is None and hi > multiple:
            nxt = min(_round(hi / (1 + step), multiple), hi - multiple)
            lo, hi = (nxt, hi) if fits(nxt) else (None, nxt)
            step *= 2
    while lo is not None and hi is not None and hi - lo > max(multiple, TOLERANCE * lo):
        mid = _round((lo + hi) // 2, multiple)
        if mid <= lo:
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _round(value: float, multiple: int) -> int:
    return max(multiple, int(value) // multiple * multiple)


def render_rehearsal(out: dict[str, Any]) -> str:
    """The text after the plan's table: the probes, the rehearsed longest length, the final report."""
    lines = ["", "rehearsal of the recommended command (fake tensors; one step):"]
    for seq_len, fits, peak in out["probes"]:
        lines.append(f"  {seq_len:>11,} tokens: {'fits' if fits else 'does not fit':<12} "
                     f"device peak {peak / 2**30:,.2f} GiB")  # fmt: skip
    if out["longest"] is not None:
        ratio = out["longest"] / out["planned"]
        lines.append(f"longest by rehearsal: {out['longest']:,} tokens (the planner's: {out['planned']:,}; {ratio:.2f}x)")
    lines.append(out["report"])
    return "\n".join(lines)
