"""The ``ulysses-sp`` command line; see ``main``. The library never imports this package.

May import: anything in the library; nothing imports it.
"""
