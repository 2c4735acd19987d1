"""Sequence parallelism for Mamba-1 mixers: Mamba's ``MambaMixer``, Falcon-Mamba's
``FalconMambaMixer``, Jamba's ``JambaMambaMixer`` and Zamba's multi-head ``ZambaMambaMixer``.

The mixer (transformers' unfused path): ``x, z = in_proj(h)`` (``I`` channels each); a depthwise
causal conv over the ``x`` channels with an activation; ``dt_r, B, C = x_proj(x)`` — a projection of
*all* ``I`` channels to the rank-``R`` time step and the ``N``-wide ``B``, ``C`` shared by every
channel (Falcon-Mamba and Jamba normalize the three); ``dt = dt_proj.weight @ dt_r`` (``I``); the
selective scan, one ``N``-state recurrence per channel with ``A [I, N]``, ``D``, ``dt``'s bias and
the gate ``z``; ``out_proj``. The scan is the only part that mixes tokens beyond ``K-1`` positions
and it is per channel; ``x_proj`` mixes channels, so the cut is around the scan, not before the conv:

1. the model's own forward runs on the local tokens (``in_proj``, ``x_proj``, the norms, ``dt_proj``,
   ``out_proj``: every channel, full parameters, so no partial sums to reduce);
2. its ``causal_conv1d_fn`` gets the ``K-1`` positions before the shard from the previous rank
   (``halo``) and restarts at every global document start (``linear_attn._Sharded.conv``);
3. its ``mamba_selective_scan(x, dt, A, B, C, D, z, delta_bias)`` is dispatched here: ONE packed
   all-to-all turns ``x``, ``dt``, ``z [B, I, S_l]`` into channel shards ``[B, I_l, S]`` and gives
   every rank the whole ``B``, ``C [B, N, S]`` (replicated ``P`` times before the exchange); the
   model's scan runs over the full sequence for the rank's channels with ``A``, ``D`` and the bias
   sliced to them (slices of the model's own tensors: autograd returns full-parameter gradients),
   once per packed document; one all-to-all returns ``[B, I, S_l]``;
4. a fused whole-mixer kernel (``mamba_inner_fn``, with ``mamba-ssm`` in training) would run the
   local shard alone: inside a sharded forward it answers "no kernel" (``None``), so the model
   takes the unfused path above.

Cost per local token and layer (elements handed to the all-to-alls, ``(P-1)/P`` of them leave the
rank): ``3 I + 2 N P`` in, ``I`` out (in the scan's output dtype: fp32 on the torch path), plus a
halo of ``(K-1) I`` per row. Mamba-2 exchanges ``I + 2 G N + H`` in and ``I`` out: Mamba-1 also
sends ``dt`` per channel (its ``dt_proj`` runs before the scan, on the local tokens) and the gate
``z`` (the scan applies it). Memory: the scan's ``[B, I_l, S, N]`` terms fall as ``1/P``.

Matched by structure (a depthwise ``conv1d`` of ``I`` channels, ``x_proj`` from ``I`` to ``R + 2N``,
``dt_proj`` from ``R`` to ``I``, ``A_log [I, N]``, and the modeling file's ``causal_conv1d_fn`` and
``mamba_selective_scan``), never by model name.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``I`` channels (intermediate
size), ``I_l = I/P``, ``N`` state size, ``R`` time-step rank, ``K`` conv kernel, ``P`` sp size.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ulysses_sp.mixers._kernels import model_function
from ulysses_sp.mixers.documents import per_document, segments
from ulysses_sp.mixers.linear_attn import LinearAttentionHandler, _Sharded, wrap_linear_attention
from ulysses_sp.parallel.comm import heads_to_seq, seq_to_heads_packed

SCAN_FN = "mamba_selective_scan"
FUSED_FN = "mamba_inner_fn"
ATTRS = ("conv1d", "in_proj", "x_proj", "dt_proj", "out_proj", "A_log", "D", "intermediate_size",
         "ssm_state_size", "time_step_rank")  # fmt: skip


def usable_sizes(channels: int, up_to: int = 64) -> str:
    """The sp sizes in ``2..up_to`` that divide ``channels``, as a message fragment."""
    sizes = [str(p) for p in range(2, up_to + 1) if channels % p == 0]
    return ", ".join(sizes) if sizes else "none above 1"


class _SelectiveScan(_Sharded):
    """``_Sharded`` with Mamba-1's scan: channel shards for ``x, dt, z``, the whole ``B, C``."""

    def scan(self, original: Callable[..., Any], signature: inspect.Signature, args: tuple, kwargs: dict):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("return_last_state"):
            raise ValueError("a returned final state (generation with a cache) is not sequence-parallel")
        arg = bound.arguments
        x, dt, z = arg["hidden_states"], arg["dt"], arg.get("z")  # [B, I, S_l] each
        p, i_l = self.sp_size, x.shape[1] // self.sp_size
        local = slice(self.sp_rank * i_l, (self.sp_rank + 1) * i_l)  # this rank's channels
        per_channel = {n: arg[n][local] for n in ("A", "D", "delta_bias") if arg.get(n) is not None}
        # [B, N, S_l] -> [B, P, N, S_l]: every rank gets the whole B and C
        bc = [t.unsqueeze(1).expand(-1, p, -1, -1) for t in (arg["B"], arg["C"])]
        seqs = [x, dt] + ([z] if z is not None else [])
        # one all-to-all: [B, I, S_l] -> [B, I_l, S] (x, dt, z), [B, P, N, S_l] -> [B, 1, N, S] (B, C)
        full = seq_to_heads_packed((*seqs, *bc), self.group, seq_dim=-1, head_dim=1)
        parts = [*full[: len(seqs)], *(t.squeeze(1) for t in full[len(seqs) :])]  # B, C: [B, N, S]
        names = ["hidden_states", "dt", *(["z"] if z is not None else []), "B", "C"]

        def run(*xs: torch.Tensor) -> torch.Tensor:
            bound.arguments.update(zip(names, xs), **per_channel)
            return original(*bound.args, **bound.kwargs)  # [B, I_l, S_doc]

        spans = segments(self.layout, x.shape[0], parts[0].shape[-1])
        out = per_document(run, parts, spans, seq_dim=2)  # [B, I_l, S], per packed document
        return heads_to_seq(out, self.group, head_dim=1, seq_dim=2)  # -> [B, I, S_l]

    def fused(self, original: Callable[..., Any], signature: inspect.Signature, args: tuple, kwargs: dict):
        """A fused whole-mixer kernel would scan the local shard alone: "no kernel", the unfused path."""
        return None


class Mamba1Handler(LinearAttentionHandler):
    """Shards Mamba-1 mixers over the SP group by channels (see the module docstring)."""

    name = "mamba1"
    label = "Mamba-1"
    attrs = ATTRS
    scan_fn = SCAN_FN

    def matches(self, module: nn.Module) -> bool:
        if not super().matches(module):
            return False
        i, n, r = module.intermediate_size, module.ssm_state_size, module.time_step_rank
        conv, x_proj, dt_proj = module.conv1d, module.x_proj, module.dt_proj
        return (
            all(isinstance(v, int) for v in (i, n, r))
            and conv.groups == conv.in_channels == conv.out_channels == i
            and isinstance(x_proj, nn.Linear)
            and (x_proj.in_features, x_proj.out_features) == (i, r + 2 * n)
            and isinstance(dt_proj, nn.Linear)
            and (dt_proj.in_features, dt_proj.out_features) == (r, i)
            and isinstance(module.A_log, nn.Parameter)
            and tuple(module.A_log.shape) == (i, n)
        )

    def check(self, module: nn.Module, sp_size: int) -> None:
        i = module.intermediate_size
        if i % sp_size:
            raise ValueError(
                f"{type(module).__name__} (Mamba-1, {i} channels): the channels are not divisible by "
                f"sp_size {sp_size} (its selective scan is sharded by channel); sp sizes that divide "
                f"them: {usable_sizes(i)}"
            )

    def wrap(self, module: nn.Module, mesh: Any) -> Callable[[], None]:
        self.check(module, mesh.sp_size)
        fused = (FUSED_FN,) if model_function(module, FUSED_FN) is not None else ()
        return wrap_linear_attention(module, mesh, self.positions, conv_fn=self.conv_fn, scan_fns=(self.scan_fn,),
                                     what=self.what(module), state=_SelectiveScan, fused_fns=fused)  # fmt: skip


class MultiHeadMamba1Handler(Mamba1Handler):
    """Zamba's Mamba-1 with ``H`` independent heads of ``I_h = I/H`` channels: per-head ``x_proj_weight
    [H, R+2N, I_h]`` and ``dt_proj_weight [H, I_h, R]`` (on the local tokens, position-wise), and the model's
    scan called once per head (``x, dt, z [B, I_h, S_l]``, that head's ``B, C``). Each call is cut as above:
    its ``I_h`` channels over the ranks, its ``B, C`` to every rank; so ``I_h`` must divide by the sp size."""

    name = "mamba1_heads"
    label = "Mamba-1, per-head projections"
    attrs = ("conv1d", "in_proj", "x_proj_weight", "dt_proj_weight", "out_proj", "A_log", "D", "intermediate_size",
             "ssm_state_size", "time_step_rank", "n_mamba_heads", "mamba_head_dim")  # fmt: skip

    def matches(self, module: nn.Module) -> bool:
        if not LinearAttentionHandler.matches(self, module):
            return False
        i, n, r, h, d = (module.intermediate_size, module.ssm_state_size, module.time_step_rank, module.n_mamba_heads,
                         module.mamba_head_dim)  # fmt: skip
        conv = module.conv1d
        return (
            all(isinstance(v, int) for v in (i, n, r, h, d)) and h * d == i
            and conv.groups == conv.in_channels == conv.out_channels == i
            and tuple(module.x_proj_weight.shape) == (h, r + 2 * n, d)
            and tuple(module.dt_proj_weight.shape) == (h, d, r)
            and tuple(module.A_log.shape) == (h, d, n)
        )  # fmt: skip

    def check(self, module: nn.Module, sp_size: int) -> None:
        h, d = module.n_mamba_heads, module.mamba_head_dim
        if d % sp_size:
            raise ValueError(
                f"{type(module).__name__} (Mamba-1, {h} heads of {d} channels): a head's channels are not divisible "
                f"by sp_size {sp_size} (each head's scan is sharded by channel); sp sizes that divide them: "
                f"{usable_sizes(d)}"
            )


HANDLER = Mamba1Handler()
"""An unbound instance for ``claimed_by`` (the closed-world guard); ``apply_mixers`` binds its own."""
HEADS_HANDLER = MultiHeadMamba1Handler()
"""The same for Zamba's multi-head Mamba-1."""
