"""Memory techniques of ALST: sequence-tiled MLP and logits+loss (``tiling`` over the private
``_tiled`` mechanism), activation checkpoint offload (``offload``) and the peak-memory ``meter``.

May import: ``checks``, ``parallel``.
"""
