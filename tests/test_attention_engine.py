"""Through the engine: Ulysses attention + SP loss + ZeRO 0/3 equal training without SP.

For Llama, Qwen2 and Mistral, sdpa and eager, layouts (1,2), (1,4), (2,2): the loss the engine
returns, every parameter's reduced gradient, the global gradient norm, and the parameters after two
SGD steps (SGD: a gradient error shows in the parameters one-to-one; Adam would normalise it away)
equal a plain model trained on the same global batches.
"""

from __future__ import annotations

import copy

import pytest
import torch
from models import global_batch, reference_loss, shift, tiny_model
from oracle import assert_grads_close
from torch.distributed.tensor import DTensor

from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.engine import initialize
from ulysses_sp.parallel.mesh import init_mesh

B, S, LR, STEPS = 2, 16, 0.5, 2
ARCHS = ("llama", "qwen2", "mistral")
CORES = ("sdpa", "eager")


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _ref_step(ref, opt, ids, labels, dp):
    loss = reference_loss(ref, ids, labels, dp)
    opt.zero_grad()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    norm = torch.nn.utils.get_total_norm(list(grads.values()))
    opt.step()
    return loss.item(), grads, norm.item()


def _engine_equivalence(dp, sp, stage, cases):
    mesh = init_mesh((dp, sp))
    info = mesh
    s_l = S // sp
    rows = slice(info.dp_rank * B, (info.dp_rank + 1) * B)
    cols = slice(info.sp_rank * s_l, (info.sp_rank + 1) * s_l)
    compared = []
    for arch, core in cases:
        ref = tiny_model(arch, attn=core)
        model = copy.deepcopy(ref)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        reg = UlyssesSPAttentionHF.register_with_transformers(model, core, sp, B, mesh=mesh)
        config = {
            "train_micro_batch_size_per_gpu": B,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "SGD", "params": {"lr": LR}},
        }
        engine, _, _, _ = initialize(model=model, config=config, mpu=reg)
        for step in range(STEPS):
            ids = global_batch(10 + step, dp * B, S)
            labels = shift(ids)
            ref_loss, ref_grads, ref_norm = _ref_step(ref, ref_opt, ids, labels, dp)
            pos = torch.arange(S)[cols].expand(B, -1)
            out = engine(input_ids=ids[rows, cols], position_ids=pos, shift_labels=labels[rows, cols])
            engine.backward(out.loss)
            grads = {n: _full(p.grad) for n, p in engine.module.named_parameters()}
            step_loss = engine.step()
            torch.testing.assert_close(step_loss, ref_loss, rtol=1e-5, atol=0)
            assert_grads_close(grads, ref_grads)  # rtol 1e-4, atol min(1e-6, 1e-5 x the largest)
            norm = engine.get_global_grad_norm()
            torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
        for name, p in engine.module.named_parameters():
            r = dict(ref.named_parameters())[name]
            torch.testing.assert_close(_full(p.detach()), r.detach(), rtol=1e-5, atol=1e-6)
        compared.append((arch, core))
        reg.remove()
    return compared


CASES = [(a, c) for a in ARCHS for c in CORES]


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("dp, sp", [(1, 2), (1, 4), (2, 2)])
def test_engine_sp_training_equals_no_sp(pool, dp, sp, stage):
    assert pool.run(_engine_equivalence, dp * sp, dp, sp, stage, CASES)[0] == CASES
