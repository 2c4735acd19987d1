"""The planner's inputs: a model's shape (from a transformers config or a named shape) and one
way to run it (``Settings``: layout, dtype, ZeRO stage, techniques, offload).

Used by ``plan`` (the memory and time model), ``preflight`` (a training run's own settings) and
``ulysses-sp plan`` (the candidates). Plain frozen dataclasses, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ulysses_sp.plan.vision import VisionShape

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True, kw_only=True)
class MixerShape:
    """The sizes of one sequence mixer (what ``ulysses_sp.mixers`` shards by heads) that its memory
    and exchange depend on; fields a kind does not have stay 0."""

    kind: str
    """``mamba2``, ``mamba1``, ``gated_delta_net``, ``short_conv``, ``kimi_delta_attention`` or
    ``lightning_attention`` (the handler names)."""
    heads: int = 0
    """``H``: Mamba-2's, KDA's and lightning attention's heads, gated delta-net's value heads."""
    head_dim: int = 0
    """``Dh`` (Mamba-2), ``Dv`` (gated delta-net), ``D`` (KDA, lightning attention)."""
    key_heads: int = 0
    """Gated delta-net's key heads ``Hk``."""
    key_dim: int = 0
    """Gated delta-net's key head dim ``Dk``."""
    groups: int = 0
    """Mamba-2's B/C groups ``G``."""
    state: int = 0
    """Mamba-2's and Mamba-1's state size ``N``."""
    chunk: int = 64
    """The scan's chunk length ``c`` (lightning attention's block size)."""
    channels: int = 0
    """The short convolution's channels ``C``; Mamba-1's ``I``."""
    decay_exchanged: bool = False
    """KDA: its per-channel decay ``[H, D]`` per token rides the exchange head-sharded (a full-rank gate:
    Bailing), instead of the rank-``D`` gate feature sent to every rank (Kimi-Linear)."""


@dataclass(frozen=True, kw_only=True)
class RoutedShape:
    """A mixture of experts' MLP, as transformers' grouped experts run it: each token copied to its
    ``top_k`` experts (``[T k, h]``), beside a shared expert of width ``shared`` (0: none)."""

    top_k: int
    """``k``, experts per token (``num_experts_per_tok``)."""
    width: int
    """One expert's MLP width (``moe_intermediate_size``, or ``intermediate_size`` where the experts are the MLP)."""
    experts: int
    """Experts per layer: the router's fp32 probabilities ``[T, experts]``."""
    shared: int = 0
    """The shared expert's width (Qwen2-MoE, Qwen3-Next: ``shared_expert_intermediate_size``; DeepSeek:
    ``n_shared_experts x moe_intermediate_size``)."""

    @classmethod
    def from_hf_config(cls, config: Any) -> RoutedShape | None:
        """The routed MLP of a transformers config, ``None`` for a dense one (Doge's ``is_moe`` off included)."""
        k = getattr(config, "num_experts_per_tok", 0) or 0
        experts = next((n for n in (getattr(config, a, 0) for a in ("num_experts", "num_local_experts", "n_routed_experts"))
                        if isinstance(n, int) and n > 1), 0)  # fmt: skip
        if not isinstance(k, int) or k < 1 or not experts or not getattr(config, "is_moe", True):
            return None
        width = getattr(config, "moe_intermediate_size", None) or getattr(config, "intermediate_size", 0) or 0
        shared = getattr(config, "shared_expert_intermediate_size", None) or 0
        if not shared and isinstance(getattr(config, "n_shared_experts", None), int):
            shared = config.n_shared_experts * width
        return cls(top_k=k, width=width, experts=experts, shared=shared) if width else None


@dataclass(frozen=True, kw_only=True)
class LayerKind:
    """What one decoder layer holds: softmax attention, an MLP, a sequence mixer (any may be absent:
    Nemotron-H's one-block layers; Falcon-H1 runs attention and a mixer side by side)."""

    attention: bool = True
    mlp: bool = True
    mixer: MixerShape | None = None
    own_scores: bool = False
    """The attention computes its own ``[B, H/P, S, S]`` scores (BLOOM, Falcon, MPT, ...: run head-parallel,
    ``mixers.own_scores``): quadratic in ``S``, not the fused core's O(S) workspace."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of a decoder-only transformer that memory and time depend on."""

    hidden: int
    """``h``, the model width."""
    intermediate: int
    """``I``, the MLP width."""
    layers: int
    """``L``, decoder layers."""
    heads: int
    """``H``, query heads."""
    kv_heads: int
    """``Hkv``, key/value heads."""
    head_dim: int
    """``D``."""
    vocab: int
    """``V``, vocabulary (embedding rows)."""
    tied: bool = False
    """Input and output embeddings share one matrix."""
    max_positions: int | None = None
    """The longest sequence the model's positions cover (``max_position_embeddings``, or more with
    RoPE scaling: ``run.prelaunch.max_trained_length``); ``train`` refuses a longer ``--seq-len``.
    ``None``: no limit known."""
    layer_kinds: tuple[LayerKind, ...] = ()
    """One per layer (hybrid models); empty: every layer attention + MLP (Llama)."""
    param_count: int | None = None
    """The model's exact parameter count when known (a built model); ``None``: the Llama formula."""
    extra_params: int = 0
    """Parameters besides the language model's (a vision-language model's vision tower and merger):
    in the model states (sharded as the rest), in no decoder layer."""
    vision: VisionShape | None = None
    """A vision-language model's tower (``plan.vision.VisionShape``): its activations per patch;
    ``None``: a text model."""
    routed: RoutedShape | None = None
    """The MLP routes each token to ``top_k`` experts (every MLP layer planned so: DeepSeek's first dense
    layers and Jamba's every other hold less); ``None``: dense."""
    qk_norm: bool = False
    """Norms on q and k after their projections (Qwen3, Gemma 3, OLMo 2): they keep the projections'
    outputs for their backward (``q + Hkv D`` per token)."""
    output_gate: bool = False
    """The q projection also makes a gate for the attention's output (Qwen3-Next, Qwen3.5: ``2 H D`` wide): its
    half, its sigmoid and the gated output are kept (``3 q`` per token)."""

    @classmethod
    def from_hf_config(cls, config: Any, *, max_positions: int | None = None) -> ModelShape:
        """From a transformers ``PretrainedConfig`` (Llama, Qwen2, Mistral and their kin);
        ``max_positions``: the positions limit as the caller reads it off the config. A config whose
        head counts differ by layer is planned at its widest layer's. A model without softmax attention
        or MLP (Mamba-2 alone) gets 1 head and width 0: its ``layer_kinds`` say what the layers hold."""
        per_layer = getattr(config, "per_layer_config", None)
        widest = (max(per_layer, key=lambda c: getattr(c, "num_attention_heads", 0) or 0) if per_layer
                  else config)  # fmt: skip
        heads = getattr(widest, "num_attention_heads", None) or 1
        return cls(
            hidden=config.hidden_size, intermediate=getattr(config, "intermediate_size", None) or 0,
            layers=config.num_hidden_layers,
            heads=heads, kv_heads=getattr(widest, "num_key_value_heads", None) or heads,
            head_dim=getattr(widest, "head_dim", None) or config.hidden_size // heads, vocab=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)), max_positions=max_positions,
            routed=RoutedShape.from_hf_config(config),
        )  # fmt: skip

    def kinds(self) -> tuple[LayerKind, ...]:
        """``layer_kinds``, or ``layers`` attention + MLP layers."""
        return self.layer_kinds or (LayerKind(),) * self.layers

    @property
    def layer_params(self) -> int:
        if self.param_count is not None:  # the mean layer: what is not the embeddings and the final norm
            embed = self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden
            return max(0, self.param_count - embed) // max(self.layers, 1)
        q, kv, h = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden
        return 2 * q * h + 2 * kv * h + 3 * h * self.intermediate + 2 * h

    @property
    def params(self) -> int:
        """Parameter count (``param_count``, or the Llama layout: no biases; Qwen2's q/k/v biases are
        ignored, < 0.1 %)."""
        if self.param_count is not None:
            return self.param_count + self.extra_params
        return (
            self.layers * self.layer_params + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden
            + self.extra_params
        )


LLAMA_8B = ModelShape(
    hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, head_dim=128, vocab=128256,
    max_positions=131072,
)
"""Llama-3.1-8B (8.03e9 parameters; ``max_position_embeddings`` 131072)."""
SHAPES = {"llama-8b": LLAMA_8B}


@dataclass(frozen=True, kw_only=True)
class Settings:
    """One way to run: the layout and the ``ulysses-sp train`` settings that change memory or time."""

    seq_len: int
    """``S``, tokens per sample."""
    micro_batch_size: int = 1
    """``B``, samples per micro-step per dp replica."""
    dp: int = 1
    """Data-parallel size."""
    sp: int = 1
    """Sequence-parallel size ``P``."""
    ring_size: int = 1
    """Hybrid Ulysses x Ring: ``P = ring_size x (P / ring_size)`` Ulysses ranks (``--ring-size``)."""
    zero_stage: int = 0
    """0-3, as ``--zero-stage``."""
    partition: str = "data_parallel"
    """ZeRO partitions over the DP axis or ``"all"`` dp*sp ranks."""
    dtype: str = "fp32"
    """Compute dtype, as ``train --dtype``: ``fp32``, or ``bf16``/``fp16`` mixed precision (fp32
    master weights and optimizer state)."""
    tiled_mlp: bool = False
    tiled_mlp_shards: int | None = None
    """``None``: auto, tiles of about ``h`` tokens."""
    tiled_loss: bool = False
    tiled_loss_shards: int | None = None
    """``None``: auto, tiles of about ``h`` tokens."""
    activation_checkpointing: bool = False
    offload_activations: bool = False
    """Checkpointed layer inputs on the host."""
    disk_layers: int = 0
    """Of those, the first N layers' in files (``--disk-layers``): neither host nor device memory."""
    recompute_norms: bool = False
    """The decoder layers' RMSNorms keep only their output (the input is the layer's anyway) and
    recompute their internals in backward, one norm at a time (``--recompute-norms``)."""
    offload_states: bool = False
    """Gradients, optimizer state and master weights on the host (one layer's on the device)."""
    attention: str = "sdpa"
    """``sdpa``/``flash``: memory-efficient core attention (O(S) workspace); ``blockwise``: the same
    in blocks, attention inputs offloaded (a setting of the attention engineers' branch)."""
    head_chunks: int = 1
    """Head groups exchanged and attended one at a time (``--head-chunks``): the attention backward's
    exchange buffers scale by ``1/head_chunks``; one more q/k/v exchange and attention forward."""
    head_blocks: bool = True
    """With ``head_chunks > 1``: each attention module's whole block per group (``attention/head_blocks.py``);
    False: the function-level groups (Ulysses-Offload, LoRA-wrapped projections)."""
    head_overlap: bool = False
    """With the block per head group at ``P > 1``: the next group's exchange posted before this group's core
    (``--head-chunk-overlap``): a second group's q/k/v and an output exchange alive in the block's forward."""
    exchange: str = "auto"
    """The attention all-to-all: ``packed`` (one collective, a transient buffer of the
    exchanged q/k/v), ``headwise`` or ``auto`` (packed below the link's per-piece threshold)."""
    device_type: str = "cuda"
    """``cpu``: single-tensor AdamW; accelerators: multi-tensor (whole-shard workspace)."""
    vision_patches: int = 0
    """A vision-language model's patches its vision tower encodes on one rank per micro-step (the
    largest micro-batch's share: ``run.vlm.patches_per_rank``); 0: none or not known."""

    @property
    def world(self) -> int:
        return self.dp * self.sp

    @property
    def shard(self) -> int:
        """Ranks the ZeRO partitions span."""
        return self.world if self.partition == "all" else self.dp


def routed_experts_note(config: Any) -> list[str]:
    """A note for a model whose MLP routes each token to ``k`` experts: the planner counts them as transformers'
    grouped experts hold them (``RoutedShape``); other expert kernels hold other sets. ``[]`` for a dense MLP."""
    routed = RoutedShape.from_hf_config(config) if config is not None else None
    if routed is None:
        return []
    return [f"routed experts (top-{routed.top_k} of {routed.experts}): planned as transformers' grouped experts keep "
            f"them (each token copied to its {routed.top_k} experts: {routed.top_k} x (2 hidden + 4 expert width) per "
            "token at the experts' backward); another experts implementation keeps another set: confirm a plan with "
            "--rehearse"]  # fmt: skip
