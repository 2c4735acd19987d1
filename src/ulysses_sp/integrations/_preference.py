"""TRL's ``DPOTrainer`` and ``KTOTrainer`` under sequence parallelism: their own losses on log-probabilities
gathered over the SP group (``RewardTrainer``: the same data and loss scaling, its head in ``_reward``).

Every DPO loss TRL offers (sigmoid, IPO, hinge, ..., the f-divergences, ``ld_alpha``, WPO weighting)
and every metric it logs is a function of the per-token outputs of one call, TRL's fused LM head
(``trl.trainer.utils.add_fused_lm_head``): ``model(input_ids, attention_mask, labels=..., fused_lm_head=True)``
on the concatenated ``[2B, S]`` chosen + rejected batch returns ``log_probs``, ``entropy``,
``mean_logits``, ``is_top1`` ... ``[2B, S-1]``, computed in tiles without the full logits. So the SP
path changes that call and nothing else (DeepSpeed-Ulysses / verl / OpenRLHF's recipe):

1. **Data** (DESIGN.md step 2): every rank of an SP group gets every batch of the group *whole*
   (``PreferenceDataLoader``: the ``P`` ranks each load one batch, exchange them with one
   ``all_gather_object`` per round and work through them one by one, in the order one process of a
   run without SP would on a ``dp = 1`` layout). TRL's collator built the batch; its padding is
   checked to be on the right.
2. **Forward** (steps 3-4): the fused-head ``forward`` of the policy (the PEFT base model, whose
   adapter-disabled call is the reference) and of a separate ``ref_model`` is wrapped
   (``patch_fused_heads``): the full ``[2B, S]`` input is padded to a multiple of ``P``, the labels are
   shifted over the whole sequence, and rank ``k`` calls TRL's head on its tokens
   ``[k*S_l, (k+1)*S_l)`` with the full-sequence ``position_ids`` (their layout attached) and the
   pre-shifted ``shift_labels`` — TRL's documented SP entry. Its per-token outputs ``[2B, S_l]`` are
   gathered into ``[2B, S-1]`` (``objectives.gather_sequence``: one all-gather of every field
   stacked; the backward hands each rank its own slice).
3. **Loss** (step 5): TRL's ``_compute_loss``, unchanged, on the full-sequence values: the same
   numbers on every rank of the group. ``compute_loss`` scales the gradient by ``P`` (``loss +
   (P-1) * (loss - loss.detach())``, value unchanged) so that the Trainer's DDP/FSDP average over
   ``W = dp * sp`` ranks is the sum over SP and the mean over DP; TRL's token counter divides by
   ``P`` the duplicates an SP group contributes to its gather (its ``_tp_size``, the same case for
   tensor parallelism). Logged means gather the group's ``P`` equal values: unchanged.

Shape legend: ``B`` pairs per batch, ``S`` sequence (chosen and rejected padded alike), ``S_l = S/P``,
``P`` sp size.

``KTOTrainer`` is the same path: its policy, reference and KL-completion passes are the same fused-head call
on unpaired ``[B, S]`` batches (right-padded by its collator). Its KL term is a per-micro-step mean over the
processes' batches (``gather_for_metrics``); at ``dp = 1`` the group's ``P`` equal values leave it unchanged,
but at ``dp > 1`` a micro-step holds ``dp`` distinct batches where the run without SP holds ``dp * sp``, so
no run without SP has the same KL estimate: refused (``loss_type='apo_zero_unpaired'`` has no KL term).
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ulysses_sp.checks import check_seq_len_divisible
from ulysses_sp.data.shard import make_shift_labels
from ulysses_sp.integrations._support import check_trl_sp_path
from ulysses_sp.integrations._trainer import SOURCE_KEY, SPTrainerDataLoader, SPTrainerMixin
from ulysses_sp.objectives.logps import gather_sequence
from ulysses_sp.parallel.comm import all_gather_object, raise_if_any_rank_failed
from ulysses_sp.parallel.doc_layout import HostLayout, attach_layout
from ulysses_sp.parallel.loss import IGNORE_INDEX
from ulysses_sp.parallel.mesh import SPMesh

PREFERENCE_TRAINERS = ("DPOTrainer", "KTOTrainer", "RewardTrainer")
"""TRL trainers whose SP path is this module's (``RewardTrainer`` with ``_reward``'s head)."""

FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
"""The per-token fields of TRL's ``FusedCausalLMOutput`` (``None`` where not asked for)."""


def is_preference_trainer(trainer: Any) -> bool:
    """Whether ``trainer`` is (a subclass of) TRL's ``DPOTrainer``, ``KTOTrainer`` or ``RewardTrainer``."""
    return any(c.__name__ in PREFERENCE_TRAINERS and c.__module__.startswith("trl.") for c in type(trainer).__mro__)


def check_preference(trainer: Any, *, ring_size: int, tiled_loss: bool | int, dp_size: int) -> None:
    """Refuse what the preference SP path does not reproduce exactly, naming it and the fix (``ValueError``)."""
    name = type(trainer).__name__
    if getattr(trainer, "calculate_KL", False) and dp_size > 1:
        raise ValueError(
            f"{name} with loss_type={trainer.loss_type!r} at dp_size={dp_size}: its KL term is a mean over the "
            f"processes' batches of each micro-step, which under sequence parallelism holds {dp_size} distinct "
            f"batches, not {dp_size} x sp; run dp_size=1 (world size = sp_size) or loss_type='apo_zero_unpaired'"
        )
    if getattr(trainer, "aux_loss_enabled", False):
        raise ValueError(
            f"{name}: the MoE auxiliary (load-balancing) loss is not reproduced under sequence parallelism "
            "(each rank routes only its shard's tokens); set router_aux_loss_coef=0.0 in the trainer's config"
        )
    if getattr(trainer, "_is_vlm", False) or getattr(trainer, "_is_vision_dataset", False):
        raise ValueError(f"{name} with a vision-language model or images is not supported under sequence parallelism")
    check_trl_sp_path(trainer, name, ring_size=ring_size, tiled_loss=tiled_loss, stop_at=PREFERENCE_TRAINERS,
                                methods=("compute_loss", "_compute_loss", "compute_ref_log_probs", "_compute_kl_logps"),
                                why="the SP path reproduces TRL's own loss only")  # fmt: skip


# ---------------------------------------------------------------------------------------------- data
def _right_padded(batch: Mapping[str, Any]) -> None:
    """Raise unless ``input_ids [2B, S]`` and every ``attention_mask`` row is real tokens, then padding."""
    ids = batch.get("input_ids")
    if not torch.is_tensor(ids) or ids.dim() != 2:
        raise ValueError(f"a preference batch needs 'input_ids' [2B, S] (keys: {sorted(map(str, batch))})")
    mask = batch.get("attention_mask")
    if mask is not None:
        real = mask != 0
        gap = (~real[:, :-1] & real[:, 1:]).any(dim=1)  # [2B]: padding before a real token
        if bool(gap.any()):
            raise ValueError(
                f"attention_mask rows {gap.nonzero().flatten().tolist()} have padding before real tokens; "
                "sequence parallelism drops attention_mask (causal attention over right padding is exact): "
                "pad on the right, as TRL's DataCollatorForPreference does"
            )


class PreferenceDataLoader(SPTrainerDataLoader):
    """``SPTrainerDataLoader`` whose rounds hand every rank of the group every batch whole (the
    model call shards it, ``patch_fused_heads``); ``len`` and the round order are the same."""

    def _refill(self, it: Iterator[Any]) -> list[dict[str, Any]] | None:
        batch, error = next(it, None), None
        if batch is not None:
            batch = {k: v.cpu() if torch.is_tensor(v) else v for k, v in dict(batch).items()}
            try:
                _right_padded(batch)
            except ValueError as e:
                error = str(e)
        if self.sp_group is None:
            if error is not None:
                raise ValueError(error)
            return None if batch is None else [batch]
        raise_if_any_rank_failed(error, self.sp_group)
        batches = all_gather_object(batch, self.sp_group)  # [P] whole batches, SP-rank order
        if all(b is None for b in batches):
            return None
        done = [r for r, b in enumerate(batches) if b is None]
        if done:
            raise ValueError(f"the SP group's loaders have different lengths: rank(s) {done} of the group ran "
                             "out of batches while the others had one")  # fmt: skip
        return batches


# ---------------------------------------------------------------------------------------------- model
def _shard_call(
    kwargs: dict[str, Any], labels: torch.Tensor, mesh: SPMesh, *, pad_token_id: int, strict: bool
) -> tuple[dict[str, Any], int]:
    """The keyword inputs of this rank's shard of a full-sequence fused-head call, and ``S``."""
    ids = kwargs.pop("input_ids", None)
    if ids is None or kwargs.get("inputs_embeds") is not None or kwargs.get("position_ids") is not None:
        raise ValueError("under sequence parallelism the fused LM head call needs input_ids [2B, S] and no "
                         "inputs_embeds / position_ids (the SP path builds the full-sequence positions)")  # fmt: skip
    kwargs.pop("attention_mask", None)  # right padding (checked by the loader): causal attention is exact
    b, s = ids.shape
    for key, value in kwargs.items():
        if torch.is_tensor(value) and value.dim() >= 2 and tuple(value.shape[:2]) == (b, s):
            raise ValueError(f"the per-token input {key!r} {tuple(value.shape)} is not sharded under sequence "
                             "parallelism; only input_ids and attention_mask are")  # fmt: skip
    p, k = mesh.sp_size, mesh.sp_rank
    if strict:
        check_seq_len_divisible(s, p, fix="set the config's pad_to_multiple_of to")
    padded = math.ceil(s / p) * p
    s_l, cut = padded // p, slice(k * (padded // p), (k + 1) * (padded // p))
    ids = F.pad(ids, (0, padded - s), value=pad_token_id)  # [2B, S] -> [2B, S_pad]
    shift = make_shift_labels(F.pad(labels, (0, padded - s), value=IGNORE_INDEX))  # label t+1 at t, [2B, S_pad]
    pos = torch.arange(k * s_l, (k + 1) * s_l, device=ids.device).repeat(b, 1)  # [2B, S_l] full-sequence ids
    layout = HostLayout(padded, tuple(((0, 0),) for _ in range(b)), pos.dtype)  # one document per row
    shard = dict(kwargs, input_ids=ids[:, cut], position_ids=attach_layout(pos, layout), shift_labels=shift[:, cut])
    return shard, s


def _gather_outputs(out: Any, s: int, mesh: SPMesh) -> Any:
    """TRL's ``FusedCausalLMOutput`` of the shard (``[2B, S_l]`` fields) as the full call returns it:
    ``[2B, S-1]`` fields (position ``t`` scores token ``t+1``), its ``loss`` the mean over them."""
    names = [n for n in FIELDS if getattr(out, n, None) is not None]
    # one all-gather for every field: [2B, S_l, F] -> [2B, S_pad, F] -> [2B, S-1, F]
    stacked = torch.stack([getattr(out, n).to(torch.float32) for n in names], dim=-1)
    full = gather_sequence(stacked, mesh.sp_group)[:, : s - 1]
    fields = {n: full[..., i].to(getattr(out, n).dtype) for i, n in enumerate(names)}
    mask = fields["label_mask"] if "label_mask" in fields else fields["log_probs"] != 0
    fields["loss"] = -fields["log_probs"].sum() / mask.sum().clamp(min=1)
    return type(out)(**fields)


def _sp_fused_forward(fused: Any, mesh: SPMesh, *, pad_token_id: int, strict: bool) -> Any:
    """The fused-head ``forward`` under SP (module docstring, step 2) around TRL's ``fused``."""

    def forward(self: Any, *args: Any, fused_lm_head: bool = False, labels: Any = None, **kwargs: Any) -> Any:
        if not fused_lm_head:  # generation and plain calls: the model as TRL left it
            return fused(*args, labels=labels, **kwargs)
        if args or labels is None:
            raise ValueError("under sequence parallelism the fused LM head takes keyword inputs and labels")
        shard, s = _shard_call(kwargs, labels, mesh, pad_token_id=pad_token_id, strict=strict)
        return _gather_outputs(fused(fused_lm_head=True, **shard), s, mesh)

    return forward


class FusedHeadPatch:
    """The SP wrapper around the fused-head ``forward`` of each given model; ``remove()`` restores them."""

    def __init__(self, models: list[torch.nn.Module], mesh: SPMesh, *, pad_token_id: int, strict: bool) -> None:
        self._saved: list[tuple[torch.nn.Module, Any]] = []
        for model in models:
            fused = vars(model).get("forward")
            if fused is None:
                raise ValueError(f"{type(model).__name__} has no fused LM head (trl add_fused_lm_head): build "
                                 "the trainer before prepare()")  # fmt: skip
            wrapper = _sp_fused_forward(fused, mesh, pad_token_id=pad_token_id, strict=strict)
            model.forward = types.MethodType(wrapper, model)
            self._saved.append((model, fused))

    def remove(self) -> None:
        for model, fused in reversed(self._saved):
            model.forward = fused
        self._saved = []


def fused_head_models(trainer: Any) -> list[torch.nn.Module]:
    """The models TRL gave a fused LM head: the policy (the PEFT base model) and a separate reference."""
    model = trainer.model
    models = [model.get_base_model() if hasattr(model, "peft_config") else model]
    if getattr(trainer, "ref_model", None) is not None:
        models.append(trainer.accelerator.unwrap_model(trainer.ref_model))
    return models


# ---------------------------------------------------------------------------------------------- trainer
class SPPreferenceMixin(SPTrainerMixin):
    """``SPTrainerMixin`` for TRL's ``DPOTrainer``, ``KTOTrainer`` and ``RewardTrainer``: whole batches, TRL's own
    loss (module docstring).
    The eval step is ``SPTrainerMixin``'s (each rank reports the batch it loaded)."""

    _sp_token_weighted = False
    """TRL's losses here are per-batch means (``num_items_in_batch`` unused), in training and in eval."""

    def _sp_loader(self, loader: Any) -> PreferenceDataLoader:
        handle = self._ulysses_sp
        return PreferenceDataLoader(loader, handle.mesh, pad_token_id=handle.pad_token_id, strict=handle.strict)

    def get_batch_samples(self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device) -> Any:
        # the Trainer's own: preference batches carry no labels, its loss is a mean per batch
        return super(SPTrainerMixin, self).get_batch_samples(epoch_iterator, num_batches, device)

    def compute_loss(self, model: torch.nn.Module, inputs: Mapping[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:  # fmt: skip
        """TRL's loss of the group's batch; gradient ``P`` times this rank's share (module docstring)."""
        inputs = {k: v for k, v in inputs.items() if k != SOURCE_KEY}
        p = self._ulysses_sp.mesh.sp_size
        prev = getattr(self, "_tp_size", 1)
        self._tp_size = prev * p  # every rank of the group holds the same batch: its tokens count once
        try:
            out = super(SPTrainerMixin, self).compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            self._tp_size = prev
        loss = out[0] if return_outputs else out
        loss = loss + (p - 1) * (loss - loss.detach())  # the W-average of the gradients: sum over SP
        return (loss, out[1]) if return_outputs else loss

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        raise ValueError(
            f"precomputing reference log-probs for the {name!r} dataset after prepare() is not supported under "
            "sequence parallelism (its loader gives each rank different batches); pass the dataset as "
            "eval_dataset when building the trainer (it is precomputed there, before prepare())"
        )
