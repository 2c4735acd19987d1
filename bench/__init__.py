"""ulysses-sp benchmark suite (run as ``python -m bench``; see the README's Performance section, docs/readme/performance.md).

Not part of the installed package: scripts that measure the library against analytic limits and against
DeepSpeed's own Ulysses/ALST. Modules here that run inside the DeepSpeed venv (``ds_worker``, ``spec``)
import only torch and transformers.
"""
