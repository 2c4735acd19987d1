"""Registering Ulysses attention with transformers, and the handle that undoes it.

``SPRegistration`` is what ``UlyssesSPAttentionHF.register_with_transformers`` returns: an ``Mpu``
over the mesh, the owner of the ``"ulysses_sp"`` entry in transformers' ``AttentionInterface``
registry, and the guardrail that checks after every sequence-parallel forward that the SP
attention ran in every attention layer (a model that bypasses it would silently attend within its
local shard only).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from .mesh import Mpu

if TYPE_CHECKING:
    from .attention import UlyssesSPAttentionHF

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
    if config is None or not hasattr(config, "num_attention_heads"):
        raise TypeError(
            f"expected a transformers model or a local model directory, got {type(model_name_or_path).__name__}"
        )
    return model_name_or_path, config


def num_attention_layers(config: Any) -> int:
    """Layers that run attention: all of them, unless ``layer_types`` marks some as non-attention."""
    types = getattr(config, "layer_types", None)
    if types:
        return sum(1 for t in types if "attention" in str(t))
    return int(config.num_hidden_layers)


class SPRegistration(Mpu):
    """The ``mpu`` returned by ``register_with_transformers``, and the handle that undoes it.

    While registered, ``ALL_ATTENTION_FUNCTIONS["ulysses_sp"]`` is the SP attention and the model
    (when one was given) uses it. ``remove()`` restores the model's previous attention
    implementation and removes the registry entry (restoring any entry it replaced).
    """

    def __init__(self, mesh: DeviceMesh, attention: UlyssesSPAttentionHF, model: Any | None) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        super().__init__(mesh)
        self.attention = attention
        self.model = model
        self._registry = ALL_ATTENTION_FUNCTIONS
        # Item assignment on the global instance (the public MutableMapping API) rather than the
        # class-level register(): unlike register(), it can be deleted again.
        self._replaced = ALL_ATTENTION_FUNCTIONS.get(ATTN_NAME)
        ALL_ATTENTION_FUNCTIONS[ATTN_NAME] = attention
        self._prev_impl = None
        self._hooks: list[Any] = []
        self._active = True
        if model is not None:
            self._prev_impl = model.config._attn_implementation
            model.set_attn_implementation(ATTN_NAME)
            self.attach(model)

    def attach(self, model: torch.nn.Module) -> None:
        """Install the guardrail on ``model``: after every sequence-parallel forward, check that the
        SP attention ran in every attention layer (raises with what to change otherwise)."""
        self.model = model
        self._num_layers = num_attention_layers(model.config)
        self._hooks.append(model.register_forward_pre_hook(lambda *_: self.attention.reset_calls()))
        self._hooks.append(model.register_forward_hook(self._after_forward))

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        attn = self.attention
        if attn.sp_size > 1 and not (attn.disable_in_eval and not module.training):
            self.check_ran(self._num_layers)

    @property
    def sequence_parallel_size(self) -> int:
        return self.get_sequence_parallel_world_size()

    def remove(self) -> None:
        """Undo the registration: the model computes exactly what it did before."""
        if not self._active:
            return
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.model is not None and self._prev_impl is not None:
            self.model.set_attn_implementation(self._prev_impl)
        if self._registry.get(ATTN_NAME) is self.attention:
            del self._registry[ATTN_NAME]
            if self._replaced is not None and self._registry.get(ATTN_NAME) is not self._replaced:
                self._registry[ATTN_NAME] = self._replaced
        self._active = False

    def check_ran(self, num_layers: int) -> None:
        """Guardrail: raise unless the SP attention ran in ``num_layers`` layers since the last reset."""
        calls = self.attention.calls
        if calls < num_layers:
            impl = getattr(getattr(self.model, "config", None), "_attn_implementation", "?")
            raise RuntimeError(
                f"sequence-parallel attention ran in {calls} of {num_layers} attention layers: the model's "
                f"attention bypassed it (attn_implementation={impl!r}). Set "
                f"model.set_attn_implementation({ATTN_NAME!r}) or load the model with "
                f"attn_implementation={ATTN_NAME!r}; models that do not dispatch attention through "
                "transformers' AttentionInterface cannot use Ulysses SP"
            )

    def __repr__(self) -> str:
        return f"SPRegistration(dp_size={self.get_data_parallel_world_size()}, sp_size={self.sequence_parallel_size}, core={self.attention.core!r})"
