"""Comparing a run against its oracle: one loss and every parameter gradient, at fixed tolerances.

Shared by the equivalence tests (SP vs no SP, tiled vs untiled, engine vs plain model). The rule
for a gradient: ``assert_close(g, r, rtol=rtol, atol=min(atol_cap, 1e-5 * max|r|))`` — a tolerance
far below the gradients themselves, so a 2x (or 1.01x) error cannot pass — and a zero reference
gradient is refused, since it would test nothing.
"""

from __future__ import annotations

import torch


def assert_grads_close(
    grads: dict[str, torch.Tensor],
    ref_grads: dict[str, torch.Tensor],
    *,
    rtol: float = 1e-4,
    atol_cap: float = 1e-6,
) -> None:
    """The same parameter names, and every gradient equal to the reference's of that name.

    ``atol`` is ``min(atol_cap, 1e-5 * max|reference|)``; ``atol_cap=math.inf`` makes it
    ``1e-5 * max|reference|`` alone.
    """
    assert grads.keys() == ref_grads.keys(), sorted(grads.keys() ^ ref_grads.keys())
    for name, g in grads.items():
        r = ref_grads[name]
        scale = r.abs().max().item()
        assert scale > 0, f"{name}: zero reference gradient tests nothing"
        atol = min(atol_cap, 1e-5 * scale)
        torch.testing.assert_close(g, r, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def assert_step_close(
    loss: torch.Tensor,
    grads: dict[str, torch.Tensor],
    ref_loss: torch.Tensor,
    ref_grads: dict[str, torch.Tensor],
    *,
    loss_rtol: float = 1e-5,
    rtol: float = 1e-4,
    atol_cap: float = 1e-6,
) -> None:
    """The loss (``rtol=loss_rtol``, ``atol=0``) and every gradient (``assert_grads_close``)."""
    torch.testing.assert_close(loss, ref_loss, rtol=loss_rtol, atol=0)
    assert_grads_close(grads, ref_grads, rtol=rtol, atol_cap=atol_cap)
