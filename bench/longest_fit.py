"""Section 7: the longest sequence in one per-rank budget, ulysses-sp and DeepSpeed side by side.

    python -m bench --sections longest_fit      # every system on causal and packed data (~10 min, 2-core CPU)
    python -m torch.distributed.run --nproc-per-node 2 -m bench.longest_fit --impl ours --tech ckpt,mlp --data causal \\
        --out /tmp/ours.json
    (bench/.venv-deepspeed/bin/python for ``--impl deepspeed``; --budget-mib --start-seq --time-seq ...)

Both sides build the same wide Llama (``MODEL``, seed 0, sdpa) and get the same tensors (``make_data``), rank k
holding tokens ``[k S/2, (k+1) S/2)``, sp 2; one forward + backward per length, the loss tiled on both sides (no
optimizer: its states are the same). ``--tech``: ulysses-sp's techniques (``TECHS``); packed documents take the
per-document sdpa path unless ``kv_offload`` sends them through the blockwise core. One meter
(``track_peak_memory``, max over ranks); *device* bytes leave out what our offloads stage on the host.
"""
from __future__ import annotations

import importlib.util
import math
import re
import sys

import torch
import torch.distributed as dist

from bench.counters import timed
from bench.launch import DS_PYTHON, ROOT, finish_worker, init_worker, parser, run_worker, under_torchrun
from bench.launch import max_over_ranks as _max
from bench.md import table
from bench.spec import IGNORE_INDEX as IGNORE
from bench.spec import llama, packed_positions, sp_loss_combine

MODEL = {"hidden": 64, "intermediate": 512, "layers": 4, "heads": 4, "vocab": 2048}
"""A small vocabulary-heavy Llama: wide MLP, so that each technique shows."""
TECHS = {"ckpt": "activation checkpointing", "offload": "activation (checkpoint) offload to host",
         "mlp": "tiled MLP", "kv_offload": "Ulysses-Offload (blockwise core, K/V on host)",
         "headsN": "head-chunked attention, N head groups (`--head-chunks N`)",
         "norms": "norm recompute (`--recompute-norms`: RMSNorms keep only input and output)"}  # fmt: skip
"""``ours --tech`` names (new techniques: a name here and a line in ``ours``)."""
DEEPSPEED = ("UlyssesSPAttentionHF (sdpa), TiledMLP, TiledFusedLogitsLoss, HF checkpointing, checkpoint offload "
             "context (on; skips every tensor on CPU)")
SYSTEMS = [("DeepSpeed", "deepspeed", {}),
           ("ulysses-sp, same techniques", "ours", {"causal": "ckpt,mlp", "packed": "ckpt,mlp"}),
           ("ulysses-sp, all techniques", "ours", {"causal": "ckpt,offload,mlp,norms,heads2", "packed": "ckpt,offload,mlp,norms,heads2"})]
"""``(name, impl, {data: --tech})``: what section 7 runs. All techniques: the set that holds the longest S per data
(2026-11-27, the whole attention block per head group): ``heads2`` (one head per group at sp 2) holds 16896 causal
(14336 with Ulysses-Offload instead, which keeps the function-level groups) and 15872 packed (11264 without it)."""
START = {"deepspeed": {"causal": 8192, "packed": 5120}, "ours": {"causal": 10240, "packed": 9216}}  # near the fits


def make_data(seq: int, vocab: int, packed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids, shift_labels)``, each ``[1, S]``: the same tensors on both sides."""
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(seq))
    pos = packed_positions(seq) if packed else torch.arange(seq)[None]
    shift = torch.cat([ids[:, 1:], torch.full((1, 1), IGNORE)], 1)
    shift[0, torch.cat([pos[0, 1:] == 0, torch.tensor([True])])] = IGNORE  # a document's last token predicts nothing
    return ids, pos, shift


def ours(model, world: int, tech: list[str]):
    """ulysses-sp with the techniques ``tech``; returns ``step(ids, pos, shift) -> (loss, notes)``."""
    from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
    from ulysses_sp.memory.offload import enable_activation_checkpointing, enable_activation_offload
    from ulysses_sp.memory.tiling import TiledCausalLMLoss, apply_tiled_mlp

    if bad := [t for t in tech if re.sub(r"^heads\d+$", "headsN", t) not in TECHS]:
        raise ValueError(f"unknown --tech {bad}; choose from {list(TECHS)} (headsN: heads2, heads4, ...)")
    heads = next((int(t[5:]) for t in tech if t.startswith("heads")), 1)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, 1, head_chunks=heads,
                                                          offload_attention="kv_offload" in tech)  # fmt: skip
    if "ckpt" in tech:
        enable_activation_checkpointing(model)
    offload = enable_activation_offload(model) if "offload" in tech else None
    if "mlp" in tech:
        apply_tiled_mlp(model)
    if "norms" in tech:
        from ulysses_sp.memory.norms import apply_norm_recompute

        apply_norm_recompute(model)
    loss_fn, group = TiledCausalLMLoss(), reg.get_sequence_parallel_group()

    def step(ids, pos, shift):
        loss = loss_fn(model, {"input_ids": ids, "position_ids": pos, "use_cache": False}, shift, group).loss
        loss.backward()
        return loss, {"attention_path": reg.attention.last_path,
                      **({"offloaded_bytes": offload.stats.offloaded_bytes} if offload else {})}  # fmt: skip

    return step


def deepspeed(model, world: int):
    """DeepSpeed's ALST pieces on the same model; returns ``step(ids, pos, shift) -> (loss, notes)``."""
    import deepspeed as ds
    from deepspeed.runtime.activation_checkpointing import offload_activations
    from deepspeed.runtime.sequence_parallel import ulysses_sp as alst
    from transformers.models.llama import modeling_llama

    mpu = alst.UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", world, 1, seq_length_is_variable=True)
    group = mpu.get_sequence_parallel_group()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def tiled_mlp_forward(self, x):  # TiledMLP's docstring recipe; every rank the same count (no deadlock)
        dist.all_reduce(shards := torch.tensor(math.ceil(x.shape[1] / x.shape[2])), op=dist.ReduceOp.MAX)
        fwd = lambda self, x: self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))  # noqa: E731
        return alst.TiledMLP.apply(fwd, self, x, int(shards), [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight])

    modeling_llama.LlamaMLP.forward = tiled_mlp_forward

    def loss_fn(self, x, y):  # one tile: logits and the sum of its token losses
        logits = self.lm_head(x).view(-1, MODEL["vocab"]).float()
        return torch.nn.functional.cross_entropy(logits, y.view(-1), ignore_index=IGNORE, reduction="sum")

    def step(ids, pos, shift):
        off = offload_activations.get_checkpoint_hidden_states_offloading_ctx_manager()
        with off:  # its __enter__ returns None
            hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
            shards = max(1, math.ceil(hidden.shape[1] / hidden.shape[2]))  # ours: ceil(S_l / h)
            loss_sum = alst.TiledFusedLogitsLoss.apply(loss_fn, model, hidden, shift, None, shards, [model.lm_head.weight],
                                                  "sum")  # fmt: skip
            loss = sp_loss_combine(loss_sum, (shift != IGNORE).sum(), group)  # DeepSpeed's documented recipe
            loss.backward()
        s = off.stats
        return loss, {"deepspeed_version": ds.__version__, "ckpt_offload": [s.marked_tensors, s.offloaded_tensors,
                                                                           s.skipped_marked_tensors]}  # fmt: skip

    return step


def local_data(seq: int, packed: bool) -> list[torch.Tensor]:
    """This rank's ``[1, S/2]`` slices of ``make_data``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return [t[:, rank * seq // world : (rank + 1) * seq // world] for t in make_data(seq, MODEL["vocab"], packed)]


def probe(step, model, seq: int, packed: bool) -> dict:
    """One metered forward + backward at ``seq``: device and host peaks (max over ranks), loss."""
    from ulysses_sp.memory.meter import track_peak_memory

    data = local_data(seq, packed)
    with track_peak_memory("cpu", include=model.parameters()) as mem:
        loss, notes = step(*data)
    model.zero_grad(set_to_none=True)
    return {"seq": seq, "device": _max(mem.peak_bytes), "host": _max(mem.host_peak_bytes), "loss": float(loss.detach()), **notes}


def search(fits, start: int, gran: int, max_seq: int) -> dict:
    """Longest S (a multiple of ``gran``, at most ``max_seq``) with ``fits(S)``: from ``start`` in steps of 2, 4,
    8 ... x ``gran`` towards the boundary, then bisection. ``fit`` is None when not even ``gran`` fits."""
    up, step = fits(start), 2 * gran
    lo, hi = (start, max_seq + gran) if up else (0, start)  # longest known fit (0: none), shortest known over
    while lo < (s := min(lo + step, max_seq) if up else max(hi - step, gran)) < hi:
        if fits(s) != up:
            lo, hi = (lo, s) if up else (s, hi)
            break
        lo, hi, step = (s, hi, 2 * step) if up else (lo, s, 2 * step)
    while hi - lo > gran:
        mid = (lo + hi) // 2 // gran * gran
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return {"fit": lo or None, "first_over": hi if hi <= max_seq else None, "capped": hi > max_seq}


def worker(args) -> dict:
    """One system on one kind of data: the search (``--start-seq`` 0: none), then the timed steps (if any)."""
    init_worker(1800, deepspeed=args.impl == "deepspeed")
    world, m, packed = dist.get_world_size(), MODEL, args.data == "packed"
    model = llama(hidden_size=m["hidden"], intermediate_size=m["intermediate"], num_hidden_layers=m["layers"],
                  num_attention_heads=m["heads"], num_key_value_heads=m["heads"], vocab_size=m["vocab"],
                  max_position_embeddings=args.max_seq)  # fmt: skip
    step = ours(model, world, args.tech.split(",")) if args.impl == "ours" else deepspeed(model, world)
    probes: dict[int, dict] = {}

    def fits(seq: int) -> bool:
        if seq not in probes:
            probes[seq] = probe(step, model, seq, packed)
        return probes[seq]["device"] <= args.budget_mib * 2**20

    fit = search(fits, args.start_seq, args.granularity, args.max_seq) if args.start_seq else None
    data, times, got = local_data(args.time_seq, packed), [], {}
    for _ in range(args.time_steps + 1 if args.time_steps else 0):  # the first one warms up
        times.append(_max(timed(lambda: got.setdefault("loss", step(*data)[0]))))
        model.zero_grad(set_to_none=True)
    return {"args": vars(args), "world": world, "model": m, "fit": fit, "probes": [probes[s] for s in sorted(probes)],
            "step_seconds": min(times[1:], default=None), "loss_at_time_seq": float(got["loss"].detach()) if got else None}


def run_section(launches: list, rounds: int = 2) -> list[dict]:
    """Every system on causal and packed data: its search, then ``rounds`` rounds of timed steps (``--start-seq
    0``), the systems interleaved so that a burst of load from elsewhere hits no one side alone; the best step."""
    out, plan = {}, [(data, *system) for data in ("causal", "packed") for system in SYSTEMS]
    for i in range(rounds + 1):
        for data, name, impl, tech in plan:
            args = ["--impl", impl, *(["--tech", tech[data]] if tech else []), "--data", data,
                    *(["--start-seq", str(START[impl][data]), "--time-steps", "0"] if i == 0 else ["--start-seq", "0"])]
            res, cmd, _ = run_worker("bench.longest_fit", 2, args, python=DS_PYTHON if impl == "deepspeed" else None,
                                     timeout=1800, launches=launches)  # fmt: skip
            if i == 0:
                out[data, name] = {**res, "system": name, "command": cmd, "steps_timed": 0}
            else:
                best = min(x for x in (out[data, name]["step_seconds"], res["step_seconds"]) if x is not None)
                out[data, name].update(step_seconds=best, loss_at_time_seq=res["loss_at_time_seq"],
                                       steps_timed=out[data, name]["steps_timed"] + res["args"]["time_steps"])
    return list(out.values())


# ---------------------------------------------------------------------------------------------- report
def ratio(runs: list[dict], data: str, name: str, key=lambda r: r["fit"]["fit"]) -> float | None:
    """``key`` of system ``name`` over DeepSpeed's on ``data`` (``None``: either is missing or found none)."""
    by = {r["system"]: r for r in runs if r["args"]["data"] == data}
    a, b = (key(by[n]) if n in by else None for n in (name, "DeepSpeed"))
    return a / b if a and b else None


def targets(runs: list[dict]) -> list[list]:
    """Issue 26's goals: ``[measure, target, measured, met, section]`` (report.targets' rows)."""
    if not runs:
        return []
    fit = {d: ratio(runs, d, SYSTEMS[2][0]) for d in ("causal", "packed")}
    step = {d: ratio(runs, d, SYSTEMS[1][0], lambda r: r["step_seconds"]) for d in ("causal", "packed")}
    r, s = lambda x: "—" if x is None else f"{x:.2f}x", runs[0]["args"]["time_seq"]  # noqa: E731
    return [["7a. longest S in the same budget (device bytes), ulysses-sp all techniques / DeepSpeed", ">= 1.5",
             f"causal {r(fit['causal'])}, packed {r(fit['packed'])}", all(x and x >= 1.5 for x in fit.values())],
            [f"7b. step at S={s}, same techniques, ulysses-sp / DeepSpeed (causal)", "<= 1.0", r(step["causal"]),
             bool(step["causal"] and step["causal"] <= 1.0)],
            [f"7c. step at S={s}, packed documents: ulysses-sp exact / DeepSpeed", "<= 1.0", r(step["packed"]),
             bool(step["packed"] and step["packed"] <= 1.0)]]  # fmt: skip


def section(runs: list[dict]) -> tuple[str, str]:
    """Section 7's heading and body (tables from the runs' JSON)."""
    a, m = runs[0]["args"], runs[0]["model"]
    head = (f"7. Longest sequence in {a['budget_mib']:g} MiB per rank, side by side with DeepSpeed Ulysses/ALST (sp=2, "
            f"h={m['hidden']}, I={m['intermediate']}, L={m['layers']}, H={m['heads']}, V={m['vocab']}, fp32)")
    r = lambda x: "—" if x is None else f"{x:.2f}x"  # noqa: E731
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    rows = []
    for x in runs:
        f, d, by = x["fit"], x["args"]["data"], {p["seq"]: p for p in x["probes"]}
        at = by.get(f["fit"], {})
        rows.append([d, x["system"], x["args"]["tech"] if x["args"]["impl"] == "ours" else "its own (above)",
                     "none" if f["fit"] is None else f"≥ {f['fit']} (capped)" if f["capped"] else f["fit"],
                     r(ratio(runs, d, x["system"])), f"{mib(at['device'])} / {mib(at['host'])}" if at else "—",
                     at.get("attention_path", "—"), f"{x['loss_at_time_seq']:.5f}", f"{x['step_seconds']:.3f}",
                     r(ratio(runs, d, x["system"], lambda r: r["step_seconds"])),
                     ", ".join(f"{p['seq']}: {mib(p['device'])}" for p in x["probes"]), f"`{x['command']}`"])
    ds = next((x["probes"][-1] for x in runs if x["args"]["impl"] == "deepspeed"), None)
    return head, "\n".join([
        "Meter (both sides): `ulysses_sp.memory.meter.track_peak_memory` (live tensor storages, parameters and "
        "gradients included, max over ranks). *Device* bytes leave out what ulysses-sp's offloads stage on the host "
        "(what would leave an accelerator); the host peak is listed beside them.", "",
        f"- DeepSpeed: {DEEPSPEED}", "- ulysses-sp: UlyssesSPAttentionHF (sdpa), tiled loss, and `--tech`: "
        + "; ".join(f"`{k}` {v}" for k, v in TECHS.items()) + ". Packed documents take the per-document sdpa path "
        "unless `kv_offload` sends them through the blockwise core. Step: the best of "
        f"{runs[0]['steps_timed']} unmetered steps at S={a['time_seq']} (a warm-up step before each launch's), in "
        "launches with `--start-seq 0` (no search) after the searches, the systems interleaved.", "",
        table(["data", "system", "--tech", "longest S (device)", "vs DeepSpeed", "MiB device / host at fit",
               "attention path", f"loss at S={a['time_seq']}", f"step s at S={a['time_seq']}", "step vs DeepSpeed",
               "probes (S: device MiB)", "command"], rows),
        *(["", f"DeepSpeed {ds['deepspeed_version']} checkpoint offload at S={ds['seq']}: marked / offloaded / "
           f"skipped {' / '.join(map(str, ds['ckpt_offload']))}."] if ds else [])])  # fmt: skip


def main(argv=None) -> None:
    ap = parser(__doc__, "longest_fit.json")
    ap.add_argument("--impl", choices=("ours", "deepspeed"), required=True)
    ap.add_argument("--tech", default="ckpt,mlp", help=f"ours: comma list of {', '.join(TECHS)}")
    ap.add_argument("--data", choices=("causal", "packed"), required=True)
    ap.add_argument("--budget-mib", type=float, default=24.0, help="per-rank budget of device bytes")
    ap.add_argument("--start-seq", type=int, default=8192, help="first length tried (a guess of the fit); 0: no search")
    ap.add_argument("--granularity", type=int, default=512)
    ap.add_argument("--max-seq", type=int, default=32768)
    ap.add_argument("--time-seq", type=int, default=4096, help="length of the timed (unmetered) steps")
    ap.add_argument("--time-steps", type=int, default=2, help="0: no timing")
    args = ap.parse_args(argv)
    if not under_torchrun():
        ap.error("a worker: run it under torch.distributed.run (or python -m bench --sections longest_fit)")
    if importlib.util.find_spec("ulysses_sp") is None:  # the DeepSpeed venv: the meter from this checkout
        sys.path.append(str(ROOT / "src"))
    finish_worker(worker(args), args.out)


if __name__ == "__main__":
    main()
