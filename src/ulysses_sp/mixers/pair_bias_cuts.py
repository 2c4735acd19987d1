"""Which slices of a pair-bias attention module's parameters belong to a set of its heads.

``mixers/pair_bias.py`` runs an attention module that builds its own relative-position bias over token
pairs (Inkling's ``InklingAttention``, Inkling-2's sliding and full attention) on one rank's heads. Its
parameters sit in nested projections (a query projection with a per-head scale, key/value projections
with short convolutions inside, a gated output projection, a sink projection, the bias's own per-head
projection), so the cut is read from structure, per parameter (never from the model's name):

- the **group**: parameters under a child named ``k_*``/``v_*`` (keys, values and their convolutions)
  belong to the kv heads, every other one to the query heads;
- the **dim**: the output projection's weight (``o_proj`` when a ``Linear``; else the ``Linear`` its
  forward returns the call of) by its input columns; a 2-D parameter that is not a layer's weight and
  leads with its owner's ``conv_kernel_size`` (a dynamic convolution's ``static_weight [K, C]``) by its
  last dim; every other one (``Linear`` rows, a depthwise ``Conv1d``'s channels, a per-head scale
  ``[H, d]``) by its first dim, which must hold a whole number of rows per head of its group;
- **shared** by every head: the bias's distance profiles (the child's ``proj [d_rel, rel_extent]``) and
  1-D per-feature weights of size ``D`` or ``d_rel`` (norms over a head's features).

Head-count attributes (``num_heads``, ``num_key_value_heads``, ``num_key_value_groups`` on the module;
``num_heads`` of a child, by its group) shrink to the rank's heads while its forward runs.

Shape legend: ``H``/``Hkv`` query/kv heads, ``D`` head dim, ``P`` sp size, ``H_l = H/P``, ``h`` hidden.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

import torch
from torch import nn

OUT_NAMES = ("o_proj", "out_proj", "dense")


@dataclass(frozen=True)
class PairCut:
    """How one pair-bias attention module's parameters split by head (see the module docstring)."""

    heads: int
    kv_heads: int
    head_dim: int
    out_weight: str
    """The output projection's weight (its input columns are cut; its bias is added once, after)."""
    params: tuple[tuple[str, int, bool, int], ...]
    """``(name, dim, is_kv, rows per head)`` for every parameter cut by head."""
    attrs: tuple[tuple[str, str, bool], ...]
    """``(module path, attribute, is_kv)`` head counts to shrink (path ``""``: the module itself)."""

    def kv_heads_of(self, sp_size: int, sp_rank: int) -> list[int]:
        """The kv heads rank ``sp_rank``'s query heads ``[r*H_l, (r+1)*H_l)`` use."""
        h_l, ratio = self.heads // sp_size, self.heads // self.kv_heads
        return sorted({i // ratio for i in range(sp_rank * h_l, (sp_rank + 1) * h_l)})


def bias_child(module: nn.Module) -> nn.Module | None:
    """The child that turns per-token relative states into a pair bias: an int ``rel_extent`` and a
    parameter ``proj [d_rel, rel_extent]`` (Inkling's ``InklingRelativeLogits``, Inkling-2's
    ``RelativePositionBias``), or ``None``."""
    for child in module.children():
        extent, proj = getattr(child, "rel_extent", None), getattr(child, "proj", None)
        if isinstance(extent, int) and isinstance(proj, nn.Parameter) and proj.dim() == 2 and proj.shape[1] == extent:
            return child
    return None


def _returned_linear(owner: nn.Module) -> str | None:
    """The attribute name of the ``Linear`` child whose call ``owner.forward`` returns (``return self.X(...)``)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(type(owner).forward))))
    except (OSError, TypeError, SyntaxError):
        return None
    found = {n.value.func.attr for n in ast.walk(tree) if isinstance(n, ast.Return) and isinstance(n.value, ast.Call)
             and isinstance(n.value.func, ast.Attribute) and isinstance(getattr(owner, n.value.func.attr, None), nn.Linear)}  # fmt: skip
    return found.pop() if len(found) == 1 else None


def pair_cut(module: nn.Module) -> PairCut | str:
    """The module's ``PairCut``, or why its parameters do not split by head (a sentence)."""
    what = type(module).__name__
    heads, kv, d = (getattr(module, a, None) for a in ("num_heads", "num_key_value_heads", "head_dim"))
    child = bias_child(module)
    if not all(isinstance(v, int) and v > 0 for v in (heads, kv, d)) or child is None or heads % kv:
        return f"{what} has no num_heads/num_key_value_heads/head_dim or no pair-bias child (rel_extent, proj) it knows"
    d_rel = child.proj.shape[0]
    out_name = next((n for n in OUT_NAMES if isinstance(getattr(module, n, None), nn.Module)), None)
    if out_name is None:
        return f"{what} has no output projection ({'/'.join(OUT_NAMES)})"
    out = getattr(module, out_name)
    inner = "" if isinstance(out, nn.Linear) else _returned_linear(out)
    if inner is None:
        return f"{what}'s output projection {out_name} returns no single Linear's call it can cut by its input columns"
    out_weight = f"{out_name}.{inner}.weight" if inner else f"{out_name}.weight"
    cut, bias_path = [], next(n for n, m in module.named_children() if m is child)
    for name, p in module.named_parameters():
        owner_path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_path)
        is_kv = name.split(".")[0].startswith(("k_", "v_"))
        n = kv if is_kv else heads
        if name == f"{bias_path}.proj" or name == out_weight.replace("weight", "bias"):
            continue  # shared distance profiles; the output bias is added once, after the partial sums
        if name == out_weight:
            if p.shape[1] != heads * d:
                return f"{what}'s output projection takes {p.shape[1]} features, not {heads} heads of {d}"
            cut.append((name, 1, False, d))
            continue
        layer = isinstance(owner, (nn.Linear, nn.Conv1d))
        if p.dim() == 1 and not layer:
            if p.shape[0] in (d, d_rel):
                continue  # a norm over a head's features: the same for every head
            return f"{what}'s parameter {name} {tuple(p.shape)} is neither cut by head nor shared by all heads"
        k = getattr(owner, "conv_kernel_size", None)
        dim = 1 if p.dim() == 2 and not layer and isinstance(k, int) and p.shape[0] == k else 0
        if p.shape[dim] % n:
            return f"{what}'s parameter {name} {tuple(p.shape)} does not hold whole rows for each of its {n} heads"
        cut.append((name, dim, is_kv, p.shape[dim] // n))
    attrs = [("", a, a == "num_key_value_heads") for a in ("num_heads", "num_key_value_heads")]
    for path, m in module.named_modules():
        if path and isinstance(getattr(m, "num_heads", None), int):
            is_kv = path.split(".")[0].startswith(("k_", "v_"))
            if m.num_heads != (kv if is_kv else heads):
                return f"{what}'s {path}.num_heads ({m.num_heads}) is neither its query nor its kv head count"
            attrs.append((path, "num_heads", is_kv))
    return PairCut(heads, kv, d, out_weight, tuple(cut), tuple(attrs))


def local_params(module: nn.Module, cut: PairCut, sp_size: int, sp_rank: int) -> dict[str, torch.Tensor]:
    """Every cut parameter at rank ``sp_rank``'s heads (differentiable ``index_select``s of the real ones:
    autograd puts each gradient at its rows), and the output projection's bias as zeros."""
    h_l = cut.heads // sp_size
    device = next(module.parameters()).device
    groups = {False: list(range(sp_rank * h_l, (sp_rank + 1) * h_l)), True: cut.kv_heads_of(sp_size, sp_rank)}
    params = dict(module.named_parameters())
    out = {}
    for name, dim, is_kv, unit in cut.params:
        index = torch.tensor([i * unit + j for i in groups[is_kv] for j in range(unit)], device=device)
        out[name] = params[name].index_select(dim, index)
    bias = cut.out_weight[: -len("weight")] + "bias"
    if params.get(bias) is not None:
        out[bias] = torch.zeros_like(params[bias])
    return out


def local_attrs(module: nn.Module, cut: PairCut, sp_size: int) -> dict[tuple[nn.Module, str], int]:
    """``{(module, attribute): value}``: the head counts its forward reads, at the rank's share."""
    h_l, kv_l = cut.heads // sp_size, max(cut.kv_heads // sp_size, 1)
    out = {(module.get_submodule(path), a): kv_l if is_kv else h_l for path, a, is_kv in cut.attrs}
    if isinstance(getattr(module, "num_key_value_groups", None), int):
        out[(module, "num_key_value_groups")] = h_l // kv_l
    return out
