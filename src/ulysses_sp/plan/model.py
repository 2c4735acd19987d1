"""The memory and time model behind ``ulysses-sp plan``, the startup prediction and the bench projection.

``predict(shape, settings, hw)`` returns one rank's peak bytes, broken down, and the step time.
Where it sits: before anything is built (nothing here touches a tensor or a process group).

**Memory.** The peak is ``model states + the highest point of a simulated step``. The step is
walked as the allocator sees it, in units of one element per *local* token (``T = B * S_l``):

* forward keeps, per decoder layer (transformers' Llama/Qwen2/Mistral layer, read off the code):
  the layer input ``h``; the input norm's normalised input and output ``2h`` (16-bit: its fp32
  input copy and normalised input too, ``12 h`` bytes); q, k, v as attention
  receives them ``q + 2 kv`` (``kv = max(Hkv, P) D``: kv heads replicated when fewer than ``P``),
  and with ``P > 1`` the same again for the tensors handed to the all-to-all (measured: they stay
  referenced until the layer's backward starts; not located in the code);
  the attention output ``q`` and the o-projection input ``q``; the residual sum and the post-norm's
  two tensors ``3h``; the MLP's gate, act, up and product ``4I`` (none with tiled MLP, which keeps
  only its input). Checkpointing keeps only the layer input (on the host when offloaded). With
  ``recompute_norms`` a layer's norm keeps nothing (the projections after it absorb it and keep its
  input, held anyway; the final norm keeps its output ``h``); its backward holds its input gradient
  and, for one tile, its full set again (at the post-attention norm: the attention's terms alive).
* hybrid models (``ModelShape.layer_kinds``): a layer keeps only what it holds — the attention's
  terms, the MLP's, a sequence mixer's (``plan.mixers``: measured bytes per local token, its input
  norm added when no attention carries it) — and its backward's high point is the larger of the
  MLP's and the mixer's (or attention's) workspace; the all-to-all bytes are each mixer's exchange.
* routed experts (``ModelShape.routed``; transformers' grouped experts, read off the code and Qwen3-Next-80B-A3B's
  rehearsals): the MLP keeps the shared expert's ``4 I_s``, the router's fp32 probabilities and, per token, its
  ``k`` copies and the experts' intermediates ``k (2 h + 4 I)``; their backward begins the layer's with ``3 k h``
  more (the copies' gradient, gathered back) and one layer gathered, not two (the next not yet prefetched), with
  the layer above's gradient reduction in flight (states on the devices, 16-bit: its gradients and their fp32 copy);
  mid-way (the activation's backward) holds ``k (h + 6 I)`` and the down projection's weight gradient (wide
  experts: Mixtral), and it ends with the experts' weight gradients made and ``2 k I`` freed. Every MLP layer of
  such a model is planned so (Mixtral, Qwen3-MoE, OLMoE and Qwen3-Next rehearsed within 3.3 %, over).
* the head: the final norm's input and its two tensors; untiled: the fp32 log-softmax ``V`` (what
  autograd saves of the loss) and, in the loss backward, two fp32 ``V`` gradients — the logits
  themselves (model dtype) are freed with the model output before the backward (``run.loop.micro_step``)
  and in the forward they never meet the two gradients; tiled: the same for one tile.
* backward walks the layers down: the layer's activations (recomputed when checkpointed), then
  the larger of the MLP backward's ``3I`` workspace (per tile, with the tile's recompute, when
  tiled) and the attention backward's (grads of q, k, v and the output, + the exchange buffers
  with ``P > 1``); the gradient flowing and the residual's ``2h`` (+ ``h``: the tiled MLP's own
  input-gradient buffer, gone by the attention's backward; in the MLP's and the post-attention
  norm's backward the residual's gradient is still the one flowing in), and the parameter gradients
  accumulated so far (shards from stage 2).
* the optimizer step: gradients, optimizer state, and a workspace (AdamW: one temporary per
  parameter tensor, multi-tensor (``foreach``) on accelerators: the whole shard).

Model states per rank: ``plan.states``.

**Time.** FLOPs ``6 N T`` (+ ``2 N T`` recompute with checkpointing) plus causal attention
``6 B S^2 h L / P`` (x 4/3 with recompute), at ``tflops x mfu``; all-to-all bytes (forward, backward,
+ recompute) and gradient-reduction bytes (ring all-reduce ``2 (n-1)/n`` of the gradients) over the
link bandwidth of ``plan_hw.Hardware``. ``comm_share = comm / (comm + compute)`` (no overlap).

What is not modelled (and so not in the 10 % check): allocator fragmentation and kernel scratch
(the ``reserve``), the data adapter's shard buffers, and host memory beyond the offloaded bytes and states.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ulysses_sp.plan.attention import attention_terms, block_groups
from ulysses_sp.plan.exchange import exchange_latency_s
from ulysses_sp.plan.hardware import Hardware, link_gbps
from ulysses_sp.plan.inputs import DTYPE_BYTES, ModelShape, Settings
from ulysses_sp.plan.mixers import exchange_per_token
from ulysses_sp.plan.mixers import memory_per_token as mixer_memory
from ulysses_sp.plan.states import model_states
from ulysses_sp.plan.vision import tower_bytes


@dataclass(frozen=True)
class Prediction:
    """What ``predict`` returns: bytes per rank and seconds per optimizer step (one micro-step)."""

    breakdown: dict[str, int]
    """Device bytes at the peak by component (sums to ``peak_bytes``)."""
    peak_bytes: int
    host_bytes: int
    """Host memory the rank stages (offloaded activations and states)."""
    compute_s: float
    comm_s: float
    """Sequence-parallel all-to-alls."""
    dp_comm_s: float
    """Gradient reduction (and ZeRO-3 parameter gathers)."""
    tokens_per_s: float
    flops: float = field(default=0.0)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s + self.dp_comm_s

    @property
    def comm_share(self) -> float:
        return (self.comm_s + self.dp_comm_s) / self.step_s if self.step_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "step_s": self.step_s, "comm_share": self.comm_share}


def _tile_tokens(tokens: int, hidden: int, shards: int | None) -> int:
    n = max(1, min(tokens, math.ceil(tokens / max(hidden, 1)))) if shards is None else shards
    return math.ceil(tokens / n)


def _routed_ungathered(m: ModelShape, s: Settings) -> int:
    """Bytes of layer states a routed MLP's backward does not hold that the layers' usual backward has (ZeRO 3,
    rehearsed): the next layer, not yet prefetched; with the states on the devices in 16-bit, less the layer above's
    reduction still in flight (its 16-bit gradients and their fp32 copy, where this layer's own are counted)."""
    if s.zero_stage != 3:
        return 0
    e = DTYPE_BYTES[s.dtype]
    return m.layer_params * e * (1 if s.offload_states or e == 4 else -1)


def _activations(m: ModelShape, s: Settings, hw: Hardware | None = None) -> tuple[dict[str, int], int]:
    """(the step's activation peak by component, host bytes of offloaded activations)."""
    e = DTYPE_BYTES[s.dtype]
    tok = s.micro_batch_size * s.seq_len // s.sp
    h, big_i, v, d = m.hidden, m.intermediate, m.vocab, m.head_dim
    q, kv = m.heads * d, max(m.kv_heads, s.sp) * d
    # RMSNorm keeps its normalised input and output; in 16-bit (fp32 compute) its fp32 input copy, the fp32
    # normalised input, its 16-bit cast and the output: 12 bytes per h
    norm_full = 2 * h if e == 4 else 12 * h // e
    # recomputed (memory.norms): a layer's norm keeps its output only (its input is held anyway); its backward
    # holds its input gradient h and, for one tile of ~h tokens, its saved set again next to two fp32 gradient
    # temporaries (and the cast's 16-bit gradient): 12 bytes per h in fp32, 16 in 16-bit (bench.plan_check)
    norm = 0 if s.recompute_norms else norm_full  # recomputed: the projections after it absorb it (memory.norms)
    norm_ws = (h * tok + (12 if e == 4 else 16) * h // e * _tile_tokens(tok, h, None)) if s.recompute_norms else 0
    t_attn = attention_terms(m, s, hw, norm)
    attn_saved, exchange_in = t_attn.saved, t_attn.exchange_in
    mlp_saved = 0 if s.tiled_mlp else 4 * big_i
    ckpt = s.activation_checkpointing
    kept = 0 if s.offload_activations else h
    rope = 2 * d
    head_saved = h + (h if s.recompute_norms else norm_full)  # the final norm recomputes too (its backward's tile: below the loss workspace)
    if s.tiled_loss:
        t = _tile_tokens(tok, h, s.tiled_loss_shards)
        loss_ws = 4 * v * t * 4 // e + h * tok  # one tile's fp32 logits/lsm/grads + the hidden's grad
    else:
        loss_ws = 3 * v * tok * 4 // e  # fp32 lsm and its two fp32 grads (the logits are freed by then)
    # MLP backward: grad of the product, of act and of up (per tile when tiled, with the recompute)
    if s.tiled_mlp:
        t = _tile_tokens(tok, h, s.tiled_mlp_shards)
        mlp_ws = 7 * big_i * t
    else:
        mlp_ws = 3 * big_i * tok
    routed = m.routed if m.routed is not None and not s.tiled_mlp else None
    if routed is not None:  # the shared expert's 4 and 3 I, the router's fp32 probabilities, the routed copies
        k = routed.top_k  # (grouped experts, read off the code: k (2 h + 4 I) saved; 3 k h in the index's backward)
        mlp_saved = 4 * routed.shared + routed.experts * 4 // e + k * (2 * h + 4 * routed.width)
        mlp_ws = max(3 * routed.shared, 3 * k * h) * tok
    attn_ws = t_attn.workspace * tok
    # the gradient flowing down and the residual's; the tiled MLP adds its input gradient, summed
    # over the tiles in a buffer of its own
    grad_flow = (3 if s.tiled_mlp else 2) * h * tok
    # per layer (per local token): what its forward keeps, and its backward's high point
    full, per_layer, here, first = [], [], [], []
    for kind in m.kinds():
        mixed = attn_saved * kind.attention  # the input norm rides with the attention's terms
        mix_ws = attn_ws if kind.attention else 0
        if kind.attention and kind.mixer is None and t_attn.backward:  # its backward's set, whole
            mix_ws = (t_attn.backward - attn_saved) * tok
        exch = exchange_in if kind.attention else 0
        if kind.mixer is not None:  # measured bytes (plan.mixers), in elements of the model dtype
            saved_b, ws_b = mixer_memory(kind.mixer, s.sp, e)
            mixed += saved_b / e + (0 if kind.attention else norm)
            mix_ws = max(mix_ws, ws_b / e * tok)
        if kind.attention and kind.own_scores:  # per local token: its fp32 probabilities [B, H/P, S, S] (H S),
            # the gathered input [B, S, h] (P h) and the [B, 1, S, S] bool mask (P S bytes)
            probs, gathered = m.heads * s.seq_len * 4 // e, s.sp * h + s.sp * s.seq_len // e
            mixed += probs + gathered
            mix_ws = max(mix_ws, (2 * probs + gathered) * tok)  # the scores' and probabilities' gradients
        mlp = (h + norm + mlp_saved) if kind.mlp else 0
        layer_full = h + mixed + mlp  # the layer input included
        full.append(layer_full)
        per_layer.append(kept if ckpt else layer_full + exch)
        # the tiled MLP's input-gradient buffer: freed before the attention's backward, and in the MLP's
        # and the post-attention norm's the residual's gradient is the one flowing in (no buffer of its own)
        mlp_grad = h if (s.tiled_mlp and kind.mlp) else 0
        # recomputed norms: the post-attention norm's backward (the MLP's tensors gone, its input kept)
        norm_here = (layer_full - mlp - mlp_grad + (h if kind.mlp else 0)) * tok + norm_ws if norm_ws else 0
        # checkpointed: the recompute runs the layer's forward to its end (torch stops it at the last saved
        # tensor, which a tiled MLP saves after its tiles), so the MLP's output and its input (a recomputed
        # norm's output) are alive at once next to the layer's set and the gradient flowing in
        recompute = (layer_full + (2 * h if kind.mlp else 0) + h) * tok if ckpt else 0
        if ckpt and kind.attention and t_attn.recompute:  # the block per head group: its forward's set
            recompute = max(recompute, t_attn.recompute * tok)  # the layer input, the norm's output, the grad in
        elif ckpt and kind.attention and s.sp > 1:  # the attention's recompute: the layer input, the norm's
            # output (the caller's local), the gradient in; q/k/v, their exchanged copies, the core's output,
            # its token-major copy and what the return exchange gives back
            recompute = max(recompute, (3 * h + (q + 2 * kv) + exchange_in + 3 * q + t_attn.packed) * tok)
        core = (layer_full - mlp - mlp_grad - mixed + t_attn.core - h) * tok + grad_flow if t_attn.core and kind.attention else 0
        mlp_back = (layer_full - mlp_grad) * tok + (mlp_ws if kind.mlp else 0) + grad_flow
        # routed experts (rehearsed): their backward starts the layer's, before the next layer is gathered; at its
        # end the experts' weight gradients exist, the copies' gate/up and their gradients freed (2 k I fewer)
        routed_layer = routed is not None and kind.mlp
        if routed_layer:  # mid-way, at the activation's backward: the copies' gate/up, its output and their three
            # gradients (k (h + 6 I) where k (2 h + 4 I) was kept), the down projection's weight gradient made
            mid = (layer_full - mlp_grad + k * (2 * routed.width - h)) * tok + routed.experts * routed.width * h + grad_flow
            mlp_back = max(mlp_back, mid)
        first.append(max(mlp_back, recompute) + rope * tok if routed_layer else 0)
        late = (layer_full - mlp_grad - 2 * routed.top_k * routed.width) * tok + grad_flow if routed_layer else 0
        here.append(max(late if routed_layer else max(mlp_back, recompute), core,
                        (layer_full - mlp - mlp_grad) * tok + mix_ws + grad_flow, norm_here + grad_flow) + rope * tok)
    # gradients made so far: whole layers (stages 0-1) or their shards after each reduce-scatter
    layer_grads = m.layer_params * e if s.zero_stage < 2 else m.layer_params * e // s.shard
    # the root's gradients are reduce-scattered when its backward ends: unsharded through the layers' at ZeRO 3
    head_grads = (m.vocab * h + h) * e // (s.shard if s.zero_stage == 2 else 1)
    grads_end = 0 if s.offload_states else None
    # forward end / loss backward: every layer's kept activations + the head + the loss workspace
    saved = (sum(per_layer) + head_saved + rope) * tok
    at_loss = saved * e + loss_ws * e
    # backward of layer l (from the top): layers below keep theirs, layer l holds its full set
    worst_layer = worst_acts = worst_below = worst_full = worst_less = 0
    ungathered = _routed_ungathered(m, s)
    prefix = [0.0, *itertools.accumulate(per_layer)]  # prefix[l]: the layers below l
    for done in range(m.layers):  # layers above l are done: their grads exist
        layer = m.layers - 1 - done
        below = prefix[layer] * tok
        # host-resident states: this layer's gradients and the root's (the output embedding's, unsharded,
        # made by the loss's backward and reduced when the root's backward ends)
        grads = (head_grads + done * layer_grads) if grads_end is None else (m.layer_params + m.vocab * h) * e
        if s.zero_stage >= 2 and grads_end is None:
            grads += m.layer_params * e  # this layer's unsharded gradients before the reduce-scatter
        for point, less in ((here[layer], 0), *(((first[layer], ungathered),) if first[layer] else ())):
            if (below + point) * e + grads - less > worst_layer - worst_less:
                worst_layer, worst_acts, worst_less = (below + point) * e + grads, (below + point) * e, less
                worst_below, worst_full = below * e, full[layer]
    phase = "loss" if at_loss >= worst_layer - worst_less else ("routed" if worst_less else "backward")
    host = (m.layers - s.disk_layers) * h * tok * e if (ckpt and s.offload_activations) else 0
    if s.attention == "blockwise":
        host += m.layers * (2 * q + 2 * kv) * tok * e
    if phase == "loss":
        out = {
            "activations": saved * e,
            "logits_loss": loss_ws * e,
            "backward_workspace": 0,
            "grads_in_flight": 0,
        }
    else:
        acts_here = min(worst_acts, worst_below + int((worst_full + rope) * tok * e))  # a point without the MLP's set
        ws = worst_acts - acts_here
        out = {"activations": acts_here, "logits_loss": 0, "backward_workspace": ws,
               "grads_in_flight": worst_layer - worst_acts}  # fmt: skip
    return {k: int(x) for k, x in out.items()}, int(host), phase


def memory(m: ModelShape, s: Settings, hw: Hardware | None = None) -> tuple[dict[str, int], int]:
    """``(breakdown, host_bytes)`` of one rank's peak; ``breakdown`` sums to the peak."""
    states, host_states, step_ws, host_step = model_states(m, s)
    acts, host_acts, phase = _activations(m, s, hw)
    # a VLM's tower keeps its activations through the language model's forward and backward (plan.vision)
    acts["vision_tower"], host_tower = tower_bytes(m.vision, s)
    # layers not gathered at the peak: none at an untiled loss at ZeRO 3 (FSDP2 resharded them after the
    # forward; their gradient buffers not yet made); at a routed MLP's backward, _routed_ungathered
    layer = DTYPE_BYTES[s.dtype] * m.layer_params
    less = dict.fromkeys(("parameters", "comm_buffers"), 0)
    if s.zero_stage == 3 and not s.tiled_loss and phase == "loss":
        less = {"comm_buffers": 2 * layer, "parameters": 2 * layer if s.offload_states else 0}
    elif phase == "routed":
        less["parameters" if s.offload_states else "comm_buffers"] = _routed_ungathered(m, s)
    end = states["gradients"] + step_ws
    # the activation phases count the gradients made so far themselves; the step holds all of them
    if end >= sum(acts.values()) - sum(less.values()):
        breakdown = {**states, **dict.fromkeys(acts, 0), "optimizer_workspace": step_ws}
    else:
        breakdown = {**states, "gradients": 0, **acts, "optimizer_workspace": 0}
        breakdown.update({k: breakdown[k] - less[k] for k in less})
    breakdown["reserve"] = hw.reserve_bytes if hw is not None else 0
    # the host: the offloaded activations until the backward frees them, then the step's gradients and temporary
    return breakdown, host_states + max(host_acts + host_tower, host_step)


def _flops(m: ModelShape, s: Settings) -> float:
    tokens = s.micro_batch_size * s.seq_len * s.dp  # the global micro-batch
    dense = 6 * (m.params - m.vocab * m.hidden * (0 if m.tied else 1)) * tokens
    attn_layers = sum(k.attention for k in m.kinds())
    attn = (
        6 * s.micro_batch_size * s.dp * s.seq_len**2 * m.heads * m.head_dim * attn_layers
    )  # causal half of 4+8 (the mixers' scans are linear in S: their projections are in 6 N T)
    if s.activation_checkpointing:
        dense, attn = dense * 4 / 3, attn * 4 / 3
    if s.head_chunks > 1:  # each head group's attention forward again in backward
        attn += attn / (4 if s.activation_checkpointing else 3)
    if block_groups(m, s) is not None:  # ... and, the whole block per group, its q/k/v/o projections
        attn += 2 * tokens * (2 * m.heads + 2 * m.kv_heads) * m.head_dim * m.hidden * attn_layers
    return float(dense + attn)


def predict(m: ModelShape, s: Settings, hw: Hardware) -> Prediction:
    """One rank's peak memory (breakdown) and one optimizer step's time under ``s`` on ``hw``."""
    breakdown, host = memory(m, s, hw)
    e = DTYPE_BYTES[s.dtype]
    flops = _flops(m, s)
    compute = flops / s.world / (hw.tflops[s.dtype if s.dtype in hw.tflops else "bf16"] * 1e12 * hw.mfu)
    tok = s.micro_batch_size * s.seq_len // s.sp
    u, r = s.sp // s.ring_size, s.ring_size  # Ulysses ranks (the all-to-all) x ring ranks
    q, kv = m.heads * m.head_dim, max(m.kv_heads, u) * m.head_dim
    blocks = block_groups(m, s)
    kv = kv if blocks is None else s.head_chunks * blocks[1]  # the block per group: a shared kv head per group
    passes = 3 if s.activation_checkpointing else 2
    a2a = 0.0
    if u > 1:  # sent per rank per layer per pass: (U-1)/U of q, k, v in and the output back
        per_tok = sum((2 * q + 2 * kv) * k.attention + sum(exchange_per_token(k.mixer, u) if k.mixer else (0, 0))
                      for k in m.kinds())  # fmt: skip
        a2a = passes * tok * per_tok * e * (u - 1) / u
        # head groups: q/k/v exchanged again in backward
        a2a += (s.head_chunks > 1) * tok * sum((q + 2 * kv) * k.attention for k in m.kinds()) * e * (u - 1) / u
    comm = a2a / (link_gbps(hw, u) * 1e9)
    comm += exchange_latency_s(m, s, hw, passes)
    if r > 1:  # ring: a hop sends the local K/V (S/R tokens, kv/U heads); forward passes R-1 hops each,
        # backward R-1 K/V hops plus R hops of fp32 dK/dV (counted exactly by bench/ring_bench.py)
        hop = s.micro_batch_size * s.seq_len // r * 2 * kv // u
        comm += m.layers * hop * ((passes - 1) * (r - 1) * e + (r - 1) * e + r * 4) / (link_gbps(hw, s.sp) * 1e9)
    grad_bytes = m.params * e
    ring = 2 * (s.world - 1) / s.world * grad_bytes if s.world > 1 else 0.0
    if s.zero_stage == 3 and s.shard > 1:
        ring += 2 * (s.shard - 1) / s.shard * m.params * e  # parameter all-gathers, forward and backward
    dp_comm = ring / (link_gbps(hw, s.world) * 1e9)
    if s.offload_states:
        dp_comm += 2 * m.params * e / (hw.host_to_device_gbps * 1e9)
    step = compute + comm + dp_comm
    tokens = s.micro_batch_size * s.seq_len * s.dp
    return Prediction(
        breakdown=breakdown, peak_bytes=sum(breakdown.values()), host_bytes=host, compute_s=compute,
        comm_s=comm, dp_comm_s=dp_comm, tokens_per_s=tokens / step if step > 0 else math.inf, flops=flops,
    )  # fmt: skip


def max_seq_len(
    m: ModelShape, s: Settings, hw: Hardware, *, budget: int | None = None, cap: int = 1 << 27,
    host_budget: int | None = None, ranks_per_node: int = 1,
) -> int:
    """The longest ``S`` (a multiple of ``sp``) whose predicted peak fits ``budget`` (default: the
    device's memory) and, with ``host_budget``, whose host bytes of ``ranks_per_node`` ranks fit it;
    0 when not even ``S = sp`` fits. Memory grows with ``S``: a bisection."""
    budget = hw.memory_bytes if budget is None else budget
    step = s.sp

    def fits(n: int) -> bool:
        pred = predict(m, replace(s, seq_len=n * step), hw)
        host_ok = host_budget is None or pred.host_bytes * ranks_per_node <= host_budget
        return pred.peak_bytes <= budget and host_ok

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi * step <= cap and fits(hi):
        lo, hi = hi, hi * 2
    if hi * step > cap:
        return lo * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step
