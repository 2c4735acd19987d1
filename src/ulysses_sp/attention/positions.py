"""Where the local tokens sit in the sequence: the position contract of the SP attention.

Under sequence parallelism each rank's model runs on ``S_l`` tokens of a longer sequence, and the
core attention needs the **full-sequence** ``position_ids`` of its tokens (packed documents restart
at 0; DESIGN.md step 2). Position ids alone cannot tell those from positions a model made up for
its shard: packed documents whose boundaries fall on the shard boundaries give every rank exactly
``0..S_l-1``. So the contract is about who supplied them, not what they look like:

- the model's top-level call must be given ``position_ids`` (``UlyssesSPDataLoaderAdapter``, the
  Trainer integration and the CLI always pass them): they are taken as the full-sequence positions
  of the local tokens, whatever their values;
- a call **without** ``position_ids`` on a sequence-parallel forward is refused on every rank: the
  model would number each shard ``0..S_l-1`` itself.

The registration's forward pre-hook records the top-level call (``capture_call``); the attention
uses the ``position_ids`` that reach it (most models pass them down) or, for models that do not pass
them to their attention (Llama 4), the ones the top-level call was given.

Per-layer structure derived from positions also lives here: **chunked attention** (Llama 4's
``attention_chunk_size`` layers: a token sees only earlier tokens of its own chunk of the full
sequence, i.e. packed documents further split at chunk boundaries), and the **token-index query
temperature** of Llama 4's NoPE layers, which the model computes from ``arange`` over the local
shard and which is corrected to the global token index.

Shape legend: ``B`` batch, ``S`` full sequence, ``S_l = S/P``, ``H`` heads, ``D`` head dim.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ulysses_sp.parallel.mesh_shape import sp_token_order

GIVEN, NOT_GIVEN, UNSEEN = 1, 0, 2
"""Codes for how a rank's positions arrived (exchanged with the shapes in ``gather_positions``)."""


@dataclass(frozen=True)
class CallPositions:
    """What the model's top-level call said about positions (recorded by the forward pre-hook)."""

    given: bool
    """Whether ``position_ids`` was passed (not ``None``)."""
    source: weakref.ref | None = None
    """The ``position_ids`` tensor passed (while it lives), else ``None``."""

    def tensor(self) -> torch.Tensor | None:
        return None if self.source is None else self.source()


def capture_call(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> CallPositions:
    """The ``position_ids`` of one call ``module(*args, **kwargs)`` (keyword or positional)."""
    pos = kwargs.get("position_ids")
    if pos is None and args:
        try:
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = {}
        pos = bound.get("position_ids")
    if not isinstance(pos, torch.Tensor):
        return CallPositions(given=False)
    return CallPositions(given=True, source=weakref.ref(pos))


def local_positions(
    passed: torch.Tensor | None, call: CallPositions | None, s_local: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """``([B|1, S_l] position ids, code)``: the ids that reached the attention, else the top-level
    call's; ``code`` says how they arrived (``GIVEN``, ``NOT_GIVEN``, ``UNSEEN``: no top-level call
    was recorded)."""
    code = UNSEEN if call is None else (GIVEN if call.given else NOT_GIVEN)
    if passed is None and call is not None:
        top = call.tensor()
        if top is not None and top.dim() == 2 and top.shape[-1] == s_local:
            passed = top
    if passed is None:
        passed = torch.arange(s_local, device=device)[None]
    return passed, code


def positions_problem(codes: list[int], sp_size: int) -> str | None:
    """The refusal for the ``codes`` of the SP ranks, or ``None`` when every rank was given positions."""
    missing = [r for r, c in enumerate(codes) if c == NOT_GIVEN]
    if missing:
        return (
            f"the model was called without position_ids on SP rank(s) {missing} of a sequence-parallel "
            f"forward (sp_size {sp_size}): each rank holds a shard of the sequence, and a model numbers "
            "the tokens it is given 0..S_l-1 itself, wrong on every shard but the first. Pass the "
            "full-sequence position_ids of the local tokens (UlyssesSPDataLoaderAdapter and "
            "shard_batch do; packed documents restart at 0)"
        )
    unseen = [r for r, c in enumerate(codes) if c == UNSEEN]
    if unseen:
        return (
            f"the sequence-parallel attention ran on SP rank(s) {unseen} in a model whose call it did not "
            "see (registered from a directory, or an inner module called directly), so it cannot tell "
            "whether position_ids were given. Attach the model: mpu.attach(model) "
            "(register_with_transformers(model, ...) and initialize(model, ...) do), and call it"
        )
    return None


def layer_chunk(module: torch.nn.Module) -> int | None:
    """The attention chunk of the module's layer (``config.layer_types[layer_idx] ==
    "chunked_attention"`` with ``config.attention_chunk_size``), else ``None``."""
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    if not types or not isinstance(idx, int) or idx >= len(types) or types[idx] != "chunked_attention":
        return None
    chunk = getattr(config, "attention_chunk_size", None)
    return int(chunk) if chunk else None


def split_at_chunks(positions: torch.Tensor, chunk: int) -> torch.Tensor:
    """``[B|1, S] -> [B|1, S]``: position ids that restart where a chunk starts: at every position
    that is a multiple of ``chunk`` (document starts included). This is transformers' chunked mask
    (``pos_q // chunk == pos_k // chunk``, within documents, positions = token index without
    packing). Only the restarts matter: they mark the attention segments."""
    s = positions.shape[-1]
    idx = torch.arange(s, device=positions.device)
    starts = positions % chunk == 0  # [B|1, S]
    starts[:, 0] = True
    # index of the latest segment start at or before each token
    last = torch.where(starts, idx[None], torch.zeros_like(idx)[None]).cummax(-1).values
    return idx[None] - last


def global_token_index(sp_group: Any, s_local: int, seq_len: int, ring_size: int) -> torch.Tensor:
    """``[S_l]``: the full-sequence token index of each of this SP rank's tokens (zigzag with a ring)."""
    rank, size = dist.get_rank(sp_group), dist.get_world_size(sp_group)
    order = sp_token_order(seq_len, size, ring_size)
    if order is None:
        return torch.arange(rank * s_local, (rank + 1) * s_local)
    return order[rank * s_local : (rank + 1) * s_local]


def correct_query_temperature(
    module: torch.nn.Module, query: torch.Tensor, positions: torch.Tensor, global_index: torch.Tensor | None
) -> torch.Tensor:
    """Llama 4's NoPE layers scale queries by ``log1p(floor((i+1)/floor_scale))*attn_scale + 1`` with
    ``i = arange`` over the tokens the model was given: under SP the shard's ``0..S_l-1``, and in a
    packed row the token's index in the row, not in its document. Rescale ``query [B, H, S_l, D]`` to
    each token's position in its own document: ``positions [B|1, S]`` (the forward's full-sequence
    position ids) at ``global_index [S_l]`` (this rank's tokens; ``None``: all of them, no SP). Without
    packing that is the global token index (what the model computes without SP); with packing each
    document is scaled as it is alone (as chunked attention's chunks restart at documents)."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return query
    local = torch.arange(query.shape[-2], device=query.device, dtype=torch.float32)
    own = positions if global_index is None else positions[:, global_index.to(positions.device)]  # [B|1, S_l]

    def factor(i: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((i + 1.0) / module.floor_scale)) * module.attn_scale + 1.0

    ratio = factor(own.to(query.device, torch.float32)) / factor(local)  # [B|1, S_l]
    return (query * ratio[:, None, :, None]).to(query.dtype)
