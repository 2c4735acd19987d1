"""Sequence parallelism for token mixers that are not softmax attention: linear attention (gated
delta-net, KDA), state-space scans (Mamba-2, Mamba-1) and short causal convolutions, each head-sharded by an
all-to-all around the model's own kernel (``base`` holds the handler contract and ``shard_mixers``).

May import: ``checks``, ``parallel``, ``attention`` (positions and document layout), ``vlm`` (which
multimodal models the guard admits).
"""
