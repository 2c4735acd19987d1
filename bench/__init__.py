"""ulysses-sp benchmark suite (``python -m bench``; the README's Performance section, docs/readme/performance.md).

Not part of the installed package: scripts that measure the library against analytic limits and against
DeepSpeed's own Ulysses/ALST. Leaves: ``md`` (tables, provenance) and ``launch`` (the one launcher). The
modules the DeepSpeed venv runs (``steploop``, ``spec``, ``counters``, ``launch``) import torch and
transformers, and from this checkout only the library's memory meter.
"""
