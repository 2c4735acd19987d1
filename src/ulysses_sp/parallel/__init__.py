"""Layout and communication: the ``(dp, sp)`` mesh (``mesh``, ``mesh_shape``), every collective
(``comm``, timed by ``comm_timing``; its byte ``packing``; the attention exchange head by head,
``headwise``), the SP loss reduction (``loss``) and group teardown.

May import: ``checks`` only. Everything else in the library imports from here; nothing here
imports the rest of the library.
"""
