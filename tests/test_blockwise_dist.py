"""Packed documents + sliding window through the blockwise core (chunked, offloaded) under Ulysses SP
equal the same model run on each document alone without SP: loss and every gradient, at
sp in {1, 2, 4}, GQA with fewer kv heads than SP ranks, and through the engine at ZeRO 0 and 3."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from models import global_batch, per_document_loss, shift, tiny_model
from oracle import assert_grads_close, assert_step_close
from torch.distributed.tensor import DTensor

from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.engine import initialize
from ulysses_sp.parallel.loss import sp_causal_lm_loss
from ulysses_sp.parallel.mesh import init_mesh

DOCS = (5, 7, 4)  # 16 tokens: boundaries fall inside shards at sp 2 and 4
WINDOW = 3  # shorter than every document but the last: the window matters inside documents


def _model(heads, kv):
    ref = tiny_model("mistral", heads=heads, kv_heads=kv)
    ref.config.sliding_window = WINDOW
    return ref


def _packed(seed):
    """One packed sequence ``[1, S]``: ids, position ids restarting per document, labels (-100 at
    every document's last token)."""
    ids = global_batch(seed, 1, sum(DOCS))
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]
    labels = shift(ids)
    labels[0, torch.tensor(DOCS).cumsum(0) - 1] = -100
    return ids, pos, labels


def _packed_window_chunked(sp, heads, kv, chunk, offload):
    mesh = init_mesh((1, sp))
    ref = _model(heads, kv)
    model = copy.deepcopy(ref)
    reg = UlyssesSPAttentionHF.register_with_transformers(
        model, "sdpa", sp, 1, mesh=mesh, attn_chunk=chunk, offload_attention=offload
    )
    ids, pos, labels = _packed(3)
    ref_loss = per_document_loss(ref, ids, DOCS)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    s_l = ids.shape[1] // sp
    cols = slice(mesh.sp_rank * s_l, (mesh.sp_rank + 1) * s_l)
    out = model(input_ids=ids[:, cols], position_ids=pos[:, cols])
    loss = sp_causal_lm_loss(out.logits, labels[:, cols], mesh.sp_group)
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    attn = reg.attention
    reg.remove()
    assert_step_close(
        loss.detach(), {n: p.grad for n, p in model.named_parameters()}, ref_loss.detach(), ref_grads
    )
    offloaded = attn.kv_offload.stats.offloaded_bytes if attn.kv_offload else 0
    return attn.last_path, attn.block_counts.skipped, offloaded


@pytest.mark.parametrize(
    "sp, heads, kv, chunk, offload",
    [
        (1, 4, 2, 3, False),
        (2, 4, 1, 3, True),  # GQA, Hkv < P
        (2, 4, 4, None, False),  # auto chunk (one block)
        (4, 4, 2, 5, False),  # GQA, Hkv < P; chunk 5 does not divide S = 16
        (4, 8, 4, 4, True),
    ],
)
def test_packed_documents_with_window_chunked_and_offloaded_equal_no_sp(pool, sp, heads, kv, chunk, offload):
    for path, skipped, offloaded in pool.run(_packed_window_chunked, sp, sp, heads, kv, chunk, offload):
        assert path == ("blockwise+offload" if offload else "blockwise")
        assert (offloaded > 0) == offload
        assert skipped > 0 or chunk is None  # documents and the window leave whole blocks out


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _engine_packed(dp, sp, stage, offload):
    mesh = init_mesh((dp, sp))
    ref = _model(4, 1)
    model = copy.deepcopy(ref)
    reg = UlyssesSPAttentionHF.register_with_transformers(
        model, "sdpa", sp, 1, mesh=mesh, attn_chunk=3, offload_attention=offload
    )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
    }
    engine, *_ = initialize(model=model, config=config, mpu=reg)
    samples = [_packed(20 + d) for d in range(dp)]
    ref_loss = torch.stack([per_document_loss(ref, ids, DOCS) for ids, _, _ in samples]).mean()
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ids, pos, labels = samples[mesh.dp_rank]
    s_l = ids.shape[1] // sp
    cols = slice(mesh.sp_rank * s_l, (mesh.sp_rank + 1) * s_l)
    out = engine(input_ids=ids[:, cols], position_ids=pos[:, cols], shift_labels=labels[:, cols])
    engine.backward(out.loss)
    grads = {n: _full(p.grad) for n, p in engine.module.named_parameters()}
    loss = engine.step()
    reg.remove()
    torch.testing.assert_close(loss, ref_loss.item(), rtol=1e-5, atol=0)
    assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("dp, sp, stage, offload", [(1, 2, 0, True), (2, 2, 3, False)])
def test_engine_with_packed_documents_and_window_equals_no_sp(pool, dp, sp, stage, offload):
    pool.run(_engine_packed, dp * sp, dp, sp, stage, offload)
