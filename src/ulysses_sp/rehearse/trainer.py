"""The HF Trainer path rehearsed: the user's ``Trainer`` after ``prepare()`` at its real shapes, on fake tensors.

``rehearse_trainer(trainer, sp_size=P, seq_len=S, gpus=N, tiled_mlp=True, ...)`` takes the trainer a
script builds (any model: only its ``config`` is read) and ``prepare()``'s own keywords, and rehearses
one step of ``trainer.train()`` as it would run on ``N`` GPUs (``torchrun --nproc-per-node``) with
``TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2})``:

* **build** (on the fake world, outside the fake mode): a copy of the trainer (the user's is left
  untouched) holding a model built from ``trainer.model.config`` on the meta device (no weights),
  ``prepare(copy, sp_size=P, **options)`` — the registration, the ALST techniques, the SP mixin — and
  the Trainer's own gradient checkpointing (``gradient_checkpointing_enable`` with its kwargs, as
  ``train()`` does);
* **wrap**: FSDP2 over all ranks as accelerate's ``fsdp_version=2`` applies it (the decoder layers and
  the root sharded, fp32 master weights, bf16 compute under ``bf16=True``; ``"offload"`` in ``fsdp``:
  states on the host), here the library's own FSDP2 (``engine.initialize``) with AdamW and the
  Trainer's clipping, and accelerate's autocast around the model's forward (outputs to fp32);
* **micro-step**: ``trainer.training_step(model, shard, num_items_in_batch)`` — the Trainer's own,
  with the SP mixin's loss (tiled or not), on the shard the SP loader yields (``data.shard``:
  ``input_ids``, ``position_ids``, ``shift_labels`` ``[B, S_l]``), its ``accelerator.backward`` the
  engine's; then the optimizer step. Both under ``rehearse.step``'s tracker.

DDP (a Trainer without ``fsdp``) cannot be rehearsed: its C++ reducer reads parameter memory that
fake tensors do not have; the rehearsal shows the FSDP2 run. The planner's prediction is that of the
equivalent ``ulysses-sp train`` settings (``trainer_run_config``).

Shape legend: ``B`` micro-batch, ``S`` sequence, ``S_l = S/P``, ``P`` the SP size, ``N`` GPUs.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from ulysses_sp.rehearse.fake import RehearsalDevice, rehearsal_device
from ulysses_sp.rehearse.run import DEFAULT_HOST_MEMORY, Rehearsal, _projected, synthetic_batch
from ulysses_sp.rehearse.step import StepResult, quiet, rehearse_step
from ulysses_sp.run.config import RunConfig

PREPARE_OPTIONS = ("core_attn_implementation", "strict", "ring_size", "tiled_loss", "tiled_mlp",
                   "offload_activations", "offload_attention", "head_chunks", "recompute_norms")  # fmt: skip
"""The keywords of ``integrations.transformers.prepare`` a rehearsal passes on."""


def _fsdp_words(trainer: Any, fsdp: str | None) -> set[str]:
    """The FSDP options the rehearsal runs: ``fsdp``, else the TrainingArguments', else ``full_shard``."""
    given = fsdp if fsdp is not None else getattr(trainer.args, "fsdp", None)
    if isinstance(given, (list, tuple)):
        given = " ".join(str(getattr(w, "value", w)) for w in given)
    words = set((given or "full_shard").split())
    if not words & {"full_shard", "shard_grad_op"} or words - {"full_shard", "shard_grad_op", "offload", "auto_wrap"}:
        raise ValueError(
            f"fsdp={given!r}: a Trainer rehearsal runs FSDP2 as accelerate applies it; pass fsdp='full_shard' or "
            "'shard_grad_op' (with ' offload' for states on the host). DDP cannot be rehearsed: its C++ reducer "
            "reads parameter memory that fake tensors do not have"
        )
    return words


def trainer_run_config(trainer: Any, *, sp_size: int, seq_len: int, fsdp: str | None = None,
                       **options: Any) -> RunConfig:  # fmt: skip
    """The ``ulysses-sp train`` settings equivalent to ``trainer`` after ``prepare(trainer, sp_size=...,
    **options)`` under FSDP2 (the planner's input, and the engine's config in the rehearsal)."""
    args, words = trainer.args, _fsdp_words(trainer, fsdp)
    tiles = {name: options.get(name, False) for name in ("tiled_loss", "tiled_mlp")}
    core = options.get("core_attn_implementation") or getattr(trainer.model.config, "_attn_implementation", None)
    return RunConfig(
        model=getattr(trainer.model.config, "_name_or_path", "") or "trainer.model", seq_len=seq_len, sp=sp_size,
        micro_batch_size=args.per_device_train_batch_size, grad_accum=1, lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2), weight_decay=args.weight_decay, grad_clip=args.max_grad_norm or 0.0,
        seed=args.seed, attn=core or "sdpa", zero_stage=3 if "full_shard" in words else 2, zero_partition="all",
        cpu_offload="offload" in words, dtype="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        activation_checkpointing=bool(args.gradient_checkpointing),
        tiled_loss=tiles["tiled_loss"] is not False, tiled_loss_shards=None if isinstance(tiles["tiled_loss"], bool) else tiles["tiled_loss"],
        tiled_mlp=tiles["tiled_mlp"] is not False, tiled_mlp_shards=None if isinstance(tiles["tiled_mlp"], bool) else tiles["tiled_mlp"],
        offload_activations=options.get("offload_activations", False), offload_attention=options.get("offload_attention", False),
        recompute_norms=options.get("recompute_norms", False), head_chunks=options.get("head_chunks", 1),
        ring_size=options.get("ring_size"), progress=False,
    )  # fmt: skip


def meta_model(config: Any, *, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A causal LM of ``config`` on the meta device (no memory, no weights) that a ``Trainer`` accepts as
    it is: its ``hf_device_map`` (``{"": "meta"}``) tells the Trainer not to move it. For rehearsing a
    model too large for this machine; ``rehearse_trainer`` reads only its ``config``."""
    from ulysses_sp.state.loading import empty_model_from_config

    model = empty_model_from_config(config, attn_implementation=attn_implementation)
    model.hf_device_map = {"": "meta"}
    return model


class _Accelerator:
    """The trainer copy's ``accelerator``: the user's, with ``backward`` the engine's (looked up at each call,
    so the rehearsal's phase switch sees it)."""

    def __init__(self, real: Any, engine: Any) -> None:
        self._real, self._engine = real, engine

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self._engine.backward(loss)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _autocast_forward(module: torch.nn.Module, dtype: torch.dtype, device_type: str) -> None:
    """accelerate's mixed-precision wrap of ``model.forward``: autocast, outputs converted to fp32."""
    from accelerate.utils import convert_outputs_to_fp32

    forward = module.forward

    @functools.wraps(forward)
    def autocast_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=device_type, dtype=dtype):
            return forward(*args, **kwargs)

    module.forward = convert_outputs_to_fp32(autocast_forward)


def trainer_step_parts(trainer: Any, cfg: RunConfig, options: dict[str, Any], *, gpus: int, device_type: str,
                       empty: bool = True) -> tuple[Any, Any, Any]:  # fmt: skip
    """``(build, make_engine, micro_step)`` of the Trainer path for ``rehearse.step.rehearse_step`` (see the
    module docstring); with ``empty=False`` the model is built with initialised weights on the CPU (a real
    step on a real process group: ``bench/rehearse_check.py``'s measured side)."""
    from ulysses_sp.integrations.transformers import prepare

    config, args = trainer.model.config, trainer.args
    sp_trainer = copy.copy(trainer)  # the user's trainer keeps its model, class and accelerator
    state: dict[str, Any] = {}

    def build() -> tuple[torch.nn.Module, Any]:
        from transformers import AutoModelForCausalLM

        from ulysses_sp.state.loading import empty_model_from_config

        if empty:
            model = empty_model_from_config(config, attn_implementation=cfg.attn)
        else:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=cfg.attn)
        model.train()
        sp_trainer.model = sp_trainer.model_wrapped = model
        sp_trainer.optimizer = sp_trainer.lr_scheduler = None
        state["handle"] = prepare(sp_trainer, sp_size=cfg.sp, **options)
        if args.gradient_checkpointing:  # what Trainer.train() does before its first step
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
        return model, state["handle"].mesh

    def make_engine(model: torch.nn.Module, mesh: Any) -> Any:
        from ulysses_sp.engine import initialize

        handle = state["handle"]
        engine, _, _, _ = initialize(model, cfg.training_config(gpus), mpu=handle.registration or mesh.mpu)
        if cfg.dtype != "fp32":
            _autocast_forward(engine.module, torch.bfloat16 if cfg.dtype == "bf16" else torch.float16, device_type)
        sp_trainer.accelerator = _Accelerator(trainer.accelerator, engine)
        sp_trainer._prepare_inputs = lambda inputs: {  # the Trainer's device move, to the engine's device
            k: v.to(engine.device) if torch.is_tensor(v) else v for k, v in inputs.items()}  # fmt: skip
        sp_trainer.current_gradient_accumulation_steps = 1
        return engine

    def micro_step(engine: Any, batch: dict[str, Any]) -> None:
        batch = dict(batch)
        items = batch.pop("_num_items", None)  # the Trainer's N (get_batch_samples), a host number
        items = items if getattr(sp_trainer, "model_accepts_loss_kwargs", False) else None  # as get_batch_samples
        sp_trainer.training_step(engine.module, batch, items)

    return build, make_engine, micro_step


def trainer_batch(cfg: RunConfig, vocab_size: int, *, sp_rank: int, dp: int) -> dict[str, Any]:
    """This rank's shard as the SP loader yields it, with the host layout and the Trainer's ``N``
    (``_num_items``: valid labels of the global batch, as ``get_batch_samples`` counts them)."""
    from ulysses_sp.data.shard import prepare_batch, shard_batch
    from ulysses_sp.integrations._trainer import SOURCE_KEY
    from ulysses_sp.parallel.doc_layout import host_layout

    full = synthetic_batch(cfg, vocab_size, seed=cfg.seed)
    prepared = prepare_batch({**full, "labels": full["input_ids"]}, cfg.sp)
    local = shard_batch(prepared, sp_rank, cfg.sp)
    local[SOURCE_KEY] = sp_rank
    local["_layout"] = host_layout(prepared["position_ids"])
    local["_num_items"] = int((prepared["shift_labels"] != -100).sum()) * dp
    return local


def rehearse_trainer(
    trainer: Any,
    *,
    sp_size: int,
    seq_len: int,
    gpus: int | None = None,
    device: str = "cuda",
    fsdp: str | None = None,
    gpu_memory: str | int | None = None,
    host_memory: str | int | None = None,
    ranks: tuple[int, ...] | None = None,
    reserve: int | None = None,
    progress: Any = None,
    **options: Any,
) -> Rehearsal:
    """Rehearse one ``trainer.train()`` step after ``prepare(trainer, sp_size=sp_size, **options)`` on
    ``gpus`` ranks (default ``sp_size``) at ``seq_len`` tokens per sequence (see the module docstring).

    Args:
        trainer: a ``transformers.Trainer`` (or subclass) built as the training script builds it; its
            model's ``config`` and its ``TrainingArguments`` are read, nothing is changed.
        fsdp: the FSDP options of the GPU run (``"full_shard"``, ``"shard_grad_op"``, ``+ " offload"``);
            default: ``trainer.args.fsdp``, else ``"full_shard"``.
        device, gpu_memory, host_memory, ranks, reserve, progress: as ``rehearse.run.rehearse_run``.
        options: ``prepare()``'s keywords (``tiled_mlp``, ``tiled_loss``, ``offload_activations``, ...).

    Returns:
        The ``Rehearsal`` (``rehearse.report.format_rehearsal`` prints it), the planner's prediction for
        the equivalent ``ulysses-sp train`` settings beside it.

    Raises:
        ValueError: an unknown option, a layout that does not divide, or an FSDP setting not rehearsable.
    """
    from ulysses_sp.checks import check_seq_len_divisible, positive_int
    from ulysses_sp.plan.hardware import DEVICES, GB, parse_bytes
    from ulysses_sp.run.preflight import prediction

    unknown = sorted(set(options) - set(PREPARE_OPTIONS))
    if unknown:
        raise ValueError(f"rehearse_trainer got {unknown}: not prepare() options (those are {list(PREPARE_OPTIONS)})")
    if hasattr(trainer.model, "peft_config"):
        raise ValueError(
            "trainer.model is a PEFT model: the rehearsal builds the model from its config alone, without the "
            "adapter, and would train every weight; rehearse the base model's Trainer (full fine-tuning: an "
            "upper bound of the adapter run's memory)"
        )
    gpus = sp_size if gpus is None else gpus
    positive_int("gpus", gpus)
    positive_int("sp_size", sp_size)
    if gpus % sp_size:
        raise ValueError(f"gpus ({gpus}) must be a multiple of sp_size ({sp_size}): dp = gpus / sp_size")
    check_seq_len_divisible(seq_len, sp_size, 1, fix="use a seq_len")
    cfg = trainer_run_config(trainer, sp_size=sp_size, seq_len=seq_len, fsdp=fsdp, **options)
    where: RehearsalDevice = rehearsal_device(device)
    hw = DEVICES["cpu" if device == "cpu" else "h100"]
    config = trainer.model.config
    ranks = ranks if ranks is not None else tuple(sorted({0, sp_size - 1}))
    results: list[StepResult] = []
    with quiet():
        for rank in ranks:
            build, make_engine, micro_step = trainer_step_parts(trainer, cfg, options, gpus=gpus,
                                                                device_type=where.tensor_device)  # fmt: skip
            batch = trainer_batch(cfg, config.vocab_size, sp_rank=rank % sp_size, dp=gpus // sp_size)
            results.append(rehearse_step(build, make_engine, batch, gpus=gpus, rank=rank, device=where,
                                         micro_step=micro_step, host_states=cfg.cpu_offload, progress=progress))  # fmt: skip
    pred = prediction(cfg, gpus, config, torch.device("cpu" if device == "cpu" else "cuda"))
    notes = [f"device: {where.describe()}", "the Trainer path under FSDP2 (accelerate's fsdp_version=2) over "
             f"{gpus} rank(s); the planner's figures are those of the equivalent `ulysses-sp train` settings",
             "not seen by a rehearsal: CUDA context, kernel workspaces (cuBLAS, flash/sdpa), NCCL buffers, allocator "
             f"fragmentation, pinned staging; the planner keeps {hw.reserve_bytes / GB:.0f} GB for them"]  # fmt: skip
    budget = parse_bytes(gpu_memory, what="gpu_memory") if gpu_memory is not None else hw.memory_bytes
    host = parse_bytes(host_memory, what="host_memory") if host_memory is not None else DEFAULT_HOST_MEMORY
    return Rehearsal(device=where.describe(), gpus=gpus, seq_len=seq_len, ranks=results, predicted=pred.as_dict(),
                     gpu_memory=budget, reserve=hw.reserve_bytes if reserve is None else reserve, host_memory=host,
                     gpus_per_node=hw.gpus_per_node, notes=notes, time=_projected(cfg, config, results, hw, gpus))  # fmt: skip
