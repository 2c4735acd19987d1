"""Integrations with other training front-ends (optional extra ``ulysses-sp[hf]``).

- ``integrations.transformers``: sequence parallelism inside ``transformers.Trainer`` and TRL's
  ``SFTTrainer`` (any ``Trainer`` subclass) and TRL's ``DPOTrainer``, without DeepSpeed:
  ``prepare(trainer, sp_size=P)``.

Importing this package imports nothing else (``transformers``, ``accelerate``, ``trl`` and ``peft``
are imported by the submodule that uses them).

May import: the library below ``run`` (``parallel``, ``attention``, ``mixers``, ``memory``, ``data``, ``objectives``,
``vlm``, ``engine``).
"""
