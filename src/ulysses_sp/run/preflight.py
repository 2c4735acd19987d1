"""The planner's prediction for one ``ulysses-sp train`` run, and the check that it fits.

``prediction(cfg, world_size, model_config, device_type)`` maps the run's ``RunConfig`` onto
``plan.Settings`` and returns ``plan.predict``'s answer; ``check_fits`` raises ``ValueError``
(or, with ``--force``, only warns) before anything is built when the predicted peak per rank
exceeds the memory budget: ``--memory`` when given, else the accelerator's total memory, else
(CPU) the host's available memory divided among the local ranks. Where it sits: ``train.run``
calls it after the layout is known and before the tokenizer, data and model are built.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

import torch

from ulysses_sp.plan.hardware import DEVICES, Hardware, parse_bytes
from ulysses_sp.plan.inputs import ModelShape, Settings
from ulysses_sp.plan.model import Prediction, predict
from ulysses_sp.plan.vision import VisionShape
from ulysses_sp.run.config import RunConfig

logger = logging.getLogger(__name__)


def settings_for(cfg: RunConfig, world_size: int, device_type: str) -> Settings:
    """The planner's view of a training run's settings."""
    return Settings(
        seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size, dp=world_size // cfg.sp, sp=cfg.sp,
        zero_stage=cfg.zero_stage, partition=cfg.partition_for(world_size),
        dtype="fp32" if cfg.dtype == "fp32" else "bf16",  # fp16 takes bf16's bytes
        offload_states=cfg.cpu_offload, tiled_mlp=cfg.tiled_mlp, tiled_mlp_shards=cfg.tiled_mlp_shards,
        tiled_loss=cfg.tiled_loss, tiled_loss_shards=cfg.tiled_loss_shards,
        activation_checkpointing=cfg.activation_checkpointing, offload_activations=cfg.offload_activations,
        disk_layers=cfg.disk_layers,
        recompute_norms=cfg.recompute_norms, head_chunks=cfg.head_chunks, exchange=cfg.exchange,
        head_blocks=not cfg.offload_attention, head_overlap=cfg.head_chunk_overlap,
        device_type=device_type,
    )  # fmt: skip


def _host_available_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def memory_budget(cfg: RunConfig, device: torch.device) -> tuple[int | None, str]:
    """``(bytes one rank may use, where the number comes from)``; ``None`` when unknown."""
    if cfg.memory is not None:
        return parse_bytes(cfg.memory), "--memory"
    if device.type != "cpu":
        props = torch.get_device_module(device.type).get_device_properties(device)
        return int(props.total_memory), f"{device.type} device memory"
    avail = _host_available_bytes()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return (avail // max(local, 1) if avail else None), "available host memory / local ranks"


def model_shape(config: Any, *, max_positions: int | None = None, model: Any = None) -> ModelShape:
    """The planner's ``ModelShape`` of a transformers config; for a hybrid model with each layer's
    kind (attention, MLP, which sequence mixer and its sizes: ``mixers.shapes``) and the exact
    parameter count, read off the model built on the ``meta`` device (no memory, no weights).
    ``model``: that model when the caller built it (a vision-language model: ``config`` is its text
    config, and the language model's parameters are counted)."""
    from transformers import AutoModelForCausalLM

    from ulysses_sp.mixers.shapes import layer_kinds
    from ulysses_sp.plan.inputs import LayerKind, MixerShape

    shape = ModelShape.from_hf_config(config, max_positions=max_positions)
    try:
        if model is None:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        kinds = layer_kinds(model)
    except Exception as e:  # noqa: BLE001 - best effort: a model it cannot read is planned as Llama layers
        logger.info("planner: layer kinds not read (%s: %s); planned as attention + MLP layers", type(e).__name__, e)
        return shape
    # the exact count: a mixture of experts' layers hold k-fold the Llama formula's MLP (Mixtral-8x7B: 46.7B, not 7.2B)
    q_width, language = shape.heads * shape.head_dim, _language_parameters(model)
    shape = replace(shape, qk_norm=any(hasattr(mod, "q_norm") and hasattr(mod, "q_proj") for mod in model.modules()),
                    output_gate=any(getattr(getattr(mod, "q_proj", None), "out_features", 0) == 2 * q_width
                                    for mod in model.modules()),
                    param_count=sum(p.numel() for p in language))  # fmt: skip
    if all(k["attention"] and k["mlp"] and k["mixer"] is None and not k["own_scores"] for k in kinds):
        return shape
    widths = [k["mlp_width"] for k in kinds if k["mlp"] and k["mlp_width"]]
    intermediate = max(widths) if widths else shape.intermediate  # the MLP as built (LFM2 rounds it up)
    return replace(shape, intermediate=intermediate,
                   layer_kinds=tuple(
        LayerKind(attention=k["attention"], mlp=k["mlp"], mixer=MixerShape(**k["mixer"]) if k["mixer"] else None,
                  own_scores=k["own_scores"])
        for k in kinds))  # fmt: skip


def _language_parameters(model: Any) -> list[torch.nn.Parameter]:
    """A causal LM's parameters; a vision-language model's language model's (its decoder and output embeddings)."""
    if model.config.get_text_config() is model.config:
        return list(model.parameters())
    out = model.get_output_embeddings()
    return list({id(p): p for part in (model.get_decoder(), out) if part is not None for p in part.parameters()}.values())


def _meta_vlm(config: Any) -> Any:
    from ulysses_sp.state.model_dir import auto_model_class

    with torch.device("meta"):
        return auto_model_class(config).from_config(config)


def vision_params(config: Any, model: Any = None) -> int:
    """The parameters of a vision-language model outside its language model (the vision tower and
    its merger), counted on the model built on the ``meta`` device (``model``, when built); 0 for a text model."""
    if config.get_text_config() is config:
        return 0
    model = _meta_vlm(config) if model is None else model
    text = {id(p) for p in _language_parameters(model)}
    return sum(p.numel() for p in model.parameters() if id(p) not in text)


def vlm_shape(config: Any, shape: ModelShape | None = None, *, max_positions: int | None = None) -> ModelShape:
    """A vision-language model's ``ModelShape``: its language model's (``shape``, or read off the model built on the
    ``meta`` device: the exact count, experts, q/k norms and gates, which transformers' causal-LM class cannot build
    from a Qwen-VL text config) with the vision tower's parameters in its states."""
    model = _meta_vlm(config)
    if shape is None:
        shape = model_shape(config.get_text_config(), max_positions=max_positions, model=model)
    extra = vision_params(config, model)
    return replace(shape, extra_params=extra) if extra else shape


def planned_shape(config: Any, *, max_positions: int | None = None) -> ModelShape:
    """The planner's ``ModelShape`` of a model's config: ``model_shape`` for a text model, ``vlm_shape`` (its language
    model, the tower's parameters in the states) for a vision-language model."""
    if config.get_text_config() is config:
        return model_shape(config, max_positions=max_positions)
    return vlm_shape(config, max_positions=max_positions)


def prediction(
    cfg: RunConfig, world_size: int, model_config: Any, device: torch.device, *, vision_patches: int = 0
) -> Prediction:
    """The planner's prediction for this run (reserve 0 on CPU, the table's on accelerators). For a
    vision-language model: its language model's, with the vision tower's parameters in the states
    (``vlm_shape``) and its activations for ``vision_patches`` patches a rank encodes per micro-step
    (``run.vlm.patches_per_rank``; ``plan.vision``)."""
    hw: Hardware = DEVICES["cpu" if device.type == "cpu" else "h100"]
    text = model_config.get_text_config()  # a text model's own config
    settings = settings_for(cfg, world_size, device.type)
    if text is model_config:
        return predict(model_shape(text), settings, hw)
    shape = replace(planned_shape(model_config), vision=VisionShape.from_hf_config(model_config))
    return predict(shape, replace(settings, vision_patches=vision_patches), hw)


ALST_FLAGS = ("tiled_mlp", "tiled_loss", "activation_checkpointing", "offload_activations", "recompute_norms")


def levers(cfg: RunConfig, world_size: int) -> list[str]:
    """Every setting that lowers the peak per rank and that this run does not use yet, as flags."""
    out = [f"--micro-batch-size 1 (now {cfg.micro_batch_size}; --grad-accum keeps the global batch)"
           ] if cfg.micro_batch_size > 1 else []  # fmt: skip
    if cfg.dtype == "fp32":
        out.append("--dtype bf16")
    zero = [] if cfg.zero_stage == 3 else ["--zero-stage 3"]
    if cfg.sp > 1 and cfg.partition_for(world_size) != "all":  # over all dp x sp ranks, not dp alone
        zero.append("--zero-partition all")
    out += [" ".join(zero)] if zero else []
    alst = [name for name in ALST_FLAGS if not getattr(cfg, name)]
    out += ["ALST " + " ".join("--" + n.replace("_", "-") for n in alst)] if alst else []
    if not cfg.cpu_offload:
        out.append("--cpu-offload (model states in host memory, ZeRO 3)")
    return [*out, f"more --sp (now {cfg.sp}: more ranks share each sequence)", "a shorter --seq-len"]


def check_fits(cfg: RunConfig, pred: Prediction, device: torch.device, world_size: int) -> str:
    """Raise ``ValueError`` (warn with ``--force``) when ``pred`` exceeds the budget, naming every
    lever not yet pulled (``levers``); return the startup summary's line."""
    budget, source = memory_budget(cfg, device)
    line = f"  predicted peak per rank {pred.peak_bytes / 2**20:,.1f} MiB" + (
        f" of {budget / 2**20:,.0f} MiB ({source})" if budget else ""
    )
    if budget is not None and pred.peak_bytes > budget:
        big = sorted(pred.breakdown.items(), key=lambda kv: -kv[1])[:3]
        msg = (
            f"predicted peak per rank {pred.peak_bytes:,} bytes > {budget:,} bytes ({source}); largest parts: "
            + ", ".join(f"{k} {v:,}" for k, v in big)
            + "; what would lower it: " + ", ".join(levers(cfg, world_size))
            + f"; `ulysses-sp plan --model {cfg.model} --gpus {world_size} --seq-len {cfg.seq_len}` finds a "
            "setting that fits; --force tries anyway"
        )
        if not cfg.force:
            raise ValueError(msg)
        logger.warning("--force: %s", msg)
    return line


def vision_patches(cfg: RunConfig, model_config: Any, dataset: Any) -> int:
    """For a vision-language run, the most patches one rank's tower encodes per micro-step
    (``run.vlm.patches_per_rank``); 0 for a text run."""
    from ulysses_sp.run.vlm import is_vlm_config, patches_per_rank

    return patches_per_rank(dataset, cfg) if is_vlm_config(model_config) else 0


def check_before_launch(cfg: RunConfig, world_size: int, model_config: Any, *, vision_patches: int = 0) -> None:
    """In the launching process, with ``--memory`` given: the same verdict before any rank starts."""
    if cfg.memory is None:
        return
    from ulysses_sp.parallel.mesh import default_device_type

    device = torch.device(default_device_type())
    pred = prediction(cfg, world_size, model_config, device, vision_patches=vision_patches)
    check_fits(cfg, pred, device, world_size)
