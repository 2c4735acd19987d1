"""Rehearsal of the real training step on fake tensors and a fake process group (``train --rehearse``)."""
