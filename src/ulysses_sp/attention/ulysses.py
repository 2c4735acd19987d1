"""Ulysses sequence-parallel attention for HuggingFace transformers models.

``UlyssesSPAttentionHF`` is the core-attention function transformers calls (through its public
``AttentionInterface`` registry, under the name ``"ulysses_sp"``). Each rank's model runs on its
local shard of ``S_l = S/P`` tokens; the attention layer hands us q/k/v after the rotary embedding
as ``[B, H, S_l, D]``. We all-to-all them into ``[B, H_l, S, D]`` (the full sequence for a slice of
the heads), run the **unmodified** core attention (``sdpa``, ``eager``, flash/flex when installed)
causally over the full sequence, and all-to-all the output back to ``[B, S_l, H, D]``. Everything
else in the model (embeddings, norms, MLPs, projections) is token-local and needs no change.

Masks: transformers builds its causal mask for the *local* shard, which is wrong for the full sequence,
so we never use it. The full sequence's layout comes with the batch from the data adapter as host values
attached to ``position_ids`` (``parallel/doc_layout.py``: no collective, no device sync); without it (a
direct call) we gather the ``position_ids`` over the SP group once per forward. Then the path
``attention/core.py`` picks runs: plain causal through the kernel's own causal mode; packed documents
(position ids restart at 0) and sliding windows through the blockwise core for sdpa (no ``S x S``
tensor), varlen for flash, a ``BlockMask`` for flex, a dense mask for eager. DSA's picked keys (``indices``):
gathered, then the blockwise core (``attention/indexed.py``). DeepSeek-V4's pooled K/V (``pooled=``): its local
queries over their window and the whole sequence's entries, no all-to-all (``attention/pooled_core.py``).
q/k/v and the output cross packed below a per-piece byte threshold, head by head above: ``parallel/headwise.py``.
Positions, chunked layers, NoPE temperature: ``attention/positions.py``; sinks cut per rank: ``attention/heads.py``.
GQA/MQA: kv heads split like query heads when ``Hkv % P == 0``; when ``Hkv < P`` each goes to the ``P/Hkv`` ranks
whose queries use it (``headwise.py``). A head group's block posting its exchange: ``attention/block_overlap.py``.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``H`` query heads, ``H_l = H/P``,
``Hkv`` kv heads, ``Hkv_l`` kv heads per rank, ``D`` head dim, ``P`` sp size.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ulysses_sp.attention.blockwise import BlockCounts
from ulysses_sp.attention.checks import check_sp_attention
from ulysses_sp.attention.core import (
    attention_path,
    check_blockwise_options,
    check_core,
    check_ring_options,
    core_function,
    core_mask,
    run_blockwise,
    run_ring,
    run_segments,
    structure_for,
)
from ulysses_sp.attention.head_blocks import HeadBlockHandle, install_head_blocks
from ulysses_sp.attention.head_chunks import check_no_sinks, head_chunked_attention, plan_head_chunks
from ulysses_sp.attention.heads import HeadView, local_view
from ulysses_sp.attention.indexed import IndexedStructure, gather_indices
from ulysses_sp.attention.kv_offload import KVOffload
from ulysses_sp.attention.masks import ForwardState, SeqLayout, seq_layout
from ulysses_sp.attention.pooled_core import pooled_attention
from ulysses_sp.attention.positions import (
    CallPositions,
    correct_query_temperature,
    global_token_index,
    layer_chunk,
    local_positions,
)
from ulysses_sp.attention.registration import SPRegistration, model_and_config, resolve_layout
from ulysses_sp.attention.ring import RingStats
from ulysses_sp.parallel.exchange_cost import check_exchange
from ulysses_sp.parallel.headwise import out_heads_to_seq, packed_exchange, qkv_seq_to_heads
from ulysses_sp.parallel.mesh import SPMesh, require_process_group
from ulysses_sp.parallel.mesh_shape import check_heads, head_counts

logger = logging.getLogger(__name__)


class UlyssesSPAttentionHF:
    """The sequence-parallel core-attention function registered with transformers.

    Instances are callables with the signature transformers gives attention functions:
    ``fn(module, query, key, value, attention_mask, *, dropout, scaling, **kwargs)`` with q/k/v of shape
    ``[B, H, S_l, D]``, returning ``(output [B, S_l, H, D], None)``. Use ``register_with_transformers(...)``:
    it builds the mesh, registers an instance, points the model at it, and returns an ``mpu``.
    """

    def __init__(
        self,
        *,
        sp_group: dist.ProcessGroup,
        core_attn_implementation: str = "sdpa",
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        max_length: int | None = None,
        disable_in_eval: bool = False,
        attn_chunk: int | None = None,
        offload_attention: bool = False,
        ulysses_group: dist.ProcessGroup | None = None,
        ring_group: dist.ProcessGroup | None = None,
        head_chunks: int = 1,
        exchange: str = "auto",
    ) -> None:
        check_core(core_attn_implementation)
        self.exchange, self.last_exchange = check_exchange(exchange), None  # auto/packed/headwise; the last call's
        plan_head_chunks(head_chunks, 1, head_chunks, 1)  # its type and sign; each layer's heads: per call
        check_blockwise_options(core_attn_implementation, attn_chunk, offload_attention)
        self.attn_chunk = attn_chunk
        """Tokens per block of the blockwise core; ``None`` = auto."""
        self.offload_attention = offload_attention
        """Every sequence through the blockwise core, K/V on the host between forward and backward."""
        self.kv_offload = KVOffload() if offload_attention else None
        """The host K/V store and its streams (``offload_attention``), with byte counters."""
        self.head_chunks = head_chunks
        """Head groups exchanged and attended one at a time (``attention/head_chunks.py``); 1 = all at once."""
        self.head_chunk_overlap = False  # the next head group's exchange posted before this one's core (2 in flight)
        self.in_head_block = False  # set while one head group's whole block runs (attention/head_blocks.py)
        self.block_overlap = None  # with head_chunk_overlap: that group's ``block_overlap.Deferred``
        self.block_counts = BlockCounts()
        """Blocks computed / skipped and their FLOPs in the blockwise core and the ring (cumulative)."""
        self.ring_stats = RingStats()  # bytes and hops ring attention sent from this rank (hybrid layout only)
        self.last_path: str | None = None
        """The path the most recent call ran (``core_attention.attention_path``)."""
        self.sp_group = sp_group
        self.sp_size = dist.get_world_size(sp_group)
        self.ulysses_group = sp_group if ulysses_group is None else ulysses_group
        """The all-to-all group: the SP group, or its Ulysses sub-group in the hybrid layout."""
        self.ring_group = ring_group
        """The hybrid layout's ring sub-group (K/V passing), or ``None``."""
        self.ring_size = 1 if ring_group is None else dist.get_world_size(ring_group)
        self.ulysses_size = dist.get_world_size(self.ulysses_group)
        check_ring_options(core_attn_implementation, self.ring_size, offload_attention)
        if self.ring_size * self.ulysses_size != self.sp_size:
            raise ValueError(
                f"ring group size ({self.ring_size}) x ulysses group size ({self.ulysses_size}) != "
                f"sp group size ({self.sp_size}); pass the groups of one SPMesh (init_mesh(ring_size=...))"
            )
        self.core = core_attn_implementation
        self.seq_length = seq_length
        self.seq_length_is_variable = seq_length_is_variable
        self.max_length = max_length
        self.disable_in_eval = disable_in_eval
        self.calls = 0  # attention calls since the last ``reset_calls()`` (the guardrail counts them)
        self.last_seq_len: int | None = None  # ``S`` seen by the most recent call
        self.registration: SPRegistration | None = None
        """The registration whose registry entry this is (``register_with_transformers`` sets it)."""
        self.call: CallPositions | None = None
        """The positions of the most recent top-level model call (the registration's pre-hook)."""
        self._forward: ForwardState | None = None

    # ------------------------------------------------------------------ per-forward layout
    def _seq_layout(self, passed: torch.Tensor | None, s_local: int, batch: int, device, sp: bool):
        """The forward's full-sequence layout, once per forward (every layer of one forward and its
        checkpoint recompute receive the same ``position_ids`` object): the data adapter's host
        layout attached to them (``parallel/doc_layout.py``), else their gather over the SP group."""
        position_ids, source = local_positions(passed, self.call, s_local, device)
        key = (position_ids._version, s_local, sp)
        state = self._forward
        if state is not None and state.source() is position_ids and state.key == key:
            return state.layout
        expected = None if self.seq_length_is_variable else self.max_length or self.seq_length
        layout = seq_layout(position_ids, source, group=self.sp_group if sp else None, batch=batch, s_local=s_local,
                            expected_len=expected, ring_size=self.ring_size)  # fmt: skip
        self._forward = ForwardState(weakref.ref(position_ids, self._release), key, layout)
        return layout

    def _release(self, source: weakref.ref) -> None:
        """The step's ``position_ids`` are gone: drop the layout and masks built from them."""
        if self._forward is not None and self._forward.source is source:
            self._forward = None

    # ------------------------------------------------------------------ the attention call
    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        sp = not (self.disable_in_eval and not module.training) and self.sp_size > 1
        if kwargs.get("pooled") is not None:  # DeepSeek-V4's pooled K/V: local queries (attention/pooled_kv.py)
            self.calls, self.last_path = self.calls + 1, "pooled"
            return pooled_attention(query, key, value, kwargs), None
        (b, h, s_local, _), hkv = query.shape, key.shape[1]
        if sp:
            check_heads(h, hkv, self.ulysses_size)
            if key.shape[2] != s_local:  # shapes only: no device read
                raise ValueError(f"{type(module).__name__}: {key.shape[2]} keys for {s_local} queries on this rank: "
                                 "cross-attention (to an encoder's states) or a cache; sequence parallelism shards "
                                 "self-attention over the same tokens only (train it with sp 1, or text-only)")  # fmt: skip
        base = layout = self._seq_layout(kwargs.pop("position_ids", None), s_local, b, query.device, sp)
        self.calls, self.last_seq_len, _ = self.calls + 1, layout.seq_len, kwargs.pop("is_causal", None)
        chunk = layer_chunk(module)
        if chunk is not None:  # chunked attention: segments end at documents and chunk boundaries
            layout = self._per_forward(base, ("chunked", chunk), lambda: base.split_at_chunks(chunk))
        a2a = sp and self.ulysses_size > 1
        # the model's token-index query scale used the shard's 0..S_l-1 (the row's, packed): each document's own
        index = global_token_index(self.sp_group, s_local, layout.seq_len, self.ring_size) if sp else None
        if kwargs.get("indices") is not None:  # DSA picks [B, S_l, topk] -> [B, S, topk] (attention/indexed.py)
            kwargs["indices"] = gather_indices(kwargs["indices"], self.ulysses_group if a2a else None)
        query = correct_query_temperature(module, query, base.positions, index)
        layouts, rank = (base, layout, chunk), dist.get_rank(self.ulysses_group) if a2a else 0
        if self.head_chunks > 1 and not self.in_head_block and (sp or self.sp_size == 1):  # at sp 1 no exchange
            check_no_sinks(module, kwargs, self.head_chunks)  # [B, H*, S_l, D] -> [B, S_l, H, D]
            groups = plan_head_chunks(h, hkv, self.head_chunks, self.ulysses_size if a2a else 1)
            attend = lambda g, q, k, v: self._attend(module, q, k, v, layouts, args, dict(kwargs), h,  # noqa: E731
                                                     rank * groups.n + g)  # fmt: skip
            return head_chunked_attention(query, key, value, attend=attend, groups=groups, overlap=self.head_chunk_overlap,
                                          group=self.ulysses_group if a2a else None), None  # fmt: skip
        if a2a and self.block_overlap is not None and self.ring_size == 1:  # a head group's exchange, posted:
            attend = lambda q, k, v: self._attend(module, q, k, v, layouts, args, kwargs, h, rank)  # noqa: E731
            return self.block_overlap.post(query, key, value, attend, self.ulysses_group), None  # [B, S_l, H, D]
        if a2a:  # P below is the Ulysses size U (= sp size without a ring); S the ring rank's S/R tokens
            packed = packed_exchange(self.exchange, self.ulysses_group, query, key, value)  # by a piece's bytes
            self.last_exchange = "packed" if packed else "headwise"
            # [B, H, S_l, D] -> [B, H_l, S, D], [B, Hkv, S_l, D] -> [B, Hkv_l, S, D] (Hkv < P: rank j's kv head)
            query, key, value = qkv_seq_to_heads(query, key, value, self.ulysses_group, packed=packed)
        out = self._attend(module, query, key, value, layouts, args, kwargs, h, rank, ring=sp)  # [B, S, H_l, D]
        del query, key, value  # the full-sequence q/k/v (not what the core saved) go before the output exchange
        if a2a:
            out = out_heads_to_seq(out, self.ulysses_group, packed=packed)  # [B, S, H_l, D] -> [B, S_l, H, D]
        return out, None

    def _attend(self, module, q, k, v, layouts: tuple, args: tuple, kwargs: dict[str, Any], num_heads: int,
                head_rank: int, ring: bool = True) -> torch.Tensor:  # fmt: skip
        """This rank's heads over the full sequence, ``[B, H_l, S, D] -> [B, S, H_l, D]``: ring attention
        (``ring`` and a ring axis; ``S`` is then the ring rank's ``S/R``) or the core. ``head_rank``:
        which ``H_l``-sized slice of the ``num_heads`` query heads these are (per-head parameters)."""
        base, layout, chunk = layouts
        if ring and self.ring_size > 1:  # K/V around the ring
            window = kwargs.get("sliding_window")
            structure = self._per_forward(base, ("ring", window, chunk), lambda: structure_for(layout, window))
            self.last_path = "ring"
            return run_ring(module, q, k, v, structure, kwargs, group=self.ring_group, chunk=self.attn_chunk,
                            counts=self.block_counts, stats=self.ring_stats)  # fmt: skip
        view = local_view(module, kwargs, num_heads=num_heads, local_heads=q.shape[1], local_kv_heads=k.shape[1],
                          rank=head_rank)  # fmt: skip
        return self._core(view, q, k, v, layouts, args, kwargs)

    def _core(self, view: HeadView, q, k, v, layouts: tuple, args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
        """The core attention over the full sequence: ``[B, H_l, S, D] -> [B, S, H_l, D]``.
        ``layouts``: the forward's layout, this layer's (chunked or the same) and its chunk."""
        base, layout, chunk = layouts
        window, indices = kwargs.get("sliding_window"), kwargs.pop("indices", None)  # DSA picks: the blockwise core
        path = self.last_path = attention_path(self.core, layout, window, self.offload_attention, sinks=kwargs.get(
            "s_aux") is not None, attn_chunk=self.attn_chunk, indexed=indices is not None)  # fmt: skip
        if path == "segments":  # documents' lengths: host ints, once per forward
            lengths = self._per_forward(base, ("segments", chunk), layout.doc_lengths)
            return run_segments(view, q, k, v, lengths, kwargs)
        if path.startswith("blockwise"):
            structure = self._per_forward(base, ("blockwise", window, chunk), lambda: structure_for(layout, window))
            structure = structure if indices is None else IndexedStructure.of(structure, indices)
            return run_blockwise(view, q, k, v, structure, kwargs, chunk=self.attn_chunk,
                                 offload=self.kv_offload, counts=self.block_counts)  # fmt: skip
        mask = self._per_forward(base, (q.dtype, window, chunk), lambda: core_mask(self.core, layout, q.dtype, window))
        if self.core.startswith("flash"):
            kwargs["position_ids"] = layout.positions  # varlen boundaries from the full sequence
        out, _ = core_function(self.core, view._module)(view, q, k, v, mask, *args, is_causal=True, **kwargs)
        return out

    def _per_forward(self, layout: SeqLayout, key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
        """What ``build`` makes from this forward's layout (a mask, the blockwise structure), built
        once per forward (every layer shares it) and released with the forward's state."""
        state = self._forward
        if state is None or state.layout is not layout:  # not cached (cannot happen via __call__)
            return build()
        if key not in state.masks:
            state.masks[key] = build()
        return state.masks[key]

    def prepare_model(self, model: torch.nn.Module) -> HeadBlockHandle | None:
        """With head groups (not Ulysses-Offload): each attention module's whole block per group."""
        return install_head_blocks(model, self) if self.head_chunks > 1 and not self.offload_attention else None

    def reset_calls(self) -> None:
        """Zero the call counter (the guardrail does this before each checked forward)."""
        self.calls = 0

    # ------------------------------------------------------------------ registration
    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
        *,
        mesh: SPMesh | DeviceMesh | None = None,
        attn_chunk: int | None = None,
        offload_attention: bool = False,
        ring_size: int | str | None = None,
        head_chunks: int = 1,
        exchange: str = "auto",
    ) -> SPRegistration:
        """Build the SP groups, register Ulysses attention with transformers, and return an ``mpu``.

        Args:
            model_name_or_path: a ``PreTrainedModel`` (pointed at the SP attention in place) or a
                local model directory (its config is read to check the heads; load the model
                afterwards with ``attn_implementation="ulysses_sp"``). Nothing is downloaded.
            core_attn_implementation: the attention run over the full sequence: ``sdpa``,
                ``eager``, ``flash_attention_2``/``_3`` or ``flex_attention``.
            sequence_parallel_size: ``P``; the data-parallel size is ``world_size / P``.
            micro_batch_size, seq_length: hints (eval may use other sizes).
            seq_length_is_variable: when False, every batch must have ``S == max_length`` (or ``seq_length``).
            disable_in_eval: in ``model.eval()`` plain attention on the local sequence (one-rank evaluation).
            mesh: adopt an existing layout (an ``SPMesh`` from ``init_mesh``, or a ``(data_parallel,
                sequence_parallel)`` ``DeviceMesh``) instead of ``init_mesh(sp_size=sequence_parallel_size)``
                (which reuses a live layout of that shape).
            attn_chunk: tokens per block of the blockwise core (sdpa with packed documents or a window,
                or ``offload_attention``); ``None`` = auto. A block holds ``B * H_l * attn_chunk^2`` fp32 scores.
            offload_attention: Ulysses-Offload (sdpa only): every sequence through the blockwise core,
                the full-sequence K/V on the host between forward and backward, streamed back by chunks.
            ring_size: hybrid Ulysses x Ring: the SP axis factors into ``ring_size`` ring groups of
                ``sequence_parallel_size / ring_size`` Ulysses ranks (K/V passed around the ring,
                zigzag token layout: the data adapter shards accordingly). ``None``/``"auto"``: 1
                when the heads allow Ulysses alone, else the smallest ring size that makes them
                split (with a given ``mesh``: the mesh's ring size). Cores ``sdpa``/``eager``.
            head_chunks: run the attention in this many head groups, one at a time (UPipe): each
                attention module's whole block per group (``attention/head_blocks.py``), else the
                exchange and core per group (``attention/head_chunks.py``); one more block forward in backward.
            exchange: q/k/v's and the output's all-to-all: ``packed`` (one collective each way, a buffer of the
                exchanged size), ``headwise`` (one per batch row and head) or ``auto`` (``parallel/exchange_cost.py``).

        Returns:
            An ``SPRegistration``: an ``Mpu`` (``get_sequence_parallel_group()`` ...) that
            ``initialize(mpu=...)`` accepts, with ``remove()`` to undo the registration.
        """
        require_process_group("register_with_transformers")
        check_core(core_attn_implementation)
        model, config = model_and_config(model_name_or_path)
        # what the launcher also checks before any worker starts (run.model_checks): kinds, heads, options
        ring = check_sp_attention(config, core_attn_implementation, sequence_parallel_size, ring_size=ring_size,
                                  attn_chunk=attn_chunk, offload_attention=offload_attention)  # fmt: skip
        heads = head_counts(config)
        mesh = resolve_layout(mesh, sequence_parallel_size, heads, ring, ring_size)
        check_ring_options(core_attn_implementation, mesh.ring_size, offload_attention)
        for num_heads, num_kv in heads:  # every layer's heads split into the head groups
            plan_head_chunks(num_heads, num_kv, head_chunks, mesh.ulysses_size)
        attn = cls(
            sp_group=mesh.sp_group,
            core_attn_implementation=core_attn_implementation,
            seq_length=seq_length,
            seq_length_is_variable=seq_length_is_variable,
            max_length=max_length,
            disable_in_eval=disable_in_eval,
            attn_chunk=attn_chunk,
            offload_attention=offload_attention,
            ulysses_group=mesh.ulysses_group,
            ring_group=mesh.ring_group,
            head_chunks=head_chunks,
            exchange=exchange,
        )
        return SPRegistration(mesh, attn, model)
