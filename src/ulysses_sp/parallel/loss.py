"""Sequence-parallel causal-LM loss: the mean over every valid token of the SP group's sequences.

Each rank holds ``[B, S_l]`` pre-shifted labels (``shift_labels``: position ``t`` is labelled with
token ``t+1`` of the *full* sequence, ``-100`` = ignore) and computes the **sum** of its token
losses and the **count** of its valid tokens. One all-reduce of ``(sum, count)`` over the SP group
gives the global mean, which every rank returns as the loss *value*.

The gradient is the subtle part. Summing gradients over the SP group (what the engine does) is
exact only if each rank back-propagates **its own** share, ``local_sum / global_count``. A
differentiable all-gather of per-rank losses followed by a sum would make every rank back-propagate
the whole loss, and the SP sum would then multiply gradients by ``sp`` (the trap the reference
system falls into under ZeRO 1/2). So the returned tensor is
``local_sum / n + stopgrad(global_sum / n - local_sum / n)``: global value, local gradient.
A rank (or a whole group) with zero valid tokens contributes zero, never NaN.

Shape legend: ``B`` batch, ``S_l`` local sequence, ``V`` vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ulysses_sp.parallel.comm import all_reduce_sum

IGNORE_INDEX = -100


def causal_lm_loss_parts(
    logits: torch.Tensor, shift_labels: torch.Tensor, *, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of token losses, number of valid tokens)`` for ``logits [B, S_l, V]`` and
    ``shift_labels [B, S_l]``. The sum is fp32 and differentiable; the count is a float tensor."""
    if logits.shape[:-1] != shift_labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and shift_labels {tuple(shift_labels.shape)} disagree: "
            "expected logits [B, S_l, V] and labels [B, S_l]"
        )
    labels = shift_labels.reshape(-1).to(logits.device)
    # [B, S_l, V] -> [B*S_l, V]; fp32 for a stable log-softmax whatever the model dtype.
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels, ignore_index=ignore_index, reduction="sum"
    )
    count = (labels != ignore_index).sum().to(torch.float32)
    return total, count


def sp_mean_loss(
    local_sum: torch.Tensor, local_count: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Global mean over the SP group, with the gradient of this rank's share only (see module doc).

    ``group=None`` (or a 1-rank group) means no sequence parallelism: plain ``sum / count``.
    """
    local_count = local_count.detach().to(torch.float64)
    if group is None or dist.get_world_size(group) == 1:
        return local_sum / local_count.clamp(min=1).to(local_sum.dtype)
    both = torch.stack([local_sum.detach().to(torch.float64), local_count])
    global_sum, global_count = all_reduce_sum(both, group, timed="sp").unbind()  # one collective for both
    denom = global_count.clamp(min=1)
    share = local_sum / denom.to(local_sum.dtype)
    return share + (global_sum / denom).to(local_sum.dtype).sub(share.detach())


def sp_causal_lm_loss(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Mean causal-LM loss over all valid tokens of the SP group's sequences.

    Args:
        logits: ``[B, S_l, V]`` this rank's logits.
        shift_labels: ``[B, S_l]`` labels already shifted over the full sequence (``-100`` ignored).
        group: the sequence-parallel group (``None`` for no SP).

    Returns:
        A scalar whose value is identical on every SP rank and whose gradient, summed over the SP
        group, is the exact gradient of the full-sequence mean loss.
    """
    total, count = causal_lm_loss_parts(logits, shift_labels, ignore_index=ignore_index)
    return sp_mean_loss(total, count, group)
