"""TRL's ``GRPOTrainer`` and ``RLOOTrainer`` under sequence parallelism: each rank is what it is without SP,
except that its SP group computes the ranks' per-token log-probabilities together.

Both trainers build every loss (each ``loss_type``), advantage, importance ratio and metric from one
method's output, ``_get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep)``:
the log-probability (and entropy) of each completion token under the policy (the training pass, the
old log-probs of ``num_iterations > 1`` / ``steps_per_generation``) or the reference model. The SP path
replaces that method and wraps generation; nothing else (no SP data loader, no SP loss):

1. **Generation and rewards, without SP.** TRL's ``RepeatSampler`` draws one index order on every
   process (same seed) and accelerate's loader gives rank ``r`` of a ``W``-process run its contiguous
   slice of each generation batch; sampling is seeded per process (``set_seed(seed,
   device_specific=True)``); rewards are gathered over all ``W`` processes to normalise advantages. None
   of that depends on SP, so every rank generates and scores exactly the completions it does in the
   same run without SP — each prompt once, the generation spread over all ``W`` ranks, not ``P`` copies
   of a group's work. ``_generate`` runs the policy on its core attention (the attention mask and KV
   cache as transformers runs them), with the SP guard off.
2. **Per-token log-probs, with SP** (DESIGN.md steps 3-5). The ``P`` ranks of a group exchange their
   batches (token ids and each row's padding spans, host values, one ``all_gather_object``) and then take
   them one source rank (and TRL ``batch_size`` chunk) at a time: each row's real tokens first (TRL
   left-pads prompts and right-pads completions), its position ids those of the run without SP
   (``arange(T)``: the left padding's offset kept), padded to a multiple of ``P``. Rank ``k`` runs TRL's
   fused LM head (``add_fused_lm_head``: no ``[B, S, V]`` logits) on tokens ``[k*S_l, (k+1)*S_l)`` of
   those rows with pre-shifted ``shift_labels`` — ``B x T/P`` tokens per rank per forward, the ``1/P``
   SP is for; the per-token fields are gathered (``gather_sequence``) and the source rank keeps them, in
   TRL's ``[B, logits_to_keep]`` layout (zeros off the completion, as TRL's labels ``-100`` give).
3. **Loss and gradients.** These values carry no graph. TRL's ``_compute_loss`` runs unchanged on each
   rank for its own batch, so its value and every logged metric (reward, KL, entropy, clip ratios,
   completion lengths and their collectives over ``W`` processes) are those of the run without SP.
   ``compute_loss`` then takes the loss's gradient with respect to the per-token values and recomputes
   the forward one source rank's rows at a time, back-propagating ``sum(values * gradient)`` on the
   source rank and zero on the others: the gather's backward sums the group's gradients before each
   rank takes its token slice (``sum_grads``), so after the rounds the group's parameter gradients add
   up to the gradient of the sum of its ranks' losses, and the Trainer's DDP/FSDP average over ``W`` is
   the run without SP's — no scaling. Every round but the last accumulates under ``no_sync``; each is
   scaled as ``Trainer.training_step`` scales its backward. Cost: one forward more than without SP (the
   no-grad pass), as with full activation checkpointing.

The oracle is the same trainer on the same ``W`` processes without SP (one process without SP samples
other completions: its seed and its slice of the generation batch differ).

Shape legend: ``B`` rows of one rank's chunk, ``T`` its prompt + completion length, ``C`` its
``logits_to_keep``, ``S`` its longest real run padded to a multiple of ``P``,
``S_l = S/P``, ``F`` per-token fields, ``P`` sp size.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from ulysses_sp.integrations._support import check_trl_sp_path
from ulysses_sp.objectives.logps import gather_sequence
from ulysses_sp.parallel.comm import all_gather_object
from ulysses_sp.parallel.doc_layout import HostLayout, attach_layout
from ulysses_sp.parallel.loss import IGNORE_INDEX
from ulysses_sp.parallel.mesh import SPMesh

RL_TRAINERS = ("GRPOTrainer", "RLOOTrainer")
"""TRL trainers whose SP path is this module's."""

OWN_METHODS = ("_get_per_token_logps_and_entropies", "_generate", "compute_loss", "_compute_loss")
"""What a subclass may not override: the SP path replaces the first two and reproduces TRL's loss only."""


def is_rl_trainer(trainer: Any) -> bool:
    """Whether ``trainer`` is (a subclass of) TRL's ``GRPOTrainer`` or ``RLOOTrainer``."""
    return any(c.__name__ in RL_TRAINERS and c.__module__.startswith("trl.") for c in type(trainer).__mro__)


def check_rl(trainer: Any, *, ring_size: int, tiled_loss: bool | int) -> None:
    """Refuse what the RL SP path does not reproduce exactly, naming it and the fix (``ValueError``)."""
    name, args = type(trainer).__name__, trainer.args
    if getattr(trainer, "aux_loss_enabled", False):
        raise ValueError(
            f"{name}: the MoE auxiliary (load-balancing) loss is not reproduced under sequence parallelism "
            "(each rank routes only its shard's tokens); set router_aux_loss_coef=0.0 in the config"
        )
    if getattr(trainer, "_is_vlm", False):
        raise ValueError(f"{name} with a vision-language model is not supported under sequence parallelism")
    if getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) == "colocate":
        raise ValueError(
            f"{name} with use_vllm=True, vllm_mode='colocate' is not supported under sequence parallelism (a vLLM "
            "engine inside every training process, untested with the SP groups); run a vLLM server "
            "(vllm_mode='server': generation outside the training processes) or generate with transformers"
        )
    if getattr(args, "use_transformers_continuous_batching", False):
        raise ValueError(
            f"{name} with use_transformers_continuous_batching=True is not supported under sequence parallelism "
            "(its paged attention is not the core attention the SP path restores for generation); set it to False"
        )
    check_trl_sp_path(trainer, name, ring_size=ring_size, tiled_loss=tiled_loss, stop_at=RL_TRAINERS, methods=OWN_METHODS,
                                why="the SP path replaces TRL's per-token log-probabilities and wraps its generation, "
                                "and reproduces TRL's own loss only")  # fmt: skip


def reference_model(trainer: Any) -> torch.nn.Module | None:
    """A separate reference model (``beta > 0`` without PEFT), unwrapped; ``None`` otherwise."""
    ref = getattr(trainer, "ref_model", None)
    return None if ref is None else trainer.accelerator.unwrap_model(ref)


# ---------------------------------------------------------------------------------------------- layout
def _spans(mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """Per row: ``a`` padding tokens, then ``b`` real ones, then padding only (raises otherwise)."""
    real = mask.detach().cpu() != 0  # [B, T]
    b = real.sum(dim=1)  # [B]
    a = torch.where(b > 0, real.int().argmax(dim=1), 0)  # [B]: the first real token
    idx = torch.arange(real.shape[1])
    inside = (idx >= a[:, None]) & (idx < (a + b)[:, None])  # [B, T]
    bad = (inside != real).any(dim=1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"attention_mask rows {bad} have padding between real tokens; under sequence parallelism each row "
            "must be left padding, real tokens, right padding (TRL's prompt + completion layout)"
        )
    return a.tolist(), b.tolist()


Batch = tuple[torch.Tensor, list[int], list[int], int]
"""One rank's rows as the group exchanges them: token ids ``[B, T]`` (host), each row's ``a`` left-padding
and ``b`` real tokens (``_spans``), and ``logits_to_keep``."""


def exchange(ids: torch.Tensor, mask: torch.Tensor, keep: int, mesh: SPMesh) -> list[Batch]:
    """Every rank's rows, in SP-rank order (host values, one ``all_gather_object``; a collective)."""
    a, b = _spans(mask)
    return all_gather_object((ids.detach().cpu(), a, b, keep), mesh.sp_group)


def chunks(batch: Batch, rows: int) -> Iterator[Batch]:
    """``batch`` in pieces of at most ``rows`` rows (TRL's ``batch_size`` chunking)."""
    ids, a, b, keep = batch
    for i in range(0, ids.shape[0], rows):
        yield ids[i : i + rows], a[i : i + rows], b[i : i + rows], keep


def _lay_out(batch: Batch, p: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` and ``shift_labels`` ``[B, S]`` as the SP forward takes them: each row's real tokens first,
    padded to a multiple of ``P``; the label at ``i`` is token ``i+1`` where TRL scores it, else ``-100``."""
    ids, a_k, b_k, keep = batch
    s = math.ceil(max(1, max(b_k, default=0)) / p) * p
    tokens = torch.full((ids.shape[0], s), pad_token_id, dtype=torch.long)  # [B, S]
    shift = torch.full((ids.shape[0], s), IGNORE_INDEX, dtype=torch.long)  # [B, S]
    for row, (a, b) in enumerate(zip(a_k, b_k)):
        tokens[row, :b] = ids[row, a : a + b]
        first = max(ids.shape[1] - keep - a, 1)  # the first scored token's index in the real run
        shift[row, first - 1 : b - 1] = ids[row, a + first : a + b]
    return tokens, shift


def source_logps(model: Any, batch: Batch, mesh: SPMesh, *, pad_token_id: int, entropy: bool,
                 device: torch.device) -> tuple[torch.Tensor, torch.dtype]:  # fmt: skip
    """The per-token log-probs (and entropies) ``[B, keep, F]`` of one rank's rows, on every rank of the group,
    computed by the group together (module docstring, step 2), in TRL's layout; and the head's dtype.

    Differentiable: the gather's backward sums the group's gradients before each rank takes its token
    slice, so the rank whose rows these are may back-propagate its loss while the others pass zeros."""
    ids, a_k, _, keep = batch
    tokens, shift = _lay_out(batch, mesh.sp_size, pad_token_id)
    s = tokens.shape[1]
    s_l, k = s // mesh.sp_size, mesh.sp_rank
    cut = slice(k * s_l, (k + 1) * s_l)
    pos = torch.tensor(a_k)[:, None] + torch.arange(k * s_l, (k + 1) * s_l)  # [B, S_l]: the positions without SP
    layout = HostLayout(s, tuple(((0, a),) for a in a_k))  # one document per row
    out = model(input_ids=tokens[:, cut].to(device), position_ids=attach_layout(pos.to(device), layout),
                shift_labels=shift[:, cut].to(device), fused_lm_head=True)  # fmt: skip
    names = ("log_probs", "entropy") if entropy else ("log_probs",)
    # one all-gather for every field: [B, S_l, F] -> [B, S, F]; backward: summed over the group, then sliced
    full = gather_sequence(torch.stack([getattr(out, n).float() for n in names], dim=-1), mesh.sp_group,
                           sum_grads=True)  # fmt: skip
    # TRL's column j scores token T-C+j, predicted at the real-run index T-C+j-1-a
    idx = torch.arange(ids.shape[1] - keep - 1, ids.shape[1] - 1)[None] - torch.tensor(a_k)[:, None]  # [B, C]
    valid = ((idx >= 0) & (idx < s)).to(device)
    picked = full.gather(1, idx.clamp(0, s - 1).to(device)[..., None].expand(-1, -1, len(names)))  # [B, C, F]
    return picked.masked_fill(~valid[..., None], 0.0), out.log_probs.dtype


@contextlib.contextmanager
def unsharded(model: Any, attention: Any) -> Iterator[None]:
    """``model`` on its core attention and the SP guard off: generation without SP (each rank its own)."""
    prev_impl, prev_size = model.config._attn_implementation, attention.sp_size
    model.set_attn_implementation(attention.core)
    attention.sp_size = 1  # the registration's guard checks SP forwards only
    try:
        yield
    finally:
        attention.sp_size = prev_size
        model.set_attn_implementation(prev_impl)


# ---------------------------------------------------------------------------------------------- trainer
class SPRLMixin:
    """The SP overrides of TRL's ``GRPOTrainer`` / ``RLOOTrainer`` (module docstring); put in front of the
    trainer's class by ``integrations.transformers.prepare``, which sets ``_ulysses_sp``."""

    _ulysses_sp: Any  # integrations.transformers.SPTrainerHandle

    _sp_training_pass: list[Any] | None = None
    """While ``compute_loss`` runs TRL's loss: the training pass's inputs and leaf values (``_sp_backward``)."""

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                           logits_to_keep: int, batch_size: int | None = None,
                                           compute_entropy: bool = False, compute_aux_loss: bool = False,
                                           **multimodal: Any) -> tuple[torch.Tensor, torch.Tensor | None, None]:  # fmt: skip
        """TRL's per-token log-probs and entropies ``[B, C]`` of this rank's rows, computed by the SP group one
        source rank's rows at a time (``B x T/P`` tokens per rank per forward), without a graph: the training
        pass returns leaves whose gradients ``compute_loss`` back-propagates (``_sp_backward``)."""
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given or compute_aux_loss:
            raise ValueError(f"under sequence parallelism the RL log-probs take token ids only (given: "
                             f"{given or ['compute_aux_loss']})")  # fmt: skip
        capture = self._sp_training_pass
        if torch.is_grad_enabled() and capture is None:
            raise ValueError("under sequence parallelism the RL log-probs with a graph come from compute_loss only")
        handle = self._ulysses_sp
        group = exchange(input_ids, attention_mask, logits_to_keep, handle.mesh)
        rows, mine, dtype = batch_size or input_ids.size(0), [], None
        with torch.no_grad():
            for j, batch in enumerate(group):
                for part in chunks(batch, rows):
                    with self.accelerator.autocast():  # type: ignore[attr-defined]
                        picked, dtype = source_logps(model, part, handle.mesh, pad_token_id=handle.pad_token_id,
                                                     entropy=compute_entropy, device=input_ids.device)  # fmt: skip
                    if j == handle.mesh.sp_rank:
                        mine.append(picked)
        values = [v.to(dtype).clone() for v in torch.cat(mine).unbind(-1)]  # [B, C] per field
        if capture is not None:
            capture.append((model, group, rows, [v.requires_grad_() for v in values]))
        return values[0], values[1] if compute_entropy else None, None

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:  # fmt: skip
        """TRL's loss of this rank's batch; its gradient back-propagated here, one source rank at a time."""
        if not torch.is_grad_enabled():
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)  # type: ignore[misc]
        self._sp_training_pass = []
        try:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)  # type: ignore[misc]
        finally:
            passes, self._sp_training_pass = self._sp_training_pass, None
        if len(passes) != 1:
            raise ValueError(f"expected one training pass of the per-token log-probs per loss, got {len(passes)}")
        grads = torch.autograd.grad(loss, passes[0][3], allow_unused=True)  # dL/d(log-probs, entropies) [B, C]
        upstream = torch.stack([torch.zeros_like(v) if g is None else g for g, v in zip(grads, passes[0][3])], -1)
        self._sp_backward(*passes[0][:3], upstream * self._sp_accumulation_scale(num_items_in_batch))
        return loss.detach().requires_grad_()  # the gradient is in place; the Trainer's backward adds nothing

    def _sp_backward(self, model: Any, group: list[Batch], rows: int, upstream: torch.Tensor) -> None:
        """The parameter gradients of this rank's loss, the group's rows recomputed one source rank's chunk at a
        time (module docstring, step 3); each rank's ``upstream`` ``[B, C, F]`` enters at its own rows. Every
        round but the last accumulates without DDP's sync; the last syncs when the Trainer's step does."""
        handle, acc = self._ulysses_sp, self.accelerator  # type: ignore[attr-defined]
        rounds = [(j, i * rows, part) for j, batch in enumerate(group) for i, part in enumerate(chunks(batch, rows))]
        for n, (j, start, part) in enumerate(rounds):
            with contextlib.nullcontext() if n == len(rounds) - 1 else acc.no_sync(model):
                with acc.autocast():
                    picked, _ = source_logps(model, part, handle.mesh, pad_token_id=handle.pad_token_id,
                                             entropy=upstream.shape[-1] > 1, device=upstream.device)  # fmt: skip
                own = j == handle.mesh.sp_rank
                acc.backward((picked * upstream[start : start + picked.shape[0]]).sum() if own else picked.sum() * 0)

    def _sp_accumulation_scale(self, num_items_in_batch: Any) -> float:
        """What ``Trainer.training_step`` divides the loss by before its backward (gradient accumulation)."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = (getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None) or (
                getattr(self, "compute_loss_func", None) is not None)  # fmt: skip
        return 1.0 if scaled else 1.0 / self.current_gradient_accumulation_steps  # type: ignore[attr-defined]

    def _generate(self, prompts: list[Any]) -> Any:
        with unsharded(self.model, self._ulysses_sp.registration.attention):  # type: ignore[attr-defined]
            return super()._generate(prompts)  # type: ignore[misc]
