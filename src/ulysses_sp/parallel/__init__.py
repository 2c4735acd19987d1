"""Layout and communication: the ``(dp, sp)`` mesh (``mesh``, ``mesh_shape``), every collective
(``comm``, timed by ``comm_timing``; its byte ``packing``; the attention exchange packed or head by
head, ``headwise``, chosen by the alpha/beta model of ``exchange_cost``), the SP loss reduction
(``loss``) and group teardown.

May import: ``checks`` only. Everything else in the library imports from here; nothing here
imports the rest of the library.
"""
