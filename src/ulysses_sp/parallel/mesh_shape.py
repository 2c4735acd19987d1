"""Layout arithmetic, pure (no process group): mesh sizes, how heads split, which tokens a rank holds.

The ``(data_parallel, sequence_parallel)`` shape (``resolve_mesh_shape``), the head-count rules of
the Ulysses split (``check_heads``) and of the hybrid Ulysses x Ring split (``resolve_ring_size``),
and the token layout of a sharded sequence (``shard_spans``): what the config validation, the data
path, the attention and the unit tests compute identically on every rank before any collective.

Hybrid layout: the SP axis of ``P`` ranks factors into ``R`` ring groups of ``U = P/R`` Ulysses
ranks, Ulysses ranks contiguous (SP rank ``k = ring_rank * U + ulysses_rank``, so they share a
node under torchrun's rank order). With ``R > 1`` the sequence is cut into ``2R`` chunks of
``c = S/(2R)`` tokens and ring rank ``i`` holds chunk ``i`` then chunk ``2R-1-i`` (zigzag: every
ring rank does the same work under the causal mask); its ``U`` Ulysses ranks split those ``2c``
tokens contiguously. With ``R = 1`` rank ``k`` holds ``[k*S/P, (k+1)*S/P)``, as plain Ulysses does.
"""

from __future__ import annotations

from typing import Any

import torch

from ulysses_sp.checks import check_seq_len_divisible, positive_int, seq_len_multiple


def resolve_mesh_shape(
    world_size: int, dp_size: int | None = None, sp_size: int | None = None
) -> tuple[int, int]:
    """Return ``(dp_size, sp_size)`` with any missing size derived from ``world_size``.

    Raises:
        ValueError: a size is not a positive int, or ``dp_size * sp_size != world_size``, or the
            given size does not divide the world size. The message names every number.
    """
    world_size = positive_int("world_size", world_size)
    if dp_size is not None:
        dp_size = positive_int("data_parallel_size", dp_size)
    if sp_size is not None:
        sp_size = positive_int("sequence_parallel_size", sp_size)
    if dp_size is None and sp_size is None:
        return world_size, 1
    if sp_size is None:
        if world_size % dp_size:
            raise ValueError(
                f"data_parallel_size ({dp_size}) does not divide world_size ({world_size}); "
                f"choose a divisor of {world_size}"
            )
        return dp_size, world_size // dp_size
    if dp_size is None:
        if world_size % sp_size:
            raise ValueError(
                f"sequence_parallel_size ({sp_size}) does not divide world_size ({world_size}); "
                f"choose a divisor of {world_size}"
            )
        return world_size // sp_size, sp_size
    if dp_size * sp_size != world_size:
        raise ValueError(
            f"dp_size ({dp_size}) * sp_size ({sp_size}) = {dp_size * sp_size} != world_size ({world_size})"
        )
    return dp_size, sp_size


def check_mesh_param(mesh_param: Any) -> tuple[int, int]:
    """Validate ``mesh_param`` as a ``(dp_size, sp_size)`` pair of positive ints and return it."""
    if not isinstance(mesh_param, (tuple, list)) or len(mesh_param) != 2:
        raise ValueError(
            f"mesh_param must be a pair (data_parallel_size, sequence_parallel_size), got {mesh_param!r}"
        )
    return positive_int("mesh_param[0] (dp_size)", mesh_param[0]), positive_int(
        "mesh_param[1] (sp_size)", mesh_param[1]
    )


def data_parallel_world_size(
    world_size: int,
    *,
    mpu: Any | None = None,
    mesh: Any | None = None,
    sequence_parallel_size: int | None = None,
) -> int:
    """The world size that ZeRO/FSDP partitions over and batch arithmetic uses.

    Decided in this order (the reference system's rule):

    1. an ``mpu`` with ``get_data_parallel_world_size()`` -> that;
    2. an ``mpu`` without it -> ``world_size / mpu.get_sequence_parallel_world_size()``;
    3. a ``mesh`` -> the size of its ``data_parallel`` axis;
    4. ``sequence_parallel_size`` -> ``world_size / sequence_parallel_size``;
    5. otherwise ``world_size``.
    """
    world_size = positive_int("world_size", world_size)
    if mpu is not None:
        if hasattr(mpu, "get_data_parallel_world_size"):
            return positive_int("mpu.get_data_parallel_world_size()", mpu.get_data_parallel_world_size())
        sp = positive_int("mpu.get_sequence_parallel_world_size()", mpu.get_sequence_parallel_world_size())
        return resolve_mesh_shape(world_size, sp_size=sp)[0]
    if mesh is not None and hasattr(mesh, "dp_size"):  # an SPMesh
        return mesh.dp_size
    if mesh is not None:  # a DeviceMesh
        names = tuple(mesh.mesh_dim_names or ())
        return mesh.size(names.index("data_parallel")) if "data_parallel" in names else mesh.size(0)
    if sequence_parallel_size is not None:
        return resolve_mesh_shape(world_size, sp_size=sequence_parallel_size)[0]
    return world_size


def _heads_split(num_heads: int, num_kv_heads: int, ulysses: int) -> bool:
    return num_heads % ulysses == 0 and (num_kv_heads % ulysses == 0 or ulysses % num_kv_heads == 0)


def valid_sp_sizes(num_heads: int, num_kv_heads: int) -> list[int]:
    """Ulysses sizes that split ``num_heads`` query heads and ``num_kv_heads`` kv heads evenly
    (kv heads either split, or replicated when fewer than ``P``)."""
    return [p for p in range(1, num_heads + 1) if _heads_split(num_heads, num_kv_heads, p)]


def check_heads(num_heads: int, num_kv_heads: int, sp_size: int) -> None:
    """Raise ``ValueError`` naming the numbers when the heads cannot be split over ``sp_size``
    Ulysses ranks (the hint names ``--ring-size``, which lifts the limit)."""
    if _heads_split(num_heads, num_kv_heads, sp_size):
        return
    what = (
        f"num_attention_heads ({num_heads}) is not divisible by sequence_parallel_size ({sp_size})"
        if num_heads % sp_size
        else f"num_key_value_heads ({num_kv_heads}) neither divides nor is divisible by "
        f"sequence_parallel_size ({sp_size})"
    )
    raise ValueError(
        f"{what}; valid sequence_parallel_size values for Ulysses alone: "
        f"{valid_sp_sizes(num_heads, num_kv_heads)} (a ring, ring_size > 1, allows larger ones)"
    )


def valid_ring_sizes(sp_size: int, num_heads: int, num_kv_heads: int) -> list[int]:
    """Ring sizes ``R`` dividing ``sp_size`` whose Ulysses size ``sp_size / R`` splits the heads."""
    return [r for r in range(1, sp_size + 1) if sp_size % r == 0 and _heads_split(num_heads, num_kv_heads, sp_size // r)]


def resolve_ring_size(sp_size: int, num_heads: int, num_kv_heads: int, ring_size: int | str | None = None) -> int:
    """The ring size of the hybrid layout: ``ring_size``, or for ``None``/``"auto"`` the smallest valid
    one (``1`` when the heads allow Ulysses alone).

    Raises:
        ValueError: ``ring_size`` does not divide ``sp_size``, or ``sp_size / ring_size`` Ulysses ranks
            cannot split the heads; the message names the valid ring sizes.
    """
    sp_size = positive_int("sequence_parallel_size", sp_size)
    valid = valid_ring_sizes(sp_size, num_heads, num_kv_heads)  # never empty: R = sp_size gives U = 1
    if ring_size is None or ring_size == "auto":
        return valid[0]
    ring_size = positive_int("ring_size", ring_size)
    if ring_size not in valid:
        why = (
            f"ring_size ({ring_size}) does not divide sequence_parallel_size ({sp_size})"
            if sp_size % ring_size
            else f"ulysses size sp/ring = {sp_size // ring_size} cannot split {num_heads} attention heads "
            f"/ {num_kv_heads} kv heads"
        )
        raise ValueError(f"{why}; valid ring sizes for sequence_parallel_size {sp_size}: {valid} (or 'auto')")
    return ring_size


def head_counts(config: Any) -> list[tuple[int, int]]:
    """The distinct ``(query heads, kv heads)`` of a transformers config's attention layers: one pair
    for a homogeneous config; each layer's for a heterogeneous one (transformers' ``per_layer_config``,
    whose global head count is ambiguous and raises when read). Empty when the config names no heads.
    A composite (vision-language) config is read through its text config."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    per_layer = getattr(config, "per_layer_config", None)
    pairs: list[tuple[int, int]] = []
    for layer in list(per_layer) if per_layer is not None else [config]:
        heads = getattr(layer, "num_attention_heads", None)
        if heads:
            pair = (heads, getattr(layer, "num_key_value_heads", None) or heads)
            if pair not in pairs:
                pairs.append(pair)
    return pairs


def resolve_ring_size_for_layers(
    sp_size: int, pairs: list[tuple[int, int]], ring_size: int | str | None = None
) -> int:
    """``resolve_ring_size`` for every layer shape of ``head_counts`` at once: one ring size that lets
    the Ulysses ranks split the heads of every layer (``ValueError`` naming the layer shape that fails).
    No attention layers (``pairs`` empty: a pure state-space model such as Mamba-2): ring size 1, as
    there are no keys and values to pass around a ring; a ring size > 1 asked for is refused."""
    if not pairs:
        if ring_size in (None, "auto", 1):
            return 1
        raise ValueError(
            f"ring_size {ring_size}: the model has no attention layers (its config names no num_attention_heads), "
            "so there is nothing for a ring to pass; drop the ring size (its mixers shard by heads)"
        )
    if ring_size is None or ring_size == "auto":
        common = [r for r in valid_ring_sizes(sp_size, *pairs[0]) if all(
            r in valid_ring_sizes(sp_size, *p) for p in pairs[1:])]  # fmt: skip
        return common[0]  # never empty: R = sp_size gives U = 1
    for heads, kv in pairs:
        resolve_ring_size(sp_size, heads, kv, ring_size)
    return int(ring_size)


def seq_multiple(sp_size: int, ring_size: int = 1) -> int:
    """What the sequence length must be a multiple of: ``P``, or ``2P`` with a ring (zigzag chunks)."""
    return seq_len_multiple(sp_size, ring_size)[0]


def _check_ring(seq_len: int, ring_size: int, ring_rank: int) -> None:
    if ring_size < 1 or not 0 <= ring_rank < ring_size:
        raise ValueError(
            f"ring_rank must be in [0, ring_size); got ring_rank {ring_rank}, ring_size {ring_size}"
        )
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")


def zigzag_spans(seq_len: int, ring_size: int, ring_rank: int) -> list[tuple[int, int]]:
    """The global ``[start, stop)`` pieces ring rank ``i`` holds, in local order: chunk ``i`` and
    chunk ``2R-1-i`` of ``c = S/(2R)`` tokens (``[i c, (i+1) c)``, then ``[(2R-1-i) c, (2R-i) c)``).

    Raises ``ValueError`` unless ``seq_len`` is a multiple of ``2 * ring_size``, naming the length
    to pad to.
    """
    _check_ring(seq_len, ring_size, ring_rank)
    if seq_len % (2 * ring_size):
        padded = -(-seq_len // (2 * ring_size)) * 2 * ring_size
        raise ValueError(
            f"zigzag ring attention needs the sequence length divisible by 2 * ring_size = "
            f"{2 * ring_size}; got {seq_len}: pad the sequence to {padded} tokens"
        )
    c = seq_len // (2 * ring_size)
    far = 2 * ring_size - 1 - ring_rank
    return [(ring_rank * c, (ring_rank + 1) * c), (far * c, (far + 1) * c)]


def contiguous_spans(seq_len: int, ring_size: int, ring_rank: int) -> list[tuple[int, int]]:
    """The one global piece ``[i S/R, (i+1) S/R)`` of ring rank ``i`` (no load balance)."""
    _check_ring(seq_len, ring_size, ring_rank)
    if seq_len % ring_size:
        padded = -(-seq_len // ring_size) * ring_size
        raise ValueError(
            f"ring attention needs the sequence length divisible by ring_size = {ring_size}; "
            f"got {seq_len}: pad the sequence to {padded} tokens"
        )
    n = seq_len // ring_size
    return [(ring_rank * n, (ring_rank + 1) * n)]


def shard_spans(seq_len: int, sp_rank: int, sp_size: int, ring_size: int = 1) -> list[tuple[int, int]]:
    """The global ``[start, stop)`` pieces of a sequence that SP rank ``sp_rank`` holds, in local order.

    One piece without a ring; with one, the rank's part of its ring rank's zigzag chunks (one piece,
    or two when a Ulysses piece straddles the two chunks). ``seq_len`` must be a multiple of
    ``seq_multiple(sp_size, ring_size)``.
    """
    check_seq_len_divisible(seq_len, sp_size, ring_size, fix="pad to")
    local = seq_len // sp_size
    if ring_size == 1:
        return [(sp_rank * local, (sp_rank + 1) * local)]
    ulysses = sp_size // ring_size
    ring_rank, u = divmod(sp_rank, ulysses)
    c = seq_len // (2 * ring_size)
    chunks = zigzag_spans(seq_len, ring_size, ring_rank)
    lo, hi = u * local, (u + 1) * local  # in the ring rank's 2c local tokens
    out = []
    for j, (a, _) in enumerate(chunks):
        s0, s1 = max(lo, j * c), min(hi, (j + 1) * c)
        if s0 < s1:
            out.append((a + s0 - j * c, a + s1 - j * c))
    return out


def sp_token_order(seq_len: int, sp_size: int, ring_size: int = 1) -> torch.Tensor | None:
    """``[S]`` global index of each token of the SP ranks' shards concatenated in rank order, or
    ``None`` when that is the identity (no ring): ``full[:, order] = gathered`` restores global order."""
    if ring_size == 1:
        return None
    spans = [span for k in range(sp_size) for span in shard_spans(seq_len, k, sp_size, ring_size)]
    return torch.cat([torch.arange(a, b) for a, b in spans])
