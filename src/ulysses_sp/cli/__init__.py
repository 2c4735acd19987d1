"""The ``ulysses-sp`` command line; see ``main``. The library never imports this package."""
