"""The memory and time model behind ``ulysses-sp plan`` and the startup prediction: the inputs
(``inputs``: model shape and settings), the hardware table (``hardware``), the model (``model``)
its sequence-mixer terms (``mixers``: Mamba-2, gated delta-net, short convolution, KDA layers) and the
attention exchange's path and latency (``exchange``).

May import: ``checks`` and ``parallel.exchange_cost`` (the exchange's alpha/beta model; pure arithmetic:
no torch.distributed, no model).
"""
