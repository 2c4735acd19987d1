"""Ulysses sequence parallelism inside ``transformers.Trainer`` and TRL's ``SFTTrainer``, no DeepSpeed.

One call turns an existing trainer script sequence-parallel::

    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, eval_dataset=eval_ds)
    prepare(trainer, sp_size=2)          # the one new line
    trainer.train()

Launch as before (``torchrun --nproc-per-node W script.py``); ``W / sp_size`` ranks are data
parallel. ``prepare`` builds the ``(dp, sp)`` layout over the process group the Trainer's
``TrainingArguments`` started, registers ``UlyssesSPAttentionHF`` and points the model at it
(a PEFT/LoRA model too: only its adapter weights train, its checkpoints are the adapter's usual
files), and puts ``SPTrainerMixin`` in front of the trainer's class: train, eval and test loaders go
through the SP data adapter, the loss is the SP causal-LM loss normalised exactly as the Trainer
normalises the model's own, and the Trainer's own DDP or FSDP (through accelerate) reduces the
gradients (see ``_trainer``'s module docstring for why that is the sum over SP and the mean over DP).
A Qwen-VL model (``ulysses_sp.vlm``) gets its language-model hook, and its loaders exchange whole
batches in the SP round (the merge and the 3-D positions need the full sample). TRL's ``DPOTrainer``
and ``KTOTrainer`` get ``SPPreferenceMixin`` instead (``_preference``): whole batches to every rank of the
group, the fused LM head run on the shard and its per-token outputs gathered, TRL's own loss and metrics;
``RewardTrainer`` the same, with the last token's score gathered and routed (``_reward``). TRL's
``GRPOTrainer`` / ``RLOOTrainer`` get ``SPRLMixin`` (``_rl``): generation as without SP, each SP group
computing its ranks' per-token log-probs together, TRL's own loss and metrics on every rank.

What changes for the user: each rank runs ``sp_size`` times as many micro-steps per epoch (an SP
group shares its ranks' batches), so ``gradient_accumulation_steps * sp_size`` keeps the global batch
of a run without SP on the same number of processes.

Refused, with the fix in the message (``ValueError`` on every rank, before any collective): a
Trainer with DeepSpeed or with accelerate's own sequence/context/tensor parallelism, single-process
multi-GPU ``DataParallel``, an attention implementation the SP attention cannot wrap, a model with a
module that mixes tokens outside the SP attention (``mixers.guard``: a convolution, scan or linear attention),
a trainer with another objective (TRL's non-SFT trainers but ``DPOTrainer``, ``KTOTrainer``,
``RewardTrainer``, ``GRPOTrainer`` and ``RLOOTrainer``, any subclass with its own ``compute_loss``: ``_support``; the options
``_preference.check_preference`` and ``_rl.check_rl`` name), Liger kernels on the CPU, a prompt-learning PEFT adapter (virtual tokens), a custom
``compute_loss_func``, label smoothing, TRL's ``loss_type="dft"`` or MoE auxiliary loss, ``compute_metrics`` (it needs full-sequence logits, which SP
never gathers). Collator outputs the adapter cannot shard (left padding, a ``[B, S]`` tensor whose
batch size differs, ...) raise at the first batch on every rank of the group.
"""

from __future__ import annotations

import logging
from typing import Any

from ulysses_sp.attention.core import CORE_ATTENTIONS
from ulysses_sp.attention.registration import ATTN_NAME, SPRegistration
from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.checks import positive_int
from ulysses_sp.integrations._preference import (
    FusedHeadPatch,
    SPPreferenceMixin,
    check_preference,
    fused_head_models,
    is_preference_trainer,
)
from ulysses_sp.integrations._reward import RewardHeadPatch, is_reward_trainer, reward_model
from ulysses_sp.integrations._rl import SPRLMixin, check_rl, is_rl_trainer, reference_model
from ulysses_sp.integrations._support import (
    check_liger,
    check_prompt_learning,
    check_trainer_loss,
    fsdp_dropped,
)
from ulysses_sp.integrations._trainer import SPTrainerDataLoader, SPTrainerMixin
from ulysses_sp.integrations.alst import ALSTHandle, ALSTOptions
from ulysses_sp.mixers.apply import apply_mixers, has_unsharded_mixers
from ulysses_sp.mixers.base import MixerHandle
from ulysses_sp.mixers.guard import check_document_mixing, check_sequence_mixing
from ulysses_sp.parallel.mesh import SPMesh, init_mesh, require_process_group
from ulysses_sp.parallel.mesh_shape import head_counts, resolve_ring_size_for_layers
from ulysses_sp.vlm import VLMShardHandle, shard_vlm, vlm_parts
from ulysses_sp.vlm.shard import installed

logger = logging.getLogger(__name__)

__all__ = ["SPTrainerDataLoader", "SPTrainerHandle", "SPTrainerMixin", "prepare"]


class SPTrainerHandle:
    """What ``prepare`` returns: the layout, the attention registration, and ``remove()``.

    Attributes:
        trainer: the prepared trainer (the same object, now an instance of the SP subclass).
        mesh: the run's ``SPMesh`` (``mesh.sp_group``, ``mesh.dp_group``, ...).
        registration: the ``mpu`` of ``register_with_transformers``; ``None`` for a model without
            attention layers (pure Mamba-2: its mixers alone are sharded).
    """

    def __init__(
        self,
        trainer: Any,
        mesh: SPMesh,
        registration: SPRegistration | None,
        *,
        pad_token_id: int,
        strict: bool,
        mixers: MixerHandle | None = None,
        alst: ALSTHandle | None = None,
        vlm: VLMShardHandle | None = None,
        preference: FusedHeadPatch | None = None,
        rl: bool = False,
    ) -> None:
        self.trainer = trainer
        self.mesh = mesh
        self.registration = registration
        self.mixers = mixers
        """The model's sharded sequence mixers (``mixers.apply.apply_mixers``), or ``None``."""
        self.alst = alst
        """The ALST techniques applied to the model (``integrations.alst``), or ``None``."""
        self.vlm = vlm
        """A vision-language model's per-shard merge (``vlm.shard_vlm``), or ``None``."""
        self.preference = preference
        """TRL ``DPOTrainer``: its fused LM heads under SP (``_preference``), or ``None``."""
        self.pad_token_id = pad_token_id
        self.strict = strict
        self.own_eval_loss: Any = None
        """During an eval round: the loss of the batch this rank loaded (see ``prediction_step``)."""
        self._trainer_class = type(trainer)
        trainer._ulysses_sp = self
        # A subclass built per trainer (no module-level cache): the trainer's own overrides stay in
        # force below the mixin's five, and ``remove`` restores the class.
        cls = self._trainer_class
        mixin = SPRLMixin if rl else SPTrainerMixin if preference is None else SPPreferenceMixin
        trainer.__class__ = type(f"SequenceParallel{cls.__name__}", (mixin, cls), {})

    def remove(self) -> None:
        """Undo ``prepare``: the trainer's class and the model's attention are restored."""
        if getattr(self.trainer, "_ulysses_sp", None) is not self:
            return
        self.trainer.__class__ = self._trainer_class
        del self.trainer._ulysses_sp
        if self.mixers is not None:
            self.mixers.remove()
        if self.alst is not None:
            self.alst.remove()
        if self.vlm is not None:
            self.vlm.remove()
        if self.preference is not None:
            self.preference.remove()
        if self.registration is not None:
            self.registration.remove()

    def __repr__(self) -> str:
        return f"SPTrainerHandle({self._trainer_class.__name__}, {self.mesh!r})"


def prepare(
    trainer: Any,
    *,
    sp_size: int,
    core_attn_implementation: str | None = None,
    strict: bool = False,
    ring_size: int | str | None = None,
    tiled_loss: bool | int = False,
    tiled_mlp: bool | int = False,
    offload_activations: bool = False,
    offload_attention: bool = False,
    head_chunks: int = 1,
    recompute_norms: bool = False,
) -> SPTrainerHandle:
    """Make ``trainer`` (a ``transformers.Trainer`` or subclass, e.g. TRL's ``SFTTrainer``) train
    and evaluate with Ulysses sequence parallelism over groups of ``sp_size`` ranks.

    Call it after building the trainer and before ``train()`` / ``evaluate()``, on every rank.

    Args:
        trainer: the trainer; its model must be a transformers causal LM (or a PEFT model of one).
        sp_size: ranks per sequence-parallel group ``P``; must divide the world size. Beyond what
            the heads allow, a ring takes the rest (``ring_size``).
        core_attn_implementation: the attention run over the full sequence (``sdpa``, ``eager``,
            ``flash_attention_2``/``_3``, ``flex_attention``); ``None`` keeps the model's own.
        strict: refuse a sequence length not divisible by ``sp_size`` instead of padding it.
        ring_size: hybrid Ulysses x Ring (``register_with_transformers``'s ``ring_size``); ``None``:
            1 when the heads split over ``sp_size``, else the smallest ring that makes them.
        tiled_loss, tiled_mlp, offload_activations, offload_attention: the ALST memory techniques
            (``integrations.alst``): tiled logits+loss and tiled MLP (``True`` = auto tiles, or a
            tile count), checkpointed layer inputs in host memory (with
            ``gradient_checkpointing=True``), the full-sequence K/V on the host (sdpa). bf16 and
            activation checkpointing are the Trainer's own ``bf16`` / ``gradient_checkpointing``.
        head_chunks: exchange and attend the heads in this many groups, one at a time
            (``register_with_transformers``'s ``head_chunks``: less peak memory, more compute).
        recompute_norms: the decoder layers' RMSNorms keep only input and output and recompute
            the rest in backward (``memory.norms``; exact, works with ``gradient_checkpointing``).

    Returns:
        An ``SPTrainerHandle``; ``handle.remove()`` undoes the preparation.

    Raises:
        ValueError: the trainer's configuration cannot run with SP (the message says what to
            change), or the sizes do not fit (it names them).
    """
    positive_int("sp_size", sp_size)
    if isinstance(trainer, (SPTrainerMixin, SPRLMixin)):
        raise ValueError("this trainer is prepared for sequence parallelism already")
    model = getattr(trainer, "model", None)
    core = core_attn_implementation or _model_attention(model)
    _check_trainer(trainer, core)
    options = ALSTOptions(tiled_loss=tiled_loss, tiled_mlp=tiled_mlp, offload_activations=offload_activations,
                          offload_attention=offload_attention, recompute_norms=recompute_norms)  # fmt: skip
    options.check(trainer, core)
    check_sequence_mixing(model, sp_size=sp_size)  # the closed-world guard, before any collective
    args = getattr(trainer, "args", None)
    if getattr(args, "packing", False) or getattr(args, "padding_free", False):  # any sp size (DeepSeek-V4's pooling)
        check_document_mixing(model, what="packed sequences (SFTConfig packing / padding_free)")
    heads = head_counts(getattr(model, "config", None))  # none: no attention layers (pure Mamba-2)
    ring = resolve_ring_size_for_layers(sp_size, heads, ring_size)
    preference = is_preference_trainer(trainer)  # TRL's DPOTrainer: its own loss on gathered log-probs
    reward = reward_model(trainer) if is_reward_trainer(trainer) else None  # RewardTrainer's classifier
    if preference:
        check_preference(trainer, ring_size=ring, tiled_loss=tiled_loss, dp_size=trainer.args.world_size // sp_size)
        for ref in [] if reward is not None else fused_head_models(trainer)[1:]:
            check_sequence_mixing(ref, sp_size=sp_size)
    rl = is_rl_trainer(trainer)  # TRL's GRPOTrainer / RLOOTrainer: its own loss on group-computed log-probs
    if rl:
        check_rl(trainer, ring_size=ring, tiled_loss=tiled_loss)
        if reference_model(trainer) is not None:
            check_sequence_mixing(reference_model(trainer), sp_size=sp_size)
    require_process_group("ulysses_sp.integrations.transformers.prepare")
    mesh = init_mesh(sp_size=sp_size, ring_size=ring)
    registration = None if not heads else UlyssesSPAttentionHF.register_with_transformers(
        model, core, sp_size, trainer.args.per_device_train_batch_size, mesh=mesh,
        offload_attention=offload_attention, head_chunks=head_chunks,
    )  # fmt: skip
    mixers = apply_mixers(model, mesh) if has_unsharded_mixers(model) else None  # conv / Mamba-2 layers
    fsdp_dropped(trainer)  # accelerate on a CPU: an FSDP config runs as DDP
    vlm = None  # Qwen-VL: whole batches to every rank, each rank merges its own shard (frames split)
    if vlm_parts(model) is not None:
        vlm = installed(model) or shard_vlm(
            model, sp_rank=mesh.sp_rank, sp_size=mesh.sp_size, ring_size=mesh.ring_size, core=core,
            split_images_over=mesh.sp_group,
        )
    logger.info("sequence parallelism in %s: %r, core attention %r", type(trainer).__name__, mesh, core)
    alst = options.apply(model) if options != ALSTOptions() else None
    patch = None
    if reward is not None:  # RewardTrainer: the last token's score routed (_reward)
        patch = RewardHeadPatch(reward, mesh, pad_token_id=_pad_token_id(trainer))
    elif preference:
        models = fused_head_models(trainer)
        for ref in models[1:]:  # a separate reference model runs the SP attention too
            registration.attach(ref)
        patch = FusedHeadPatch(models, mesh, pad_token_id=_pad_token_id(trainer), strict=strict)
    if rl and reference_model(trainer) is not None:  # a separate reference model runs the SP attention too
        registration.attach(reference_model(trainer))
    return SPTrainerHandle(
        trainer,
        mesh,
        registration,
        pad_token_id=_pad_token_id(trainer),
        strict=strict,
        mixers=mixers,
        alst=alst,
        vlm=vlm,
        preference=patch,
        rl=rl,
    )


def _model_attention(model: Any) -> str:
    """The model's attention implementation, if the SP attention can run it over the full sequence."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(
            f"trainer.model is a {type(model).__name__}, not a transformers model with a config: "
            "sequence parallelism needs a transformers causal LM (or a PEFT model of one)"
        )
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if not head_counts(config):  # no attention layers (pure Mamba-2): no core attention runs at all
        return impl if impl in CORE_ATTENTIONS else "eager"
    if impl == ATTN_NAME:
        raise ValueError(
            f"the model already uses attn_implementation={ATTN_NAME!r}; load it with its core attention "
            f"(one of {list(CORE_ATTENTIONS)}) or pass core_attn_implementation="
        )
    if impl not in CORE_ATTENTIONS:
        raise ValueError(
            f"attn_implementation={impl!r} cannot run inside Ulysses sequence parallelism; load the model "
            f"with attn_implementation='sdpa' (or one of {list(CORE_ATTENTIONS)}), or pass "
            "core_attn_implementation='sdpa' to prepare()"
        )
    return impl


def _check_trainer(trainer: Any, core: str) -> None:
    """Refuse what cannot run with SP; every rank sees the same configuration, so every rank raises."""
    if core not in CORE_ATTENTIONS:
        raise ValueError(f"core_attn_implementation={core!r}; choose one of {list(CORE_ATTENTIONS)}")
    own_loss = is_preference_trainer(trainer) or is_rl_trainer(trainer)
    if not own_loss:
        check_trainer_loss(trainer)  # objectives the SP loss does not compute
    check_liger(trainer)
    check_prompt_learning(trainer, type(trainer).__name__)
    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False) or getattr(args, "deepspeed", None):
        raise ValueError(
            "this Trainer is configured with DeepSpeed; ulysses-sp replaces DeepSpeed's Ulysses path: "
            "remove `deepspeed=` from TrainingArguments (use `fsdp=` for sharded states, or DDP)"
        )
    pc = getattr(trainer.accelerator, "parallelism_config", None) or getattr(args, "parallelism_config", None)
    if pc is not None:
        sizes = {n: getattr(pc, f"{n}_size", 1) or 1 for n in ("sp", "cp", "tp")}
        used = {n: s for n, s in sizes.items() if s > 1}
        if used:
            raise ValueError(
                f"TrainingArguments.parallelism_config uses {used}: accelerate's own sequence/context/"
                "tensor parallelism cannot be combined with ulysses-sp; remove parallelism_config "
                "(prepare(trainer, sp_size=...) sets the sequence-parallel size)"
            )
    if args.n_gpu > 1:
        raise ValueError(
            f"n_gpu={args.n_gpu}: one process drives several GPUs (torch DataParallel); launch one process "
            "per GPU with `torchrun --nproc-per-node N`"
        )
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise ValueError(
            "a custom compute_loss_func would see only this rank's shard of each sequence; remove it "
            "(ulysses-sp computes the exact causal-LM loss over the full sequence)"
        )
    if getattr(trainer, "label_smoother", None) is not None:
        raise ValueError(
            f"label_smoothing_factor={args.label_smoothing_factor} is not supported with sequence "
            "parallelism; set label_smoothing_factor=0"
        )
    if getattr(trainer, "compute_metrics", None) is not None:
        raise ValueError(
            "compute_metrics needs full-sequence logits, which sequence parallelism never gathers on one "
            "rank; remove compute_metrics (the eval loss is computed with SP)"
        )
    if own_loss:  # its own loss (every loss_type), refusals in _preference.check_preference / _rl.check_rl
        return
    loss_type = getattr(args, "loss_type", None)  # TRL's SFTConfig
    if loss_type not in (None, "nll"):
        raise ValueError(
            f"loss_type={loss_type!r} is not reproduced under sequence parallelism (the SP loss is the "
            "causal-LM negative log-likelihood); set loss_type='nll'"
        )
    if getattr(trainer, "aux_loss_enabled", False):  # TRL: the config's coefficient unless the SFTConfig's
        raise ValueError(
            "the MoE auxiliary (load-balancing) loss is not reproduced under sequence parallelism (the SP loss "
            "is the causal-LM negative log-likelihood); set router_aux_loss_coef=0.0 in the SFTConfig (TRL "
            "then turns the model's output_router_logits off)"
        )


def _pad_token_id(trainer: Any) -> int:
    """The id used to pad a length not divisible by ``sp_size`` (its label is ``-100`` anyway)."""
    for source in (getattr(trainer, "processing_class", None), getattr(trainer.model, "config", None)):
        pad = getattr(source, "pad_token_id", None)
        if isinstance(pad, int):
            return pad
    return 0
