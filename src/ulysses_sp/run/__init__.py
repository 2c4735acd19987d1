"""The ``train`` command as a library: its config (``config``), the checks run once before launch
(``checks``, ``prelaunch``, ``preflight``), the loop (``loop``) and its micro-batches (``stream``;
``eval`` reads them too), run directory, lock and stops.

May import: every library package below it (parallel … engine, state, plan, tasks, data); never ``cli``.
"""
