"""Refit the planner's sequence-mixer memory terms (``src/ulysses_sp/plan/mixers.py``) from measurements.

    python scripts/fit_mixer_terms.py                      # every kind (about a minute on 2 CPU cores)
    python scripts/fit_mixer_terms.py --kinds short_conv mamba1
    python scripts/fit_mixer_terms.py --kinds mamba2 --dtype bf16   # Mamba-2's 16-bit terms (fake tensors, ~15 s)
    python scripts/fit_mixer_terms.py --kinds gated_delta_net --dtype bf16   # gated delta-net's (~2 min: its chunk loop)

For each mixer kind, one sharded mixer module of transformers' own code (Bamba's Mamba-2, Qwen3.5's
gated delta-net, LFM2's short convolution, Mamba's Mamba-1, Kimi-Linear's KDA; the torch fallbacks
the CPU runs) at ``GRIDS[kind]``'s sizes runs forward then backward in fp32 under the library's
meter (``memory.meter.track_peak_memory``), at sp 1 in a gloo group of one process, much as
tests/test_plan_mixers.py measures it: the bytes kept for backward per token (the output excluded:
it is the caller's) and the backward's high point above them (the incoming gradient excluded, for
the same reason). A least-squares fit of each on the monomials of ``plan.mixers.memory_per_token``
(``MONOMIALS``, in fp32 elements per token) prints the coefficients beside the largest relative
error of the fit and of the formula the code holds now. ``--dtype bf16`` (Mamba-2 and gated delta-net) measures a
bf16 mixer at ``REAL_GRIDS``' real sizes on fake tensors instead (``measure_fake``: the rehearsal's own
counting, ``rehearse.tracker.StepTracker``; no memory, so 256 heads of 64 cost nothing). Paste coefficients that moved into
``plan/mixers.py``; tests/test_plan_mixers.py then checks them at sizes no grid here uses.
tests/test_docs_reference.py runs the short-convolution fit against the code's coefficients.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch

S = 512
"""Tokens per measurement (every chunk size of the grids divides it)."""

_COMMON = dict(vocab_size=264, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
               max_position_embeddings=1 << 17, tie_word_embeddings=False)  # fmt: skip
_KIMI = dict(moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, mlp_layer_types=["dense", "dense"],
             kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip


def _mamba2(h: int, d: int, n: int, g: int, c: int) -> tuple[str, dict[str, Any]]:
    return "BambaConfig", dict(hidden_size=h * d // 2, num_hidden_layers=2, attn_layer_indices=[1], mamba_expand=2,
                               mamba_n_heads=h, mamba_d_head=d, mamba_d_state=n, mamba_n_groups=g,
                               mamba_chunk_size=c, mamba_d_conv=4)  # fmt: skip


def _gdn(hk: int, h: int, dk: int, d: int) -> tuple[str, dict[str, Any]]:
    return "Qwen3_5TextConfig", dict(hidden_size=64, num_hidden_layers=2, head_dim=16,
                                     layer_types=["linear_attention", "full_attention"], linear_num_key_heads=hk,
                                     linear_num_value_heads=h, linear_key_head_dim=dk, linear_value_head_dim=d,
                                     linear_conv_kernel_dim=4)  # fmt: skip


def _mamba1(hidden: int, i: int, n: int) -> tuple[str, dict[str, Any]]:
    return "MambaConfig", dict(hidden_size=hidden, intermediate_size=i, state_size=n, num_hidden_layers=1)


def _kda(h: int, d: int) -> tuple[str, dict[str, Any]]:
    return "KimiLinearConfig", dict(hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                    linear_num_heads=h, linear_head_dim=d, linear_conv_kernel_dim=4, **_KIMI)  # fmt: skip


GRIDS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "mamba2": [_mamba2(*s) for s in [(4, 16, 16, 2, 32), (8, 16, 16, 2, 64), (8, 8, 32, 4, 64), (4, 32, 8, 1, 32),
                                     (16, 8, 16, 2, 128), (8, 16, 8, 8, 16), (12, 8, 16, 4, 64), (8, 32, 16, 2, 64),
                                     (4, 16, 32, 4, 128), (8, 8, 8, 2, 32)]],
    "gated_delta_net": [_gdn(*s) for s in [(2, 4, 16, 16), (2, 4, 8, 16), (4, 8, 16, 8), (1, 4, 32, 16), (2, 8, 16, 32),
                                           (4, 4, 8, 8), (2, 2, 32, 32), (4, 8, 32, 16), (1, 2, 16, 8)]],
    "short_conv": [("Lfm2Config", dict(hidden_size=w, num_hidden_layers=2, layer_types=["conv", "full_attention"]))
                   for w in (32, 48, 64, 96, 128)],
    "mamba1": [_mamba1(*s) for s in [(32, 64, 8), (32, 128, 16), (64, 128, 8), (64, 256, 16), (32, 64, 32),
                                     (64, 256, 32), (48, 96, 16), (32, 128, 8), (64, 192, 24), (32, 256, 8)]],
    "kimi_delta_attention": [_kda(*s) for s in [(4, 8), (4, 16), (8, 8), (2, 16), (8, 16), (4, 32), (6, 8), (2, 32)]],
}  # fmt: skip
"""Per kind, ``(transformers config class, its keyword arguments)`` of each measured size."""
REAL_GRID = [_mamba2(*s) for s in [(128, 64, 128, 8, 128), (128, 64, 128, 1, 256), (80, 64, 128, 1, 256),
                                   (64, 64, 256, 8, 128), (48, 64, 64, 2, 128), (96, 32, 128, 4, 256), (32, 128, 128, 1, 128),
                                   (64, 64, 128, 8, 64), (128, 32, 64, 4, 128), (24, 64, 128, 1, 256), (32, 64, 256, 2, 256),
                                   (256, 64, 256, 8, 128)]]  # fmt: skip
"""Mamba-2 at real sizes (Nemotron-H, Bamba, Mamba2-2.7B and their kin): ``--dtype bf16``'s grid."""
REAL_GDN_GRID = [_gdn(*s) for s in [(16, 32, 128, 128), (16, 64, 128, 128), (8, 16, 128, 128), (16, 16, 128, 128),
                                    (4, 8, 64, 64), (8, 32, 128, 64), (16, 48, 128, 128), (2, 8, 128, 128),
                                    (8, 8, 64, 128), (4, 16, 128, 64)]]  # fmt: skip
"""Gated delta-net at real sizes (Qwen3-Next's 16 key / 32 value heads of 128, Qwen3.5's and their kin):
``--dtype bf16``'s grid."""
REAL_GRIDS = {"mamba2": REAL_GRID, "gated_delta_net": REAL_GDN_GRID}

Monomials = dict[str, Callable[[Any], float]]
MONOMIALS: dict[str, tuple[Monomials, Monomials]] = {
    "mamba2": (
        {"H c": lambda m: m.heads * m.chunk, "H Dh": lambda m: m.heads * m.head_dim, "H N": lambda m: m.heads * m.state,
         "H Dh N / c": lambda m: m.heads * m.head_dim * m.state / m.chunk, "H": lambda m: m.heads,
         "G N": lambda m: m.groups * m.state},
        {"H c": lambda m: m.heads * m.chunk, "H Dh": lambda m: m.heads * m.head_dim, "H N": lambda m: m.heads * m.state,
         "H Dh N / c": lambda m: m.heads * m.head_dim * m.state / m.chunk, "H": lambda m: m.heads,
         "G N": lambda m: m.groups * m.state, "1": lambda m: 1.0},
    ),
    "gated_delta_net": (
        {"H c": lambda m: m.heads * m.chunk, "H Dk": lambda m: m.heads * m.key_dim, "H Dh": lambda m: m.heads * m.head_dim,
         "H Dk Dh / 64": lambda m: m.heads * m.key_dim * m.head_dim / 64, "Hk Dk": lambda m: m.key_heads * m.key_dim},
        {"H c": lambda m: m.heads * m.chunk, "H Dk": lambda m: m.heads * m.key_dim, "H Dh": lambda m: m.heads * m.head_dim},
    ),
    "short_conv": ({"C": lambda m: m.channels}, {"C": lambda m: m.channels}),
    "mamba1": (
        {"I N": lambda m: m.channels * m.state, "I": lambda m: m.channels, "N": lambda m: m.state},
        {"I N": lambda m: m.channels * m.state, "I": lambda m: m.channels, "N": lambda m: m.state},
    ),
    "kimi_delta_attention": (
        {"H Dh c": lambda m: m.heads * m.head_dim * m.chunk, "H": lambda m: m.heads,
         "H Dh^2 / 64": lambda m: m.heads * m.head_dim**2 / 64},
        {"H Dh c": lambda m: m.heads * m.head_dim * m.chunk, "H": lambda m: m.heads},
    ),
}  # fmt: skip
"""Per kind, ``(saved, backward workspace)``: the monomials of ``plan.mixers.memory_per_token`` at sp 1."""


def measure(kind: str, cls: str, kwargs: dict[str, Any]) -> tuple[Any, float, float]:
    """``(MixerShape, saved bytes, backward high point above them)`` per token of one ``kind`` mixer
    of ``cls(**kwargs)``, at sp 1 (needs a process group: ``measure_grid`` starts one)."""
    import transformers
    from transformers import AutoModelForCausalLM

    from ulysses_sp.memory.meter import track_peak_memory
    from ulysses_sp.mixers.apply import apply_mixers
    from ulysses_sp.mixers.shapes import mixer_sizes
    from ulysses_sp.parallel.mesh import init_mesh
    from ulysses_sp.plan.inputs import MixerShape

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**_COMMON, **kwargs})).float()
    handle = apply_mixers(model, init_mesh((1, 1)))
    try:
        name, handler = handle.wrapped[0]
        if handler != kind:
            raise ValueError(f"{cls}: its first sharded mixer is {handler!r}, not {kind!r}")
        module = model.get_submodule(name)
        x = torch.randn(1, S, model.config.hidden_size, requires_grad=True)  # [B, S, hidden]
        with track_peak_memory("cpu", include=[*model.parameters(), x]) as mem:
            y = module(x)
            y = y[0] if isinstance(y, tuple) else y
            out_bytes = y.numel() * y.element_size()
            after = mem.current_bytes
            saved = after - mem.baseline_bytes - out_bytes  # the output is the caller's
            y.backward(torch.ones_like(y))  # the incoming gradient is the caller's too: not counted below
    finally:
        handle.remove()
    return MixerShape(**mixer_sizes(module, kind)), saved / S, (mem.peak_bytes - after - out_bytes) / S


def measure_fake(kind: str, cls: str, kwargs: dict[str, Any], dtype: torch.dtype = torch.bfloat16,
                 tokens: int = 8192) -> tuple[Any, float, float]:  # fmt: skip
    """``measure`` on fake tensors in ``dtype``: the rehearsal's counting (``StepTracker``) of one ``kind``
    mixer's forward and backward over ``tokens`` tokens (needs a process group, as ``measure``)."""
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from ulysses_sp.mixers.apply import apply_mixers
    from ulysses_sp.mixers.shapes import mixer_sizes
    from ulysses_sp.parallel.mesh import init_mesh
    from ulysses_sp.plan.inputs import MixerShape
    from ulysses_sp.rehearse.tracker import StepTracker

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**_COMMON, **kwargs})).to(dtype)
    handle, tracker, dev = apply_mixers(model, init_mesh((1, 1))), StepTracker("cpu"), None
    try:
        name, handler = handle.wrapped[0]
        if handler != kind:
            raise ValueError(f"{cls}: its first sharded mixer is {handler!r}, not {kind!r}")
        module = model.get_submodule(name)
        with FakeTensorMode(allow_non_fake_inputs=True):
            module.to_empty(device="cpu")
            x = torch.empty(1, tokens, model.config.hidden_size, dtype=dtype, requires_grad=True)  # [B, S, hidden]
            with tracker:
                tracker.start_step()
                dev = tracker.places["device"]
                base = dev.current
                y = module(x)
                y = y[0] if isinstance(y, tuple) else y
                out_bytes, after = y.numel() * y.element_size(), dev.current
                y.backward(torch.ones_like(y))
                tracker.finish()
    finally:
        handle.remove()
    return MixerShape(**mixer_sizes(module, kind)), (after - base - out_bytes) / tokens, (dev.peak - after - out_bytes) / tokens


def measure_grid(kinds: tuple[str, ...], dtype: str = "fp32") -> dict[str, list[tuple[Any, float, float]]]:
    """``measure`` at every size of ``GRIDS[kind]`` (``dtype`` bf16: ``measure_fake`` at ``REAL_GRIDS[kind]``'s), in the
    current process group (or a gloo group of this one process, started and ended here)."""
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="ulysses-sp-fit-"), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        out: dict[str, list[tuple[Any, float, float]]] = {}
        for kind in kinds:
            out[kind] = []
            grid = GRIDS[kind] if dtype == "fp32" else REAL_GRIDS[kind]
            for i, (cls, kw) in enumerate(grid):
                print(f"{kind}: size {i + 1} of {len(grid)}", file=sys.stderr, flush=True)  # noqa: T201
                out[kind].append(measure(kind, cls, kw) if dtype == "fp32" else measure_fake(kind, cls, kw))
        return out
    finally:
        if own:
            dist.destroy_process_group()


def fit(kind: str, rows: list[tuple[Any, float, float]], dtype_bytes: int = 4) -> dict[str, Any]:
    """The least-squares coefficients (fp32 elements per token) of the saved bytes and of the
    backward workspace on ``MONOMIALS[kind]``, each with the largest residual of the fit and of the
    formula the code holds now (``memory_per_token`` at sp 1), relative to the saved bytes (the
    workspace's: to saved + workspace, the high point the planner adds up)."""
    from ulysses_sp.plan.mixers import FP32, memory_per_token

    out: dict[str, Any] = {}
    for part, monomials in zip(("saved", "workspace"), MONOMIALS[kind], strict=True):
        a = torch.tensor([[f(m) for f in monomials.values()] for m, _, _ in rows], dtype=torch.float64)
        b = torch.tensor([r[1] if part == "saved" else r[2] for r in rows], dtype=torch.float64) / FP32
        coef = torch.linalg.lstsq(a, b[:, None]).solution[:, 0]
        # relative to what the planner adds up: the saved bytes, or saved + workspace (a workspace near 0
        # at a small size would make any error look large)
        total = torch.tensor([r[1] + (r[2] if part == "workspace" else 0.0) for r in rows], dtype=torch.float64)
        scale = (total / FP32).abs().clamp_min(1.0)
        now = torch.tensor([memory_per_token(m, 1, dtype_bytes)[0 if part == "saved" else 1] / FP32 for m, _, _ in rows],
                           dtype=torch.float64)  # fmt: skip
        out[part] = {
            "coefficients": dict(zip(monomials, coef.tolist(), strict=True)),
            "fit_error": float(((a @ coef - b).abs() / scale).max()),
            "code_error": float(((now - b).abs() / scale).max()),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", nargs="+", choices=tuple(GRIDS), default=list(GRIDS))
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: the 16-bit terms of Mamba-2 and gated delta-net")
    args = ap.parse_args(argv)
    if args.dtype == "bf16" and not set(args.kinds) <= set(REAL_GRIDS):
        ap.error(f"--dtype bf16 fits the 16-bit terms of {' and '.join(REAL_GRIDS)} only: pass --kinds with those")
    for kind, rows in measure_grid(tuple(args.kinds), args.dtype).items():
        print(f"{kind} ({len(rows)} sizes)")  # noqa: T201 - the script's report
        for part, r in fit(kind, rows, 4 if args.dtype == "fp32" else 2).items():
            terms = " + ".join(f"{c:.4g} {name}" for name, c in r["coefficients"].items())
            print(f"  {part:9s} = 4 x ({terms})")  # noqa: T201
            print(f"  {'':9s}   largest error: fit {r['fit_error']:.1%}, code now {r['code_error']:.1%}")  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
