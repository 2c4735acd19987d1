"""Task: the ALST techniques one at a time — peak memory per rank vs sequence length, and step time.

    python -m torch.distributed.run --nproc-per-node 2 -m bench.alst_worker --out /tmp/alst.json [--smoke]

One tiny-but-wide Llama (a large vocabulary so the logits matter, a wide MLP), one forward+backward
per measurement (no optimizer state), two single-thread ranks. Each configuration adds one technique
to the previous one (``CONFIGS``): SP over the 2 ranks, tiled loss, tiled MLP, activation
checkpointing, checkpoint offload, blockwise/offloaded attention (the blockwise core with the
full-sequence K/V on the host between forward and backward: Ulysses-Offload). For each, the sequence grows along ``Setup.seqs`` until the peak
(``ulysses_sp.memory.track_peak_memory``, max over ranks, parameters included) exceeds the budget.
Time: one step at ``time_seq`` without the tracker, the configurations interleaved round after round
(the baseline runs the whole sequence on each rank); the best round of each. Rank 0 writes
``{"setup": ..., "configs": {name: {"rows": [...], "step_seconds": s}}}``; bench/report.py derives
the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time

import torch
import torch.distributed as dist

from bench.launch import finish_worker, init_worker, max_over_ranks
from bench.spec import llama

CONFIGS = ["baseline", "+sp2", "+tiled_loss", "+tiled_mlp", "+checkpointing", "+offload", "+blockwise_offload"]


@dataclasses.dataclass(frozen=True)
class Setup:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int
    budget_mib: float
    seqs: tuple[int, ...]
    time_seq: int
    time_steps: int


FULL = Setup(
    hidden=64, intermediate=512, layers=4, heads=4, vocab=16384, budget_mib=64.0,
    seqs=(128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384),
    time_seq=1024, time_steps=5,
)  # fmt: skip
SMOKE = Setup(
    hidden=32, intermediate=128, layers=2, heads=4, vocab=1024, budget_mib=2.0,
    seqs=(32, 64, 128, 256, 512), time_seq=64, time_steps=1,
)  # fmt: skip


def build(setup: Setup, config: str, reg):
    """A fresh model with ``config``'s techniques (SP through the one registration ``reg``)."""
    from ulysses_sp.attention.registration import ATTN_NAME
    from ulysses_sp.memory.offload import enable_activation_checkpointing, enable_activation_offload
    from ulysses_sp.memory.tiling import TiledCausalLMLoss, apply_tiled_mlp

    model = llama(hidden_size=setup.hidden, intermediate_size=setup.intermediate, num_hidden_layers=setup.layers,
                  num_attention_heads=setup.heads, num_key_value_heads=setup.heads, vocab_size=setup.vocab,
                  max_position_embeddings=max(setup.seqs))  # fmt: skip
    tech = set(CONFIGS[1 : CONFIGS.index(config) + 1])
    if "+sp2" in tech:  # one registration shared by the SP models, each with its own guardrail
        model.set_attn_implementation(ATTN_NAME)
        reg.attach(model)
    if "+checkpointing" in tech:
        enable_activation_checkpointing(model)
    if "+offload" in tech:
        enable_activation_offload(model)
    if "+tiled_mlp" in tech:
        apply_tiled_mlp(model)
    loss_fn = TiledCausalLMLoss() if "+tiled_loss" in tech else None
    model.attention_offload = "+blockwise_offload" in tech  # read by step(): the registration is shared
    return model, (reg if "+sp2" in tech else None), loss_fn


@contextlib.contextmanager
def _attention_offload(reg, on: bool):
    """The shared attention through the blockwise core with K/V offloaded while the body runs
    (forward and backward: a checkpoint's recompute must take the same path)."""
    from ulysses_sp.attention.kv_offload import KVOffload

    attn = reg.attention
    prev = attn.offload_attention, attn.kv_offload
    attn.offload_attention, attn.kv_offload = on, (KVOffload() if on else prev[1])
    try:
        yield
    finally:
        attn.offload_attention, attn.kv_offload = prev


def step(model, reg, loss_fn, seq: int, vocab: int) -> None:
    from ulysses_sp.data.shard import prepare_batch, shard_batch
    from ulysses_sp.parallel.loss import sp_causal_lm_loss

    sp = 1 if reg is None else reg.get_sequence_parallel_world_size()
    rank = 0 if reg is None else reg.get_sequence_parallel_rank()
    group = None if reg is None else reg.get_sequence_parallel_group()
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
    local = shard_batch(prepare_batch({"input_ids": ids}, sp, strict=True), rank, sp)  # [1, S] -> [1, S_l]
    batch = {"input_ids": local["input_ids"], "position_ids": local["position_ids"], "use_cache": False}
    offload = reg is not None and model.attention_offload
    with _attention_offload(reg, True) if offload else contextlib.nullcontext():
        if loss_fn is None:
            loss = sp_causal_lm_loss(model(**batch).logits, local["shift_labels"], group)
        else:
            loss = loss_fn(model, batch, local["shift_labels"], group).loss
        loss.backward()
    model.zero_grad(set_to_none=True)


def sweep(setup: Setup, model, reg, loss_fn) -> list[dict]:
    from ulysses_sp.memory.meter import track_peak_memory

    rows = []
    for seq in setup.seqs:
        with track_peak_memory("cpu", include=model.parameters()) as mem:
            step(model, reg, loss_fn, seq, setup.vocab)
        peak = max_over_ranks(mem.peak_bytes)
        rows.append({"seq": seq, "peak_bytes": int(peak), "host_peak_bytes": int(max_over_ranks(mem.host_peak_bytes))})
        if peak > setup.budget_mib * 2**20:
            break
    return rows


def main(argv=None) -> None:
    from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF

    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    ap.add_argument("--budget-mib", type=float, help="per-rank memory budget")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    setup = SMOKE if args.smoke else FULL
    if args.budget_mib is not None:
        setup = dataclasses.replace(setup, budget_mib=args.budget_mib)
    init_worker(600)
    # One registration (a throwaway model of the same shape fills its slot); every SP model attaches
    # to it, since transformers resolves the "ulysses_sp" attention name to one function.
    world = dist.get_world_size()
    reg = UlyssesSPAttentionHF.register_with_transformers(build(setup, "baseline", None)[0], "sdpa", world, 1)
    built = {c: build(setup, c, reg) for c in CONFIGS}
    configs = {c: {"rows": sweep(setup, *built[c])} for c in CONFIGS}
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for round_ in range(setup.time_steps + 1):  # interleaved: a burst of load hits every config alike
        for c in CONFIGS:
            dist.barrier()
            t0 = time.perf_counter()
            step(*built[c], setup.time_seq, setup.vocab)
            if round_:  # round 0 warms up
                times[c].append(max_over_ranks(time.perf_counter() - t0))
    for c in CONFIGS:
        configs[c]["step_seconds"] = min(times[c])
    finish_worker({"setup": dataclasses.asdict(setup), "configs": configs}, args.out)


if __name__ == "__main__":
    main()
