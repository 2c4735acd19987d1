"""Sequence-parallel attention: the Ulysses all-to-all attention (``ulysses``) and its undoable
registration with transformers (``registration``), the core attention paths (``core``: dense,
``blockwise`` online-softmax, ``segments`` (sdpa per packed document), ``varlen`` (one CUDA varlen
call for packed documents), ``ring``), head-chunked exchanges (``head_chunks``), full-sequence
``masks`` and Ulysses-Offload (``kv_offload``).

May import: ``checks``, ``parallel``, ``memory.meter``.
"""
