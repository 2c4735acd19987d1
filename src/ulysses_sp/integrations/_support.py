"""Which trainers and kernels the SP Trainer path reproduces exactly, and the refusal of the rest.

``SPTrainerMixin`` replaces the trainer's ``compute_loss`` with the exact causal-LM negative
log-likelihood (``transformers.Trainer``'s and TRL ``SFTTrainer``'s ``loss_type="nll"``). A
trainer whose own class computes another objective would be trained on the wrong loss without a
word, so ``prepare`` refuses it, naming the class and the reason:

- TRL's distillation trainers and ``trl.experimental``'s ``ORPOTrainer`` / ``CPOTrainer``: their
  losses read the full-sequence ``[B, S, V]`` logits (a teacher's distribution; ORPO/CPO's chosen NLL
  and log-probs sliced from ``outputs.logits``) on one rank, which SP never gathers (``S/P`` tokens per
  rank). ``DPOTrainer``, ``KTOTrainer``, ``RewardTrainer`` (``_preference``, ``_reward``),
  ``GRPOTrainer`` and ``RLOOTrainer`` (``_rl``) gather per-token values instead and are not checked here.
- any other subclass that defines its own ``compute_loss``: the same reason, for an objective we
  cannot know.

Liger kernels (``use_liger_kernel``): Triton, GPU only. On CPU they are refused. On CUDA the
position-wise kernels (RMSNorm, SwiGLU, RoPE with the shard's full-sequence ``position_ids``) act
per token and are admitted; the fused linear-cross-entropy is *not* engaged, because the SP loss
calls the model without ``labels`` (Liger fuses only when labels are given) and computes the loss
from the shard's ``[B, S/P, V]`` logits with the SP-correct pre-shifted ``shift_labels``. A fused
SP loss would have to receive those ``shift_labels`` (never ``labels``, which Liger would shift
again inside the shard, losing the label of each shard's last token) and return the token *sum* so
the SP normalisation applies; that path, and every Liger kernel under SP, is untested.

FSDP through accelerate (``accelerate launch --config_file`` with ``distributed_type: FSDP``, or
``TrainingArguments(fsdp=...)``): accelerate 1.x turns an FSDP request into ``DistributedType.FSDP``
only for accelerator distributed types (``MULTI_GPU``, ``MULTI_XPU``, ...; see
``AcceleratorState.__init__``), never for ``MULTI_CPU``: on a CPU the config is dropped without a
word and the Trainer wraps the model in DDP. The gradients are the same (both average over all
ranks, which the SP loss scaling expects), the memory is not; ``prepare`` logs a warning.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

NLL_TRAINERS = ("Trainer", "SFTTrainer", "_BaseTrainer")
"""Classes whose ``compute_loss`` is the causal-LM NLL the SP loss reproduces (``_BaseTrainer`` is
TRL's common base, which defines none of its own)."""

WHY = {
    "ORPOTrainer": "its loss slices the chosen and rejected log-probs and NLL from the full [B, S, V] logits "
    "(outputs.logits), which under SP no rank holds",
    "CPOTrainer": "its loss slices the chosen and rejected log-probs and NLL from the full [B, S, V] logits "
    "(outputs.logits), which under SP no rank holds",
    "DistillationTrainer": "its loss compares the student's and a teacher's full-sequence distributions",
}


def check_trainer_loss(trainer: Any) -> None:
    """Refuse a trainer whose own ``compute_loss`` is not the causal-LM NLL (``ValueError``)."""
    for cls in type(trainer).__mro__:
        if cls.__name__ in NLL_TRAINERS or cls is object:
            continue
        if "compute_loss" in vars(cls) or cls.__name__ in WHY:
            why = WHY.get(cls.__name__, "it defines its own compute_loss, which prepare() would replace")
            raise ValueError(
                f"{type(trainer).__name__} (through {cls.__module__}.{cls.__name__}) cannot run with "
                f"sequence parallelism: {why}, and the SP loss is the causal-LM negative log-likelihood. "
                "Use transformers.Trainer or TRL's SFTTrainer, or train this objective without prepare()"
            )


def check_liger(trainer: Any) -> None:
    """Refuse Liger kernels where they cannot run (CPU); on CUDA they are admitted, untested."""
    args = trainer.args
    if not getattr(args, "use_liger_kernel", False):
        return
    device = getattr(args, "device", None)
    if getattr(device, "type", "cpu") == "cpu":
        raise ValueError(
            "use_liger_kernel=True: Liger's kernels are Triton, GPU only, and this trainer runs on the CPU; "
            "set use_liger_kernel=False (the SP loss never builds [B, S, V] logits on one rank anyway: "
            "each rank holds [B, S/P, V])"
        )


def fsdp_dropped(trainer: Any) -> str | None:
    """The warning for an FSDP request accelerate dropped (CPU), logged; ``None`` when there is none."""
    requested = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" or bool(
        getattr(trainer.args, "fsdp", None)
    )
    distributed_type = getattr(getattr(trainer, "accelerator", None), "distributed_type", "")
    kind = str(getattr(distributed_type, "value", distributed_type))  # "MULTI_CPU", "FSDP", ...
    if not requested or kind.endswith("FSDP"):
        return None
    message = (
        f"FSDP was requested but accelerate runs {kind or 'no FSDP'}: accelerate enables FSDP only on "
        "accelerators (GPU, XPU, ...), not on the CPU, so the model is replicated (DDP) here; the steps "
        "are the same, the memory is not sharded"
    )
    logger.warning(message)
    return message


def check_trl_sp_path(
    trainer: Any, name: str, *, ring_size: int, tiled_loss: Any, stop_at: Any, methods: tuple[str, ...], why: str
) -> None:
    """The refusals the TRL preference and RL paths share (``ValueError``): a ring layout (zigzag shards),
    ``tiled_loss`` (TRL's fused head is tiled already), a prompt-learning PEFT adapter (virtual tokens
    before the sequence: its positions would not be the sequence's), and a subclass between the
    trainer's class and TRL's (``stop_at``: its class names) that overrides one of ``methods`` — the SP
    path replaces or reproduces exactly those (``why`` says how)."""
    if ring_size > 1:
        raise ValueError(
            f"{name} under a ring (ring_size={ring_size}) is not supported: the shards are in zigzag order; "
            "choose an sp_size the attention heads split over (ring_size=1)"
        )
    if tiled_loss is not False:
        raise ValueError(
            f"tiled_loss does not apply to {name}: TRL's fused LM head already computes the log-probabilities "
            "in tiles (no [B, S_l, V] logits); pass tiled_loss=False"
        )
    check_prompt_learning(trainer, name)
    for cls in type(trainer).__mro__:
        if cls.__name__ in stop_at:
            break
        own = [m for m in methods if m in vars(cls)]
        if own:
            raise ValueError(f"{name} (through {cls.__module__}.{cls.__name__}) overrides {own}: {why}")


def check_prompt_learning(trainer: Any, name: str) -> None:
    """Refuse a prompt-learning PEFT adapter (prompt / prefix / P-tuning): its virtual tokens go before
    each rank's shard, not before the sequence, so the step would not be the step without SP."""
    peft_config = getattr(trainer.model, "peft_config", None) or {}
    if any(getattr(c, "is_prompt_learning", False) for c in peft_config.values()):
        raise ValueError(
            f"{name} with a prompt-learning PEFT adapter (virtual tokens before the sequence) is not "
            "supported under sequence parallelism; use LoRA or another adapter on the weights"
        )
