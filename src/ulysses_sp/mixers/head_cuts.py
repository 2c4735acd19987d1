"""Which rows and columns of an attention module's own projections belong to a set of its heads.

The head-parallel fallback (``mixers/own_scores.py``) runs an attention module that computes its own
scores on one rank's heads only. This module reads the module's projection layout from its structure
(attribute names and parameter shapes, never the model's name) and returns a ``HeadCut``: for every
parameter, the dimension and the indices of the heads ``[r*H_l, (r+1)*H_l)`` (and the kv heads they
use), and the head-count attributes to shrink while the module runs on them. Layouts:

- separate ``q_proj``/``k_proj``/``v_proj`` (or ``project_q/k/v``) ``nn.Linear`` rows;
- a fused ``query_key_value`` interleaved per head ``[H, 3, D]`` (BLOOM, GPT-NeoX-Japanese, Falcon
  without multi-query), Falcon's grouped ``[Hkv, H/Hkv + 2, D]`` (new decoder architecture) and its
  multi-query ``[H + 2, D]`` (one k and one v head, replicated on every rank);
- a fused ``[3, H, D]`` (``Wqkv``, MPT; transformers' ``Conv1D`` ``c_attn``, OpenAI GPT: columns);
- the output projection (``out_proj``, ``o_proj``, ``dense``, ``c_proj``, ``attention_out``): the
  heads' input columns; its bias is left out of the partial sums (``out_bias``: added once after);
- per-kv-head vectors ``[Hkv]`` (Doge's ``A``): cut to the kv heads the rank's query heads use;
- a key gate (Doge's ``dt_proj``: ``nn.Linear`` from every kv head's values ``Hkv * D`` to one value
  per kv head): not cut — each kv head's gate reads all kv heads, so ``mixers/key_gates.py`` computes
  it per token on the shard with the full weights and gathers it.

Shape legend: ``H``/``Hkv`` query/kv heads, ``D`` head dim, ``P`` sp size, ``H_l = H/P``, ``h`` hidden.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads")
"""Head-count attribute names the modules' forwards reshape by."""
WIDTH_ATTRS = ("split_size", "embed_dim")
"""Width attributes (``H * D``) the forwards reshape or split by (shrunk with the heads)."""
OUT_NAMES = ("out_proj", "o_proj", "dense", "c_proj", "attention_out")
GATE_NAMES = ("dt_proj",)
"""Key gates: a linear from all kv heads' values to one value per kv head and token (Doge)."""
SEPARATE = (("q_proj", "k_proj", "v_proj"), ("project_q", "project_k", "project_v"))


@dataclass(frozen=True)
class HeadCut:
    """How one attention module's parameters split by head (see the module docstring)."""

    heads: int
    kv_heads: int
    head_dim: int
    layout: str
    """``separate``, ``interleaved``, ``grouped``, ``multi_query`` or ``stacked``."""
    qkv: tuple[str, ...]
    """The q/k/v projection module names (one for a fused projection)."""
    out: str
    """The output projection's module name."""
    conv1d: bool = False
    """transformers' ``Conv1D`` (weight ``[in, out]``) instead of ``nn.Linear`` (``[out, in]``)."""
    kv_params: tuple[str, ...] = ()
    """1-D parameters ``[Hkv]``, one entry per kv head (Doge's ``A``): cut by kv head."""
    kv_gate: str | None = None
    """The key gate's module name (``GATE_NAMES``), computed on the shard (``mixers/key_gates.py``)."""

    def kv_per_rank(self, sp_size: int) -> int:
        return max(self.kv_heads // sp_size, 1)


def _linear(m: object) -> bool:
    return isinstance(m, nn.Linear) or (type(m).__name__ == "Conv1D" and hasattr(m, "nf"))


def head_cut(module: nn.Module) -> HeadCut | str:
    """The module's ``HeadCut``, or why its parameters do not split by head (a sentence)."""
    cut = _projections(module)
    if isinstance(cut, str):
        return cut
    out_width = getattr(module, cut.out).weight.shape[1 if cut.conv1d else 0]
    gate = _key_gate(module, cut)
    kv_params = tuple(n for n, p in module.named_parameters(recurse=False) if p.dim() == 1 and p.shape[0] == cut.kv_heads)
    if kv_params and cut.kv_heads == cut.head_dim:
        return (f"{type(module).__name__}'s parameter {kv_params[0]} ({cut.kv_heads},) has one entry per kv head or per "
                f"head feature (kv heads = head dim = {cut.kv_heads}): which one cannot be read from its shape")  # fmt: skip
    for name, p in module.named_parameters():
        top, _, rest = name.partition(".")
        if top in (*cut.qkv, cut.out, *((gate,) if gate else ())) and rest in ("weight", "bias") or name in kv_params:
            continue
        # shared by every head (a norm over head_dim), or an output bias the module returns for its caller to add
        # once (GPT-NeoX-Japanese's dense_bias; checked at the call: ``returned_biases``)
        if p.dim() == 1 and (p.shape[0] == cut.head_dim or (name.endswith("bias") and p.shape[0] == out_width)):
            continue
        return f"{type(module).__name__}'s parameter {name} {tuple(p.shape)} is neither cut by head nor shared by all heads"
    return replace(cut, kv_params=kv_params, kv_gate=gate)


def _key_gate(module: nn.Module, cut: HeadCut) -> str | None:
    """The name of a ``GATE_NAMES`` linear from the values of all kv heads to one value per kv head."""
    for name in GATE_NAMES:
        gate = getattr(module, name, None)
        if cut.layout == "separate" and isinstance(gate, nn.Linear) and gate.weight.shape == (cut.kv_heads, cut.kv_heads * cut.head_dim):
            return name
    return None


def _projections(module: nn.Module) -> HeadCut | str:
    what = type(module).__name__
    heads = next((getattr(module, a) for a in HEAD_ATTRS if isinstance(getattr(module, a, None), int)),
                 getattr(getattr(module, "config", None), "num_attention_heads", None))  # fmt: skip
    out = next((n for n in OUT_NAMES if _linear(getattr(module, n, None))), None)
    if heads is None or out is None:
        return f"{what} has no head count ({'/'.join(HEAD_ATTRS)}) or no output projection ({'/'.join(OUT_NAMES)})"
    conv = type(getattr(module, out)).__name__ == "Conv1D"
    width = getattr(module, out).weight.shape[0 if conv else 1]  # the output projection's input: H * D
    if width % heads:
        return f"{what}'s output projection takes {width} features, not a whole number of its {heads} heads"
    d = width // heads
    for names in SEPARATE:
        if all(_linear(getattr(module, n, None)) for n in names):
            rows = [getattr(module, n).weight.shape[0] for n in names]
            if rows[0] != width or rows[1] != rows[2] or rows[1] % d:
                return f"{what}'s {'/'.join(names)} give {rows} features, not whole heads of {d}"
            return HeadCut(heads, rows[1] // d, d, "separate", names, out)
    for name in ("query_key_value", "Wqkv", "c_attn"):
        fused = getattr(module, name, None)
        if not _linear(fused):
            continue
        n = fused.weight.shape[1 if type(fused).__name__ == "Conv1D" else 0]
        if getattr(module, "new_decoder_architecture", False):  # Falcon: [Hkv, H/Hkv + 2, D]
            kv = getattr(module, "num_kv_heads", 0)
            if kv and heads % kv == 0 and n == (heads + 2 * kv) * d:
                return HeadCut(heads, kv, d, "grouped", (name,), out)
        elif getattr(module, "multi_query", False) and n == (heads + 2) * d:  # Falcon: [H + 2, D]
            return HeadCut(heads, 1, d, "multi_query", (name,), out)
        elif n == 3 * width:
            layout = "interleaved" if name == "query_key_value" else "stacked"
            return HeadCut(heads, heads, d, layout, (name,), out, conv1d=type(fused).__name__ == "Conv1D")
        return f"{what}'s fused {name} gives {n} features, a layout of {heads} heads of {d} it does not know"
    return f"{what} has no q/k/v projections it knows (q_proj/k_proj/v_proj, query_key_value, Wqkv, c_attn)"


def returned_biases(module: nn.Module, cut: HeadCut) -> list[str]:
    """The 1-D output-width biases outside the projections, which the module must return (not add)."""
    return [n for n, p in module.named_parameters() if "." not in n and n.endswith("bias") and p.dim() == 1
            and n not in (*cut.qkv, cut.out)]  # fmt: skip


def sp_problem(cut: HeadCut | Any, sp_size: int) -> str | None:
    """Why ``sp_size`` ranks cannot each take a whole share of the heads (``None``: they can); ``cut``: any
    cut with ``heads`` and ``kv_heads`` (``pair_bias_cuts.PairCut`` too)."""
    if cut.heads % sp_size:
        return f"its {cut.heads} attention heads do not divide by sp_size {sp_size}"
    if cut.kv_heads % sp_size and sp_size % cut.kv_heads:
        return f"its {cut.kv_heads} kv heads neither divide by sp_size {sp_size} nor divide it"
    return None


def _rows(heads: list[int], d: int, start: int = 0, stride: int | None = None, block: int = 1) -> list[int]:
    """Rows of ``heads`` (``d`` each) at ``start``; head ``i``'s block at ``start + i*stride``."""
    stride = d * block if stride is None else stride
    return [start + i * stride + j for i in heads for j in range(d * block)]


def kv_heads_of(cut: HeadCut, sp_size: int, sp_rank: int) -> list[int]:
    """The kv heads rank ``sp_rank``'s query heads ``[r*H_l, (r+1)*H_l)`` use."""
    h_l, ratio = cut.heads // sp_size, cut.heads // cut.kv_heads
    return sorted({i // ratio for i in range(sp_rank * h_l, (sp_rank + 1) * h_l)})


def cut_indices(cut: HeadCut, sp_size: int, sp_rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qkv rows, out columns)``: the fused or per-projection indices of rank ``sp_rank``'s heads.

    Separate projections: the q rows then the kv rows (the caller splits them by the two sizes)."""
    h_l, d = cut.heads // sp_size, cut.head_dim
    q = list(range(sp_rank * h_l, (sp_rank + 1) * h_l))
    ratio = cut.heads // cut.kv_heads
    kv = kv_heads_of(cut, sp_size, sp_rank)
    width = cut.heads * d
    if cut.layout == "separate":
        rows = _rows(q, d) + _rows(kv, d)
    elif cut.layout == "interleaved":  # [H, 3, D]: each head's q, k, v rows together
        rows = _rows(q, d, block=3)
    elif cut.layout == "stacked":  # [3, H, D]
        rows = _rows(q, d) + _rows(q, d, width) + _rows(q, d, 2 * width)
    elif cut.layout == "multi_query":  # [H + 2, D]: the shared k and v heads last
        rows = _rows(q, d) + list(range(width, width + 2 * d))
    else:  # grouped [Hkv, ratio + 2, D]: per kv group its query heads of this rank, then k and v
        rows = []
        for g in kv:
            base = g * (ratio + 2) * d
            rows += _rows([i - g * ratio for i in q if i // ratio == g], d, base) + list(range(base + ratio * d, base + (ratio + 2) * d))
    return torch.tensor(rows, device=device), torch.tensor(_rows(q, d), device=device)


def local_params(module: nn.Module, cut: HeadCut, sp_size: int, sp_rank: int) -> dict[str, torch.Tensor]:
    """The module's projection parameters cut to rank ``sp_rank``'s heads (differentiable
    ``index_select``s of the real ones: autograd puts each gradient at its rows), and the output
    projection's bias as zeros (the caller adds it once, after the partial sums are reduced)."""
    rows, cols = cut_indices(cut, sp_size, sp_rank, next(module.parameters()).device)
    out: dict[str, torch.Tensor] = {}
    dim_out = 1 if cut.conv1d else 0  # the dim of a projection's output features
    if cut.layout == "separate":
        n_q = cut.heads // sp_size * cut.head_dim
        parts = {cut.qkv[0]: rows[:n_q], cut.qkv[1]: rows[n_q:], cut.qkv[2]: rows[n_q:]}
    else:
        parts = {cut.qkv[0]: rows}
    for name, index in parts.items():
        proj = getattr(module, name)
        out[f"{name}.weight"] = proj.weight.index_select(dim_out, index)
        if proj.bias is not None:
            out[f"{name}.bias"] = proj.bias.index_select(0, index)
    proj = getattr(module, cut.out)
    out[f"{cut.out}.weight"] = proj.weight.index_select(1 - dim_out, cols)
    if proj.bias is not None:
        out[f"{cut.out}.bias"] = torch.zeros_like(proj.bias)
    kv = torch.tensor(kv_heads_of(cut, sp_size, sp_rank), device=rows.device)
    for name in cut.kv_params:  # [Hkv] -> [Hkv_l]
        out[name] = getattr(module, name).index_select(0, kv)
    return out


def local_attrs(module: nn.Module, cut: HeadCut, sp_size: int) -> dict[tuple[nn.Module, str], int]:
    """``{(module, attribute): value}``: the head-count and width attributes the module's forward reads
    at ``H_l`` heads, and a ``Conv1D`` projection's output width ``nf`` (its forward reshapes by it)."""
    out = {(module, a): getattr(module, a) // sp_size for a in HEAD_ATTRS + WIDTH_ATTRS
           if isinstance(getattr(module, a, None), int)}  # fmt: skip
    kv = getattr(module, "num_kv_heads", None)
    if isinstance(kv, int) and kv > 1:  # Falcon's kv heads (one shared head stays one)
        out[(module, "num_kv_heads")] = cut.kv_per_rank(sp_size)
    if isinstance(getattr(module, "num_key_value_groups", None), int):  # query heads per kv head, here
        out[(module, "num_key_value_groups")] = cut.heads // sp_size // cut.kv_per_rank(sp_size)
    if cut.conv1d:  # [3, H, D] -> [3, H_l, D] output features
        proj = getattr(module, cut.qkv[0])
        out[(proj, "nf")] = proj.nf // sp_size
    return out
