"""Analytic limits the benchmarks compare against (pure arithmetic; derivations in the docstrings).

Shape legend: ``B`` micro-batch, ``S`` global sequence, ``S_l = S/P``, ``H`` query heads, ``Hkv`` kv heads,
``D`` head dim, ``h = H*D``, ``P`` sp size, ``b`` bytes per element.
"""

from __future__ import annotations


def ulysses_min_bytes_per_layer(*, B: int, S: int, H: int, Hkv: int, D: int, P: int, b: int) -> int:
    """Fewest bytes any one rank must send, per attention layer, in forward (backward: the same).

    Model of the computation: rank ``j`` holds tokens ``[j*S_l, (j+1)*S_l)`` of q, k, v (all heads)
    and must end with the attention output of its own tokens (all heads); attention for query head
    ``i`` needs q of head ``i`` and k, v of kv head ``g(i) = i // (H/Hkv)`` over all ``S`` tokens, and
    Ulysses gives each rank ``H/P`` query heads. Counting what rank ``j`` must *receive*:

    * q: its ``H/P`` heads at the ``S - S_l`` tokens it does not hold: ``(P-1) S_l (H/P) D``.
    * k and v, each: the kv heads its query heads use at the tokens it does not hold. Its ``H/P``
      query heads use ``max(1, Hkv/P)`` kv heads (one head when ``Hkv < P``: a query-head slice never
      straddles two kv heads when ``P`` divides ``H`` and ``Hkv`` divides ``P``), so
      ``(P-1) S_l D max(Hkv, P)/P``. A scheme that replicated kv to all ``H`` heads before the
      exchange would send ``H/max(Hkv, P)`` times this.
    * output: its ``S_l`` tokens' outputs of the ``H - H/P`` heads computed elsewhere:
      ``(P-1) S_l (H/P) D``.

    Every token's q/k/v exists on exactly one rank, so every received element was sent by another
    rank; the layout is symmetric, so the per-rank share of the group's total is the total / P, and
    a balanced all-to-all attains it on every rank. Summing, with ``S_l = S/P``:

        2 B S D (P-1)/P^2 (H + max(Hkv, P)) b  =  4 B S h (P-1)/P^2 b   for MHA (Hkv = H).

    Backward mirrors it (gradients of output, q, k, v travel the other way; with ``Hkv < P`` each
    rank's partial kv-head gradient over all tokens must reach the tokens' owners — ``(P-1) S_l D``
    per rank, the same as forward, whether or not partials are pre-summed).
    """
    if H % P or not (Hkv % P == 0 or P % Hkv == 0):
        raise ValueError(f"heads H={H}, Hkv={Hkv} cannot be split over P={P}")
    if S % P:
        raise ValueError(f"S={S} is not divisible by P={P}")
    return 2 * B * S * D * (P - 1) * (H + max(Hkv, P)) * b // (P * P)


def naive_kv_bytes_per_layer(*, B: int, S: int, H: int, Hkv: int, D: int, P: int, b: int) -> int:
    """Forward bytes per rank per layer if kv were expanded to all ``H`` heads before the exchange."""
    return 4 * B * S * H * D * (P - 1) * b // (P * P)
