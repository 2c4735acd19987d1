"""Install the per-shard merge on a VLM: its forward builds only this rank's tokens.

``shard_vlm(model, sp_rank=, sp_size=, split_images_over=)`` installs, on an admitted VLM
(``families``):

- ``merge.sharded_forward`` (Qwen), ``scatter.scatter_forward`` (LLaVA-style), ``phi4mm.phi4_forward``
  (Phi-4-multimodal) or ``prefix.prefix_forward`` (GIT: the image prefix and the text cut together,
  ``N + S`` tokens in ``P`` shards) in place of the
  forward of the module that merges (``VLMParts.inner``): each rank embeds its own ``S_l`` text
  tokens, scatters the visual rows of its shard only, cuts the full-sequence positions (Qwen's
  ``[4, B, S]``, LLaVA's ``[B, S]``) to its tokens and runs the language model on ``[B, S_l, Hd]``.
  No rank holds the sample's ``[B, S, Hd]`` embeddings;
- the towers' attention back on the core attention: ``register_with_transformers`` points every
  sub-config at the SP attention, but a tower runs whole frames (Phi-4's audio tower: whole clips) on a rank.

Where a Qwen tower runs (``split``; a LLaVA-style tower encodes every image on each rank): with ``split_images_over=`` the SP group (``initialize`` and
``prepare`` pass it), the sample's frames are split over the group by patch count when there are at
least as many frames as ranks, and one all-to-all sends every merged row to the rank whose shard
holds it; otherwise (no group, or fewer frames than ranks) each rank encodes the frames its shard
touches. ``bench/vlm_memory.py`` measures both.

Shape legend: ``B`` batch, ``S`` global sequence, ``S_l = S/P``, ``Hd`` hidden.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ulysses_sp.attention.registration import ATTN_NAME
from ulysses_sp.vlm.families import VLMParts, vlm_parts
from ulysses_sp.vlm.gemma3n import gemma3n_forward
from ulysses_sp.vlm.merge import install, sharded_forward
from ulysses_sp.vlm.phi4mm import phi4_forward
from ulysses_sp.vlm.prefix import prefix_forward
from ulysses_sp.vlm.scatter import scatter_forward

INSTALLED = "_ulysses_sp_vlm_shard"
"""The language model's attribute holding its ``VLMShardHandle`` while installed."""


class VLMShardHandle:
    """What ``shard_vlm`` returns; ``remove()`` restores the VLM's forward and the vision attention."""

    def __init__(self, model: nn.Module, language_model: nn.Module, tower_configs: list, prev: list, undo: Any) -> None:
        self.model, self.language_model = model, language_model
        self._tower_configs, self._prev, self._undo = tower_configs, prev, undo

    def remove(self) -> None:
        if self._undo is None:
            return
        self._undo()
        self._undo = None
        self.language_model.__dict__.pop(INSTALLED, None)
        for config, prev in zip(self._tower_configs, self._prev):
            config._attn_implementation = prev


def shard_vlm(
    model: nn.Module,
    *,
    sp_rank: int,
    sp_size: int,
    ring_size: int = 1,
    core: str | None = None,
    split_images_over: Any = None,
) -> VLMShardHandle:
    """Install the per-shard merge (module docstring) and keep the vision tower on ``core`` attention.

    Call it after ``register_with_transformers`` (which points the whole model at the SP attention);
    ``core=None``: the core attention of that registration. ``initialize`` and ``prepare`` call it
    with ``split_images_over=`` their SP group. ``split_images_over``: the SP group to split the
    tower's frames over (``vlm.split``); ``None``: each rank encodes the frames its shard needs.
    Then call the VLM with the full sample on every rank (``prepare_vlm_batch``).

    Raises:
        ValueError: ``model`` is not an admitted VLM (``families.SUPPORTED_VLMS``), or is installed already.
    """
    parts = vlm_parts(model)
    if parts is None:
        raise ValueError(f"{type(model).__name__} is not a VLM ulysses_sp.vlm supports (see SUPPORTED_VLMS)")
    if core is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        core = getattr(ALL_ATTENTION_FUNCTIONS.get(ATTN_NAME), "core", None)
        if core is None:
            raise ValueError("shard_vlm needs register_with_transformers(...) first (or core='sdpa')")
    if INSTALLED in parts.language_model.__dict__:
        raise ValueError(
            f"{type(model).__name__} is sharded for SP already (shard_vlm was called); remove() it first"
        )
    configs = tower_configs(parts)
    prev = [config._attn_implementation for config in configs]
    for config in configs:
        config._attn_implementation = core  # the towers' own attention over their whole frames / clips
    group = split_images_over if sp_size > 1 else None
    if parts.prefix:  # GIT: the image prefix prepended, the sequence N + S cut in P
        forward = prefix_forward(parts, sp_rank=sp_rank, sp_size=sp_size, ring_size=ring_size)
    elif parts.scatter is None:  # Qwen: mrope, the tower's frames split over the group
        forward = sharded_forward(parts, sp_rank=sp_rank, sp_size=sp_size, ring_size=ring_size, group=group)
    elif parts.media is not None:  # Phi-4-multimodal: the decoder holds its towers, every image and clip on each rank
        forward = phi4_forward(parts, sp_rank=sp_rank, sp_size=sp_size, ring_size=ring_size)
    else:  # LLaVA-style: 1-D positions, every image (Gemma 3n: and audio clip) encoded on each rank
        make = gemma3n_forward if parts.scatter.per_layer_audio else scatter_forward
        forward = make(parts, sp_rank=sp_rank, sp_size=sp_size, ring_size=ring_size)
    handle = VLMShardHandle(model, parts.language_model, configs, prev, install(parts, forward))
    parts.language_model.__dict__[INSTALLED] = handle
    return handle


def tower_configs(parts: VLMParts) -> list[Any]:
    """The configs of the towers (the vision tower's; with ``VLMParts.media``, every tower model in it: Phi-4's
    image and audio towers), which ``register_with_transformers`` pointed at the SP attention too."""
    if parts.media is None:
        config = getattr(parts.vision, "config", None)  # None: Fuyu's patch projection, no attention
        return [] if config is None else [config]
    from transformers import PreTrainedModel

    towers = [m.config for m in parts.media.modules() if isinstance(m, PreTrainedModel)]
    return list({id(c): c for c in towers}.values())


def installed(model: nn.Module) -> VLMShardHandle | None:
    """The ``shard_vlm`` handle installed on ``model`` (an admitted VLM), else ``None``."""
    parts = vlm_parts(model)
    return None if parts is None else parts.language_model.__dict__.get(INSTALLED)
