"""Objectives beyond the causal-LM loss, exact under sequence parallelism: per-token log-probabilities
of a sequence's own tokens and their per-sequence sums (``sequence_logps``), the building block of
preference (DPO, KTO, ORPO) and RL (GRPO, RLOO, PPO) losses.

Owns: ``logps``.

May import: ``checks``, ``parallel`` (the collectives, via ``parallel.comm``), ``memory`` (the tiled
compute).
"""

from ulysses_sp.objectives.logps import (
    SequenceLogps,
    gather_sequence,
    model_logps,
    sequence_logps,
    sum_over_sequence,
)

__all__ = ["SequenceLogps", "gather_sequence", "model_logps", "sequence_logps", "sum_over_sequence"]
