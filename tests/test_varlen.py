"""The CUDA varlen path for packed documents (``attention/varlen.py``), its CPU-testable parts: the
decision, the ``cu_seqlens`` construction, and the packing around the kernel. The kernel itself is
CUDA-only and **not run here** (no GPU): the packing is checked with a reference kernel written from
``varlen_attn``'s documented contract against dense block-diagonal attention (fp64, outputs and
gradients, rows with different documents, GQA), the call against torch's real op on meta tensors
(its schema, fake kernel and registered backward), and ``core.run_segments``'s branch to it."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from ulysses_sp.attention.masks import SeqLayout
from ulysses_sp.attention.segments import segment_lengths
from ulysses_sp.attention.varlen import cu_seqlens, use_varlen, varlen_refusal, varlen_segment_attention


def test_cu_seqlens_per_row_and_shared_and_bad_input():
    cu, longest = cu_seqlens([[3, 5], [1, 6, 1]], 2, 8)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 8, 9, 15, 16] and longest == 6
    cu, longest = cu_seqlens([[2, 6]], 3, 8)  # one layout for every row: repeated at offsets b*S
    assert cu.tolist() == [0, 2, 8, 10, 16, 18, 24] and longest == 6
    with pytest.raises(ValueError, match=r"row sums \[8, 7\] \(over 2 rows\) do not cover 2 rows of 8 tokens"):
        cu_seqlens([[3, 5], [7]], 2, 8)
    with pytest.raises(ValueError, match=r"over 2 rows\) do not cover 3 rows"):
        cu_seqlens([[8], [8]], 3, 8)


def test_varlen_runs_only_where_the_kernel_does():
    assert varlen_refusal("cuda", torch.bfloat16, 128, 8, 2) is None
    assert varlen_refusal("cuda", torch.float16, 64, 4, 4) is None
    for args, reason in [
        (("cpu", torch.bfloat16, 128, 8, 2), "device 'cpu': the varlen kernel is CUDA-only"),
        (("cuda", torch.float32, 128, 8, 2), "dtype torch.float32: .*float16/bfloat16"),
        (("cuda", torch.bfloat16, 100, 8, 2), "head dim 100: .*multiple of 8 up to 256"),
        (("cuda", torch.bfloat16, 264, 8, 2), "head dim 264"),
        (("cuda", torch.bfloat16, 64, 6, 4), "6 query heads are not a multiple of 4 kv heads"),
    ]:
        got = varlen_refusal(*args)
        assert got is not None and re.match(reason, got), (args, got)
    assert "flash check refuses" in varlen_refusal("cuda", torch.bfloat16, 128, 8, 2, kernel_ok=False)
    q = torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16)
    assert not use_varlen(q, q[:, :2])  # CPU tensors: the per-document sdpa runs


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """``varlen_attn``'s documented contract on the host: ``[T, H*, D]`` tokens, documents at ``cu``, causal
    within each (``window_size (-1, 0)``), GQA by ``enable_gqa``; checks what the kernel requires."""
    assert cu_q is cu_k and cu_q.dtype == torch.int32 and cu_q.device == q.device and window_size == (-1, 0)
    bounds = cu_q.tolist()
    assert max_q == max_k == max(b - a for a, b in zip(bounds, bounds[1:])) and bounds[-1] == q.shape[0]
    assert enable_gqa == (q.shape[1] != k.shape[1]) and all(t.stride(-1) == 1 for t in (q, k, v))  # as flash
    outs = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True,  # [H*, n, D]
                                           scale=scale, enable_gqa=enable_gqa).transpose(0, 1)  # -> [n, H_l, D]
            for a, b in zip(bounds, bounds[1:])]  # fmt: skip
    return torch.cat(outs)


@pytest.mark.parametrize("rows, batch", [([(11, 20, 1, 8), (40,)], 2), ([(7, 33)], 2), ([(5, 30, 5)], 1)])
def test_varlen_packing_equals_dense_block_diagonal(rows, batch):
    """Rows with their own documents; one layout for both rows; one row (token-major views, no copy)."""
    doc = SeqLayout.from_positions(torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])).doc_ids
    lengths = segment_lengths(doc)
    assert len(lengths) == len(rows)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(batch, n, 40, 8, generator=g, dtype=torch.float64) for n in (6, 2, 2, 6))
    allowed = torch.ones(40, 40, dtype=torch.bool).tril() & (doc[:, :, None] == doc[:, None, :])  # [B|1, S, S]
    results = []
    for run in (
        lambda q, k, v: varlen_segment_attention(q, k, v, lengths, scale=0.3, kernel=_reference_varlen),
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=0.3,
                                                       enable_gqa=True).transpose(1, 2),  # -> [B, S, H_l, D]
    ):  # fmt: skip
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = run(*leaves)
        out.backward(dout.transpose(1, 2))
        results.append((out, *(t.grad for t in leaves)))
    assert results[0][0].shape == (batch, 40, 6, 8)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_call_matches_torch_varlen_op_and_its_backward():
    """torch's own ``varlen_attn`` custom op (schema, fake kernel, registered autograd) on meta tensors."""
    with FakeTensorMode():
        q = torch.empty(2, 6, 16, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
        k, v = (torch.empty(2, 2, 16, 64, dtype=torch.bfloat16, device="meta", requires_grad=True) for _ in "kv")
        out = varlen_segment_attention(q, k, v, [[5, 11], [16]], scale=0.125)
        assert out.shape == (2, 16, 6, 64) and out.dtype == torch.bfloat16
        out.sum().backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_run_segments_takes_the_varlen_branch_where_chosen(monkeypatch):
    """The wiring in ``core.run_segments``: when ``use_varlen`` says yes, the varlen call's ``[B, S, H_l, D]``
    is returned as it is and equals the per-document sdpa branch (here with the reference kernel)."""
    from functools import partial

    from ulysses_sp.attention import core

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, n, 24, 8, generator=g, dtype=torch.float64) for n in (4, 2, 2))
    lengths, kwargs, module = [[5, 19], [24]], {"scaling": 0.4}, torch.nn.Module()
    expected = core.run_segments(module, q, k, v, lengths, kwargs)  # CPU: the per-document sdpa
    taken = []
    monkeypatch.setattr(core, "use_varlen", lambda q, k: taken.append(q.shape) is None)
    monkeypatch.setattr(core, "varlen_segment_attention", partial(varlen_segment_attention, kernel=_reference_varlen))
    torch.testing.assert_close(core.run_segments(module, q, k, v, lengths, kwargs), expected, rtol=1e-12, atol=1e-12)
    assert taken == [q.shape]
