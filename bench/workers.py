"""ulysses-sp side of the benchmarks: one ``torchrun`` launch runs a list of measurements on W ranks.

    python -m torch.distributed.run --nproc-per-node 2 -m bench.workers \\
        --tasks comm,flops,memory,throughput --out bench/results/tmp-w2.json [--smoke]

Every task loops over the sequence-parallel sizes ``sp`` that divide W, on the mesh ``(W/sp, sp)``
(so ``sp=1`` runs W independent replicas under the same CPU contention as ``sp=W``). Each task
returns records (plain dicts); rank 0 writes them, with the per-rank values already reduced
(max over ranks), to ``--out``. bench/__main__.py turns records into table rows.

* ``comm``: bytes this rank sends per attention layer, forward and backward (all-to-all only; the
  other collectives of a step are reported beside), for MHA and GQA with ``Hkv`` above, equal to and
  below ``P``; compared with ``analytic.ulysses_min_bytes_per_layer``.
* ``flops``: ``FlopCounterMode`` FLOPs of forward+backward of the local shard against the same
  model without SP on the full sequence, divided by P. Core attention ``eager``: PyTorch's flop
  counter has no formula for the CPU sdpa kernel, so sdpa attention would count as 0.
* ``memory``: peak tensor bytes (``ulysses_sp.memory.track_peak_memory``, parameters included) of
  forward+backward vs sequence length, with and without tiling (``apply_tiled_mlp`` + tiled loss).
* ``throughput``: tokens/s per rank of forward+backward at equal tokens per rank; also the share of
  the step spent inside ``all_to_all_single``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from bench import analytic
from bench import spec as S
from bench.counters import CollectiveCounter


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="comm,flops,memory,throughput")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------- helpers
def sp_sizes(world: int) -> list[int]:
    return [p for p in (1, 2, 4) if world % p == 0 and p <= world]


def make_mesh(dp: int, sp: int):
    from ulysses_sp.mesh import init_mesh

    return init_mesh(dp_size=dp, sp_size=sp)


def sp_setup(spec: S.ModelSpec, sp: int, *, core: str, mb: int, seed: int = 0):
    """(model, sp_group, sp_rank, registration) for the mesh ``(W/sp, sp)``; no SP at ``sp=1``."""
    model = S.build_model(spec, seed=seed, attn_implementation=core)
    if sp == 1:
        return model, None, 0, None
    from ulysses_sp.attention import UlyssesSPAttentionHF
    from ulysses_sp.mesh import Mpu

    mesh = make_mesh(dist.get_world_size() // sp, sp)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, core, sp, mb, mesh=mesh)
    mpu = Mpu(mesh)
    return model, mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank(), reg


def shard(batch: dict[str, torch.Tensor], sp_rank: int, sp: int):
    """Full batch ``[B, S]`` -> this rank's ``(inputs [B, S_l], shift_labels [B, S_l])`` (shift before shard)."""
    s_l = batch["input_ids"].shape[1] // sp
    cut = slice(sp_rank * s_l, (sp_rank + 1) * s_l)
    shift = torch.nn.functional.pad(batch["labels"], (0, 1), value=S.IGNORE_INDEX)[:, 1:]
    inputs = {"input_ids": batch["input_ids"][:, cut], "position_ids": batch["position_ids"][:, cut]}
    return inputs, shift[:, cut]


def loss_of(model, inputs, shift, group, *, tiled: bool = False) -> torch.Tensor:
    from ulysses_sp.loss import sp_causal_lm_loss

    if tiled:
        from ulysses_sp.tiling import TiledCausalLMLoss

        return TiledCausalLMLoss()(model, dict(inputs), shift, group).loss
    logits = model(**inputs, use_cache=False).logits
    return sp_causal_lm_loss(logits, shift, group)


def gather_max(value: float) -> float:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return max(out)


def cleanup(reg) -> None:
    if reg is not None:
        reg.remove()


# ---------------------------------------------------------------------------------------------- tasks
def task_comm(smoke: bool) -> list[dict]:
    """Bytes per rank per attention layer vs the analytic minimum, MHA and GQA (deterministic)."""
    world = dist.get_world_size()
    b, seq, h_q, d = 2, (32 if smoke else 256), 8, 8
    records = []
    for sp in [p for p in sp_sizes(world) if p > 1]:
        for hkv in (8, 4, 2, 1):
            spec = S.ModelSpec(hidden_size=h_q * d, num_attention_heads=h_q, num_key_value_heads=hkv)
            model, group, sp_rank, reg = sp_setup(spec, sp, core="sdpa", mb=b)
            batch = S.make_batch(list(range(b)), seq, spec.vocab_size)
            inputs, shift = shard(batch, sp_rank, sp)
            counter = CollectiveCounter()
            with counter:
                with counter.label("forward"):
                    loss = loss_of(model, inputs, shift, group)
                with counter.label("backward"):
                    loss.backward()
            cleanup(reg)
            layers = spec.num_hidden_layers
            kw = dict(B=b, S=seq, H=h_q, Hkv=hkv, D=d, P=sp, b=4)
            minimum = analytic.ulysses_min_bytes_per_layer(**kw)
            fwd = gather_max(counter.total("forward", "all_to_all_single") / layers)
            bwd = gather_max(counter.total("backward", "all_to_all_single") / layers)
            records.append(
                {
                    "task": "comm",
                    "sp": sp,
                    "dp": world // sp,
                    "heads": h_q,
                    "kv_heads": hkv,
                    "head_dim": d,
                    "batch": b,
                    "seq": seq,
                    "dtype_bytes": 4,
                    "a2a_calls_per_layer_fwd": counter.ncalls("forward", "all_to_all_single") / layers,
                    "fwd_bytes_per_layer": fwd,
                    "bwd_bytes_per_layer": bwd,
                    "min_bytes_per_layer": minimum,
                    "naive_kv_bytes_per_layer": analytic.naive_kv_bytes_per_layer(**kw),
                    "fwd_ratio": fwd / minimum,
                    "bwd_ratio": bwd / minimum,
                    "other_fwd_bytes_per_step": gather_max(
                        counter.total("forward") - counter.total("forward", "all_to_all_single")
                    ),
                    "other_bwd_bytes_per_step": gather_max(
                        counter.total("backward") - counter.total("backward", "all_to_all_single")
                    ),
                }
            )
    return records


def count_flops(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


def task_flops(smoke: bool) -> list[dict]:
    """FLOPs per rank of forward+backward vs (no-SP total) / P; eager core attention (see module doc)."""
    world = dist.get_world_size()
    seq = 64 if smoke else 512
    spec = S.ModelSpec(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=256)
    batch = S.make_batch([0], seq, spec.vocab_size)
    ref = S.build_model(spec, attn_implementation="eager")
    total = count_flops(lambda: S.causal_lm_loss(ref, batch).backward())
    records = []
    for sp in sp_sizes(world):
        model, group, sp_rank, reg = sp_setup(spec, sp, core="eager", mb=1)
        inputs, shift = shard(batch, sp_rank, sp)
        local = count_flops(lambda: loss_of(model, inputs, shift, group).backward())  # noqa: B023
        cleanup(reg)
        worst = gather_max(local)
        records.append(
            {
                "task": "flops",
                "sp": sp,
                "dp": world // sp,
                "seq": seq,
                "flops_per_rank": worst,
                "total_flops": total,
                "ratio_to_total_over_p": worst / (total / sp),
            }
        )
    return records


def task_memory(smoke: bool) -> list[dict]:
    """Peak tensor bytes of forward+backward vs S for each sp, with and without tiling."""
    from ulysses_sp.memory import track_peak_memory
    from ulysses_sp.tiling import apply_tiled_mlp

    world = dist.get_world_size()
    spec = S.ModelSpec(
        hidden_size=64, num_attention_heads=8, num_key_value_heads=8, intermediate_size=256, vocab_size=1024
    )
    seqs = [64, 128] if smoke else [512, 1024, 2048, 4096]
    records = []
    for tiled in (False, True):
        for sp in sp_sizes(world):
            model, group, sp_rank, reg = sp_setup(spec, sp, core="sdpa", mb=1)
            handle = apply_tiled_mlp(model) if tiled else None
            for seq in seqs:
                batch = S.make_batch([0], seq, spec.vocab_size)
                inputs, shift = shard(batch, sp_rank, sp)
                model.zero_grad(set_to_none=True)
                with track_peak_memory("cpu", include=list(model.parameters())) as m:
                    loss_of(model, inputs, shift, group, tiled=tiled).backward()
                records.append(
                    {
                        "task": "memory",
                        "sp": sp,
                        "dp": world // sp,
                        "tiled": tiled,
                        "seq": seq,
                        "layers": spec.num_hidden_layers,
                        "hidden": spec.hidden_size,
                        "peak_bytes": gather_max(m.peak_bytes),
                        "baseline_bytes": gather_max(m.baseline_bytes),
                    }
                )
            if handle is not None:
                handle.remove()
            cleanup(reg)
            del model
    return records


def task_throughput(smoke: bool) -> list[dict]:
    """tokens/s per rank of forward+backward at equal tokens per rank, and the share in all-to-all."""
    world = dist.get_world_size()
    tokens = 64 if smoke else 1024
    steps = 2 if smoke else 4
    spec = S.ModelSpec(hidden_size=64, num_attention_heads=8, num_key_value_heads=8, intermediate_size=256)
    records = []
    for sp in sp_sizes(world):
        model, group, sp_rank, reg = sp_setup(spec, sp, core="sdpa", mb=1)
        batch = S.make_batch([dist.get_rank() // sp], tokens * sp, spec.vocab_size)
        inputs, shift = shard(batch, sp_rank, sp)
        a2a_time = [0.0]
        orig = dist.all_to_all_single

        def timed(*a, _orig=orig, _acc=a2a_time, **k):
            t = time.perf_counter()
            try:
                return _orig(*a, **k)
            finally:
                _acc[0] += time.perf_counter() - t

        times = []
        dist.all_to_all_single = timed
        try:
            for i in range(steps + 1):
                dist.barrier()
                a2a_time[0] = 0.0
                t0 = time.perf_counter()
                loss_of(model, inputs, shift, group).backward()
                model.zero_grad(set_to_none=True)
                if i:  # the first step warms up
                    times.append((time.perf_counter() - t0, a2a_time[0]))
        finally:
            dist.all_to_all_single = orig
        cleanup(reg)
        step = gather_max(sorted(t for t, _ in times)[len(times) // 2])
        a2a = gather_max(sorted(a for _, a in times)[len(times) // 2])
        records.append(
            {
                "task": "throughput",
                "sp": sp,
                "dp": world // sp,
                "tokens_per_rank": tokens,
                "seq": tokens * sp,
                "step_s": step,
                "tokens_per_s_per_rank": tokens / step,
                "a2a_share": a2a / step,
            }
        )
    return records


TASKS = {"comm": task_comm, "flops": task_flops, "memory": task_memory, "throughput": task_throughput}


def main(argv=None) -> None:
    args = parse_args(argv)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=180))
    torch.set_num_threads(1)
    records = []
    for name in args.tasks.split(","):
        t0 = time.perf_counter()
        recs = TASKS[name](args.smoke)
        for r in recs:
            r["world"] = dist.get_world_size()
            r["task_wall_s"] = round(time.perf_counter() - t0, 2)
        records += recs
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)
    dist.barrier()
    from ulysses_sp.mesh import shutdown

    shutdown()  # joins the gloo workers now, not during interpreter exit


if __name__ == "__main__":
    main()
