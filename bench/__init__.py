"""ulysses-sp benchmark suite (``python -m bench``; the README's Performance section, docs/readme/performance.md).

Not part of the installed package: scripts that measure the library against analytic limits and DeepSpeed's
Ulysses/ALST. Leaves: ``md`` (tables, provenance), ``launch`` (the one launcher, each script's parser and worker).
What the DeepSpeed venv runs (``steploop``, ``spec``, ``counters``, ``launch``) uses only our memory meter.
"""
