"""Where a model's decoder layers are, and the architectures refused whole, before any layer is read.

The closed-world guard (``mixers.guard``) checks every module of every decoder layer and the modules of
the decoder stack around them; this module finds them:

- ``decoder_layers``: the ``nn.ModuleList`` of the text config's ``num_hidden_layers`` modules, or, for a
  model that runs its layers more than once (HRM's H and L stacks, looped: ``num_hidden_layers`` counts
  the runs), every ``nn.ModuleList`` of transformers decoder layers under one module;
- ``around_layers``: the modules of the decoder stack outside its layers (embeddings, norms, rotary tables);
- ``architecture_refusal``: families whose sequence is not one token sequence that sequence parallelism
  can cut into ``S/P`` shards — refused by name, with the reason, before their layers are looked for.
"""

from __future__ import annotations

import inspect
import os

from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

_DRAFTER = (
    "is a draft model for assisted decoding: every one of its layers attends to the key/value states of "
    "another model (shared_kv_states, the target model's cache, given for the whole sequence under a "
    "bidirectional mask) and it reads that model's hidden states as inputs_embeds, not token ids; it has no "
    "sequence of its own to shard, and it is trained with its target model, not stand-alone"
)
REFUSED_ARCHITECTURES: dict[str, str] = {
    "gemma4_assistant": _DRAFTER,
    "gemma4_unified_assistant": _DRAFTER,
    "blt": "is a byte-latent transformer: a local encoder and decoder over the bytes and a global transformer "
    "over patches whose boundaries its patcher picks from each byte's entropy (a data-dependent number of "
    "patches, read on the host); a patch spans shard boundaries, the bytes cross-attend to their patches, and "
    "the global transformer's sequence is not the byte sequence: no split of the bytes into S/P shards is a "
    "split of its patches, so the SP attention, which cuts one sequence evenly, cannot run it",
}
"""``config.model_type`` -> why sequence parallelism cannot shard the family's sequence."""


def architecture_refusal(model: nn.Module) -> str | None:
    """Why ``model``'s family is refused as a whole (``REFUSED_ARCHITECTURES``; any model whose forward
    takes another model's ``shared_kv_states``), or ``None``."""
    config = getattr(model, "config", None)
    why = REFUSED_ARCHITECTURES.get(str(getattr(config, "model_type", "")))
    if why is None and "shared_kv_states" in inspect.signature(type(model).forward).parameters:
        why = _DRAFTER
    return why


def decoder_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """``(decoder stack, its layers)``: the ``nn.ModuleList`` of ``num_hidden_layers`` modules (the text
    config's), the first such in the model's module order, and the module holding it. A looped model
    (fewer decoder-layer modules than ``num_hidden_layers``, each run several times): every list of
    transformers decoder layers, as one list, and their closest common module."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = getattr(text, "num_hidden_layers", None)
    for _, parent in model.named_modules():
        for child in parent.children():
            if isinstance(child, nn.ModuleList) and len(child) == n and n:
                return parent, child
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)
             and all(isinstance(x, GradientCheckpointingLayer) for x in m)]  # fmt: skip
    if lists and n and sum(len(m) for _, m in lists) < n:
        common = os.path.commonprefix([name.split(".") for name, _ in lists])
        return model.get_submodule(".".join(common[: len(common) - (len(lists) == 1)])), nn.ModuleList(
            [layer for _, m in lists for layer in m]
        )
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__} (no nn.ModuleList of num_hidden_layers = "
        f"{n} modules): sequence parallelism needs a transformers decoder whose layers it can check"
    )


def around_layers(stack: nn.Module, layers: nn.ModuleList) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` for the modules of ``stack`` outside ``layers``: its children that hold no layer,
    and inside a child that holds some (HRM's H and L stacks) that child's own such modules."""
    held = {id(m) for m in layers} | {id(layers)}
    out: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if id(child) in held:
                continue
            if any(id(m) in held for m in child.modules()):
                visit(child, f"{prefix}{name}.")
            else:
                out.append((f"{prefix}{name}", child))

    visit(stack, "")
    return out
