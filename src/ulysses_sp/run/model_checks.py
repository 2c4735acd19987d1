"""Every model-dependent refusal of a ``train`` run, in the launching process, before any worker starts.

A rank builds the model, applies the ALST transforms (``apply_techniques``: tiled MLP, norm
recompute, activation checkpointing and offload, tiled loss), registers the SP attention
(``sp_attention_wanted``) and hands the model to ``initialize`` (the closed-world guard, the mixer
handlers). Each of those refuses some models and settings; asked only there, the refusal arrives
after the launch, once per rank. ``check_model_run`` asks the same functions the same questions of
the model built on the meta device (``build_meta_model``: no weight read, no memory), in the order a
rank meets them:

1. the model builds with ``--attn`` (transformers refuses e.g. sdpa for gpt-oss);
2. the techniques apply (``apply_techniques`` on the meta model, undone at once; the tiled loss's
   model check);
3. the SP attention takes the model at ``--sp`` (``attention.checks``: layer kinds, heads, ring,
   head groups, sinks under ``--head-chunks``);
4. the closed-world guard (``mixers.guard.check_sequence_mixing``) and the mixer handlers' checks at
   ``--sp`` and the ring size (``mixers.base.check_mixers``).

``run.resolve.resolve_run`` calls it for ``train``; ``ulysses-sp plan`` calls it before it offers a
setting (``JUDGED``: the run fields it reads, so a planner can ask once per distinct answer).
Raises ``ValueError`` on one line, naming the flag where one is to blame.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ulysses_sp.run.config import RunConfig
from ulysses_sp.run.vlm import is_vlm_config

JUDGED = ("sp", "attn", "ring_size", "tiled_mlp", "tiled_mlp_shards", "tiled_loss", "recompute_norms",
          "activation_checkpointing", "offload_activations", "head_chunks", "attn_chunk", "offload_attention")  # fmt: skip
"""The ``RunConfig`` fields ``check_model_run`` reads: runs equal in these get the same verdict."""


def technique_steps(cfg: RunConfig) -> list[tuple[str, Callable[[nn.Module], Any]]]:
    """``(flag, apply)`` for each ALST transform ``cfg`` asks for, in the order a rank applies them;
    ``apply(model)`` returns the transform's undo handle (``None``: none to keep)."""
    from ulysses_sp.memory.norms import apply_norm_recompute
    from ulysses_sp.memory.offload import enable_activation_checkpointing, enable_activation_offload
    from ulysses_sp.memory.tiling import apply_tiled_mlp

    steps: list[tuple[str, Callable[[nn.Module], Any]]] = [
        ("--tiled-mlp", lambda model: apply_tiled_mlp(model, cfg.tiled_mlp_shards)),
        ("--recompute-norms", apply_norm_recompute),
        ("--activation-checkpointing", enable_activation_checkpointing),
        ("--offload-activations",
         lambda model: enable_activation_offload(model, disk_dir=cfg.offload_dir, disk_layers=cfg.disk_layers)),
    ]
    return [(flag, fn) for flag, fn in steps if getattr(cfg, flag[2:].replace("-", "_"))]


def apply_techniques(cfg: RunConfig, model: nn.Module) -> tuple[list[Any], Any]:
    """Apply the ALST transforms to the bare model; return (undo handles, loss_fn or None)."""
    from ulysses_sp.memory.tiling import TiledCausalLMLoss

    handles = [h for _, apply in technique_steps(cfg) if (h := apply(model)) is not None]
    loss_fn = TiledCausalLMLoss(num_shards=cfg.tiled_loss_shards) if cfg.tiled_loss else None
    return handles, loss_fn


def sp_attention_wanted(cfg: RunConfig, model_config: Any) -> bool:
    """Whether the run's attention goes through ``UlyssesSPAttentionHF``: at sp > 1, for the blockwise
    core's options, and at sp 1 for every text model whose layers it runs exactly. At sp 1 that keeps
    packed documents apart on every family (some families' own forward lets them attend across
    documents) and never builds transformers' ``[1, 1, S, S]`` mask (16 GiB at 128K tokens)."""
    from ulysses_sp.attention.layer_kinds import plain_attention_layers
    from ulysses_sp.parallel.mesh_shape import head_counts

    if not head_counts(model_config):  # no attention layers (pure Mamba-2): its mixers alone are sharded
        return False
    if cfg.sp > 1 or cfg.offload_attention or cfg.attn_chunk is not None:
        return True
    text = model_config.get_text_config()
    if "indexed_attention" in (getattr(text, "layer_types", None) or ()) and cfg.attn not in ("sdpa", "eager"):
        return False  # DSA's picks run in the SP attention's blockwise core only: other cores keep the model's path
    if is_vlm_config(model_config):  # packed VLM rows at sp 1: the SP path keeps the documents apart
        return cfg.packing == "best-fit"
    return plain_attention_layers(text)


def built_attn(cfg: RunConfig, model_config: Any) -> str:
    """The attention implementation a rank builds the model with: ``--attn``, except ``eager`` for a model
    without attention layers (pure Mamba-2: no core runs, and transformers builds it only as eager)."""
    from ulysses_sp.parallel.mesh_shape import head_counts

    return cfg.attn if head_counts(model_config) else "eager"


def build_meta_model(model_config: Any, attn: str, *, name: str = "the model") -> nn.Module:
    """The model of ``model_config`` as a rank builds it (its auto class, ``attn`` as its attention),
    on the meta device: shapes and modules, no memory, no weights read."""
    from ulysses_sp.state.model_dir import auto_model_class

    config = copy.deepcopy(model_config)
    try:
        with torch.device("meta"):
            return auto_model_class(config).from_config(config, attn_implementation=attn)
    except (ValueError, ImportError) as e:  # e.g. "GptOssForCausalLM does not support ... sdpa"
        raise ValueError(f"--attn {attn}: transformers cannot build {name} with it: {e}; choose an --attn this "
                         "model supports (e.g. --attn eager)") from None


def one_line(message: str) -> str:
    """``message`` on one line (a guard's per-module list joined with ``; ``)."""
    out = ""
    for part in (p.strip() for p in message.splitlines()):
        if part:
            out += ("" if not out else " " if out.endswith(":") else "; ") + part
    return out


def check_model_run(cfg: RunConfig, model_config: Any, *, ring_size: int, model: nn.Module | None = None) -> None:
    """Raise ``ValueError`` (one line) for what the ranks of ``cfg``'s run would refuse about its model.

    ``ring_size``: the run's resolved ring size (``run.checks.check_model``); ``model``: the model
    already built on the meta device (``build_meta_model``; ``None``: built here). The model's
    modules are patched and restored; activation checkpointing, once enabled, stays enabled on it.
    """
    if model is None:
        model = build_meta_model(model_config, built_attn(cfg, model_config), name=repr(cfg.model))
    try:
        for check in _checks(cfg, model_config, ring_size):
            check(model)
    except ValueError as e:
        raise ValueError(one_line(str(e))) from None


def _checks(cfg: RunConfig, model_config: Any, ring: int) -> list[Callable[[nn.Module], None]]:
    from ulysses_sp.attention.checks import check_head_chunk_sinks, check_sp_attention
    from ulysses_sp.memory.tiling import TiledCausalLMLoss
    from ulysses_sp.mixers._kernels import check_layout
    from ulysses_sp.mixers.apply import HANDLERS, has_mixers, needs_plain_layout
    from ulysses_sp.mixers.base import check_mixers
    from ulysses_sp.mixers.guard import check_sequence_mixing
    from ulysses_sp.parallel.mesh_shape import head_counts

    def techniques(model: nn.Module) -> None:
        handles = []
        try:
            for flag, apply in technique_steps(cfg):
                with _flag(flag):
                    handles.append(apply(model))
        finally:
            for handle in reversed(handles):
                if handle is not None:
                    handle.remove()
        if cfg.tiled_loss:
            with _flag("--tiled-loss"):
                TiledCausalLMLoss.check_model(model)

    def attention(model: nn.Module) -> None:
        if not any(head_counts(model_config)):
            return
        if not sp_attention_wanted(cfg, model_config):  # sp 1 on the model's own attention: no head groups there
            if cfg.head_chunks > 1:
                raise ValueError(f"--head-chunks {cfg.head_chunks}: at --sp 1 {type(model).__name__} runs transformers' "
                                 "own attention (a vision-language model, or layers the SP attention does not run "
                                 "at sp 1), which has no head groups; drop --head-chunks")  # fmt: skip
            return
        with _flag(f"--sp {cfg.sp}" if cfg.head_chunks == 1 else f"--head-chunks {cfg.head_chunks}"):
            check_sp_attention(model_config, cfg.attn, cfg.sp, ring_size=ring, attn_chunk=cfg.attn_chunk,
                               offload_attention=cfg.offload_attention, head_chunks=cfg.head_chunks)  # fmt: skip
            check_head_chunk_sinks(model, cfg.head_chunks)

    def mixing(model: nn.Module) -> None:
        check_sequence_mixing(model, sp_size=cfg.sp)  # names the layer, the module and the fix itself
        if has_mixers(model):
            with _flag(f"--sp {cfg.sp}"):
                if ring > 1 and needs_plain_layout(model):
                    check_layout(_Layout(ring), type(model).__name__)
                check_mixers(model, cfg.sp, HANDLERS)

    return [techniques, attention, mixing]


class _Layout:
    """What ``mixers._kernels.check_layout`` reads of a mesh: its ring size."""

    def __init__(self, ring_size: int) -> None:
        self.ring_size = ring_size


@contextlib.contextmanager
def _flag(flag: str) -> Iterator[None]:
    """Prefix a ``ValueError`` raised inside with ``flag: `` (the option the user can change)."""
    try:
        yield
    except ValueError as e:
        if str(e).startswith("--"):
            raise
        raise ValueError(f"{flag}: {e}") from None
