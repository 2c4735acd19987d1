"""The planner's terms for one sequence-mixer layer (Mamba-2, Mamba-1, gated delta-net, short
convolution, KDA, lightning attention) at sp ``P``: bytes kept for backward, the backward's workspace, and the exchanged elements.

Per rank, a mixer runs its projections on the ``T = B * S/P`` local tokens and its scan over the
full sequence ``S`` for ``H/P`` heads (``mixers``' head-sharded exchange). Every term of the scan is
a product of the heads with per-head sizes, so per *local* token it is the sp-1 term of the whole
model: a mixer layer's memory per rank falls as ``1/P`` with nothing left over, except the B/C groups
(Mamba-2) and key heads (gated delta-net) that are replicated when fewer than ``P`` (``max(G, P)``).

**Where the coefficients come from.** They are measured, not guessed: the library's meter
(``memory.meter.track_peak_memory``, CPU) around one sharded mixer module of transformers 5.24's
own code (Bamba's Mamba-2 mixer, Qwen3.5's gated delta-net, LFM2's short convolution, Kimi-Linear's
KDA, MiniMax's lightning attention, Mamba's Mamba-1 mixer — its scan keeps ``exp(dt A)``, ``dt B`` and the state per token and
channel: the ``3 I N`` term; the torch fallbacks the CPU runs) in fp32, forward then backward, at
8-11 size combinations per kind; a least-squares fit of the bytes per token on the monomials below
(Mamba-2's chunked scan keeps three ``[c, c]`` blocks per chunk and head: ``G``, ``L``, ``M`` — the
``H c`` term; a state ``[Dh, N]`` per chunk and head — ``H Dh N / c``; ...). The largest fit
residual is < 0.3 % of the saved bytes (Mamba-2's backward workspace: 5 %). At ``P = 2`` the
exchange added < 1 % (the all-to-all's receive buffers *are* the scan's inputs). The scans compute
in fp32 whatever the model dtype, so the terms are counted at 4 bytes for 16-bit models too (an
upper bound there). Mamba-2 has terms of its own for 16-bit models: its projections, convolution and
gate stay in the model dtype, about 11 % of what it keeps (Nemotron-H-8B at 393,216 tokens on 8 GPUs:
the fp32 terms 7 % over the rehearsed peak); so has gated delta-net (its projections, convolution, q/k
norms and output norm in the model dtype: the fp32 terms keep 32 % more at Qwen3-Next's sizes, found
by Qwen3-Next-80B-A3B's rehearsals at 131,072 and 851,968 tokens). They are fit on fake tensors (``rehearse.tracker``'s
counting, ``scripts/fit_mixer_terms.py --dtype bf16``) at 12 real sizes (64-256 heads of 32-128, state
64-256, chunk 64-256), residual < 0.1 % (gated delta-net: 10 sizes, 8-64 value heads of 64-128, saved
residual < 0.1 %, backward workspace 7 %); at the CPU grid's small sizes they give the meter's bf16 bytes
within 0.5 %. With the fused CUDA kernels (``mamba-ssm``,
``flash-linear-attention``), which keep far less, the terms are an upper bound.

Shape legend: ``H`` heads (value heads), ``Dh`` head dim, ``N`` state, ``G`` groups, ``c`` chunk,
``Hk``/``Dk`` key heads and dim, ``C`` conv channels (Mamba-1's ``I``), ``P`` sp size.
"""

from __future__ import annotations

from ulysses_sp.plan.inputs import MixerShape

FP32 = 4


def memory_per_token(mx: MixerShape, sp: int, dtype_bytes: int = 4) -> tuple[float, float]:
    """``(saved, backward workspace)``: bytes per local token of one ``mx`` layer at sp ``sp`` in a model
    of ``dtype_bytes`` per element (the fp32 terms unless the kind has 16-bit terms: Mamba-2, gated delta-net)."""
    h, d, c = mx.heads, mx.head_dim, mx.chunk
    if mx.kind == "mamba2" and dtype_bytes < FP32:  # fit on fake tensors at real sizes (module docstring)
        g, n = max(mx.groups, sp) if sp > 1 and mx.groups % sp else mx.groups, mx.state
        saved = 3.0 * h * c + 11.5 * h * d + 5.0 * h * n + 2.02 * h * d * n / c + 5.38 * h + 2.01 * g * n
        ws = 1.53 * h * d + 2.02 * h * n + 1.0 * h * d * n / c + 1.78 * h + 1.99 * g * n + 4.45
    elif mx.kind == "mamba2":
        g, n = max(mx.groups, sp) if sp > 1 and mx.groups % sp else mx.groups, mx.state
        saved = 3.07 * h * c + 13.77 * h * d + 4.73 * h * n + 3.02 * h * d * n / c + 6.0 * h + 8.02 * g * n
        ws = 0.53 * h * c + 0.72 * h * d + 0.44 * h * n + 4.59 * h * d * n / c - 24.9 * h - 1.2 * g * n + 91
    elif mx.kind == "gated_delta_net" and dtype_bytes < FP32:  # fit on fake tensors at real sizes, as Mamba-2's
        hk, dk = max(mx.key_heads, sp) if mx.key_heads % sp else mx.key_heads, mx.key_dim
        saved = 5.149 * h * c + 8.0 * h * dk + 8.501 * h * d + 1.0 * h * dk * d / 64 + 2.001 * hk * dk
        ws = 4.894 * h * c + 2.94 * h * dk - 1.89 * h * d
    elif mx.kind == "gated_delta_net":
        hk = max(mx.key_heads, sp) if mx.key_heads % sp else mx.key_heads
        dk = mx.key_dim
        saved = 5.2 * h * c + 11.6 * h * dk + 10.92 * h * d + 0.707 * h * dk * d / 64 + 5.12 * hk * dk
        ws = 2.985 * h * c + 3.0 * h * dk - 2.94 * h * d
    elif mx.kind == "short_conv":
        saved, ws = 6.0 * mx.channels, 2.1 * mx.channels
    elif mx.kind == "mamba1":  # fit at 11 sizes (I 64-256, N 8-32), residual < 0.1 % (backward 1.3 %)
        i, n = mx.channels, mx.state  # the whole B, C on every rank: the N terms grow with P
        saved, ws = 3.01 * i * n + 10.09 * i + 2.2 * n * sp, 3.97 * i * n - 0.81 * i + 1.26 * n * sp
    elif mx.kind == "kimi_delta_attention":
        saved = 3.455 * h * d * c + 1494.3 * h + 1.78 * h * d * d / 64
        ws = 2.952 * h * d * c - 7.3 * h
    elif mx.kind == "lightning_attention":  # fit at 10 sizes (H 2-8, D 8-64, block c 32-128), residual 1 % (5.8 %)
        saved = 0.974 * h * c + 12.7 * h * d + 1.124 * h * d * d / c
        ws = 0.55 * h * c + 4.84 * h * d + 1.54 * h * d * d / c
    else:
        raise ValueError(f"unknown mixer kind {mx.kind!r}")
    return FP32 * saved, FP32 * max(ws, 0.0)


def exchange_per_token(mx: MixerShape, sp: int) -> tuple[int, int]:
    """``(in, out)`` elements per local token that one ``mx`` layer hands to its two all-to-alls
    (``(P-1)/P`` of them leave the rank); Mamba-2's ``x, dt, B, C``, gated delta-net's ``q, k, v, g,
    beta``, KDA's ``q, k, v, beta`` and the gate feature (to every rank) or its decay (head-sharded, Bailing's
    full-rank gate), the conv's channels, Mamba-1's
    ``x, dt, z`` and ``B, C`` (to every rank), lightning attention's ``[q | k | v]`` per head."""
    h, d = mx.heads, mx.head_dim
    if mx.kind == "mamba2":
        g = max(mx.groups, sp) if sp > 1 and mx.groups % sp else mx.groups
        return h * d + 2 * g * mx.state + h, h * d
    if mx.kind == "gated_delta_net":
        hk = max(mx.key_heads, sp) if mx.key_heads % sp else mx.key_heads
        return 2 * hk * mx.key_dim + h * d + 2 * h, h * d
    if mx.kind == "short_conv":
        return mx.channels, mx.channels
    if mx.kind == "mamba1":
        return 3 * mx.channels + 2 * mx.state * sp, mx.channels
    if mx.kind == "kimi_delta_attention":  # the decay itself (Bailing) or the gate feature to every rank (Kimi)
        return 3 * h * d + h + (h * d if mx.decay_exchanged else sp * d), h * d
    if mx.kind == "lightning_attention":
        return 3 * h * d, h * d
    raise ValueError(f"unknown mixer kind {mx.kind!r}")


def shardable(mx: MixerShape, sp: int) -> bool:
    """Whether ``mixers`` can shard ``mx`` at sp ``sp`` (its handler's ``check``: heads divide)."""

    def splits(n: int) -> bool:  # divides by sp, or (replicated) divides it
        return n % sp == 0 or (n > 0 and sp % n == 0)

    if mx.kind == "mamba2":
        return mx.heads % sp == 0 and splits(mx.groups)
    if mx.kind == "gated_delta_net":
        return mx.heads % sp == 0 and splits(mx.key_heads)
    if mx.kind in ("short_conv", "mamba1"):
        return mx.channels % sp == 0
    return mx.heads % sp == 0


def describe(mx: MixerShape) -> str:
    """A short label for tables: ``mamba2 (8 heads x 16, state 16, 2 groups)``."""
    if mx.kind == "mamba2":
        return f"mamba2 ({mx.heads} heads x {mx.head_dim}, state {mx.state}, {mx.groups} groups)"
    if mx.kind == "gated_delta_net":
        return f"gated_delta_net ({mx.key_heads} key / {mx.heads} value heads, {mx.key_dim}/{mx.head_dim})"
    if mx.kind == "short_conv":
        return f"short_conv ({mx.channels} channels)"
    if mx.kind == "mamba1":
        return f"mamba1 ({mx.channels} channels, state {mx.state})"
    return f"{mx.kind} ({mx.heads} heads x {mx.head_dim})"
