"""Registering Ulysses attention with transformers, and the handle that undoes it.

``SPRegistration`` is what ``UlyssesSPAttentionHF.register_with_transformers`` returns: the
``mpu`` of the layout (an ``Mpu`` over the ``SPMesh``), the owner of one ``"ulysses_sp"`` entry in
transformers' ``AttentionInterface`` registry, and the guardrail that checks after every
sequence-parallel forward that the SP attention ran in every attention layer (a model that bypasses
it would silently attend within its local shard only).

The attention is reached through the small ``GuardedAttention`` protocol (its call counter), so
this module does not import ``attention`` (which imports this one).

Registrations stack: a second one under the same name shadows the first, and removing them in any
order leaves the registry holding the most recent registration still active (or nothing).
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import torch

from ulysses_sp.attention.block_indexer import install_block_indexers
from ulysses_sp.attention.indexer import install_indexers
from ulysses_sp.attention.pooled_kv import install_pooled_attention
from ulysses_sp.attention.positions import CallPositions, capture_call
from ulysses_sp.attention.span_mask import SPAN_MODELS, check_spans_shipped
from ulysses_sp.parallel.mesh import Mpu, SPMesh, as_sp_mesh, init_mesh
from ulysses_sp.parallel.mesh_shape import head_counts, resolve_ring_size_for_layers

ATTN_NAME = "ulysses_sp"
"""The name the SP attention is registered under (``attn_implementation="ulysses_sp"``)."""


def model_and_config(model_name_or_path: Any) -> tuple[Any | None, Any]:
    """``(model or None, its transformers config)`` from a model or a local model directory."""
    if isinstance(model_name_or_path, (str, os.PathLike)):
        path = os.fspath(model_name_or_path)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(
                f"{path!r} is not a local model directory with a config.json (nothing is downloaded)"
            )
        from transformers import AutoConfig

        return None, AutoConfig.from_pretrained(path, local_files_only=True)
    config = getattr(model_name_or_path, "config", None)
    if config is not None and not head_counts(config):
        raise ValueError(
            f"{type(model_name_or_path).__name__} has no attention layers (its config names no num_attention_heads): "
            "there is no attention to register; initialize(model, config, mesh_param=(dp, sp)) shards its sequence "
            "mixers (Mamba-2, Mamba-1) by themselves"
        )
    if config is None:
        raise TypeError(
            f"expected a transformers model or a local model directory, got {type(model_name_or_path).__name__}"
        )
    return model_name_or_path, config


POSITION_WISE_LAYER_TYPES = frozenset({"mlp", "moe", "ffn", "dense", "sparse"})
"""Config layer types of layers that hold no token mixer at all."""


def resolve_layout(
    mesh: Any, sp_size: int, heads: list[tuple[int, int]], ring: int, ring_size: int | str | None
) -> SPMesh:
    """The registration's ``SPMesh``: ``init_mesh(sp_size, ring)`` for ``mesh=None``, else the given
    mesh checked against ``sp_size``, an explicit ``ring_size`` and every layer's ``heads``."""
    if mesh is None:
        return init_mesh(sp_size=sp_size, ring_size=ring)
    mesh = as_sp_mesh(mesh)
    if mesh.sp_size != sp_size:
        raise ValueError(
            f"sequence_parallel_size ({sp_size}) disagrees with the mesh's sequence_parallel axis ({mesh.sp_size})"
        )
    if ring_size not in (None, "auto") and ring != mesh.ring_size:
        raise ValueError(f"ring_size ({ring}) disagrees with the mesh's ring_size ({mesh.ring_size})")
    try:
        resolve_ring_size_for_layers(sp_size, heads, mesh.ring_size)
    except ValueError as e:
        raise ValueError(f"{e}; the mesh given has ring_size {mesh.ring_size}: init_mesh(..., ring_size=R)") from None
    return mesh


def layer_kind(layer_type: str) -> str:
    """``"attention"``, ``"position-wise"`` or ``"mixer"`` for one config layer type string
    (``full_attention``/``sliding_attention``: attention; ``linear_attention``, ``conv``, ``mamba``: mixer)."""
    t = layer_type.lower()
    if "attention" in t and not any(w in t for w in ("linear", "lightning", "delta", "kda")):
        return "attention"
    return "position-wise" if t in POSITION_WISE_LAYER_TYPES else "mixer"


def num_attention_layers(config: Any) -> int:
    """Layers that run attention: all of them, unless ``layer_types`` marks some as non-attention
    (a linear-attention, convolution or state-space layer does not call the SP attention; a
    ``hybrid`` layer runs both). A composite (vision-language) config: its text config's layers."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(config, "layer_types", None)
    if types:
        return sum(1 for t in map(str, types) if layer_kind(t) == "attention" or t == "hybrid")
    # cross-attention layers (Mllama's, to the vision states) are skipped on text-only input and refused under SP
    return int(config.num_hidden_layers) - len(getattr(config, "cross_attention_layers", None) or ())


def attach_registered(model: Any) -> None:
    """Attach ``model`` to the registration of the SP attention it dispatches to, if it is not
    (a model loaded with ``attn_implementation="ulysses_sp"`` after registering from a directory)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if getattr(getattr(model, "config", None), "_attn_implementation", None) != ATTN_NAME:
        return
    registration = getattr(ALL_ATTENTION_FUNCTIONS.get(ATTN_NAME), "registration", None)
    if isinstance(registration, SPRegistration):
        registration.attach(model)


def registered_layout(model: Any) -> SPMesh | None:
    """The layout of the SP attention ``model`` dispatches to, or ``None`` when it uses another one."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != ATTN_NAME:
        return None
    registration = getattr(ALL_ATTENTION_FUNCTIONS.get(ATTN_NAME), "registration", None)
    return registration.mesh if isinstance(registration, SPRegistration) else None


class GuardedAttention(Protocol):
    """What the guardrail needs of a registered attention function."""

    calls: int
    """Attention calls since the last ``reset_calls()``."""
    sp_size: int
    disable_in_eval: bool
    core: str
    registration: SPRegistration | None
    """The registration whose registry entry this is (set by it; links the stack of entries)."""
    call: CallPositions | None
    """The positions of the most recent call of an attached model (set by the pre-hook)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def reset_calls(self) -> None: ...


class SPRegistration(Mpu):
    """The ``mpu`` returned by ``register_with_transformers``, and the handle that undoes it.

    While registered, ``ALL_ATTENTION_FUNCTIONS["ulysses_sp"]`` is the SP attention and the model
    (when one was given) uses it. ``remove()`` restores the model's previous attention
    implementation and removes the registry entry (restoring any entry it replaced).
    """

    def __init__(self, mesh: SPMesh, attention: GuardedAttention, model: Any | None) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        super().__init__(mesh)
        self.attention = attention
        self.model: Any | None = None
        """The model attached last (``attach`` may be called for several)."""
        self._registry = ALL_ATTENTION_FUNCTIONS
        # Item assignment on the global instance (the public MutableMapping API) rather than the
        # class-level register(): unlike register(), it can be deleted again. What this entry
        # shadows is kept on the registration, so out-of-order removals can relink the stack.
        if attention.registration is not None:
            raise ValueError("this attention instance is registered already; build a new one")
        self._below = ALL_ATTENTION_FUNCTIONS.get(ATTN_NAME)
        attention.registration = self
        ALL_ATTENTION_FUNCTIONS[ATTN_NAME] = attention
        self._attached: list[tuple[Any, str | None, list[Any]]] = []
        self.head_blocks: Any | None = None
        """The attention modules run as whole blocks per head group (``attention/head_blocks.py``)."""
        self._active = True
        if model is not None:
            self.attach(model)

    def attach(self, model: torch.nn.Module) -> None:
        """Point ``model`` at the SP attention and install the guardrail: after every
        sequence-parallel forward, check that the SP attention ran in every attention layer (raises
        with what to change otherwise). Before every forward the SP attention learns whether the
        model was given ``position_ids`` (``attention/positions.py``). Several models may be
        attached (attaching one twice does nothing); ``remove()`` restores all."""
        if any(m is model for m, _, _ in self._attached):
            return
        prev_impl = model.config._attn_implementation
        if prev_impl != ATTN_NAME:
            model.set_attn_implementation(ATTN_NAME)
        num_layers = num_attention_layers(model.config)
        prepare = getattr(self.attention, "prepare_model", None)  # e.g. the attention block per head group
        blocks = prepare(model) if prepare is not None else None
        self.head_blocks = blocks if blocks is not None else self.head_blocks
        hooks = [blocks] if blocks is not None else []
        # DSA / QSA indexers (attention/indexer.py, block_indexer.py): each query's picks over the whole sequence
        sp_attn = hasattr(self.attention, "_seq_layout")
        indexers = install_indexers(model, self.attention) if sp_attn else None
        indexers = install_block_indexers(model, self.attention, indexers) if sp_attn else None
        indexers = install_pooled_attention(model, self.attention, indexers) if sp_attn else None  # DeepSeek-V4
        hooks += [indexers] if indexers is not None else []
        hooks += [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(lambda module, *_: self._after_forward(module, num_layers)),
        ]
        self._attached.append((model, prev_impl, hooks))
        self.model = model

    def _before_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if kwargs.get("token_type_ids") is not None and getattr(getattr(module, "config", None), "prefix_lm", 0) is True:
            raise ValueError(  # HRM: the model's mask makes its prefix one bidirectional block; ours is causal
                f"{type(module).__name__} was given token_type_ids with config.prefix_lm = True: its own mask makes "
                "the tokens of type 1 one bidirectional block, but the SP attention builds a causal mask from "
                "positions alone. Train it causally (without token_type_ids), or without the SP attention"
            )
        config = getattr(module, "config", None)
        if kwargs.get("token_type_ids") is not None and getattr(config, "model_type", None) in SPAN_MODELS:
            check_spans_shipped(module, kwargs.get("position_ids"))
        self.attention.reset_calls()
        self.attention.call = capture_call(module, args, kwargs)

    def _after_forward(self, module: torch.nn.Module, num_layers: int) -> None:
        attn = self.attention
        if attn.sp_size > 1 and not (attn.disable_in_eval and not module.training):
            self.check_ran(num_layers, module)

    @property
    def sequence_parallel_size(self) -> int:
        return self.get_sequence_parallel_world_size()

    def remove(self) -> None:
        """Undo the registration: every attached model computes exactly what it did before, and the
        registry holds what it would hold had this registration never been made."""
        if not self._active:
            return
        for model, prev_impl, hooks in reversed(self._attached):
            for h in hooks:
                h.remove()
            if prev_impl is not None and prev_impl != ATTN_NAME:
                model.set_attn_implementation(prev_impl)
        self._attached = []
        self._unlink()
        self._active = False

    def _unlink(self) -> None:
        """Take this registration's entry out of the registry's stack of ``ATTN_NAME`` entries."""
        top = self._registry.get(ATTN_NAME)
        if top is self.attention:
            if self._below is None:
                del self._registry[ATTN_NAME]
            else:
                self._registry[ATTN_NAME] = self._below
            return
        # Shadowed by later registrations: walk down from the top to the one right above this
        # one, which from now on shadows what this one shadowed.
        above = getattr(top, "registration", None)
        while isinstance(above, SPRegistration) and above._below is not self.attention:
            above = getattr(above._below, "registration", None)
        if isinstance(above, SPRegistration):
            above._below = self._below

    def check_ran(self, num_layers: int, model: Any | None = None) -> None:
        """Guardrail: raise unless the SP attention ran in ``num_layers`` layers since the last reset."""
        calls = self.attention.calls
        if calls < num_layers:
            impl = getattr(getattr(model or self.model, "config", None), "_attn_implementation", "?")
            raise RuntimeError(
                f"sequence-parallel attention ran in {calls} of {num_layers} attention layers: the model's "
                f"attention bypassed it (attn_implementation={impl!r}). Set "
                f"model.set_attn_implementation({ATTN_NAME!r}) or load the model with "
                f"attn_implementation={ATTN_NAME!r}; models that do not dispatch attention through "
                "transformers' AttentionInterface cannot use Ulysses SP"
            )

    def __repr__(self) -> str:
        return f"SPRegistration(dp_size={self.get_data_parallel_world_size()}, sp_size={self.sequence_parallel_size}, core={self.attention.core!r})"
