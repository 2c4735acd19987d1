"""The vision tower's work for one rank: which frames it encodes, and the rows it gets back.

Both Qwen-VL towers encode a video of grid ``[t, h, w]`` frame by frame: their attention spans one
temporal patch (``cu_seqlens`` repeats ``h*w`` ``t`` times, the window index of Qwen2.5-VL is per
frame) and their position features repeat per frame. So the unit of work here is a **frame**
(``[1, h, w]``: an image, or one temporal patch of a video), and a frame's merged rows are the same
whichever other frames share the call.

Two ways to place the work (``plan_frames``), chosen from metadata every rank holds (token ids,
grids):

- **split** (a group is given and there are at least as many frames as ranks): the frames in order,
  in contiguous runs of about ``1/P`` of the patches (whole frames, never part of one), one run per
  rank. Each rank encodes its run; one all-to-all (``_RowExchange``) then sends every merged row to
  the rank whose shard holds its placeholder token, so a rank receives only its own rows. Backward:
  the inverse all-to-all brings each row's gradient back to the rank that encoded it.
``check_split`` refuses a batch whose frames cannot be split (``--split-images on``).

- **local** (no group, or fewer frames than ranks): each rank encodes the frames that have a row in
  its shard (a frame straddling a shard boundary is encoded by both ranks; each uses its own rows),
  no collective. A rank whose shard holds no visual token encodes the sample's first frame and adds
  it times zero: every rank then runs the tower whenever the sample has pixels, so the data-parallel
  engines (DDP, FSDP2's per-module hooks) see the same modules used on every rank.

Either way each rank's tower gradients come from its own rows; summed over the SP group (as every
gradient is) they are the gradients of the model without SP.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l`` this rank's tokens, ``N_p`` patches,
``N_v`` merged rows of the sample (one per placeholder token), ``N_l`` this rank's rows, ``F``
frames, ``Hd`` hidden size, ``P`` sp size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ulysses_sp.parallel.comm import exchange_bytes


class _RowExchange(torch.autograd.Function):
    """Uneven all-to-all of rows (``send_splits[k]`` rows to rank ``k``, ``recv_splits[k]`` from it)
    forward; the same all-to-all with the splits swapped backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    # [sum(send), C] -> [sum(recv), C]: rank k's rows after rank k-1's (one all-to-all of the bytes)
    c = x.shape[1]
    pieces = [[piece] for piece in x.split(send)]
    got = exchange_bytes(pieces, [r * c * x.element_size() for r in recv], group, x.device)
    return got.view(x.dtype).view(-1, c).to(x.device)


@dataclass(frozen=True)
class FramePlan:
    """One rank's share of one modality's tower work (``plan_frames``)."""

    pixels: torch.Tensor
    """``[N_p mine]`` long: the rows of ``pixel_values`` this rank encodes."""
    grid: torch.Tensor
    """``[F mine, 3]``: their frame grids (``t = 1``)."""
    take: torch.Tensor
    """``[n]`` long: rows of the encoded output to keep (local) or to send (split), in order."""
    send: list[int] | None
    """Split: rows of ``take`` for each rank; ``None``: local, no exchange."""
    recv: list[int] | None
    """Split: rows arriving from each rank."""
    unused: bool
    """Local: this rank's shard holds none of the rows (it encodes one frame, used times zero)."""


def frames(grid: torch.Tensor, merge: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[F, 3]`` frame grids (``t = 1``), ``[F]`` patches and ``[F]`` merged rows of each frame."""
    fgrid = grid.repeat_interleave(grid[:, 0], dim=0).clone()  # [N_img, 3] -> [F, 3]
    fgrid[:, 0] = 1
    patches = fgrid.prod(dim=-1)
    return fgrid, patches, patches // merge


def frame_owners(patches: torch.Tensor, sp_size: int) -> torch.Tensor | None:
    """``[F]`` owning SP rank of each frame (contiguous runs, balanced by patch count), or ``None``
    when some rank would get no frame."""
    mid = torch.cumsum(patches, 0) - patches / 2  # each frame's centre along the patch axis
    owners = (mid * sp_size / patches.sum()).long().clamp(max=sp_size - 1)
    return owners if len(set(owners.tolist())) == sp_size else None


def check_split(batch: dict[str, Any], sp_size: int, *, where: str = "a micro-batch") -> None:
    """Raise ``ValueError`` unless ``batch``'s frames (images, then videos: ``image_grid_thw``,
    ``video_grid_thw``) split over ``sp_size`` ranks, a whole frame for each (``frame_owners``)."""
    grids = [batch[k] for k in ("image_grid_thw", "video_grid_thw") if batch.get(k) is not None]
    patches = frames(torch.cat(grids).cpu(), 1)[1] if grids else torch.zeros(0, dtype=torch.long)
    if len(patches) == 0 or frame_owners(patches, sp_size) is None:
        raise ValueError(
            f"--split-images on: {where} has {len(patches)} frame(s) (patches {patches.tolist()}), which cannot "
            f"give each of the {sp_size} SP ranks a whole frame (contiguous runs balanced by patch count); use "
            "--split-images auto (such a micro-batch is encoded by the ranks its shard touches) or give every "
            "sample more images"
        )


def _starts(sizes: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(sizes, 0) - sizes


def _ranges(starts: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """``[sum(sizes)]``: ``starts[i] + arange(sizes[i])`` for every ``i``, concatenated."""
    offsets = torch.repeat_interleave(starts - _starts(sizes), sizes)
    return offsets + torch.arange(int(sizes.sum()), device=sizes.device)


def plan_frames(
    grid: torch.Tensor, rows_by_rank: list[torch.Tensor], *, sp_rank: int, merge: int, split: bool
) -> FramePlan:
    """This rank's frames and the rows it keeps or sends (module docstring).

    Args:
        grid: ``[N_img, 3]`` the modality's grids, as the processor returns them.
        rows_by_rank: for each SP rank, ``[N_k]`` the merged rows (of this modality, ascending) its
            shard's placeholder tokens take, in its local token order.
        split: a group to exchange over is available (the split is used when every rank gets a frame).
    """
    grid = grid.cpu()
    fgrid, patches, tokens = frames(grid, merge)
    p_start, t_start = _starts(patches), _starts(tokens)
    owners = frame_owners(patches, len(rows_by_rank)) if split else None
    if owners is not None:
        mine = (owners == sp_rank).nonzero().flatten()
        lo, hi = int(t_start[mine[0]]), int(t_start[mine[-1]] + tokens[mine[-1]])  # my rows [lo, hi)
        parts = [r[(r >= lo) & (r < hi)] - lo for r in rows_by_rank]  # rows each rank gets from me
        t_end = torch.cumsum(tokens, 0)
        bounds = [(int(t_start[owners == k][0]), int(t_end[owners == k][-1])) for k in range(len(rows_by_rank))]
        mine_rows = rows_by_rank[sp_rank]
        recv = [int(((mine_rows >= a) & (mine_rows < b)).sum()) for a, b in bounds]
        return FramePlan(_ranges(p_start[mine], patches[mine]), fgrid[mine], torch.cat(parts),
                         [len(p) for p in parts], recv, False)  # fmt: skip
    rows = rows_by_rank[sp_rank]
    frame_of = torch.searchsorted(torch.cumsum(tokens, 0), rows, right=True)  # [N_l] frame of each row
    mine = torch.unique(frame_of)  # sorted
    unused = mine.numel() == 0
    if unused:
        mine = torch.zeros(1, dtype=torch.long)
    base = _starts(tokens[mine])  # first output row of each of my frames
    take = base[torch.searchsorted(mine, frame_of)] + rows - t_start[frame_of]
    return FramePlan(_ranges(p_start[mine], patches[mine]), fgrid[mine], take, None, None, unused)


def encode(
    vision: Any, pixels: list[torch.Tensor], plan: FramePlan, group: dist.ProcessGroup | None,
    *, tower: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """This rank's merged rows ``[N_l, Hd]`` (in the order of its ``rows_by_rank`` entry) and
    Qwen3-VL's deepstack rows (``[N_l, Hd]`` per deepstack layer; ``[]`` for Qwen2.5-VL).
    ``pixels``: the ``pixel_values`` the grids of ``plan_frames`` describe, in order (images, then
    videos). A rank with ``plan.unused`` gets zero rows that still depend on the tower (times zero).
    ``tower``: the tower's metadata for the plan's frames, computed on the host (``layout.tower_inputs``);
    ``None``: the tower computes it from the grid (host reads of it)."""
    picked, first = [], 0
    for p in pixels:  # [N_p, C] each -> [N_p mine, C]: the plan's rows, never the whole concatenation
        sel = plan.pixels[(plan.pixels >= first) & (plan.pixels < first + p.shape[0])] - first
        picked.append(p.index_select(0, sel.to(p.device)))
        first += p.shape[0]
    x = torch.cat(picked).to(vision.device, vision.dtype)  # host pixels (the adapter's): only this rank's rows go up
    out = vision(x, grid_thw=plan.grid.to(x.device), **_uploaded(tower or {}, x.device, vision))
    feats = [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]  # each [N_v mine, Hd]
    width = feats[0].shape[-1]
    rows = torch.cat(feats, dim=-1)  # [N_v mine, (1 + layers) * Hd]: one exchange for all of them
    if plan.unused:
        rows = rows[:0] + rows.sum() * 0  # [0, ...], yet the tower is in the graph
    else:
        rows = rows.index_select(0, plan.take.to(rows.device))
        if plan.send is not None:
            rows = _RowExchange.apply(rows, plan.send, plan.recv, group)  # my rows -> their shards' ranks
    return rows[:, :width], list(rows[:, width:].split(width, dim=-1))


def _uploaded(tower: dict[str, Any], device: torch.device, vision: Any) -> dict[str, Any]:
    """``tower`` with what the tower indexes device tensors with on ``device`` (rotary positions, window
    order); the frame boundaries stay on the host (its sdpa path reads them there) unless its attention
    is flash (the kernel reads them on the device; the maxima are given)."""
    flash = "flash" in str(getattr(vision.config, "_attn_implementation", ""))
    moved = ("position_ids", "window_index", *(("cu_seqlens", "cu_window_seqlens") if flash else ()))
    return {k: v.to(device) if k in moved else v for k, v in tower.items()}
