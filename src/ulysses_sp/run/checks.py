"""The component checks a run is made of, each raising ``ValueError`` naming the flag and the numbers.

``check_train_options`` (sizes, recipe, precision, technique options: no model, no data),
``check_layout`` (world size, sp, core attention, sequence length), ``check_model`` (a model with
its tokenizer: vocabulary, heads over sp and ring, positions); ``check_run`` composes the last two
with a data probe for ``eval``. ``run.resolve.resolve_run`` composes them all, once, for ``train``.
``model_config`` reads a model's transformers config without building weights.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ulysses_sp import tasks
from ulysses_sp.attention.core import CORE_ATTENTIONS, check_blockwise_options
from ulysses_sp.checks import check_seq_len_divisible, optional_positive_int, positive_int
from ulysses_sp.parallel.exchange_cost import EXCHANGES
from ulysses_sp.parallel.mesh_shape import head_counts, resolve_ring_size, resolve_ring_size_for_layers
from ulysses_sp.run.config import RunConfig
from ulysses_sp.run.prelaunch import check_attention_available, check_seq_len_fits
from ulysses_sp.run.report import check_report_to
from ulysses_sp.vlm import SUPPORTED_VLMS


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _fraction(name: str, value: Any, *, below_one: bool = False) -> None:
    if not _is_number(value) or not 0 <= value <= 1 or (below_one and value == 1):
        interval = "[0, 1)" if below_one else "[0, 1]"
        raise ValueError(f"{_flag(name)} must be a number in {interval}, got {value!r}")


def check_recipe(cfg: RunConfig) -> None:
    """The optimizer and schedule settings, named by their flags (``ValueError``)."""
    if isinstance(cfg.lr, float) and not math.isfinite(cfg.lr):
        raise ValueError(f"--lr must be a finite number (it scales every update), got {cfg.lr}")
    if not cfg.lr > 0:
        raise ValueError(f"--lr must be > 0, got {cfg.lr}")
    betas = cfg.betas
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"--betas must be two numbers B1,B2, got {betas!r}")
    for b in betas:
        _fraction("betas", b, below_one=True)
    if not _is_number(cfg.weight_decay) or cfg.weight_decay < 0:
        raise ValueError(f"--weight-decay must be a finite number >= 0, got {cfg.weight_decay!r}")
    optional_positive_int("--warmup-steps", cfg.warmup_steps)
    if cfg.warmup_ratio is not None:
        _fraction("warmup_ratio", cfg.warmup_ratio)
        if cfg.warmup_steps is not None:
            raise ValueError(
                f"--warmup-steps ({cfg.warmup_steps}) and --warmup-ratio ({cfg.warmup_ratio}) both set "
                "the warmup; pass one of them"
            )
    _fraction("warmup_min_ratio", cfg.warmup_min_ratio)
    _fraction("cos_min_ratio", cfg.cos_min_ratio)
    if cfg.warmup_type not in ("linear", "log"):
        raise ValueError(f"--warmup-type must be 'linear' or 'log', got {cfg.warmup_type!r}")


def check_precision(cfg: RunConfig) -> None:
    """``--dtype``, ``--save-dtype`` and ``--cpu-offload`` (``ValueError`` naming the flags)."""
    names = ("fp32", "bf16", "fp16")
    if cfg.dtype not in names:
        raise ValueError(f"--dtype must be one of {names}, got {cfg.dtype!r}")
    if cfg.save_dtype is not None and cfg.save_dtype not in names:
        raise ValueError(f"--save-dtype must be one of {names}, got {cfg.save_dtype!r}")
    if cfg.cpu_offload and cfg.zero_stage != 3:
        raise ValueError(
            f"--cpu-offload needs --zero-stage 3 (got {cfg.zero_stage}): FSDP2 offloads sharded parameters, "
            "gradients and the optimizer step together; pass --zero-stage 3"
        )


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
"""The weight files a model directory loads from (transformers' ``from_pretrained`` names)."""


def model_config(model: str, vocab_size: int, *, sharded_load: bool = False, require_weights: bool = False):
    """The transformers config of ``model`` (preset or directory), without building weights;
    ``sharded_load``: the run loads the directory at ZeRO 2/3 (``state.model_dir.check_model_dir``);
    ``require_weights``: a directory without a weight file (``WEIGHT_FILES``) is refused (``train``
    loads them; ``plan`` needs the config alone)."""
    if tasks.is_preset(model):
        return tasks.preset_config(model, vocab_size=vocab_size)
    tasks.check_model_dir(model)
    from ulysses_sp.state.model_dir import check_model_dir, load_config

    config = load_config(model)
    check_text_model(model, config)
    check_special_token_ids(config.get_text_config(), model)  # before check_model_dir builds the model
    if require_weights and not any(os.path.isfile(os.path.join(model, f)) for f in WEIGHT_FILES):
        raise ValueError(
            f"--model {model!r} has a config.json but no weight file ({', '.join(WEIGHT_FILES)}): train loads "
            "the model's weights from it; copy the weights into the directory, or start from a preset "
            "(--model tiny-llama) for random weights"
        )
    # config, index, shards, their headers and shapes, naming the file
    return check_model_dir(model, sharded_load=sharded_load)


def check_text_model(path: str, config: Any) -> None:
    """Refuse a multimodal model directory unless it is an admitted VLM (``vlm.SUPPORTED_VLMS``:
    ``run.vlm`` trains those on chat JSONL with images); the CLI's other loading is text-only."""
    subs = [k for k in getattr(config, "sub_configs", {}) or {} if k in ("vision_config", "audio_config")]
    if subs and config.model_type not in SUPPORTED_VLMS:
        raise ValueError(
            f"{path!r} is a multimodal model ({config.model_type}: {', '.join(subs)}); `ulysses-sp train` loads "
            f"causal LMs with text data, and vision-language models of the families {', '.join(SUPPORTED_VLMS)} "
            "with chat JSONL with images (README, Vision-language models); others are not proven exact under SP"
        )


def ring_size_for(mcfg: Any, sp: int, ring_size: int | str | None) -> int:
    """The ring size of a run of this model (a transformers config, or its dict as the manifest's
    ``model_config``) at ``sp``: ``ring_size``, or for ``None``/``"auto"`` the smallest that works.
    A layout choice, not a run setting: a resume may change it with ``--sp``."""
    if isinstance(mcfg, dict):
        heads = mcfg.get("num_attention_heads")
        return resolve_ring_size(sp, heads, mcfg.get("num_key_value_heads") or heads, ring_size)
    return resolve_ring_size_for_layers(sp, head_counts(mcfg), ring_size)


def check_layout(world_size: int, *, sp: int, seq_len: int, sizes: Mapping[str, Any], attn: str) -> None:
    """Sizes (``sizes``: more positive ints, by option name), the ``(dp, sp)`` layout, the core
    attention and the sequence length's divisibility by ``sp`` (by the ring's, once the model is known)."""
    positive_int("--nproc", world_size)
    for name, value in {"seq_len": seq_len, "sp": sp, **sizes}.items():
        positive_int(_flag(name), value)
    if world_size % sp:
        fits = [p for p in range(1, world_size + 1) if world_size % p == 0 and seq_len % p == 0]
        raise ValueError(
            f"--nproc / world size ({world_size}) is not divisible by --sp ({sp}): "
            f"dp = world_size / sp must be an integer; use --sp in {fits} (the sizes that also divide "
            f"--seq-len {seq_len}), or --nproc a multiple of {sp}"
        )
    if attn not in CORE_ATTENTIONS:
        raise ValueError(f"--attn must be one of {CORE_ATTENTIONS}, got {attn!r}")
    check_attention_available(attn)
    check_seq_len_divisible(seq_len, sp, name="--seq-len")


def check_model(
    model: str, tokenizer: Any, *, sp: int, seq_len: int, ring_size: int | str | None, sharded_load: bool = False,
    require_weights: bool = False,
) -> tuple[Any, int]:  # fmt: skip
    """``(model config, ring size)`` of ``model`` (preset or directory) with ``tokenizer`` (loaded):
    the vocabulary fits, the heads split over ``sp`` (Ulysses, or Ulysses x Ring: ``ring_size``,
    ``None`` = auto), ``seq_len`` divides into the ring's chunks and is within the model's positions;
    ``sharded_load``: the weights load at ZeRO 2/3 (what that load cannot read is refused);
    ``require_weights``: a directory has a weight file (``model_config``)."""
    mcfg = model_config(model, len(tokenizer), sharded_load=sharded_load, require_weights=require_weights)
    return mcfg, check_model_fits(mcfg, model, tokenizer, sp=sp, seq_len=seq_len, ring_size=ring_size)


def check_model_fits(
    mcfg: Any, model: str, tokenizer: Any, *, sp: int, seq_len: int, ring_size: int | str | None
) -> int:
    """``check_model``'s checks of a model config already read (``model``: its name, for messages);
    return the ring size. The planner asks them of each candidate setting."""
    text = mcfg.get_text_config()  # a VLM's language model; a text model's own config
    if len(tokenizer) > text.vocab_size:
        raise ValueError(
            f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {text.vocab_size}; "
            "pass the model's own tokenizer with --tokenizer"
        )
    ring = ring_size_for(mcfg, sp, ring_size)
    check_seq_len_divisible(seq_len, sp, ring, name="--seq-len")
    check_seq_len_fits(seq_len, text, model)
    return ring


def check_special_token_ids(text_config: Any, model: str) -> None:
    """The config's ``pad``/``bos``/``eos`` token ids are rows of its embedding (``< vocab_size``):
    else transformers fails building it (``Padding_idx must be within num_embeddings``) or indexes
    past it. ``ValueError`` naming the id, the vocabulary size and the two ways to fix the config."""
    vocab = getattr(text_config, "vocab_size", None)
    if not isinstance(vocab, int):
        return
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(text_config, name, None)
        ids = value if isinstance(value, (list, tuple)) else [value]
        bad = [i for i in ids if isinstance(i, int) and not 0 <= i < vocab]
        if bad:
            raise ValueError(
                f"--model {model!r}: config.json has {name} {bad[0]} but vocab_size {vocab} (ids 0..{vocab - 1}): "
                f"the embedding has no row for it; set vocab_size to at least {max(bad) + 1} or {name} to an id "
                f"below {vocab} in {model}/config.json"
            )


def check_run(
    world_size: int,
    *,
    sp: int,
    seq_len: int,
    sizes: Mapping[str, Any],
    attn: str,
    models: Sequence[str],
    tokenizer: str | None,
    data: str,
    seed: int,
    held_out: bool = False,
    data_settings: tasks.DataSettings | None = None,
    ring_size: int | str | None = None,
) -> list[tuple[Any, int]]:
    """The checks ``eval`` runs before launch (``train``'s are ``run.resolve.resolve_run``'s): the
    layout, each model with its tokenizer, and text data (probed: its first sample tokenized; a
    vision-language model's chat JSONL with images is read by ``eval`` itself, and its models are
    VLMs only). Returns each model's ``(transformers config, ring size)`` (``check_model``'s)."""
    check_layout(world_size, sp=sp, seq_len=seq_len, sizes=sizes, attn=attn)
    configs, first = [], None
    for model in models:
        tok = tasks.run_tokenizer(tokenizer, model)
        first = first or tok
        configs.append(check_model(model, tok, sp=sp, seq_len=seq_len, ring_size=ring_size))
    vlm = [getattr(c, "model_type", None) in SUPPORTED_VLMS for c, _ in configs]
    if any(vlm) and not all(vlm):
        raise ValueError(f"--model {' '.join(models)}: {models[vlm.index(True)]!r} is a vision-language model and "
                         f"{models[vlm.index(False)]!r} is not; they read different data, evaluate them one by one")  # fmt: skip
    if any(vlm):
        return configs
    tasks.build_dataset(data, tokenizer=first, seq_len=seq_len, seed=seed, num_samples=1, held_out=held_out,
                        settings=data_settings, probe=True)  # fmt: skip
    return configs


def check_train_options(cfg: RunConfig) -> None:
    """Every ``train`` option that needs no model, tokenizer or data (``ValueError`` naming the flag)."""
    for name in ("micro_batch_size", "grad_accum", "steps"):
        positive_int(_flag(name), getattr(cfg, name))
    positive_int("--save-every", cfg.save_every, minimum=0)
    positive_int("--max-nonfinite-steps", cfg.max_nonfinite_steps)
    if cfg.memory_every is not None:
        positive_int("--memory-every", cfg.memory_every)
    if not _is_number(cfg.save_on_signal) or cfg.save_on_signal < 0:
        raise ValueError(f"--save-on-signal must be a number of seconds >= 0, got {cfg.save_on_signal!r}")
    if cfg.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero-stage must be 0, 1, 2 or 3, got {cfg.zero_stage}")
    check_recipe(cfg)
    if cfg.memory is not None:
        from ulysses_sp.plan.hardware import parse_bytes

        parse_bytes(cfg.memory)
    check_precision(cfg)
    if cfg.offload_activations and not cfg.activation_checkpointing:
        raise ValueError(
            "--offload-activations needs --activation-checkpointing: offload moves the one input each "
            "checkpointed layer keeps for backward to host memory; without checkpointing there is "
            "nothing it could offload"
        )
    if cfg.disk_layers < 0 or (cfg.disk_layers and not cfg.offload_activations):
        raise ValueError(
            f"--disk-layers {cfg.disk_layers}: must be >= 0, and > 0 only with --offload-activations (it sends "
            "the first layers' offloaded inputs to files instead of host memory)"
        )
    if cfg.offload_dir is not None and not cfg.disk_layers:
        raise ValueError("--offload-dir names where --disk-layers writes its files; give --disk-layers N too")
    check_blockwise_options(cfg.attn, cfg.attn_chunk, cfg.offload_attention)
    positive_int("--head-chunks", cfg.head_chunks)
    if cfg.head_chunk_overlap and (cfg.head_chunks == 1 or cfg.sp == 1):
        raise ValueError(f"--head-chunk-overlap overlaps one head group's exchange with another's core: it needs "
                         f"--head-chunks > 1 (got {cfg.head_chunks}) and --sp > 1 (got {cfg.sp}, no exchange at 1)")  # fmt: skip
    if cfg.exchange not in EXCHANGES:
        raise ValueError(f"--exchange must be one of {', '.join(EXCHANGES)}, got {cfg.exchange!r}")
    if cfg.split_images not in ("auto", "on", "off"):
        raise ValueError(f"--split-images must be auto, on or off, got {cfg.split_images!r}")
    if cfg.zero_partition not in ("auto", "data_parallel", "all"):
        raise ValueError(f"--zero-partition must be auto, data_parallel or all, got {cfg.zero_partition!r}")
    check_report_to(cfg.report_to)
