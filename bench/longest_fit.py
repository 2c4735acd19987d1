"""Task: the longest sequence one system fits in a per-rank memory budget (ulysses-sp or DeepSpeed).

    python -m torch.distributed.run --nproc-per-node 2 -m bench.longest_fit --impl ours --tech all \\
        --data packed --out /tmp/ours.json
    bench/.venv-deepspeed/bin/python -m torch.distributed.run --nproc-per-node 2 -m bench.longest_fit \\
        --impl deepspeed --data packed --out /tmp/ds.json

Run in either venv (gloo, sp = 2). Both sides build the same wide Llama (``MODEL``, same seed, sdpa) and get the same tensors (``make_data``: one causal sequence, or three packed documents),
rank k holding tokens ``[k S/2, (k+1) S/2)``; one forward + backward per length (no optimizer: its
states are the same on both sides), each side with every memory technique it runs on CPU
(``deepspeed``: DeepSpeed's UlyssesSPAttentionHF, TiledMLP patched in as its docstring shows,
TiledFusedLogitsLoss with the documented all-gather combine, HF checkpointing and its checkpoint
offload context, whose counters are recorded; ``ours --tech ckpt``: the same set; ``--tech all``: plus
activation offload and Ulysses-Offload). The meter is the same on both sides (``track_peak_memory``
with the parameters, max over ranks): ``device`` leaves out what our offloads stage on the host,
``total`` counts every byte. Search: double from ``--start-seq`` while the peak fits, then bisect to
``--granularity``, per criterion over the same cached probes; then the step time at ``--time-seq``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time

import torch
import torch.distributed as dist

from bench.launch import ROOT, finish_worker, init_worker
from bench.launch import max_over_ranks as _max
from bench.spec import IGNORE_INDEX as IGNORE
from bench.spec import llama, packed_positions, sp_loss_combine

MODEL = {"hidden": 64, "intermediate": 512, "layers": 4, "heads": 4}
"""A small vocabulary-heavy Llama (``--vocab`` sets V): wide MLP, so the techniques each show."""


def make_data(seq: int, vocab: int, packed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids, shift_labels)``, each ``[1, S]``: the same tensors on both sides."""
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
    pos = packed_positions(seq) if packed else torch.arange(seq)[None]
    shift = torch.cat([ids[:, 1:], torch.full((1, 1), IGNORE)], 1)
    shift[0, torch.cat([pos[0, 1:] == 0, torch.tensor([True])])] = IGNORE  # a document's last token predicts nothing
    return ids, pos, shift


def ours(model, world: int, tech: str):
    """ulysses-sp with its memory techniques; returns ``step(ids, pos, shift) -> (loss, notes)``."""
    from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
    from ulysses_sp.memory.offload import enable_activation_checkpointing, enable_activation_offload
    from ulysses_sp.memory.tiling import TiledCausalLMLoss, apply_tiled_mlp

    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, 1, offload_attention=tech == "all")
    group = reg.get_sequence_parallel_group()
    enable_activation_checkpointing(model)
    offload = enable_activation_offload(model) if tech == "all" else None
    apply_tiled_mlp(model)
    loss_fn = TiledCausalLMLoss()

    def step(ids, pos, shift):
        batch = {"input_ids": ids, "position_ids": pos, "use_cache": False}
        loss = loss_fn(model, batch, shift, group).loss
        loss.backward()
        notes = {"attention_path": reg.attention.last_path}
        if offload is not None:
            notes["offloaded_bytes"] = offload.stats.offloaded_bytes
        return loss, notes

    return step


def deepspeed(model, world: int):
    """DeepSpeed's ALST pieces on the same model; returns ``step(ids, pos, shift) -> (loss, notes)``."""
    import deepspeed as ds
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager as offload_ctx,
    )
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        TiledFusedLogitsLoss,
        TiledMLP,
        UlyssesSPAttentionHF,
    )
    from transformers.models.llama import modeling_llama

    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, 1, seq_length_is_variable=True)
    group = mpu.get_sequence_parallel_group()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def tiled_mlp_forward(self, x):  # TiledMLP's docstring recipe
        shards = torch.tensor(math.ceil(x.shape[1] / x.shape[2]))
        dist.all_reduce(shards, op=dist.ReduceOp.MAX)  # every rank the same count (no deadlock)

        def mlp_forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

        params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return TiledMLP.apply(mlp_forward, self, x, int(shards), params)

    modeling_llama.LlamaMLP.forward = tiled_mlp_forward
    vocab = model.config.vocab_size

    def loss_fn(self, x, y):  # one tile: logits and the sum of its token losses
        logits = self.lm_head(x).view(-1, vocab).float()
        return torch.nn.functional.cross_entropy(logits, y.view(-1), ignore_index=IGNORE, reduction="sum")

    def step(ids, pos, shift):
        off = offload_ctx()
        with off:  # its __enter__ returns None
            hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
            shards = max(1, math.ceil(hidden.shape[1] / hidden.shape[2]))  # ours: ceil(S_l / h)
            loss_sum = TiledFusedLogitsLoss.apply(loss_fn, model, hidden, shift, None, shards, [model.lm_head.weight],
                                                  "sum")  # fmt: skip
            loss = sp_loss_combine(loss_sum, (shift != IGNORE).sum(), group)  # DeepSpeed's documented recipe
            loss.backward()
        stats = off.stats
        return loss, {"deepspeed_version": ds.__version__, "ckpt_offload_marked": stats.marked_tensors,
                      "ckpt_offload_offloaded": stats.offloaded_tensors,
                      "ckpt_offload_skipped": stats.skipped_marked_tensors}  # fmt: skip

    return step


class _Total:
    """Device + host peak of one ``track_peak_memory`` region (the library reports the two apart): wraps
    that region's bookkeeping, which its storages' finalisers also call, so every add and free is seen."""

    def __init__(self, mem) -> None:
        self.current = self.peak = mem.current_bytes
        add, free = mem._add, mem._free

        def _add(key, nbytes, host):
            add(key, nbytes, host)
            self.current += nbytes
            self.peak = max(self.peak, self.current)

        def _free(key):
            self.current -= mem._live.get(key, (0, False))[0]
            free(key)

        mem._add, mem._free = _add, _free


def local_data(seq: int, vocab: int, packed: bool) -> list[torch.Tensor]:
    """This rank's ``[1, S/2]`` slices of ``make_data``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return [t[:, rank * seq // world : (rank + 1) * seq // world] for t in make_data(seq, vocab, packed)]


def probe(step, model, seq: int, vocab: int, packed: bool) -> dict:
    """One metered forward + backward at ``seq``: peaks (max over ranks), loss, time."""
    from ulysses_sp.memory.meter import track_peak_memory

    data, t0 = local_data(seq, vocab, packed), time.perf_counter()
    with track_peak_memory("cpu", include=model.parameters()) as mem:
        total = _Total(mem)
        loss, notes = step(*data)
    model.zero_grad(set_to_none=True)
    return {"seq": seq, "device": int(_max(mem.peak_bytes)), "host": int(_max(mem.host_peak_bytes)),
            "total": int(_max(total.peak)), "loss": float(loss), "seconds": _max(time.perf_counter() - t0),
            **notes}  # fmt: skip


def search(measure, criterion: str, budget: float, start: int, gran: int, max_seq: int) -> dict:
    """Longest S (a multiple of ``gran``) with ``measure(S)[criterion] <= budget``: doubling, then bisection."""
    lo = hi = None
    s = start
    while lo != max_seq:  # doubling
        if measure(s)[criterion] > budget:
            hi = s
            break
        lo, s = s, min(2 * s, max_seq)
    if lo is None or hi is None:  # nothing fits, or everything up to max_seq fits
        return {"fit": lo, "first_over": hi, "capped": hi is None and lo is not None}
    while hi - lo > gran:
        mid = (lo + hi) // 2 // gran * gran
        if measure(mid)[criterion] <= budget:
            lo = mid
        else:
            hi = mid
    return {"fit": lo, "first_over": hi, "capped": False}


def timed(step, model, seq: int, vocab: int, packed: bool, steps: int) -> float | None:
    """Best of ``steps`` unmetered forward + backward steps at ``seq`` (after one warm-up), max over ranks."""
    data, times = local_data(seq, vocab, packed), []
    for i in range(steps + 1 if steps else 0):
        dist.barrier()
        t0 = time.perf_counter()
        step(*data)
        model.zero_grad(set_to_none=True)
        if i:
            times.append(_max(time.perf_counter() - t0))
    return min(times) if times else None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("ours", "deepspeed"), required=True)
    ap.add_argument("--tech", choices=("ckpt", "all"), default="all", help="ours: without / with the offloads")
    ap.add_argument("--data", choices=("causal", "packed"), required=True)
    ap.add_argument("--vocab", type=int, default=2048, help="the vocabulary of MODEL")
    ap.add_argument("--budget-mib", type=float, default=24.0, help="per-rank budget (huge: a profile to --max-seq)")
    ap.add_argument("--start-seq", type=int, default=1024)
    ap.add_argument("--granularity", type=int, default=512)
    ap.add_argument("--max-seq", type=int, default=32768)
    ap.add_argument("--time-seq", type=int, default=4096, help="length of the timed (unmetered) steps")
    ap.add_argument("--time-steps", type=int, default=2, help="0: no timing")
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if importlib.util.find_spec("ulysses_sp") is None:  # the DeepSpeed venv: the meter from this checkout
        sys.path.append(str(ROOT / "src"))
    init_worker(1200, deepspeed=args.impl == "deepspeed")
    world, m, vocab = dist.get_world_size(), MODEL, args.vocab
    model = llama(hidden_size=m["hidden"], intermediate_size=m["intermediate"], num_hidden_layers=m["layers"],
                  num_attention_heads=m["heads"], num_key_value_heads=m["heads"], vocab_size=vocab,
                  max_position_embeddings=args.max_seq)  # fmt: skip
    step = ours(model, world, args.tech) if args.impl == "ours" else deepspeed(model, world)
    packed, budget = args.data == "packed", args.budget_mib * 2**20
    probes: dict[int, dict] = {}

    def measure(seq: int) -> dict:
        if seq not in probes:
            probes[seq] = probe(step, model, seq, vocab, packed)
        return probes[seq]

    fit = {c: search(measure, c, budget, args.start_seq, args.granularity, args.max_seq) for c in ("device", "total")}
    step_s = timed(step, model, args.time_seq, vocab, packed, args.time_steps)
    finish_worker({"args": vars(args), "world": world, "torch": torch.__version__, "model": {**m, "vocab": vocab},
                   "budget_bytes": budget, "fit": fit, "probes": [probes[s] for s in sorted(probes)],
                   "step_seconds": step_s}, args.out)  # fmt: skip


if __name__ == "__main__":
    main()
