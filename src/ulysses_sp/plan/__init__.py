"""The memory and time model behind ``ulysses-sp plan`` and the startup prediction: the inputs
(``inputs``: model shape and settings), the hardware table (``hardware``) and the model (``model``).

May import: ``checks`` only (pure arithmetic: no torch.distributed, no model).
"""
