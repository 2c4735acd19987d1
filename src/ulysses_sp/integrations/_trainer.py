"""What a ``transformers.Trainer`` runs under sequence parallelism: its loaders, its loss, its eval step.

``SPTrainerMixin`` overrides the five ``Trainer`` methods that touch the sequence dimension and
nothing else; ``integrations.transformers.prepare`` puts it in front of a trainer's own class.

Where it sits in the step (DESIGN.md):

1. **Data** (step 2): every ``get_*_dataloader`` wraps the Trainer's own (accelerate-prepared,
   sharded over all ``dp * sp`` processes) loader in ``SPTrainerDataLoader``, the library's
   ``UlyssesSPDataLoaderAdapter``: the ``P`` ranks of an SP group work through their ``P`` batches
   one by one, each holding ``S_l = S/P`` tokens with pre-shifted ``shift_labels`` and full-sequence
   ``position_ids`` (built when the collator gives none). On a ``dp=1`` layout the group sees the
   batches in the order one process of a non-SP run would; each rank runs ``P`` times as many
   micro-steps, so ``gradient_accumulation_steps * P`` gives the global batch of a non-SP run on the
   same number of processes.
2. **Loss** (step 5): ``sp_causal_lm_loss``'s parts on the local shard, normalised the way the
   Trainer normalises the model's own loss (below).
3. **Gradients** (step 7): the Trainer's DDP / FSDP (through accelerate) *averages* gradients over
   all ``W = dp * sp`` processes. The rule we need is *sum over SP, mean over DP*; each rank's
   backward carries the factor that turns the one into the other:

   - token-weighted (the Trainer's default when the model takes ``num_items_in_batch``): the loss
     is ``local_sum / N * W`` with ``N`` the valid tokens of the whole accumulated global batch
     (``average_tokens_across_devices``), exactly what the Trainer does without SP; averaging over
     ``W`` ranks then sums every rank's token share. Without ``average_tokens_across_devices``,
     ``N`` counts the SP group's tokens and the factor is ``P``: a mean over DP replicas.
   - per-batch mean (models without loss kwargs): the value is the SP group's exact mean
     (``sp_mean_loss``) and its gradient ``P`` times this rank's share; the Trainer divides by the
     accumulation steps, the ``W``-average makes it a sum over SP and a mean over DP.

   The logged loss is the Trainer's mean over all ranks of these values: the global token mean (or
   mean of batch means) of a non-SP run, never scaled by ``P``.
4. **Eval**: the same loaders and loss under ``no_grad``; every rank of an SP group returns the
   group's exact mean, so the Trainer's gather-and-mean gives the non-SP eval loss.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P`` local sequence, ``V`` vocabulary,
``P`` sp size, ``W = dp * sp`` processes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from ulysses_sp.data import UlyssesSPDataLoaderAdapter
from ulysses_sp.integrations.alst import loss_parts
from ulysses_sp.parallel.comm import all_reduce_sum
from ulysses_sp.parallel.loss import IGNORE_INDEX, sp_mean_loss
from ulysses_sp.parallel.mesh import SPMesh
from ulysses_sp.vlm.adapter import vlm_round

VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
"""Padding-free collator outputs (TRL's) that describe the *unsharded* sequence for varlen kernels.
Dropped: the SP attention derives the full sequence's document boundaries from ``position_ids``."""

SOURCE_KEY = "ulysses_sp_source_rank"
"""Added to every shard: the SP rank whose loader produced the batch (its place in the round)."""


class _WithoutVarlenKeys:
    """The Trainer's loader, minus ``VARLEN_KEYS`` (no collective: safe on one rank)."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            if isinstance(batch, Mapping):
                batch = {k: v for k, v in batch.items() if k not in VARLEN_KEYS}
            yield batch


class SPTrainerDataLoader(UlyssesSPDataLoaderAdapter):
    """``UlyssesSPDataLoaderAdapter`` over a Trainer's loader, with what the Trainer asks of a loader.

    ``len`` is ``P * len(loader)``; ``set_epoch`` (reshuffling), ``dataset``, ``batch_size`` and
    ``batch_sampler`` forward to the wrapped loader. Batches are dicts with ``input_ids [B, S]`` and optionally
    ``labels``, ``attention_mask`` (right padding only), ``position_ids`` (packed documents restart
    at 0); the shards are ``{"input_ids", "position_ids", "shift_labels": [B, S_l], ...}``.
    """

    def __init__(
        self, loader: Iterable[Any], mesh: SPMesh, *, pad_token_id: int, strict: bool, vlm_model: Any = None
    ) -> None:
        super().__init__(
            _WithoutVarlenKeys(loader),
            mesh.sp_rank,
            mesh.sp_group,
            mesh.sp_size,
            mesh.device,
            pad_token_id=pad_token_id,
            strict=strict,
        )
        self.loader = loader
        """The Trainer's own loader."""
        self.vlm_model = vlm_model
        """A vision-language model: whole batches to every rank (``vlm.adapter``), else ``None``."""

    def _refill(self, it: Iterator[Any]) -> list[dict[str, Any]] | None:
        return super()._refill(it) if self.vlm_model is None else vlm_round(self, it, self.vlm_model)

    @property
    def dataset(self) -> Any:
        return self.loader.dataset  # type: ignore[attr-defined]

    @property
    def batch_size(self) -> int | None:
        return getattr(self.loader, "batch_size", None)

    @property
    def batch_sampler(self) -> Any:
        """The wrapped loader's, so the Trainer reaches its sampler's ``set_epoch`` as without SP."""
        return getattr(self.loader, "batch_sampler", None)

    @property
    def sampler(self) -> Any:
        """Read only by ``accelerate.skip_first_batches`` (resuming mid-epoch), which would rebuild a
        plain loader in place of this one: refused with the fix."""
        raise ValueError(
            "resuming from a mid-epoch checkpoint is not supported under sequence parallelism (skipping "
            "the epoch's first batches would replace the SP loader); pass ignore_data_skip=True in "
            "TrainingArguments (the resumed epoch starts its data order again) or resume from a "
            "checkpoint at an epoch boundary"
        )

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # Every round yields the group's P batches in SP-rank order.
        for step, shard in enumerate(super().__iter__()):
            shard[SOURCE_KEY] = step % self.sp_world_size
            yield shard


def group_mean_loss(total: torch.Tensor, count: torch.Tensor, mesh: SPMesh) -> torch.Tensor:
    """The SP group's exact mean loss as the value, ``P`` times this rank's share as the gradient.

    Under a gradient average over all ``dp * sp`` ranks (DDP, FSDP) this gives the sum over SP and
    the mean over DP. ``m - m.detach()`` is zero with the share's gradient.
    """
    mean = sp_mean_loss(total, count, mesh.sp_group)
    return mean + (mesh.sp_size - 1) * (mean - mean.detach())


class SPTrainerMixin:
    """The sequence-parallel overrides of a ``transformers.Trainer`` (put in front of its class by
    ``integrations.transformers.prepare``, which sets ``_ulysses_sp``)."""

    _ulysses_sp: Any  # integrations.transformers.SPTrainerHandle

    # ------------------------------------------------------------------ loaders
    def _sp_loader(self, loader: Iterable[Any]) -> SPTrainerDataLoader:
        handle = self._ulysses_sp
        vlm = None if handle.vlm is None else handle.vlm.model
        return SPTrainerDataLoader(
            loader, handle.mesh, pad_token_id=handle.pad_token_id, strict=handle.strict, vlm_model=vlm
        )

    def get_train_dataloader(self) -> SPTrainerDataLoader:
        return self._sp_loader(super().get_train_dataloader())  # type: ignore[misc]

    def get_eval_dataloader(self, eval_dataset: Any = None) -> SPTrainerDataLoader:
        return self._sp_loader(super().get_eval_dataloader(eval_dataset))  # type: ignore[misc]

    def get_test_dataloader(self, test_dataset: Any) -> SPTrainerDataLoader:
        return self._sp_loader(super().get_test_dataloader(test_dataset))  # type: ignore[misc]

    # ------------------------------------------------------------------ loss
    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[Any], torch.Tensor | None]:
        """The Trainer's batches of one optimizer step, and ``N`` for token-weighted losses.

        The Trainer counts ``labels``, which SP shards do not carry: count ``shift_labels`` here.
        ``average_tokens_across_devices``: ``N`` is the valid tokens of every rank (a scalar).
        Otherwise a run without SP normalises each rank's batches by that rank's own count, so ``N``
        is a ``[P]`` tensor: entry ``j`` counts the batches the group's rank ``j`` loaded (its
        ``SOURCE_KEY``), summed over the group. A collective on every rank; every rank has the
        same number of batches (the adapter's contract).
        """
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)  # type: ignore[misc]
        if not getattr(self, "model_accepts_loss_kwargs", False):
            return batches, None
        mesh = self._ulysses_sp.mesh
        local = torch.zeros(mesh.sp_size, dtype=torch.int64, device=device)  # [P]: tokens per source rank
        for batch in batches:
            local[batch[SOURCE_KEY]] += (batch["shift_labels"] != IGNORE_INDEX).sum().to(device)
        if self.args.average_tokens_across_devices:  # type: ignore[attr-defined]
            return batches, all_reduce_sum(local.sum(), mesh.reduce_group)
        return batches, all_reduce_sum(local, mesh.sp_group)

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: Mapping[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """Causal-LM loss of this rank's shard, normalised as the class docstring of this module says."""
        inputs = dict(inputs)
        source = inputs.pop(SOURCE_KEY, None)
        shift_labels = inputs.pop("shift_labels", None)
        if shift_labels is None:
            raise ValueError(
                f"batch without 'shift_labels' (keys: {sorted(inputs)}): under sequence parallelism every "
                "batch must come from the trainer's get_*_dataloader (do not override them after prepare())"
            )
        inputs.setdefault("use_cache", False)
        alst = self._ulysses_sp.alst
        shards = False if alst is None else alst.options.loss_shards
        outputs, total, count = loss_parts(model, inputs, shift_labels, shards)  # tiled: no [B, S_l, V]
        mesh = self._ulysses_sp.mesh
        if num_items_in_batch is None:
            loss = group_mean_loss(total, count, mesh)
        elif self.args.average_tokens_across_devices:  # type: ignore[attr-defined]
            loss = total / num_items_in_batch * mesh.world_size
        else:  # N of the rank that loaded this batch; the W-average of the ranks' gradients as without SP
            loss = total / torch.as_tensor(num_items_in_batch)[source].clamp(min=1)
        return (loss, outputs) if return_outputs else loss

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: Mapping[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, None, None]:
        """Eval with SP: each batch's exact loss, reported as a run without SP reports it.

        Every micro-step computes the SP group's mean loss of one batch (a collective). Without SP,
        each rank reports the loss of the batch *it* loaded and the Trainer gathers them (dropping
        the duplicates that even out the last batch); so each rank keeps the loss of its own batch
        (micro-step ``sp_rank`` of the round) and reports it at the round's last micro-step, ``None``
        before: the same gather, on every rank at the same step. Logits stay sharded (never
        ``[B, S, V]`` on one rank), so only the loss is returned.

        What a rank reports is what the trainer's own ``prediction_step`` would: TRL's (and most
        subclasses') the batch's token mean; ``transformers.Trainer``'s, for a model taking
        ``num_items_in_batch`` with ``average_tokens_across_devices``, the batch's token sum over
        the valid tokens of all ``W`` ranks' batches of that eval step, times ``W``
        (``eval_tokens_across_ranks``).
        """
        inputs = dict(self._prepare_inputs(inputs))  # type: ignore[attr-defined]
        source = inputs.pop(SOURCE_KEY)
        handle = self._ulysses_sp
        mesh = handle.mesh
        with torch.no_grad(), self.compute_loss_context_manager():  # type: ignore[attr-defined]
            loss = self.compute_loss(model, inputs).detach()
        across = eval_tokens_across_ranks(self)
        if across:  # the batch's valid tokens, summed over the group (one more collective)
            count = all_reduce_sum((inputs["shift_labels"] != IGNORE_INDEX).sum(), mesh.sp_group)
        if source == mesh.sp_rank:
            handle.own_eval_loss = (loss, count) if across else loss
        if source < mesh.sp_size - 1:
            return None, None, None
        own, handle.own_eval_loss = handle.own_eval_loss, None
        if across:  # own batch's token sum / all W ranks' tokens * W
            mean, count = own
            total = all_reduce_sum(count, mesh.reduce_group).clamp(min=1)
            own = (mean.double() * count / total * mesh.world_size).to(mean.dtype)
        return own, None, None


def eval_tokens_across_ranks(trainer: Any) -> bool:
    """Whether the trainer's own eval step (below the SP mixin) normalises a batch's loss by the
    tokens of every rank's batch: ``transformers.Trainer.prediction_step`` does for a model taking
    ``num_items_in_batch`` under ``average_tokens_across_devices``; TRL's trainers override it with a
    per-batch mean."""
    from transformers import Trainer

    own_class = trainer._ulysses_sp._trainer_class
    return (
        getattr(trainer, "_sp_token_weighted", True)  # False: a TRL loss that ignores num_items_in_batch
        and own_class.prediction_step is Trainer.prediction_step
        and bool(getattr(trainer, "model_accepts_loss_kwargs", False))
        and bool(trainer.args.average_tokens_across_devices)
    )
