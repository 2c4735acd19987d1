"""Ulysses sequence-parallel attention for HuggingFace transformers models.

``UlyssesSPAttentionHF`` is the core-attention function transformers calls (through its public
``AttentionInterface`` registry, under the name ``"ulysses_sp"``). Each rank's model runs on its
local shard of ``S_l = S/P`` tokens; the attention layer hands us q/k/v after the rotary embedding
as ``[B, H, S_l, D]``. We all-to-all them into ``[B, H_l, S, D]`` (the full sequence for a slice of
the heads), run the **unmodified** core attention (``sdpa``, ``eager``, flash/flex when installed)
causally over the full sequence, and all-to-all the output back to ``[B, S_l, H, D]``. Everything
else in the model (embeddings, norms, MLPs, projections) is token-local and needs no change.

Masks: transformers builds its causal mask for the *local* shard, which is wrong for the full
sequence, so we never use it. Instead we gather the full sequence's ``position_ids`` over the SP
group (once per forward, cached) and build what the full sequence needs: plain causal (no mask
tensor at all for sdpa), or document-causal when position ids restart at 0 (packed documents),
with a sliding window where the model asks for one.

GQA/MQA: kv heads split over ranks like query heads when ``Hkv % P == 0``; when ``Hkv < P`` each kv
head is replicated locally ``P/Hkv`` times *before* the all-to-all, so every rank receives exactly
the one kv head its query heads use — the minimum number of bytes.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``H`` query heads, ``H_l = H/P``,
``Hkv`` kv heads, ``Hkv_l`` kv heads per rank, ``D`` head dim, ``P`` sp size.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .comm import all_gather_seq, heads_to_seq, seq_to_heads
from .masks import SeqLayout, mask_for
from .mesh import Mpu, init_mesh, mesh_info, require_process_group
from .registration import ATTN_NAME, SPRegistration, model_and_config  # noqa: F401 - ATTN_NAME re-exported

logger = logging.getLogger(__name__)

CORE_ATTENTIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


def valid_sp_sizes(num_heads: int, num_kv_heads: int) -> list[int]:
    """SP sizes that split ``num_heads`` query heads and ``num_kv_heads`` kv heads evenly
    (kv heads either split, or replicated when fewer than ``P``)."""
    return [
        p
        for p in range(1, num_heads + 1)
        if num_heads % p == 0 and (num_kv_heads % p == 0 or p % num_kv_heads == 0)
    ]


def check_heads(num_heads: int, num_kv_heads: int, sp_size: int) -> None:
    """Raise ``ValueError`` naming the numbers when the heads cannot be split over ``sp_size``."""
    if num_heads % sp_size == 0 and (num_kv_heads % sp_size == 0 or sp_size % num_kv_heads == 0):
        return
    what = (
        f"num_attention_heads ({num_heads}) is not divisible by sequence_parallel_size ({sp_size})"
        if num_heads % sp_size
        else f"num_key_value_heads ({num_kv_heads}) neither divides nor is divisible by "
        f"sequence_parallel_size ({sp_size})"
    )
    raise ValueError(
        f"{what}; valid sequence_parallel_size values: {valid_sp_sizes(num_heads, num_kv_heads)}"
    )


def _core_function(name: str, module: torch.nn.Module) -> Callable[..., Any]:
    """The unmodified core attention for ``name``; ``eager`` is the model's own eager function."""
    if name == "eager":
        own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        return own if own is not None else _generic_eager
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def _generic_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Plain softmax attention for models whose modeling file has no ``eager_attention_forward``."""
    n_rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(n_rep, 1), value.repeat_interleave(n_rep, 1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # [B, H_l, S, S]
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs  # [B, S, H_l, D]


class UlyssesSPAttentionHF:
    """The sequence-parallel core-attention function registered with transformers.

    Instances are callables with the signature transformers gives attention functions:
    ``fn(module, query, key, value, attention_mask, *, dropout, scaling, **kwargs)`` with q/k/v of
    shape ``[B, H, S_l, D]``, returning ``(output [B, S_l, H, D], None)``.

    Use ``UlyssesSPAttentionHF.register_with_transformers(...)``; it builds the mesh, registers an
    instance, points the model at it, and returns an ``mpu``.
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
    ) -> None:
        if core_attn_implementation not in CORE_ATTENTIONS:
            raise ValueError(
                f"unknown core_attn_implementation {core_attn_implementation!r}; "
                f"choose one of {list(CORE_ATTENTIONS)}"
            )
        self.sp_group = sp_group
        self.sp_size = dist.get_world_size(sp_group)
        self.core = core_attn_implementation
        self.seq_length = seq_length
        self.seq_length_is_variable = seq_length_is_variable
        self.max_length = max_length
        self.disable_in_eval = disable_in_eval
        self.calls = 0
        """Attention calls since the last ``reset_calls()`` (the guardrail counts them)."""
        self.last_seq_len: int | None = None
        """``S`` seen by the most recent call."""
        # The layout cache: the position_ids object it was built from (held, so its id can never be
        # reused by another tensor), that tensor's version counter (in-place edits invalidate), and
        # the call's shape/mode. Hits then depend only on the program, identically on every rank.
        self._layout_src: torch.Tensor | None = None
        self._layout_key: tuple[int, int, bool] | None = None
        self._layout: SeqLayout | None = None
        self._mask_key: tuple[Any, ...] | None = None
        self._mask: Any = None
        self._mask_layout: SeqLayout | None = None

    # ------------------------------------------------------------------ per-forward layout
    def _seq_layout(self, position_ids: torch.Tensor | None, s_local: int, batch: int, device, sp: bool):
        """Gather the full position ids once per forward: every layer of one forward (and its
        checkpoint recompute) receives the same ``position_ids`` object."""
        if position_ids is None:
            position_ids = torch.arange(s_local, device=device)[None]
        key = (position_ids._version, s_local, sp)
        if self._layout_src is position_ids and self._layout_key == key and self._layout is not None:
            return self._layout
        if (
            position_ids.dim() != 2
            or position_ids.shape[-1] != s_local
            or position_ids.shape[0] not in (1, batch)
        ):
            raise ValueError(
                f"position_ids must be [B, S_l] = [{batch}, {s_local}] (or [1, {s_local}]), "
                f"got {tuple(position_ids.shape)}"
            )
        if sp:
            self._check_local_lengths(s_local, device)
            # [B|1, S_l] -> [B|1, S]: every rank needs the whole sequence's positions for the mask.
            positions = all_gather_seq(position_ids, self.sp_group, dim=-1)
        else:
            positions = position_ids
        if (
            sp
            and torch.equal(positions[:, :s_local].repeat(1, self.sp_size), positions)
            and self.sp_size > 1
            and (positions[:, :s_local] == torch.arange(s_local, device=positions.device)).all()
        ):
            raise ValueError(
                "position_ids are local (0..S_l-1 on every SP rank): pass the full-sequence positions of "
                "the local tokens (UlyssesSPDataLoaderAdapter does), not let the model make them"
            )
        self._layout = SeqLayout.from_positions(positions)
        self._layout_src, self._layout_key = position_ids, key
        return self._layout

    def _check_local_lengths(self, s_local: int, device) -> None:
        lengths = all_gather_seq(torch.tensor([s_local], device=device), self.sp_group, dim=0)
        if bool((lengths != s_local).any()):
            raise ValueError(
                f"local sequence lengths differ between SP ranks: {lengths.tolist()}; every rank of an SP "
                "group must hold S/P tokens of the same sequence (use UlyssesSPDataLoaderAdapter)"
            )
        total = s_local * self.sp_size
        expected = self.max_length or self.seq_length
        if not self.seq_length_is_variable and expected is not None and total != expected:
            raise ValueError(
                f"S_l ({s_local}) * sp_size ({self.sp_size}) = {total} != max_length ({expected}) "
                "with seq_length_is_variable=False; pad batches to that length or pass seq_length_is_variable=True"
            )

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
        b, h, s_local, _ = query.shape
        hkv = key.shape[1]
        if sp:
            check_heads(h, hkv, self.sp_size)
        layout = self._seq_layout(kwargs.pop("position_ids", None), s_local, b, query.device, sp)
        self.calls += 1
        self.last_seq_len = layout.seq_len
        kwargs.pop("is_causal", None)
        mask = self._full_mask(layout, query.dtype, kwargs.get("sliding_window"))
        core = _core_function(self.core, module)
        if self.core.startswith("flash"):
            kwargs["position_ids"] = layout.positions  # varlen boundaries from the full sequence
        if not sp:
            out, _ = core(module, query, key, value, mask, *args, is_causal=True, **kwargs)
            return out, None

        p = self.sp_size
        if hkv < p:
            # [B, Hkv, S_l, D] -> [B, P, S_l, D]: rank j will receive the kv head its queries use.
            key = key.repeat_interleave(p // hkv, dim=1)
            value = value.repeat_interleave(p // hkv, dim=1)
        q = seq_to_heads(query, self.sp_group)  # [B, H, S_l, D] -> [B, H_l, S, D]
        k = seq_to_heads(key, self.sp_group)  # [B, Hkv|P, S_l, D] -> [B, Hkv_l, S, D]
        v = seq_to_heads(value, self.sp_group)  # [B, Hkv|P, S_l, D] -> [B, Hkv_l, S, D]
        groups = q.shape[1] // k.shape[1]
        prev = getattr(module, "num_key_value_groups", None)
        module.num_key_value_groups = groups  # the local q/kv head ratio, which differs when Hkv < P
        try:
            out, _ = core(module, q, k, v, mask, *args, is_causal=True, **kwargs)  # [B, S, H_l, D]
        finally:
            if prev is None:
                del module.num_key_value_groups
            else:
                module.num_key_value_groups = prev
        out = heads_to_seq(out, self.sp_group, head_dim=2, seq_dim=1)  # [B, S, H_l, D] -> [B, S_l, H, D]
        return out, None

    def _full_mask(self, layout: SeqLayout, dtype: torch.dtype, sliding_window: int | None) -> Any:
        """The full-sequence mask, built once per forward (every layer shares it)."""
        key = (id(layout), dtype, sliding_window)  # the layout object is held below: its id stays unique
        if self._mask_key != key:
            self._mask = mask_for(layout, self.core, dtype, sliding_window)
            self._mask_key, self._mask_layout = key, layout
        return self._mask

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
        mesh: DeviceMesh | None = None,
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
            seq_length_is_variable: when False, every batch must have ``S == max_length``
                (or ``seq_length``).
            disable_in_eval: in ``model.eval()`` run plain attention on the whole local sequence
                (single-rank evaluation of a model trained with SP).
            mesh: adopt an existing ``(data_parallel, sequence_parallel)`` mesh instead of creating one.

        Returns:
            An ``SPRegistration``: an ``Mpu`` (``get_sequence_parallel_group()`` ...) that
            ``initialize(mpu=...)`` accepts, with ``remove()`` to undo the registration.
        """
        require_process_group("register_with_transformers")
        if core_attn_implementation not in CORE_ATTENTIONS:
            raise ValueError(
                f"unknown core_attn_implementation {core_attn_implementation!r}; "
                f"choose one of {list(CORE_ATTENTIONS)}"
            )
        model, config = model_and_config(model_name_or_path)
        num_heads = config.num_attention_heads
        num_kv = getattr(config, "num_key_value_heads", None) or num_heads
        check_heads(num_heads, num_kv, sequence_parallel_size)
        if mesh is None:
            mesh = init_mesh(sp_size=sequence_parallel_size)
        elif mesh_info(mesh).sp_size != sequence_parallel_size:
            raise ValueError(
                f"sequence_parallel_size ({sequence_parallel_size}) disagrees with the mesh's "
                f"sequence_parallel axis ({mesh_info(mesh).sp_size})"
            )
        attn = cls(
            sp_group=Mpu(mesh).get_sequence_parallel_group(),
            core_attn_implementation=core_attn_implementation,
            seq_length=seq_length,
            seq_length_is_variable=seq_length_is_variable,
            max_length=max_length,
            disable_in_eval=disable_in_eval,
        )
        return SPRegistration(mesh, attn, model)
