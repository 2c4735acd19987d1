"""What a run keeps and restores: the dtype policy (``precision``), meta-init and sharded loading
(``loading``; the model directory check in ``model_dir``), checkpoints (``checkpoint``: HF export in
``hf_export``, reshardable state in ``dcp_state``).

May import: ``checks``, ``parallel``, ``config``.
"""
