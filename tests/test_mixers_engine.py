"""Hybrid models through the engine at ZeRO-3 (FSDP2): two SGD steps at dp1 x sp2 and dp2 x sp2 equal
the plain model.

``initialize`` applies the mixer handlers itself (the path the CLI takes). LFM2 with packed
documents (oracle: each document alone), Nemotron-H and Falcon-H1 on whole sequences, pure Mamba-2 (no
attention layers: nothing registered, ``mesh_param``) on packed documents: the engine's loss, every
parameter's reduced gradient, and the parameters after each step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hybrid_models import V, hybrid_model
from models import global_batch, per_document_loss, reference_loss, shift
from oracle import assert_grads_close
from torch.distributed.tensor import DTensor

from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.engine import initialize
from ulysses_sp.parallel.mesh import init_mesh

S, LR = 16, 0.5
DOCS = (5, 7, 4)  # the boundary at 5 inside rank 0's shard, at 12 inside rank 1's


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _packed_labels(ids: torch.Tensor) -> torch.Tensor:
    """Next-token labels within each document, -100 at every document's last token."""
    labels, start = shift(ids), 0
    for n in DOCS:
        labels[:, start + n - 1] = -100
        start += n
    return labels


def _engine_run(dp: int, sp: int, cases: list[tuple[str, bool]]) -> list[str]:
    mesh = init_mesh((dp, sp))
    cols = slice(mesh.sp_rank * S // sp, (mesh.sp_rank + 1) * S // sp)
    rows = slice(mesh.dp_rank, mesh.dp_rank + 1)
    done = []
    for arch, packed in cases:
        ref = hybrid_model(arch)
        model = copy.deepcopy(ref)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                  "optimizer": {"type": "SGD", "params": {"lr": LR}}}  # fmt: skip
        if arch == "mamba2":  # no attention layers: nothing to register, as the refusal to register says
            with pytest.raises(ValueError, match="has no attention layers .* mesh_param=\\(dp, sp\\)"):
                UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, mesh=mesh)
            reg, (engine, _, _, _) = None, initialize(model=model, config=config, mesh_param=(dp, sp))
        else:
            reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, mesh=mesh)
            engine, _, _, _ = initialize(model=model, config=config, mpu=reg)
        assert engine.mixers is not None and engine.mixers.wrapped, arch
        for step in range(2):
            ids = global_batch(20 + step, dp, S, vocab=V)
            if packed:  # one packed row (dp 1)
                ref_loss = per_document_loss(ref, ids, DOCS)
                labels, pos = _packed_labels(ids), torch.cat([torch.arange(n) for n in DOCS])[None]
            else:
                ref_loss = reference_loss(ref, ids, shift(ids), dp)
                labels, pos = shift(ids), torch.arange(S).expand(dp, -1)
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
            ref_opt.step()
            out = engine(
                input_ids=ids[rows, cols], position_ids=pos[rows, cols], shift_labels=labels[rows, cols]
            )
            engine.backward(out.loss)
            grads = {n: _full(p.grad) for n, p in engine.module.named_parameters()}
            loss = engine.step()
            torch.testing.assert_close(loss, ref_loss.item(), rtol=1e-5, atol=0)
            assert_grads_close(grads, ref_grads)
        refs = dict(ref.named_parameters())
        for name, p in engine.module.named_parameters():
            torch.testing.assert_close(_full(p.detach()), refs[name].detach(), rtol=1e-5, atol=1e-6)
        engine.mixers.remove()
        if reg is not None:
            reg.remove()
        done.append(arch)
    return done


@pytest.mark.parametrize(
    "dp, sp, cases",
    [(1, 2, [("lfm2", True), ("nemotron_h", False), ("mamba2", True)]), (2, 2, [("falcon_h1", False)])],
    ids=["dp1sp2", "dp2sp2"],
)
def test_hybrid_engine_zero3_equals_no_sp(pool, dp, sp, cases):
    assert pool.run(_engine_run, dp * sp, dp, sp, cases)[0] == [a for a, _ in cases]
