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

    def __init__(self, loader: Iterable[Any], mesh: SPMesh, *, pad_token_id: int, strict: bool) -> None:
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
        return SPTrainerDataLoader(
            loader, handle.mesh, pad_token_id=handle.pad_token_id, strict=handle.strict
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

        The Trainer counts ``labels``, which SP shards do not carry: count ``shift_labels`` here, over
        every rank (``average_tokens_across_devices``) or over the SP group. A collective on every
        rank; every rank has the same number of batches (the adapter's contract).
        """
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)  # type: ignore[misc]
        if not getattr(self, "model_accepts_loss_kwargs", False):
            return batches, None
        local = torch.zeros((), dtype=torch.int64, device=device)
        for batch in batches:
            local += (batch["shift_labels"] != IGNORE_INDEX).sum().to(device)
        mesh = self._ulysses_sp.mesh
        group = mesh.reduce_group if self.args.average_tokens_across_devices else mesh.sp_group  # type: ignore[attr-defined]
        return batches, all_reduce_sum(local, group)

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: Mapping[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """Causal-LM loss of this rank's shard, normalised as the class docstring of this module says."""
        inputs = dict(inputs)
        inputs.pop(SOURCE_KEY, None)
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
        else:
            scale = mesh.world_size if self.args.average_tokens_across_devices else mesh.sp_size  # type: ignore[attr-defined]
            loss = total / num_items_in_batch * scale
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
        """
        inputs = dict(self._prepare_inputs(inputs))  # type: ignore[attr-defined]
        source = inputs.pop(SOURCE_KEY)
        handle = self._ulysses_sp
        with torch.no_grad(), self.compute_loss_context_manager():  # type: ignore[attr-defined]
            loss = self.compute_loss(model, inputs).detach()
        if source == handle.mesh.sp_rank:
            handle.own_eval_loss = loss
        if source < handle.mesh.sp_size - 1:
            return None, None, None
        own, handle.own_eval_loss = handle.own_eval_loss, None
        return own, None, None
