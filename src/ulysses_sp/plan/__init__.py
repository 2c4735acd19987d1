"""The memory and time model behind ``ulysses-sp plan`` and the startup prediction: the inputs
(``inputs``: model shape and settings), the hardware table (``hardware``), the model (``model``)
and its sequence-mixer terms (``mixers``: Mamba-2, gated delta-net, short convolution, KDA layers).

May import: ``checks`` only (pure arithmetic: no torch.distributed, no model).
"""
