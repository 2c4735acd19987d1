"""Tasks of the ulysses-sp side: one launch runs a list of measurements on W ranks.

    python -m torch.distributed.run --nproc-per-node 2 -m bench.workers --tasks comm,flops,memory --out w2.json

Every task loops over the sequence-parallel sizes ``sp`` that divide W, on the layout ``(W/sp, sp)`` (so
``sp=1`` runs W independent replicas under the same CPU contention as ``sp=W``) and returns records (plain
dicts) with the per-rank values reduced (max over ranks); rank 0 writes them to ``--out``. Batches go through
the library's own ``prepare_batch`` / ``shard_batch``.

* ``comm``: bytes sent per attention layer, forward and backward (all-to-all; the step's other collectives
  beside), MHA and GQA with ``Hkv`` above, equal to and below ``P``.
* ``flops``: ``FlopCounterMode`` FLOPs of the local shard's forward+backward and of the model without SP on
  the full sequence. Core attention ``eager``: the counter has no formula for CPU sdpa.
* ``memory``: peak tensor bytes (``ulysses_sp.memory.track_peak_memory``, parameters included) of
  forward+backward vs sequence length, with and without tiling (tiled MLP + tiled loss).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from bench import analytic
from bench import spec as S
from bench.counters import CollectiveCounter
from bench.launch import finish_worker, init_worker, max_over_ranks
from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.data.shard import prepare_batch, shard_batch
from ulysses_sp.memory.meter import track_peak_memory
from ulysses_sp.memory.tiling import TiledCausalLMLoss, apply_tiled_mlp
from ulysses_sp.parallel.loss import sp_causal_lm_loss


def sp_sizes(world: int) -> list[int]:
    return [p for p in (1, 2, 4) if world % p == 0]


def sp_setup(spec: S.ModelSpec, sp: int, *, core: str, mb: int, seed: int = 0):
    """``(model, registration)`` on the layout ``(W/sp, sp)``; no registration at ``sp=1``."""
    model = S.build_model(spec, seed=seed, attn_implementation=core)
    return model, UlyssesSPAttentionHF.register_with_transformers(model, core, sp, mb) if sp > 1 else None


def local_batch(batch: dict[str, torch.Tensor], reg) -> dict[str, torch.Tensor]:
    """Full batch ``[B, S]`` -> this rank's ``{input_ids, position_ids, shift_labels}`` ``[B, S_l]``."""
    sp, rank = (1, 0) if reg is None else (reg.get_sequence_parallel_world_size(), reg.get_sequence_parallel_rank())
    return shard_batch(prepare_batch(batch, sp, strict=True), rank, sp)


def loss_of(model, local: dict, reg, *, tiled: bool = False) -> torch.Tensor:
    """The SP causal-LM loss of this rank's shard (the tiled loss when ``tiled``)."""
    group = None if reg is None else reg.get_sequence_parallel_group()
    inputs = {"input_ids": local["input_ids"], "position_ids": local["position_ids"]}
    if tiled:
        return TiledCausalLMLoss()(model, inputs, local["shift_labels"], group).loss
    return sp_causal_lm_loss(model(**inputs, use_cache=False).logits, local["shift_labels"], group)


def done(reg) -> None:
    if reg is not None:
        reg.remove()


def count_flops(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def task_comm(smoke: bool) -> list[dict]:
    """Bytes per rank per attention layer vs the analytic minimum, MHA and GQA (deterministic)."""
    world = dist.get_world_size()
    b, seq, h_q, d = 2, (32 if smoke else 256), 8, 8
    records = []
    for sp in [p for p in sp_sizes(world) if p > 1]:
        for hkv in (8, 4, 2, 1):
            spec = S.ModelSpec(hidden_size=h_q * d, num_attention_heads=h_q, num_key_value_heads=hkv)
            model, reg = sp_setup(spec, sp, core="sdpa", mb=b)
            local = local_batch(S.make_batch(list(range(b)), seq, spec.vocab_size), reg)
            with CollectiveCounter() as counter:
                with counter.label("forward"):
                    loss = loss_of(model, local, reg)
                with counter.label("backward"):
                    loss.backward()
            done(reg)
            layers, a2a = spec.num_hidden_layers, "all_to_all_single"
            kw = dict(B=b, S=seq, H=h_q, Hkv=hkv, D=d, P=sp, b=4)
            minimum = analytic.ulysses_min_bytes_per_layer(**kw)
            fwd = max_over_ranks(counter.total("forward", a2a) / layers)
            bwd = max_over_ranks(counter.total("backward", a2a) / layers)
            records.append({
                "task": "comm", "sp": sp, "dp": world // sp, "heads": h_q, "kv_heads": hkv, "head_dim": d,
                "batch": b, "seq": seq, "dtype_bytes": 4,
                "a2a_calls_per_layer_fwd": counter.ncalls("forward", a2a) / layers,
                "a2a_calls_per_layer_bwd": counter.ncalls("backward", a2a) / layers,
                "fwd_bytes_per_layer": fwd, "bwd_bytes_per_layer": bwd, "min_bytes_per_layer": minimum,
                "naive_kv_bytes_per_layer": analytic.naive_kv_bytes_per_layer(**kw),
                "fwd_ratio": fwd / minimum, "bwd_ratio": bwd / minimum,
                "other_fwd_bytes_per_step": max_over_ranks(counter.total("forward") - counter.total("forward", a2a)),
                "other_bwd_bytes_per_step": max_over_ranks(counter.total("backward") - counter.total("backward", a2a)),
            })  # fmt: skip
    return records


def task_flops(smoke: bool) -> list[dict]:
    """FLOPs per rank of forward+backward, and the same model's total without SP."""
    world = dist.get_world_size()
    seq = 64 if smoke else 512
    spec = S.ModelSpec(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=256)
    batch = S.make_batch([0], seq, spec.vocab_size)
    ref = S.build_model(spec, attn_implementation="eager")
    total = count_flops(lambda: S.causal_lm_loss(ref, batch).backward())
    records = []
    for sp in sp_sizes(world):
        model, reg = sp_setup(spec, sp, core="eager", mb=1)
        local = local_batch(batch, reg)
        worst = max_over_ranks(count_flops(lambda: loss_of(model, local, reg).backward()))  # noqa: B023
        done(reg)
        records.append({
            "task": "flops", "sp": sp, "dp": world // sp, "seq": seq, "flops_per_rank": worst,
            "total_flops": total, "ratio_to_total_over_p": worst / (total / sp),
        })  # fmt: skip
    return records


def task_memory(smoke: bool) -> list[dict]:
    """Peak tensor bytes of forward+backward vs S for each sp, with and without tiling."""
    world = dist.get_world_size()
    spec = S.ModelSpec(hidden_size=64, num_attention_heads=8, num_key_value_heads=8, intermediate_size=256, vocab_size=1024)
    records = []
    for tiled in (False, True):
        for sp in sp_sizes(world):
            model, reg = sp_setup(spec, sp, core="sdpa", mb=1)
            handle = apply_tiled_mlp(model) if tiled else None
            for seq in [64, 128] if smoke else [512, 1024, 2048, 4096]:
                local = local_batch(S.make_batch([0], seq, spec.vocab_size), reg)
                model.zero_grad(set_to_none=True)
                with track_peak_memory("cpu", include=list(model.parameters())) as m:
                    loss_of(model, local, reg, tiled=tiled).backward()
                records.append({
                    "task": "memory", "sp": sp, "dp": world // sp, "tiled": tiled, "seq": seq,
                    "peak_bytes": max_over_ranks(m.peak_bytes), "baseline_bytes": max_over_ranks(m.baseline_bytes),
                })  # fmt: skip
            if handle is not None:
                handle.remove()
            done(reg)
    return records


TASKS = {"comm": task_comm, "flops": task_flops, "memory": task_memory}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    init_worker(180)
    records = []
    for name in args.tasks.split(","):
        t0 = time.perf_counter()
        recs = TASKS[name](args.smoke)
        records += [{**r, "world": dist.get_world_size(), "task_wall_s": round(time.perf_counter() - t0, 2)} for r in recs]
    finish_worker(records, args.out)


if __name__ == "__main__":
    main()
