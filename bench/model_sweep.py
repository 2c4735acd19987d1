"""Coverage sweep: every decoder-only causal LM of the installed transformers, at sp=2 against no SP.

    python -m bench.model_sweep [--only llama,lfm2]  # all -> bench/results/model_sweep.md; a few: printed only

The families come from transformers' auto registry (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` minus the encoder-decoder
and masked-LM registries), not from a list kept here. Each gets a tiny config shrunk from its config class's defaults
(hidden 64, 4 heads / 2 kv heads, 4 experts, vocab 128, layers enough to hold every layer type of the defaults, 2 at
least; ``model_sweep_overrides.json`` per family where that does not build), random weights large enough that one
wrong position shows, fp32. Two gloo ranks build it from the same seed and run one step: the plain model on the whole
sequence (the oracle) and the same model at sp=2 (the closed-world guard first, then Ulysses attention, ``S_l = S/2``
tokens per rank, the SP loss). The verdict: **exact** (every position's logits and every gradient, summed over the SP
group, equal the oracle's at ``rtol 1e-4``), **refused** (the guard's reason), **wrong** (no refusal, a mismatch: a
bug), **skipped** (no tiny config builds, with why) or **crash** (an error, a time-out or the per-rank memory cap).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import multiprocessing as mp
import os
import resource
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM
from transformers.models.auto import modeling_auto as auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from bench import md
from bench.launch import max_over_ranks, parser
from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.mixers.apply import apply_mixers, has_unsharded_mixers
from ulysses_sp.mixers.guard import check_document_mixing, check_sequence_mixing
from ulysses_sp.parallel.loss import sp_causal_lm_loss
from ulysses_sp.parallel.mesh import init_mesh
from ulysses_sp.parallel.mesh_shape import head_counts

SEQ = 32
"""Tokens per sequence (rank holds 16): longer than the tiny sliding window and attention chunk (8)."""
SHRINK = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
    n_routed_experts=4, num_local_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
    n_shared_experts=1, num_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=256, sliding_window=8,
    attention_chunk_size=8, initializer_range=0.1, use_cache=False, is_decoder=True, n_positions=256, n_ctx=256,
    vocab_size_per_layer_input=128, hidden_size_per_layer_input=16)  # fmt: skip
"""Config fields shrunk where the config class has them (others keep their defaults)."""
REGISTRY = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
"""model type -> its class name in transformers."""
OVERRIDES = json.loads(Path(__file__).with_name("model_sweep_overrides.json").read_text())  # set last (see its "_why"s)


def families() -> list[str]:
    """Decoder-only causal-LM model types of the installed transformers, from its auto registries."""
    not_decoder_only = (auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
                        auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)  # fmt: skip
    return sorted(set(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES).difference(*not_decoder_only))


def tiny_config(model_type: str) -> Any:
    """The config class's defaults, shrunk (``SHRINK``), every default layer type in its layers, ``OVERRIDES`` last."""
    spec = OVERRIDES.get(model_type, {})  # "_why": a comment; "_config": the causal LM's own config class (Musicgen)
    cls, over = CONFIG_MAPPING[spec.get("_config", model_type)], {k: v for k, v in spec.items() if k[0] != "_"}
    if "_config" in spec:  # not an auto key: registered for the class the causal-LM registry names
        AutoModelForCausalLM.register(cls, getattr(transformers, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]), exist_ok=True)
    config = cls(**{**shrink(cls(**over).to_dict()), **over})
    for key, sub in spec.get("_swap", {}).items():  # a sub-config of another kind, set past the config's type check
        object.__setattr__(config, key, CONFIG_MAPPING[sub["model_type"]](**{k: v for k, v in sub.items() if k != "model_type"}))
    return config


def shrink(defaults: dict) -> dict:
    """The ``SHRINK`` fields a config's ``defaults`` has, tokens inside the tiny vocabulary, layers enough to hold
    every default layer type (2 at least)."""
    # a per-layer input embedding (Gemma 3n/4) is shrunk where the family has one (default 0: it has none)
    kw = {k: v for k, v in SHRINK.items() if k in defaults and not (k.endswith("_per_layer_input") and not defaults[k])}
    for key, token in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if isinstance(defaults.get(key), int) and defaults[key] >= SHRINK["vocab_size"]:
            kw[key] = token  # inside the tiny vocabulary (an embedding's padding_idx must be)
    if "qk_rope_head_dim" in kw and "head_dim" in defaults:
        kw["head_dim"] = kw["qk_rope_head_dim"]  # MLA: the rotary part of the head is "head_dim"
    if "kv_lora_rank" in kw and "num_key_value_heads" in kw:
        kw["num_key_value_heads"] = kw["num_attention_heads"]  # MLA: one key per query head
    types = defaults.get("layer_types") or []
    n = max([2] + [i + 1 for i, t in enumerate(types) if t not in types[:i]])  # every type has appeared by then
    if types:
        kw["layer_types"] = list(types[:n])
    kw["num_hidden_layers"] = n
    return kw


def build(model_type: str, seed: int = 0) -> Any:
    """The tiny fp32 model with random weights (matrices N(0, 0.2), vectors 1 + N(0, 0.1)), eval mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="eager").float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() >= 2 else p.normal_(1.0, 0.1)
    return model.eval()  # no dropout; the SP attention still runs (disable_in_eval=False)


def _attach(model: Any, size: int) -> tuple[Any, Any]:
    """``(registration, mesh)`` at sp ``size``; without attention layers (Mamba alone) only the mesh."""
    if not head_counts(model.config):
        return None, init_mesh((dist.get_world_size() // size, size))
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "eager", size, 1)
    return reg, reg.mesh


def compare(model: Any, *, guard: bool = True, seed: int = 1) -> dict[str, Any]:
    """One step at sp = world size against the same model without SP; call on every rank of a gloo group.

    ``guard=False``: neither the closed-world guard nor the mixer handlers (what SP did before them).
    Returns ``{"verdict": "exact"|"refused"|"wrong", "detail": ...}`` (the same on every rank).
    """
    sp, rank = dist.get_world_size(), dist.get_rank()
    if guard:
        try:
            check_sequence_mixing(model, sp_size=sp)
        except ValueError as err:
            lines = str(err).splitlines()  # the guard's: a header, one line per module, a hint
            return {"verdict": "refused", "detail": " | ".join(x.strip() for x in lines[1:-1] or lines)}
    ref = copy.deepcopy(model)
    vocab = next(model.get_output_embeddings().parameters()).shape[0]  # its weight (Musicgen: one head per codebook)
    ids = torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(seed))
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)  # [B, S], shifted
    try:
        ref_logits = ref(input_ids=ids, use_cache=False).logits  # [B, S, V]
        F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    except Exception as err:  # noqa: BLE001 - the tiny config does not run even without SP
        return {"verdict": "skipped", "detail": f"runs without SP neither: {type(err).__name__}: {err}"[:300]}
    try:  # the registration refuses what the SP attention cannot run (sparse/compressed attention)
        reg, mesh = _attach(model, sp)
    except ValueError as err:
        return {"verdict": "refused", "detail": str(err).replace("\n", " ")[:400]}
    # the mixers SP shards (short conv, Mamba-2, Mamba-1, gated delta-net, KDA), as initialize() applies them
    mixers = apply_mixers(model, mesh) if guard and has_unsharded_mixers(model) else None
    try:
        s_l = SEQ // sp
        part = slice(rank * s_l, (rank + 1) * s_l)  # this rank's shard: [B, S] -> [B, S_l]
        pos = torch.arange(SEQ)[None, part]
        logits = model(input_ids=ids[:, part], position_ids=pos, use_cache=False).logits  # [B, S_l, V]
        sp_causal_lm_loss(logits, labels[:, part], mesh.sp_group).backward()
    finally:
        if mixers is not None:
            mixers.remove()
        if reg is not None:
            reg.remove()
    problems = _mismatches(logits.detach(), ref_logits.detach()[:, part], "logits", 0.0)
    floor, grads, more = grad_mismatches(model, ref)
    problems += more
    if max_over_ranks(len(problems)) and not max_over_ranks(int(any(x.startswith("logits") for x in problems))):
        if max_over_ranks(int(not _within_fp32_noise(ref, grads, ids, labels, floor))) == 0:
            return {"verdict": "exact", "detail": f"gradients to fp32 rounding ({problems[0] if problems else ''}: "
                    "within 2x of the fp32 model's distance without SP from the float64 model's)"}  # fmt: skip
    if max_over_ranks(len(problems)):  # one verdict for the group
        return {"verdict": "wrong", "detail": problems[0] if problems else "another rank differs"}
    return {"verdict": "exact", "detail": ""}


def grad_mismatches(model: Any, ref: Any) -> tuple[float, dict, list[str]]:
    """``(floor, grads, problems)``: every SP gradient summed over the group (``grads``, in place) against the
    reference's; a gradient that is zero in exact arithmetic (a key bias under softmax) is rounding noise in
    both runs: its ``floor`` is 1e-6 of the largest gradient of the model."""
    floor, grads, problems = 1e-6 * max(float(r.grad.abs().max()) for r in ref.parameters() if r.grad is not None), {}, []
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        grads[name] = g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)  # sum over the SP group, as the engine reduces gradients
        if r.grad is not None:
            problems += _mismatches(g, r.grad, name, floor)
    return floor, grads, problems


def _within_fp32_noise(ref: Any, grads: dict, ids: Any, labels: Any, floor: float) -> bool:
    """Whether every SP gradient is within 2x (+ ``floor``) of the float64 model's where the fp32 model without SP is."""
    r64 = copy.deepcopy(ref).double()
    if r64.config._experts_implementation not in (None, "eager") and type(r64)._can_set_experts_implementation():
        r64.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    r64.zero_grad(set_to_none=True)
    F.cross_entropy(r64(input_ids=ids, use_cache=False).logits.flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
    return all(float((grads[n].double() - t.grad).abs().max()) <= 2 * float((r.grad.double() - t.grad).abs().max()) + floor
               for (n, r), (_, t) in zip(ref.named_parameters(), r64.named_parameters()) if r.grad is not None and t.grad is not None)  # fmt: skip


DOCS = (5, 7, 9, 11)  # packed documents of one SEQ row: the third spans the sp-2 shard boundary (16)


@torch.no_grad()
def compare_packed(model: Any, ref: Any, sp_verdict: str, route: bool = True) -> dict[str, str]:
    """Packed ``DOCS`` (positions restarting at 0) as ``train`` runs them at sp 1 and sp = world, against each
    document alone through ``ref``: per-position logits. ``{"sp1", "sp2"}``: ``exact``, ``refused``
    (``check_document_mixing`` / the sp verdict), ``leaks ...`` or ``-`` (not run). ``route=False``: sp 1
    runs the model's own forward (what ``train`` did before it routed sp 1)."""
    sp, rank = dist.get_world_size(), dist.get_rank()
    out = {"sp2": {"exact": "exact", "refused": "refused"}.get(sp_verdict, "-")}
    try:
        check_document_mixing(model)
    except ValueError:  # train refuses such packed rows at every sp size
        return {"sp1": "refused", "sp2": "refused" if out["sp2"] != "-" else "-"}
    vocab = next(ref.get_output_embeddings().parameters()).shape[0]  # its weight (Musicgen: one head per codebook)
    ids = torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(2))
    want = torch.cat([ref(input_ids=d, use_cache=False).logits for d in ids.split(DOCS, dim=1)], dim=1)
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]  # [1, S]
    for size in (1, sp) if sp_verdict == "exact" else (1,):
        reg, mesh = _attach(model, size) if route or size > 1 else (None, None)
        handles = [h for h in (apply_mixers(model, mesh) if mesh and has_unsharded_mixers(model) else None, reg) if h]
        part = slice(rank * SEQ // size, (rank + 1) * SEQ // size) if size > 1 else slice(None)
        got = model(input_ids=ids[:, part], position_ids=pos[:, part], use_cache=False).logits
        for h in handles:  # mixers first, then the registration
            h.remove()
        err = (got - want[:, part]).abs().amax(dim=-1)[0]  # [S_l]
        # a leak moves logits by a sizeable share of their scale; the row vs each document alone differ in
        # matmul shapes, which in a wide config (GPT-J keeps its 4096) rounds to ~2e-5 of the scale
        bad = not torch.allclose(got, want[:, part], rtol=1e-4, atol=1e-4 * float(want.abs().max()))
        verdict = f"leaks (logits differ by {float(err.max()):.3g} at position {int(err.argmax())})" if bad else "exact"
        worst = max_over_ranks(int(bad))
        out["sp1" if size == 1 else "sp2"] = verdict if bad or not worst else "leaks (on another rank)"
    return out


def _mismatches(got: Any, want: Any, name: str, floor: float) -> list[str]:
    scale = float(want.abs().max())
    if torch.allclose(got, want, rtol=1e-4, atol=max(1e-5 * scale, floor, 1e-12)):
        return []
    err = (got - want).abs()
    return [f"{name} differs by {float(err.max()) / max(scale, 1e-30):.1%} of its scale (at index {int(err.argmax())})"]


def _rank_main(model_type: str, rank: int, store: str, mem_bytes: int, out: Any) -> None:
    """One rank of one family's run, in its own process under the memory cap."""
    resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    try:
        try:
            model = build(model_type)
        except Exception as err:  # noqa: BLE001 - the family's tiny config is not buildable: say why
            out.put((rank, {"verdict": "skipped", "detail": f"{type(err).__name__}: {err}"}))
            return
        dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                                timeout=timedelta(seconds=120))  # fmt: skip
        plain = copy.deepcopy(model)  # the packed column's reference: each document alone
        row = compare(model)
        if row["verdict"] in ("exact", "refused"):
            row["packed"] = compare_packed(model, plain, row["verdict"])
        out.put((rank, row))
    except BaseException as err:  # noqa: BLE001 - reported as a crash with its reason
        out.put((rank, {"verdict": "crash", "detail": f"{type(err).__name__}: {err}"[:300]}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_family(model_type: str, *, timeout: float, mem_gb: float, tries: int = 2, rank_main: Any = None) -> dict[str, Any]:
    """``{"family", "verdict", "detail"}`` for one family: two fresh ranks, a time limit, a memory cap
    (a second try when gloo could not connect the two ranks: a loaded machine, not the model); ``rank_main``:
    one rank's run (``_rank_main``'s arguments; ``bench.vlm_sweep``'s)."""
    ctx = mp.get_context("fork")  # the parent's imports are shared: no interpreter start per family
    order = ["crash", "wrong", "skipped", "refused", "exact"]
    for _ in range(tries):
        out, results = ctx.Queue(), {}
        with tempfile.TemporaryDirectory() as tmp:
            args = (os.path.join(tmp, "store"), int(mem_gb * 2**30), out)
            procs = [ctx.Process(target=rank_main or _rank_main, args=(model_type, r, *args), daemon=True) for r in range(2)]
            for p in procs:
                p.start()
            try:
                while len(results) < 2:
                    rank, res = out.get(timeout=timeout)
                    results[rank] = res
            except Exception:  # noqa: BLE001 - queue.Empty: the time limit, or a rank killed (memory)
                codes = [p.exitcode for p in procs]
                results.setdefault(0, {"verdict": "crash", "detail": f"no result in {timeout:.0f}s (exit codes {codes})"})
            finally:
                for p in procs:
                    p.kill()
                    p.join()
        # the worst verdict; among crashes the cause before a peer's "connection closed"
        worst = min(results.values(), key=lambda r: (order.index(r["verdict"]), "Connection closed" in r["detail"]))
        if "connectFullMesh" not in worst["detail"]:
            break
    return {"family": model_type, **worst}


def write_table(rows: list[dict[str, Any]], path: Path, run: dict, note: str = "") -> str:
    """The results page (the run's header, the counts, ``note``, one row per family); returns the text."""
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("exact", "refused", "skipped", "crash", "wrong")}
    packed = {k: [r.get("packed", {}).get(k, "-") for r in rows] for k in ("sp1", "sp2")}
    leaks = "; ".join(f"sp {k[-1]}: {g.count('exact')} exact, {g.count('refused')} refused, "
                      f"{sum(x.startswith('leaks') for x in g)} leak" for k, g in packed.items())  # fmt: skip
    return md.page(path, "Model coverage sweep", run, [
        f"transformers {transformers.__version__}: {len(rows)} decoder-only causal-LM families from its auto "
        "registry, each at sp=2 against the same model without SP (per-position logits and every "
        "gradient, fp32, rtol 1e-4). `python -m bench.model_sweep` regenerates this file.",
        "**" + ", ".join(f"{n} {v}" for v, n in counts.items()) + "**",
        "Packed documents (documents of 5, 7, 9 and 11 tokens in one row, positions restarting at 0) against each "
        "document alone, per-position logits: at sp 1 as `train` runs it (the SP attention registered at sp 1, "
        f"the mixer handlers, `check_document_mixing` first) and at sp 2. **{leaks}**",
        *([note] if note else []),
        md.table(["family", "verdict", "packed sp 1", "packed sp 2", "reason"],
                 [[r["family"], r["verdict"], p1, p2, r["detail"][:400]] for r, p1, p2 in zip(rows, *packed.values())])])  # fmt: skip


def main(argv: list[str] | None = None, *, sweep: Any = None) -> None:
    """The sweep's command line; ``sweep``: the module whose ``__doc__``, ``families``, ``_rank_main``,
    ``write_table`` and ``REGISTRY`` it runs (default this one; ``bench.vlm_sweep``)."""
    sweep = sweep or __import__(__name__, fromlist=["_"])
    name = getattr(sweep.__spec__, "name", sweep.__name__).rsplit(".", 1)[-1]  # python -m: __name__ is __main__
    ap = parser(sweep.__doc__, f"{name}.md")
    ap.add_argument("--only", default="", help="comma-separated model types (default: every family)")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per family")
    ap.add_argument("--mem-gb", type=float, default=8.0, help="address-space cap per rank (GiB)")
    ap.add_argument("--jobs", type=int, default=1, help="families run at once (2 processes each)")
    ap.add_argument("--table-from", nargs="*", help="only write the table from these runs' printed rows "
                    "(JSON lines; a later row of a family replaces an earlier one)")  # fmt: skip
    ap.add_argument("--note", default="", help="a line under the counts (with --table-from: which runs)")
    args = ap.parse_args(argv)
    run = md.provenance(md.command(f"bench.{name}", argv))
    if args.table_from:  # a later row of a family replaces an earlier one
        logs = [json.loads(x) for log in args.table_from for x in Path(log).read_text().splitlines() if x[:1] == "{"]
        latest = {row["family"]: row for row in logs}
        sweep.write_table([latest[f] for f in sorted(latest)], Path(args.out), run, args.note)
        return
    todo = [t for t in args.only.split(",") if t] or sweep.families()
    # every module a family run needs is imported here once, shared by the forked runs (fixed for the whole
    # run): this module's imports, and the modeling modules (a family that fails to import: its run says so)
    for model_type in todo:
        with contextlib.suppress(Exception):
            getattr(transformers, sweep.REGISTRY[model_type])

    def one(model_type: str) -> dict[str, Any]:
        row = run_family(model_type, timeout=args.timeout, mem_gb=args.mem_gb, rank_main=sweep._rank_main)
        print(json.dumps(row), flush=True)
        return row

    with ThreadPoolExecutor(args.jobs) as pool:  # threads only wait on their families' processes
        rows = list(pool.map(one, todo))
    if not args.only:
        sweep.write_table(rows, Path(args.out), run)


if __name__ == "__main__":
    main()
