"""Packed documents through one sdpa call per document (``attention/segments.py``) equal dense masked
attention and the blockwise core (outputs and gradients, fp64; rows with different documents; GQA), the
path is chosen where it applies and the blockwise core keeps what it cannot express; under Ulysses SP
a packed Llama step equals each document run alone without SP (loss and every gradient)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import global_batch, per_document_loss, shift, tiny_model
from oracle import assert_step_close

from ulysses_sp.attention.blockwise import AttnStructure, blockwise_attention
from ulysses_sp.attention.core import attention_path
from ulysses_sp.attention.masks import SeqLayout
from ulysses_sp.attention.segments import segment_attention, segment_lengths
from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.parallel.loss import sp_causal_lm_loss
from ulysses_sp.parallel.mesh import init_mesh


def _positions(rows):
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def test_segments_equal_dense_mask_and_blockwise():
    rows = [(11, 20, 1, 8), (40,)]  # row 0: four documents (one of a single token); row 1: one
    layout = SeqLayout.from_positions(_positions(rows))
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, n, 40, 8, generator=g, dtype=torch.float64) for n in (6, 2, 2, 6))
    doc = layout.doc_ids
    allowed = torch.ones(40, 40, dtype=torch.bool).tril() & (doc[:, :, None] == doc[:, None, :])  # [B, S, S]
    results = []
    for run in (
        lambda q, k, v: segment_attention(q, k, v, segment_lengths(doc), scale=0.3),
        lambda q, k, v: blockwise_attention(q, k, v, structure=AttnStructure.build(doc, None), scale=0.3, chunk=7),
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=0.3, enable_gqa=True),
    ):  # fmt: skip
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = run(*leaves)
        out.backward(dout)
        results.append((out, *(t.grad for t in leaves)))
    for got in results[:2]:
        for a, b in zip(got, results[2]):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert segment_lengths(doc) == [[11, 20, 1, 8], [40]]
    with pytest.raises(ValueError, match=r"document lengths \[40\] .* do not cover q of shape \(2, 6, 41, 8\)"):
        segment_attention(q.new_zeros(2, 6, 41, 8), k, v, [[40]])


def test_segments_path_where_it_applies():
    packed, causal = SeqLayout.from_positions(_positions([(5, 11)])), SeqLayout.from_positions(_positions([(16,)]))
    assert attention_path("sdpa", packed, None, False) == "segments"
    assert attention_path("sdpa", packed, 16, False) == "segments"  # a window as long as S changes nothing
    assert attention_path("sdpa", causal, None, False) == "sdpa"
    # what one sdpa call per document cannot express stays with the blockwise core
    assert attention_path("sdpa", packed, 4, False) == "blockwise"
    assert attention_path("sdpa", packed, None, False, sinks=True) == "blockwise"
    assert attention_path("sdpa", packed, None, False, attn_chunk=8) == "blockwise"
    assert attention_path("sdpa", packed, None, True) == "blockwise+offload"


DOCS = (5, 7, 4)  # 16 tokens: boundaries fall inside shards at sp 2 and 4


def _sp_packed(sp, kv, exchange):
    mesh = init_mesh((1, sp))
    ref = tiny_model("llama", heads=4, kv_heads=kv)
    model = copy.deepcopy(ref)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, mesh=mesh, exchange=exchange)
    ids = global_batch(3, 1, sum(DOCS))
    pos = _positions([DOCS])
    labels = shift(ids)
    labels[0, torch.tensor(DOCS).cumsum(0) - 1] = -100
    ref_loss = per_document_loss(ref, ids, DOCS)
    ref_loss.backward()
    s_l = ids.shape[1] // sp
    cols = slice(mesh.sp_rank * s_l, (mesh.sp_rank + 1) * s_l)
    loss = sp_causal_lm_loss(model(input_ids=ids[:, cols], position_ids=pos[:, cols]).logits, labels[:, cols],
                             mesh.sp_group)  # fmt: skip
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    path = reg.attention.last_path
    reg.remove()
    assert_step_close(loss.detach(), {n: p.grad for n, p in model.named_parameters()}, ref_loss.detach(),
                      {n: p.grad for n, p in ref.named_parameters()})  # fmt: skip
    return path


@pytest.mark.parametrize("exchange", ["packed", "headwise"])  # auto: packed at these sizes
@pytest.mark.parametrize("sp, kv", [(4, 2)])  # GQA with fewer kv heads than ranks (sp 2: test_head_chunks)
def test_packed_documents_per_document_sdpa_equal_no_sp(pool, sp, kv, exchange):
    assert set(pool.run(_sp_packed, sp, sp, kv, exchange)) == {"segments"}
