"""A vision-language model's vision tower in the memory model: what its forward keeps per patch.

Under the per-shard merge (``ulysses_sp.vlm``) each rank's tower encodes its share of the frames at the
start of the forward (``vlm.split``: about ``1/P`` of the patches when split over the SP group, else the
frames its shard touches). What the tower keeps for its backward stays alive through the language
model's whole forward and backward (the tower's backward runs last), so it adds to every phase of the
language model's peak; the tower's own backward comes after the language model's and is lower.

Per patch this rank encodes (``VisionShape``, bytes; the byte rates are fits to the CPU meter on
Qwen2.5-VL's and Qwen3-VL's own towers, depth 3-8, hv 64-256, iv 256-512, fp32 and bf16, sdpa: within
-2.7 % to +1.3 % of the meter at those 6 sizes each; ``tests/test_plan_vision.py`` checks one):

- each block, without checkpointing: ``a hv + b iv`` (its norms, q/k/v, rotary copies, attention output,
  MLP); with checkpointing only its input, ``e hv``, which ``--offload-activations`` moves to the host;
- outside the blocks: the patch embedding, the window order, the rotary tables and the merger(s),
  ``c hv + e out / merge`` (the merged rows), and ``3.5 e hv + e out / merge`` per deepstack merger
  (Qwen3-VL; ``3 e hv`` with checkpointing).

Not modelled: eager attention in the tower (its ``[heads, n, n]`` scores per frame or window: ``train``
uses sdpa), and the rows exchanged back to their shards (``out`` per merged row, below 1 % of the above).

Shape legend: ``hv`` the tower's hidden size, ``iv`` its MLP width, ``out`` the merged row width (the
language model's hidden size), ``merge`` patches per merged row, ``e`` bytes per element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ulysses_sp.plan.inputs import DTYPE_BYTES, Settings

# bytes per patch per unit of hv / iv: (fp32, 16-bit). Qwen2.5-VL's MLP is gated (gate, up, act, product:
# 4 iv); Qwen3-VL's is not (fc1, act: 2 iv); their norms keep fp32 copies in 16-bit (a > 2 x 13 or 11)
_RATES = {  # family: (block hv, block iv, outside hv)
    "qwen2_5_vl": ((52, 16, 22), (30, 8, 16)),
    "qwen3_vl": ((44, 8, 18), (22, 4, 10)),
}


@dataclass(frozen=True, kw_only=True)
class VisionShape:
    """The sizes of a VLM's vision tower that its activation memory depends on."""

    family: str
    """``qwen2_5_vl`` or ``qwen3_vl`` (the families the per-shard merge supports)."""
    hidden: int
    """``hv``."""
    intermediate: int
    """``iv``."""
    depth: int
    """Transformer blocks."""
    out_hidden: int
    """``out``: the width of a merged row."""
    merge: int
    """Patches per merged row (``spatial_merge_size ** 2``)."""
    deepstack: int = 0
    """Qwen3-VL's deepstack mergers (each keeps its own features for the language model)."""

    @classmethod
    def from_hf_config(cls, config: Any) -> VisionShape | None:
        """From a VLM's transformers config (its ``vision_config``); ``None`` for another model."""
        v = getattr(config, "vision_config", None)
        if v is None or config.model_type not in _RATES:
            return None
        return cls(
            family=config.model_type, hidden=v.hidden_size, intermediate=v.intermediate_size, depth=v.depth,
            out_hidden=v.out_hidden_size, merge=v.spatial_merge_size**2,
            deepstack=len(getattr(v, "deepstack_visual_indexes", None) or ()),
        )  # fmt: skip

    def kept_per_patch(self, s: Settings) -> tuple[int, int]:
        """``(device bytes, host bytes)`` the tower's forward keeps per patch until its backward."""
        e = DTYPE_BYTES[s.dtype]
        block_hv, block_iv, outside_hv = _RATES[self.family][0 if e == 4 else 1]
        rows = e * self.out_hidden // self.merge
        merger = (6 if s.activation_checkpointing else 7) * e * self.hidden // 2  # a deepstack merger's set
        outside = outside_hv * self.hidden + rows + self.deepstack * (merger + rows)
        if not s.activation_checkpointing:
            return outside + self.depth * (block_hv * self.hidden + block_iv * self.intermediate), 0
        inputs = self.depth * e * self.hidden  # the checkpointed blocks' inputs
        return (outside, inputs) if s.offload_activations else (outside + inputs, 0)


def tower_bytes(v: VisionShape | None, s: Settings) -> tuple[int, int]:
    """``(device bytes, host bytes)`` one rank's tower keeps through the language model's step, for
    ``s.vision_patches`` patches encoded on this rank."""
    if v is None or s.vision_patches <= 0:
        return 0, 0
    device, host = v.kept_per_patch(s)
    return device * s.vision_patches, host * s.vision_patches
