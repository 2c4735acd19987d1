"""The run-level check: a ``RunConfig`` checked once and resolved into what every rank needs.

``resolve_run(cfg, world_size)`` composes the components' own checks (``run.checks``: options,
layout, model with tokenizer; the data layer's: formats, loss mask, template, scored tokens;
``run.rundir``: output directory, resume, checkpoint files; ``run.model_checks``: what the ranks
would refuse about the model, asked of it on the meta device) and returns a ``ResolvedRun``: the
model config, the tokenizer, the ring size, the manifest and the training dataset, each built
once. ``ulysses-sp train`` calls it in the launching process and hands the result to its ranks
(pickled: a tokenized corpus travels as its cache path, opened memory-mapped on arrival), so a
rank neither validates again nor tokenizes: a run tokenizes its corpus once and loads its model
config and tokenizer once. The library path (``run.loop.run(cfg)`` without a resolved run, e.g.
under ``torchrun``) resolves on every rank; the same checks, the same verdict everywhere.

No processes, no collectives; every check raises ``ValueError`` naming the value and the fix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Dataset

from ulysses_sp import tasks
from ulysses_sp.data.packed import check_scored
from ulysses_sp.mixers.guard import check_document_mixing
from ulysses_sp.parallel.mesh_shape import head_counts
from ulysses_sp.run.checks import check_layout, check_model, check_train_options
from ulysses_sp.run.config import RunConfig
from ulysses_sp.run.model_checks import build_meta_model, built_attn, check_model_run, one_line
from ulysses_sp.run.rundir import check_output_dir, manifest_for
from ulysses_sp.run.vlm import check_vlm_options, is_vlm_config, vlm_dataset

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ResolvedRun:
    """A checked run: what the ranks build from instead of checking and loading again."""

    cfg: RunConfig
    """The run's settings."""
    world_size: int
    """Processes the run was checked for (a rank refuses a run resolved for another world size)."""
    model_config: Any
    """The model's transformers config (a preset's, or the directory's ``config.json``)."""
    tokenizer: Any
    """The tokenizer, loaded."""
    ring_size: int
    """Ring groups the SP axis factors into (1: Ulysses alone)."""
    manifest: dict[str, Any]
    """What the run's checkpoints record and a resume compares (``rundir.manifest_for``)."""
    dataset: Dataset | list[dict[str, Any]]
    """The training samples: recall, text blocks, packed blocks over the memory-mapped token cache, or
    a VLM's chat samples with their pixels (``run.vlm``)."""


def num_samples(cfg: RunConfig, dp: int) -> int:
    """Recall samples are generated, not stored: exactly enough for every step, never repeated."""
    return cfg.steps * cfg.micro_batch_size * cfg.grad_accum * dp


def resolve_run(cfg: RunConfig, world_size: int, *, progress: bool | None = None) -> ResolvedRun:
    """Check ``cfg`` for ``world_size`` processes and resolve it (see the module docstring).

    ``progress``: a tokenizing progress bar (``None``: ``cfg.progress``). Raises ``ValueError``.
    """
    check_train_options(cfg)
    check_layout(world_size, sp=cfg.sp, seq_len=cfg.seq_len, sizes={}, attn=cfg.attn)
    cfg.training_config(world_size)  # the engine's own checks
    # The model directory's checks (config, safetensors index, shards, shapes, what a ZeRO 2/3 load can
    # read: state.model_dir.check_model_dir) run inside run.checks.model_config, called by check_model.
    tokenizer = tasks.run_tokenizer(cfg.tokenizer, cfg.model)
    mcfg, ring = check_model(cfg.model, tokenizer, sp=cfg.sp, seq_len=cfg.seq_len, ring_size=cfg.ring_size,
                             sharded_load=cfg.zero_stage >= 2, require_weights=True)  # fmt: skip
    check_attention_options(cfg, mcfg)
    vlm = is_vlm_config(mcfg)
    if vlm:
        check_vlm_options(cfg)
    elif cfg.split_images != "auto":
        raise ValueError(f"--split-images {cfg.split_images}: --model {cfg.model!r} is not a vision-language model "
                         "(no vision tower to split); drop the flag")  # fmt: skip
    meta = build_meta_model(mcfg, built_attn(cfg, mcfg), name=repr(cfg.model))
    check_model_run(cfg, mcfg, ring_size=ring, model=meta)  # the model on the meta device: what the ranks would refuse
    manifest = manifest_for(cfg, world_size, mcfg)
    check_output_dir(cfg, manifest)  # before the data: a refused output dir should not wait for tokenizing
    if vlm:  # chat JSONL with images: image tokens count toward --seq-len; a bad sample is named
        dataset = vlm_dataset(cfg, mcfg)
    else:
        dataset = tasks.build_dataset(
            cfg.data, tokenizer=tokenizer, seq_len=cfg.seq_len, seed=cfg.seed,
            num_samples=num_samples(cfg, world_size // cfg.sp),
            settings=cfg.data_settings(), progress=cfg.progress if progress is None else progress,
        )  # fmt: skip
        check_scored(dataset, seq_len=cfg.seq_len, data=cfg.data)
        if getattr(dataset, "packs_documents", bool)():  # at sp > 1 too: DeepSeek-V4's pooled K/V mixes documents
            try:
                check_document_mixing(meta, what=f"--packing {cfg.packing or 'best-fit'}: packed documents")
            except ValueError as e:
                raise ValueError(one_line(str(e))) from None
    return ResolvedRun(cfg=cfg, world_size=world_size, model_config=mcfg, tokenizer=tokenizer, ring_size=ring,
                       manifest=manifest, dataset=dataset)  # fmt: skip


def check_attention_options(cfg: RunConfig, model_config: Any) -> None:
    """A model without attention layers (pure Mamba-2) takes no attention option: refused by flag
    rather than silently without effect (``ValueError``)."""
    if head_counts(model_config):
        return
    for flag, value in (("--attn-chunk", cfg.attn_chunk), ("--offload-attention", cfg.offload_attention),
                        ("--head-chunks", cfg.head_chunks if cfg.head_chunks != 1 else None)):  # fmt: skip
        if value not in (None, False):
            raise ValueError(f"{flag}: --model {cfg.model!r} has no attention layers (its config names no "
                             "num_attention_heads), so the option would change nothing; drop it")  # fmt: skip


def validate(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    """``resolve_run``'s checks; return the run's manifest."""
    return resolve_run(cfg, world_size, progress=False).manifest
