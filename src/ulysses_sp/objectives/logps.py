"""Per-token log-probabilities of a sequence's own tokens under sequence parallelism: ``sequence_logps``.

Every preference and RL objective (DPO, KTO, ORPO, reward modelling, GRPO, RLOO, PPO) is built from
``log p(token_t | tokens_<t)`` of the sequence's own next tokens, summed per sequence or used per
token. Under SP each rank holds ``S_l`` tokens of every sequence; labels are shifted over the *full*
sequence before sharding (the data adapter's ``shift_labels``), so each rank's per-token values are
already the right ones for its positions. What differs from the no-SP computation is only how the
per-sequence quantities are assembled:

- **per-sequence sums** (``SequenceLogps.sums``, ``counts``; per document with ``position_ids``):
  this rank's partial sums, all-reduced over the SP group — the value is the whole sequence's on
  every rank, the gradient this rank's share (``local + stopgrad(global - local)``). A loss computed
  from them identically on every rank, back-propagated on every rank, and the gradients summed over
  the SP group (what the engine and the Trainer's FSDP/DDP do), is then exact — not ``sp`` times too
  large, which a differentiable all-reduce would give;
- **per-token values over the whole sequence** (``SequenceLogps.gather``): an all-gather along the
  sequence whose backward hands each rank its own slice of the gradient (not a reduce-scatter, for
  the same reason), for objectives that need every token on one rank (a token-level GRPO loss
  normalised over the batch, an importance ratio against old log-probs).

The logits ``[B, S_l, V]`` are never kept: like ``tiled_causal_lm_loss`` the output projection runs
over tiles of the sequence inside ``sequence_tiled_compute`` (forward under ``no_grad``, recomputed
per tile in backward), in fp32 after an optional temperature, with an optional per-token entropy.

Shape legend: ``B`` batch, ``S_l`` this rank's tokens, ``S = S_l * P`` the sequence, ``h`` hidden,
``V`` vocabulary, ``D`` documents per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ulysses_sp.memory._tiled import auto_num_shards, check_num_shards
from ulysses_sp.memory.tiling import sequence_tiled_compute
from ulysses_sp.parallel.comm import all_gather_seq, all_reduce_max, all_reduce_sum
from ulysses_sp.parallel.loss import IGNORE_INDEX

__all__ = ["SequenceLogps", "gather_sequence", "model_logps", "sequence_logps", "sum_over_sequence"]


class _GatherSequence(torch.autograd.Function):
    """``[B, S_l, ...] -> [B, S, ...]`` in rank order; backward: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.rank, ctx.s_l = dist.get_rank(group), x.shape[1]
        return all_gather_seq(x, group, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.narrow(1, ctx.rank * ctx.s_l, ctx.s_l), None


class _GatherSequenceSummed(_GatherSequence):
    """``[B, S_l, ...] -> [B, S, ...]`` in rank order; backward: this rank's slice of the gradient
    summed over the group (an all-reduce, then the slice: a reduce-scatter gloo also runs)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _GatherSequence.forward(ctx, x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = all_reduce_sum(grad.contiguous(), ctx.group, timed="sp")  # [B, S, ...] summed over the group
        return total.narrow(1, ctx.rank * ctx.s_l, ctx.s_l), None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None, *, sum_grads: bool = False) -> torch.Tensor:
    """Every rank's ``x [B, S_l, ...]`` concatenated along dim 1 in SP-rank order: ``[B, S, ...]``.

    Differentiable for a loss that every rank of the group computes alike from the result: the
    backward returns this rank's slice of the gradient, so the gradients summed over the SP group are
    the loss's exact gradient. Shards must have equal length (the SP data adapter pads to a multiple
    of ``P``). ``group=None`` or a 1-rank group: ``x`` itself.

    ``sum_grads=True``: for ranks whose losses differ (each reads its own rows of the result, as TRL's
    RL trainers under SP do, ``integrations._rl``): the backward sums the ranks' gradients before
    taking this rank's slice, so the gradients summed over the group are those of the sum of the
    ranks' losses."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return (_GatherSequenceSummed if sum_grads else _GatherSequence).apply(x, group)


def sum_over_sequence(local: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``local`` (a partial sum over this rank's tokens, any shape) summed over the SP group.

    The value is the sum over the whole sequence on every rank; the gradient flows into ``local``
    alone (``local + stopgrad(global - local)``): a loss every rank computes alike from the result has,
    summed over the SP group, its exact gradient."""
    if group is None or dist.get_world_size(group) == 1:
        return local
    total = all_reduce_sum(local.detach(), group, timed="sp")
    return local + (total - local.detach())


@dataclass
class SequenceLogps:
    """What ``sequence_logps`` returns for this rank's shard of ``B`` sequences."""

    token_logps: torch.Tensor
    """``[B, S_l]`` fp32 ``log p(label_t | tokens_<t)`` of this shard's labels; 0 where the label is ignored."""
    mask: torch.Tensor
    """``[B, S_l]`` bool: the label is scored (not ``ignore_index``)."""
    entropy: torch.Tensor | None
    """``[B, S_l]`` fp32 entropy of the next-token distribution (0 where ignored), when asked for."""
    sums: torch.Tensor
    """``[B]`` (``[B, D]`` per document) the sum of ``token_logps`` over the whole sequence (document)."""
    counts: torch.Tensor
    """``[B]`` (``[B, D]``) the number of scored tokens of the whole sequence (document); no gradient."""
    group: dist.ProcessGroup | None
    """The SP group the shard belongs to (``None``: no SP)."""

    def gather(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` (default ``token_logps``; any ``[B, S_l, ...]`` per-token tensor) over the whole
        sequence, ``[B, S, ...]``, differentiable (see ``gather_sequence``)."""
        return gather_sequence(self.token_logps if x is None else x, self.group)


def _document_index(position_ids: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[torch.Tensor, int]:
    """``([B, S_l] global document index within each row, D)`` from positions restarting at 0.

    A shard that begins inside a document continues the previous shard's count: the starts of the
    earlier shards are counted from the gathered ``[B, P]`` per-shard start counts (one small
    all-gather), and ``D`` (the most documents of any row in the group) is one all-reduce max."""
    starts = (position_ids == 0).to(torch.long)  # [B, S_l]
    local = starts.cumsum(dim=1)  # [B, S_l] starts seen so far in this shard
    per_shard = local[:, -1:]  # [B, 1]
    if group is not None and dist.get_world_size(group) > 1:
        every = all_gather_seq(per_shard, group, dim=1)  # [B, P]
        before = every[:, : dist.get_rank(group)].sum(dim=1, keepdim=True)
        most = all_reduce_max(every.sum(dim=1).max().reshape(1).to(torch.float64), group)
    else:
        before, most = torch.zeros_like(per_shard), per_shard.max().reshape(1).to(torch.float64)
    index = (local + before - 1).clamp(min=0)  # tokens before the first start (none in practice): doc 0
    return index, max(int(most.item()), 1)  # one host read per call: the output's size


def sequence_logps(
    hidden_states: torch.Tensor,
    lm_head: nn.Module | None,
    shift_labels: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    num_shards: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> SequenceLogps:
    """Per-token log-probabilities of this shard's labels, and per-sequence sums over the whole sequence.

    Args:
        hidden_states: ``[B, S_l, h]`` the final (normed) hidden states of this rank's shard — or, with
            ``lm_head=None``, the logits ``[B, S_l, V]`` themselves (then no tiling).
        lm_head: the output projection (``model.get_output_embeddings()``), run per tile; ``None``:
            ``hidden_states`` are logits.
        shift_labels: ``[B, S_l]`` labels shifted over the full sequence before sharding
            (``ignore_index`` where a token is not scored: prompt, padding, a document's last token).
        group: the SP group (``None`` without SP).
        position_ids: ``[B, S_l]`` this shard's positions; given, ``sums``/``counts`` are per document
            (positions restart at 0 at each document start), ``[B, D]``.
        temperature: the logits are divided by it before the softmax (GRPO's sampling temperature).
        entropy: also return the per-token entropy.
        num_shards: tiles of the sequence (``None``: ``auto_num_shards``).
        ignore_index: the label value that is not scored.

    Returns:
        ``SequenceLogps``; every tensor is differentiable except ``mask`` and ``counts``. With P = 1 the
        same numbers as the plain computation from full logits.
    """
    if hidden_states.dim() != 3 or hidden_states.shape[:2] != shift_labels.shape:
        raise ValueError(
            f"hidden_states {tuple(hidden_states.shape)} and shift_labels {tuple(shift_labels.shape)} disagree: "
            "expected [B, S_l, h] (or logits [B, S_l, V] with lm_head=None) and labels [B, S_l]"
        )
    if position_ids is not None and tuple(position_ids.shape) != tuple(shift_labels.shape):
        raise ValueError(f"position_ids {tuple(position_ids.shape)} must match shift_labels {tuple(shift_labels.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature!r}")
    labels = shift_labels.to(hidden_states.device)
    head = (lambda t: t) if lm_head is None else lm_head.forward

    def tile(h_tile: torch.Tensor, label_tile: torch.Tensor) -> torch.Tensor:
        # [B, T, h] -> [B, T, V] fp32 (one tile of logits) -> [B, T, 1 or 2] (log-prob, entropy)
        logp = torch.log_softmax(head(h_tile).float() / temperature, dim=-1)
        valid = label_tile != ignore_index
        tok = logp.gather(-1, label_tile.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
        if not entropy:
            return tok.unsqueeze(-1)
        ent = -(logp.exp() * logp).sum(dim=-1) * valid
        return torch.stack([tok, ent], dim=-1)

    s_l = hidden_states.shape[1]
    if lm_head is None:
        out = tile(hidden_states, labels)
    else:
        n = auto_num_shards(s_l, hidden_states.shape[2], hidden_states.shape[0]) if num_shards is None else num_shards
        check_num_shards(n, s_l, what="sequence_logps num_shards")
        out = sequence_tiled_compute(tile, hidden_states, n, params=list(lm_head.parameters()), aux=(labels,),
                                     preserve_rng_state=False)  # fmt: skip
    mask = labels != ignore_index
    token_logps = out[..., 0]
    if position_ids is None:
        local_sums, local_counts = token_logps.sum(dim=1), mask.sum(dim=1).to(torch.float32)
    else:
        index, d = _document_index(position_ids.to(labels.device), group)
        local_sums = token_logps.new_zeros(labels.shape[0], d).scatter_add(1, index, token_logps)
        local_counts = torch.zeros(labels.shape[0], d, device=labels.device).scatter_add(1, index, mask.float())
    return SequenceLogps(
        token_logps=token_logps, mask=mask, entropy=out[..., 1] if entropy else None,
        sums=sum_over_sequence(local_sums, group), counts=all_reduce_sum(local_counts, group) if group else local_counts,
        group=group,
    )  # fmt: skip


def model_logps(
    model: nn.Module,
    batch: dict[str, Any],
    shift_labels: torch.Tensor,
    group: dist.ProcessGroup | None,
    **options: Any,
) -> SequenceLogps:
    """``sequence_logps`` of ``model`` on this rank's shard of ``batch``, without the logits.

    Calls ``model(**batch)`` (its own ``__call__``: FSDP's and the SP attention's hooks run as usual)
    and intercepts its output embeddings: their input, the final hidden states ``[B, S_l, h]``, goes
    to ``sequence_logps`` with ``options`` (``position_ids`` for per-document sums — e.g. the batch's
    own; ``temperature``, ``entropy``, ``num_shards``, ``ignore_index``), and the model itself sees a
    ``[B, 0, h]`` slice. ``batch`` holds the model's keyword inputs for this shard; ``labels`` /
    ``shift_labels`` entries are dropped. Models that scale or soft-cap their logits are refused.
    """
    inner = model
    while not hasattr(inner, "get_output_embeddings") and isinstance(getattr(inner, "module", None), nn.Module):
        inner = inner.module  # DDP and similar wrappers: the hook on the wrapped model, the call on the wrapper
    config = getattr(inner, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, attr, None) not in (None, 1, 1.0):
            raise ValueError(f"model_logps computes plain output-embedding logits; {attr} is not supported")
    result: dict[str, SequenceLogps] = {}

    def intercept(module: nn.Module, args: tuple) -> tuple | None:
        if "out" in result:
            return None
        (hidden,) = args
        result["out"] = sequence_logps(hidden, module, shift_labels, group, **options)
        return (hidden[:, :0],)  # [B, S_l, h] -> [B, 0, h]: no logits materialised

    inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
    inputs.setdefault("use_cache", False)
    hook = inner.get_output_embeddings().register_forward_pre_hook(intercept)
    try:
        model(**inputs)
    finally:
        hook.remove()
    if "out" not in result:
        raise ValueError(f"{type(model).__name__}'s forward never called its output embeddings")
    return result["out"]
