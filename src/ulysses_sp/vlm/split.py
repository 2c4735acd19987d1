"""Optional: split the vision tower's images over the SP group instead of encoding them on every rank.

By default (``shard``) every rank of the group encodes all of the sample's images, so the vision
tower's compute and activations do not shrink with ``P``. ``split_vision`` wraps the tower's
``forward``: the images (whole images, never a part of one: the tower's attention spans an image)
are assigned in order to the ranks in contiguous runs of about ``1/P`` of the patches; each rank
encodes its run, places its merged embeddings at their rows of a zero ``[N_v, Hd]`` tensor, and one
sum over the group gives every rank all the embeddings (Qwen3-VL's deepstack features the same
way). Backward: the gradient of the summed tensor is summed over the group (every rank's tokens use
it), and each rank's rows flow back into its own images; the vision parameters' gradients, summed
over SP by the engine, are then the full-sequence ones. ``last_hidden_state`` keeps this rank's
images only (the merge reads ``pooler_output``). A call with fewer images than ranks encodes every
image on every rank, as without the split.

Shape legend: ``N_p`` patches, ``N_v`` merged visual tokens, ``Hd`` hidden size, ``P`` sp size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ulysses_sp.parallel.comm import all_reduce_sum


class _SumOverGroup(torch.autograd.Function):
    """All-reduce sum forward; all-reduce sum backward (every rank uses the whole sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce_sum(grad.contiguous(), ctx.group), None


def image_owners(patches: torch.Tensor, sp_size: int) -> torch.Tensor | None:
    """``[n_img]`` owning SP rank of each image (contiguous runs, balanced by patch count), or
    ``None`` when some rank would get no image."""
    mid = torch.cumsum(patches, 0) - patches / 2  # each image's centre along the patch axis
    owners = (mid * sp_size / patches.sum()).long().clamp(max=sp_size - 1)
    return owners if len(set(owners.tolist())) == sp_size else None


def split_vision(vision: Any, *, group: dist.ProcessGroup, sp_rank: int, sp_size: int, merge: int) -> Any:
    """Wrap ``vision.forward`` (module docstring); returns the undo function."""
    original = vision.forward

    def forward(hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any) -> Any:
        patches = grid_thw.prod(dim=-1)  # [n_img]
        owners = image_owners(patches, sp_size)
        if owners is None:
            return original(hidden_states, grid_thw=grid_thw, **kwargs)
        mine = (owners == sp_rank).nonzero().flatten()
        first, last = int(mine[0]), int(mine[-1]) + 1
        p_off, t_off = torch.cumsum(patches, 0) - patches, (torch.cumsum(patches, 0) - patches) // merge
        p0 = int(p_off[first])
        p1 = int(p_off[last]) if last < len(patches) else hidden_states.shape[0]
        out = original(hidden_states[p0:p1], grid_thw=grid_thw[first:last], **kwargs)  # [N_p mine, ...]
        n, t0 = int(patches.sum()) // merge, int(t_off[first])

        def whole(x: torch.Tensor) -> torch.Tensor:
            # [N_v mine, Hd] -> [N_v, Hd]: zeros but this rank's rows, then the sum over the group
            z = torch.cat([x.new_zeros(t0, x.shape[-1]), x, x.new_zeros(n - t0 - x.shape[0], x.shape[-1])])
            return _SumOverGroup.apply(z, group)

        out.pooler_output = whole(out.pooler_output)
        if getattr(out, "deepstack_features", None):
            out.deepstack_features = [whole(f) for f in out.deepstack_features]
        return out

    vision.forward = forward

    def undo() -> None:
        if vision.__dict__.get("forward") is forward:
            del vision.forward

    return undo
