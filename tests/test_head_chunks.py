"""Head-chunked Ulysses attention (``attention/head_chunks.py``) is exact: per-position logits and every
gradient equal the unchunked SP run and the model without SP (each packed document on its own), for
plain causal sdpa with GQA below the Ulysses size, packed documents (the per-document sdpa path), the
hybrid ring, Ulysses-Offload and sp 1 (one rank, no exchange); overlap on and off give the same bits; the
attention layer's peak memory falls with the number of head groups (the library's meter); bad head counts
are refused, and so is ``--head-chunks`` where sp 1 runs transformers' own attention."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import global_batch, tiny_model
from oracle import assert_grads_close

from ulysses_sp.attention import ulysses
from ulysses_sp.attention.head_chunks import (
    HeadGroups,
    check_no_sinks,
    head_chunked_attention,
    plan_head_chunks,
    valid_head_chunks,
)
from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.memory.meter import track_peak_memory
from ulysses_sp.parallel.comm import heads_to_seq
from ulysses_sp.parallel.headwise import qkv_seq_to_heads
from ulysses_sp.parallel.mesh import init_mesh
from ulysses_sp.parallel.mesh_shape import shard_spans

DOCS = (9, 13, 10)  # 32 tokens: boundaries inside shards at sp 2 and 4 (and inside ring zigzag chunks)


def _reference(ref, ids, docs, weight):
    """No SP, each document alone: logits ``[1, S, V]`` and the loss ``sum(logits * weight)``."""
    logits, start = [], 0
    for n in docs:
        logits.append(ref(input_ids=ids[:, start : start + n]).logits)
        start += n
    logits = torch.cat(logits, 1)
    return logits, (logits * weight).sum()


def _sp_run(ref, mesh, sp, ring, chunks, ids, pos, weight, ckpt=False, scope="block", overlap=False, **opts):
    """The model under SP with ``chunks`` head groups: ``scope`` "block" (the whole attention block per
    group, ``attention/head_blocks.py``) or "core" (the function-level groups, the block wrappers removed)."""
    model = copy.deepcopy(ref)
    if ckpt:  # every layer recomputed in backward: the head groups' forward runs again before theirs
        model.gradient_checkpointing_enable()
        model.train()
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, mesh=mesh, head_chunks=chunks,
                                                          **opts)  # fmt: skip
    blocks, reg.attention.head_chunk_overlap = reg.head_blocks, overlap
    if blocks is not None and scope == "core":
        blocks.remove()
    cols = torch.cat([torch.arange(a, b) for a, b in shard_spans(ids.shape[1], mesh.sp_rank, sp, ring)])
    grouped, real = [], ulysses.head_chunked_attention  # the layers really run the head groups (at sp 1 too)
    ulysses.head_chunked_attention = lambda *a, **kw: grouped.append(kw["groups"].n) or real(*a, **kw)
    try:
        logits = model(input_ids=ids[:, cols], position_ids=pos[:, cols], use_cache=False).logits
        (logits * weight[:, cols]).sum().backward()
    finally:
        ulysses.head_chunked_attention = real
    ran = "block" if blocks is not None and blocks.calls else "core" if grouped else "none"
    assert set(grouped) <= {chunks} and ran == ("none" if chunks == 1 else scope), (grouped, ran)
    if ran == "block":  # every layer's block in forward, and again in the checkpoint's recompute
        assert blocks.calls == model.config.num_hidden_layers * (2 if ckpt else 1) and not blocks.skipped
    for p in model.parameters():  # each rank's share of the gradient, summed over the SP group
        dist.all_reduce(p.grad, group=mesh.sp_group)
    path = reg.attention.last_path
    reg.remove()
    assert all("forward" not in vars(m) for m in model.modules())  # the block wrappers undone
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}, cols, path


def _compare(sp, ring, heads, kv, chunks, packed, offload=False, ckpt=False):
    mesh = init_mesh((1, sp), ring_size=ring)
    ref = tiny_model("llama", heads=heads, kv_heads=kv, hidden=8 * heads)
    ids = global_batch(5, 1, sum(DOCS))
    docs = DOCS if packed else (sum(DOCS),)
    pos = torch.cat([torch.arange(n) for n in docs])[None]
    weight = torch.randn(1, ids.shape[1], ref.config.vocab_size, generator=torch.Generator().manual_seed(7))
    ref_logits, ref_loss = _reference(ref, ids, docs, weight)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    run = lambda n, scope: _sp_run(ref, mesh, sp, ring, n, ids, pos, weight, ckpt, scope,  # noqa: E731
                                   offload_attention=offload)  # fmt: skip
    plain_logits, plain_grads, cols, plain_path = run(1, "none")
    for scope in ("core",) if offload else ("block", "core"):  # Ulysses-Offload keeps the function-level groups
        logits, grads, _, path = run(chunks, scope)
        assert path == plain_path
        torch.testing.assert_close(logits, ref_logits[:, cols], rtol=1e-5, atol=1e-6)
        # the block sums the groups' o_proj partial outputs: fp32 rounding; the function-level groups: the same sums
        # (the same in float64 to 1e-15: checked when this was written); gradients within 1e-5 of their largest
        tol = dict(rtol=1e-5, atol=1e-6) if scope == "block" else dict(rtol=1e-6, atol=1e-7)
        cap = math.inf if scope == "block" else 1e-6
        torch.testing.assert_close(logits, plain_logits, **tol)
        assert_grads_close(grads, ref_grads, atol_cap=math.inf)  # (16 heads of 8: fp32 sums of other orders)
        assert_grads_close(grads, plain_grads, atol_cap=cap)
    return path


@pytest.mark.parametrize(
    "sp, ring, heads, kv, chunks, packed, offload, path, ckpt",
    [
        (2, 1, 8, 2, 4, False, False, "sdpa", False),  # GQA: a rank's 4 query heads share one kv head: K/V once
        (2, 1, 8, 2, 4, False, False, "sdpa", True),  # the same under activation checkpointing
        (2, 1, 4, 4, 2, True, False, "segments", False),  # MHA: K/V travel with each group; sdpa per document
        (4, 2, 4, 2, 2, True, False, "ring", False),  # hybrid: 2 Ulysses x 2 ring
        (2, 1, 4, 1, 2, True, True, "blockwise+offload", False),  # MQA, Ulysses-Offload
        (2, 1, 4, 1, 2, False, False, "sdpa", True),  # MQA below P: each rank's block computes the one kv head
        (2, 1, 16, 4, 2, True, False, "segments", True),  # a group of 4 query heads: exactly one kv head's
        # sp 1 (no exchange: each group's q/k/v are views): GQA 8:2 in 4 groups, two per kv head; packed, checkpointed
        (1, 1, 8, 2, 4, True, False, "segments", True),
    ],
)
def test_head_chunks_equal_unchunked_and_no_sp(pool, sp, ring, heads, kv, chunks, packed, offload, path, ckpt):
    assert set(pool.run(_compare, sp, sp, ring, heads, kv, chunks, packed, offload, ckpt)) == {path}


def _overlapped(sp, heads, kv, chunks, ckpt):
    """``head_chunk_overlap`` on the whole block per group (``attention/block_overlap.py``): every group's
    q/k/v exchange posted before the previous group's core, in forward and the checkpoint's recompute;
    per-position logits and every gradient bitwise those of the groups one at a time, and equal to no SP."""
    from ulysses_sp.attention import block_overlap

    mesh = init_mesh((1, sp))
    ref = tiny_model("llama", heads=heads, kv_heads=kv, hidden=8 * heads)
    ids, pos = global_batch(5, 1, sum(DOCS)), torch.cat([torch.arange(n) for n in DOCS])[None]
    weight = torch.randn(1, ids.shape[1], ref.config.vocab_size, generator=torch.Generator().manual_seed(7))
    ref_logits, ref_loss = _reference(ref, ids, DOCS, weight)
    ref_loss.backward()
    plain_logits, plain_grads, cols, _ = _sp_run(ref, mesh, sp, 1, chunks, ids, pos, weight, ckpt)
    posts, real = [], block_overlap.Deferred.post
    block_overlap.Deferred.post = lambda self, *a: posts.append(1) or real(self, *a)
    try:
        logits, grads, _, _ = _sp_run(ref, mesh, sp, 1, chunks, ids, pos, weight, ckpt, overlap=True)
    finally:
        block_overlap.Deferred.post = real
    assert len(posts) == ref.config.num_hidden_layers * chunks * (2 if ckpt else 1), len(posts)
    assert torch.equal(logits, plain_logits) and all(torch.equal(grads[n], plain_grads[n]) for n in grads)
    torch.testing.assert_close(logits, ref_logits[:, cols], rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, {n: p.grad for n, p in ref.named_parameters()}, atol_cap=math.inf)
    return True


@pytest.mark.parametrize("sp, heads, kv, chunks, ckpt", [(2, 8, 2, 4, True), (4, 8, 2, 2, False)])
def test_head_blocks_overlapped_exchange_bitwise_the_groups_in_turn_and_equal_no_sp(pool, sp, heads, kv, chunks, ckpt):
    """sp 2: GQA, 4 groups sharing kv heads, packed documents, checkpointed (the recompute overlapped too);
    sp 4: fewer kv heads than ranks (each rank's group block computes its kv head)."""
    assert pool.run(_overlapped, sp, sp, heads, kv, chunks, ckpt) == [True] * sp


def _block_peaks():
    """One layer whose attention dominates (8 heads of 64 dims on a 32-wide model), 1024 tokens at sp 1,
    checkpointed: the step's peak bytes (the library's meter) without groups, with 8 function-level groups
    and with 2, 4, 8 whole-block groups."""
    from models import tiny_config
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama", heads=8, kv_heads=8, hidden=32, layers=1)
    cfg.head_dim = 64
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    ids, peaks = global_batch(5, 1, 1024), {}
    for chunks, scope in [(1, "none"), (8, "core"), (2, "block"), (4, "block"), (8, "block")]:
        model = copy.deepcopy(ref)
        model.gradient_checkpointing_enable()
        model.train()
        reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 1, 1, mesh=init_mesh((1, 1)),
                                                              head_chunks=chunks)  # fmt: skip
        if scope == "core":
            reg.head_blocks.remove()
        with track_peak_memory("cpu") as mem:
            model.model(input_ids=ids, use_cache=False).last_hidden_state.sum().backward()
        peaks[(chunks, scope)] = mem.peak_bytes
        reg.remove()
    return peaks


def test_head_blocks_peak_falls_with_the_groups_below_the_function_level_groups(pool):
    """The whole block per group keeps one group's q/k/v, core and gradients: measured 17.3 MiB without
    groups, 15.1 with 8 function-level groups, 9.9 / 5.8 / 3.7 with 2 / 4 / 8 block groups."""
    peaks = pool.run(_block_peaks, 1)[0]
    none, core = peaks[(1, "none")], peaks[(8, "core")]
    blocks = [peaks[(n, "block")] for n in (2, 4, 8)]
    assert blocks[2] < blocks[1] < blocks[0] < core < none, peaks
    assert blocks[2] < 0.3 * none and blocks[0] < 0.65 * none, peaks


def _qk_norms_recomputed(chunks):
    """Qwen3 (q/k norms over ``head_dim``, shared by every head) with every RMSNorm recomputing in its own
    backward (``memory.norms``: the norm reads its weight again in backward, after the group's call): logits
    and every gradient against the model without SP."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ulysses_sp.memory.norms import apply_norm_recompute

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)  # fmt: skip
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)
    ids, weight = global_batch(5, 1, 32), torch.randn(1, 32, 64, generator=torch.Generator().manual_seed(7))
    (ref(input_ids=ids, use_cache=False).logits * weight).sum().backward()
    model = copy.deepcopy(ref)
    model.zero_grad()
    norms = apply_norm_recompute(model)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 1, 1, mesh=init_mesh((1, 1)), head_chunks=chunks)
    logits = model(input_ids=ids, use_cache=False).logits
    (logits * weight).sum().backward()
    assert reg.head_blocks.calls == 2 and not reg.head_blocks.skipped
    reg.remove()
    norms.remove()
    torch.testing.assert_close(logits, ref(input_ids=ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)
    assert_grads_close({n: p.grad for n, p in model.named_parameters()},
                       {n: p.grad for n, p in ref.named_parameters()}, atol_cap=math.inf)  # fmt: skip
    return True


def test_head_blocks_with_qk_norms_that_recompute_in_backward_equal_no_sp(pool):
    assert pool.run(_qk_norms_recomputed, 1, 4) == [True]


def test_head_block_layout_cuts_per_head_and_names_what_it_cannot():
    from transformers.models.llama.modeling_llama import LlamaAttention

    from ulysses_sp.attention.head_blocks import (
        COLS_Q,
        FIRST,
        ROWS_KV,
        ROWS_Q,
        group_heads,
        head_block_layout,
    )

    cfg = tiny_model("llama", heads=8, kv_heads=2, hidden=64).config
    cfg.attention_bias = True
    layout = head_block_layout(LlamaAttention(cfg, 0))
    assert dict(zip(layout.names, layout.cuts)) == {
        "q_proj.weight": ROWS_Q, "q_proj.bias": ROWS_Q, "k_proj.weight": ROWS_KV, "k_proj.bias": ROWS_KV,
        "v_proj.weight": ROWS_KV, "v_proj.bias": ROWS_KV, "o_proj.weight": COLS_Q, "o_proj.bias": FIRST}  # fmt: skip
    assert (layout.heads, layout.kv_heads, layout.head_dim) == (8, 2, 8)
    # 8 query heads over 2 Ulysses ranks (4 each) in 2 groups: group 1 holds heads 2, 3 (rank 0's) and 6, 7
    # (rank 1's), and the kv heads they use, one per rank: 0 and 1
    assert group_heads(8, 2, 2, 2, 1) == ([2, 3, 6, 7], [0, 1])
    assert group_heads(4, 1, 2, 2, 0) == ([0, 2], [0, 0])  # MQA below P: each rank's set holds the one kv head
    gated = LlamaAttention(cfg, 0)
    gated.q_proj = torch.nn.Linear(64, 2 * 64)  # [q, gate] per head: o_proj takes half of it
    assert "q_proj gives 128 features and o_proj takes 64" in head_block_layout(gated)
    norm = LlamaAttention(cfg, 0)
    norm.q_norm = torch.nn.LayerNorm(64)  # a norm over every head's width is not per head
    assert "parameter q_norm.weight (64,) is not per head" in head_block_layout(norm)


def _function_level(chunks):
    """``head_chunked_attention`` around sdpa against exchange-sdpa-exchange; overlap on/off; peak memory."""
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(1, n, 256, 16, generator=g, dtype=torch.float64) for n in (16, 8, 8))
    dout = torch.randn(1, 256, 16, 16, generator=g, dtype=torch.float64)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)  # noqa: E731

    def plain(q, k, v):
        return heads_to_seq(sdpa(*qkv_seq_to_heads(q, k, v, group)), group, head_dim=2, seq_dim=1)

    def attend(i, q, k, v):
        return sdpa(q, k, v)

    results = {}
    for name, fn in [("plain", plain)] + [
        (f"overlap={o}", lambda q, k, v, o=o: head_chunked_attention(
            q, k, v, attend=attend, groups=plan_head_chunks(16, 8, chunks, 2), group=group, overlap=o))
        for o in (True, False)
    ]:  # fmt: skip
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with track_peak_memory("cpu", include=leaves) as mem:
            out = fn(*(t * 1 for t in leaves))  # non-leaf inputs, as a model's q/k/v
            out.backward(dout)
        results[name] = (out.detach(), *(t.grad for t in leaves), mem.peak_bytes)
    for a, b in zip(results["overlap=True"][:4], results["plain"][:4]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    for a, b in zip(results["overlap=True"][:4], results["overlap=False"][:4]):
        assert torch.equal(a, b)
    return {name: r[4] for name, r in results.items()}


def test_head_chunks_function_exact_overlap_bitwise_and_peak_falls(pool):
    peaks = {n: pool.run(_function_level, 2, n)[0] for n in (2, 8)}
    plain = min(p["plain"] for p in peaks.values())  # (gloo's thread may free a buffer late: the lowest)
    # 8 groups one at a time: a fifth below the all-heads exchange; overlap keeps a second group's
    # exchange alive; 2 groups barely gain (the saved inputs and dk/dv are not chunked)
    assert peaks[8]["overlap=False"] < peaks[8]["overlap=True"] < plain, peaks
    assert peaks[8]["overlap=False"] < 0.85 * plain, peaks
    assert peaks[8]["overlap=False"] < peaks[2]["overlap=False"], peaks


def _eager(q, k, v):
    """Causal attention as matmuls, ``[B, H, S, D] -> [B, S, H, D]``: autograd keeps ``[B, H, S, S]`` scores."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1)
    return (scores.masked_fill(causal, float("-inf")).softmax(-1) @ v).transpose(1, 2)


def test_head_chunks_at_sp1_exact_in_process_and_one_group_alive():
    """``group=None`` (one rank): the groups in turn over views of q/k/v, no process group; equal to the
    core over all heads (sdpa and matmuls; GQA, groups sharing a kv head and groups of several kv heads),
    overlap the same bits; the peak falls with the groups (the matmul core keeps a group's scores)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 128, 16, generator=g, dtype=torch.float64) for n in (8, 2, 2))
    dout = torch.randn(1, 128, 8, 16, generator=g, dtype=torch.float64)
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)  # noqa: E731
    results = {}
    for core in (sdpa, _eager):
        for chunks, overlap in [(1, False), (2, False), (8, False), (8, True)]:
            fn = core if chunks == 1 else lambda q, k, v, n=chunks, o=overlap, c=core: head_chunked_attention(
                q, k, v, attend=lambda i, q, k, v: c(q, k, v), groups=plan_head_chunks(8, 2, n, 1), group=None,
                overlap=o)  # fmt: skip
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            with track_peak_memory("cpu", include=leaves) as mem:
                out = fn(*(t * 1 for t in leaves))  # non-leaf inputs, as a model's q/k/v (dq reuses q's storage)
                out.backward(dout)
            results[(core, chunks, overlap)] = (out.detach(), *(t.grad for t in leaves)), mem.peak_bytes
        for key in [(core, 2, False), (core, 8, False)]:
            for a, b in zip(results[key][0], results[(core, 1, False)][0]):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
        assert all(torch.equal(a, b) for a, b in zip(results[(core, 8, True)][0], results[(core, 8, False)][0]))
    peaks = [results[(_eager, n, False)][1] for n in (1, 2, 8)]
    assert peaks[2] < peaks[1] < peaks[0] and peaks[2] < 0.5 * peaks[0], peaks
    with pytest.raises(ValueError, match="no group for 2 Ulysses ranks"):
        head_chunked_attention(q, k, v, attend=lambda i, q, k, v: sdpa(q, k, v), groups=plan_head_chunks(8, 2, 2, 2),
                               group=None)  # fmt: skip


@pytest.mark.parametrize("fake", [False, True])
def test_head_chunks_dq_reuses_q_storage_on_fake_tensors_too(fake):
    """dq is written into q's own storage, and the rehearsal (fake tensors, whose data pointers are all 0)
    must see that too, or it counts one more ``[B, H, S, D]`` per layer than a GPU holds."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() if fake else contextlib.nullcontext():
        leaf, k, v = (torch.randn(1, n, 64, 16, requires_grad=True) for n in (8, 2, 2))
        q, seen = leaf * 1, []
        q.register_hook(lambda g: seen.append(g.untyped_storage()._cdata == q.untyped_storage()._cdata))
        sdpa = lambda i, q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
        attend = lambda i, q, k, v: sdpa(i, q, k, v).transpose(1, 2)  # noqa: E731
        head_chunked_attention(q, k, v, attend=attend, groups=plan_head_chunks(8, 2, 4, 1), group=None).sum().backward()
    assert seen == [True]


def test_head_chunks_at_sp1_checked_and_refused_where_they_would_change_nothing():
    from vlm_models import tiny_vlm

    from ulysses_sp.run.config import RunConfig
    from ulysses_sp.run.model_checks import check_model_run

    llama = tiny_model("llama", heads=8, kv_heads=2, hidden=64)
    check_model_run(RunConfig(sp=1, head_chunks=4), llama.config, ring_size=1, model=llama)  # accepted at sp 1
    with pytest.raises(ValueError, match=r"--head-chunks 3: head_chunks 3: .* valid head_chunks for 8 query / 2 kv "
                       r"heads over 1 Ulysses ranks: \[1, 2, 4, 8\]"):  # fmt: skip
        check_model_run(RunConfig(sp=1, head_chunks=3), llama.config, ring_size=1, model=llama)
    vlm = tiny_vlm("qwen2_5_vl")  # at sp 1 a VLM keeps transformers' attention: a silent no-op is refused
    with pytest.raises(ValueError, match=r"--head-chunks 2: at --sp 1 .* transformers' own attention.*drop"):
        check_model_run(RunConfig(sp=1, head_chunks=2), vlm.config, ring_size=1, model=vlm)


def test_plan_head_chunks():
    # 8 heads over 2 ranks in 2 groups: 2 query heads and their 2 kv heads (MHA) of each rank per group
    assert plan_head_chunks(8, 8, 2, 2) == HeadGroups(n=2, p=2, hc=2, span=1, kvs=2, repeat=1)
    # GQA 16:4 over 2 ranks in 8 groups: a rank's 2 kv heads each serve 4 query heads, i.e. 4 groups
    assert plan_head_chunks(16, 4, 8, 2) == HeadGroups(n=8, p=2, hc=1, span=4, kvs=1, repeat=1)
    # MQA below P: the kv head replicated, one set for every group
    assert plan_head_chunks(4, 1, 2, 2) == HeadGroups(n=2, p=2, hc=1, span=2, kvs=1, repeat=2)
    assert valid_head_chunks(8, 8, 2) == [1, 2, 4]
    assert valid_head_chunks(12, 4, 2) == [1, 2, 6]  # a rank's 6 heads, 3 per kv head: 4 would split one
    with pytest.raises(ValueError, match=r"head_chunks 3: each rank's 4 query heads .* not divisible.*\[1, 2, 4\]"):
        plan_head_chunks(8, 8, 3, 2)
    with pytest.raises(ValueError, match=r"would split a set of 3 query heads sharing a kv head"):
        plan_head_chunks(12, 4, 3, 2)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="head_chunks must be a positive number"):
            plan_head_chunks(8, 8, bad, 2)
    module = torch.nn.Module()
    module.sinks = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(ValueError, match="attention sinks"):
        check_no_sinks(module, {}, 2)


def test_planner_exchange_buffers_scale_by_head_chunks():
    from dataclasses import replace

    from ulysses_sp.plan.hardware import DEVICES
    from ulysses_sp.plan.inputs import LLAMA_8B, Settings
    from ulysses_sp.plan.model import max_seq_len, predict

    hw = DEVICES["h100"]
    # fp32 on the CPU (its terms: CUDA's are read off the rehearsal, below): the attention backward is the
    # layer's peak, not the norms' fp32 copies
    s = Settings(seq_len=1 << 20, sp=8, dp=1, zero_stage=3, partition="all", dtype="fp32", tiled_mlp=True,
                 tiled_loss=True, activation_checkpointing=True, offload_activations=True, device_type="cpu")  # fmt: skip
    s = replace(s, head_blocks=False)  # the function-level groups (the whole block per group: below)
    one, two = predict(LLAMA_8B, s, hw), predict(LLAMA_8B, replace(s, head_chunks=2), hw)
    tok, q = s.seq_len // s.sp, LLAMA_8B.heads * LLAMA_8B.head_dim
    # the backward's send + receive buffers of q, 2 q per token in fp32: half of them with 2 head groups
    # (the saving stops where the MLP's backward becomes the layer's peak)
    assert 0 < one.breakdown["backward_workspace"] - two.breakdown["backward_workspace"] <= 2 * q * tok * 4 // 2
    assert two.step_s > one.step_s  # one more q/k/v exchange and attention forward per layer
    assert max_seq_len(LLAMA_8B, replace(s, head_chunks=2), hw) > max_seq_len(LLAMA_8B, s, hw)
    # on CUDA the flash backward's in-kernel workspace (fp32 dq accumulator, GQA-expanded dk/dv) is per
    # kernel call: each head group's call holds its share
    from ulysses_sp.plan.attention import attention_terms

    cuda = replace(s, dtype="bf16", device_type="cuda")
    core = [attention_terms(LLAMA_8B, replace(cuda, head_chunks=n), hw, 0).core for n in (1, 2, 4)]
    assert core[0] > core[1] > core[2] > 4 * q + 4 * LLAMA_8B.kv_heads * LLAMA_8B.head_dim
    # the whole block per group: the layer keeps the block's input only, and the core's set is one
    # group's (the terms read off 2-layer rehearsals: planner / rehearsal 1.004-1.013 at sp 1 and 8)
    blocks = replace(cuda, head_blocks=True)
    terms = [attention_terms(LLAMA_8B, replace(blocks, head_chunks=n), hw, 0) for n in (2, 4)]
    assert terms[0].saved == terms[1].saved == LLAMA_8B.hidden and terms[1].core < terms[0].core
    # --head-chunk-overlap: a second group's send/receive buffers, its output buffer and one output exchange
    from ulysses_sp.plan.attention import block_groups

    over = attention_terms(LLAMA_8B, replace(blocks, head_chunks=4, head_overlap=True), hw, 0)
    gq, gkv = block_groups(LLAMA_8B, replace(blocks, head_chunks=4))
    assert over.recompute - terms[1].recompute == 7 * gq + 6 * gkv and over.workspace == terms[1].workspace
    assert attention_terms(LLAMA_8B, replace(blocks, sp=1, head_chunks=4, head_overlap=True), hw, 0) == \
        attention_terms(LLAMA_8B, replace(blocks, sp=1, head_chunks=4), hw, 0)  # sp 1: no exchange to overlap
    grouped = [predict(LLAMA_8B, replace(cuda, head_chunks=4, head_blocks=b), hw).peak_bytes for b in (False, True)]
    assert grouped[1] < grouped[0], grouped
    one_gpu = replace(blocks, sp=1, head_chunks=8, offload_states=True, recompute_norms=True)
    assert max_seq_len(LLAMA_8B, one_gpu, hw) > 1.2 * max_seq_len(LLAMA_8B, replace(one_gpu, head_blocks=False), hw)


def test_overlapped_o_proj_waits_for_the_attention_output_and_refuses_a_changed_one():
    """Overlapped, a group's ``o_proj`` records its product on the buffer the attention handed out (run when
    the output has landed) and refuses an input that is not that buffer (the module changed it)."""
    from types import SimpleNamespace

    from ulysses_sp.attention.group_proj import GroupProj

    linear, out = torch.nn.Linear(8, 6), torch.zeros(1, 3, 6)
    buf = torch.empty(1, 3, 2, 2)  # [B, S_l, H_g, D]: empty until the output lands
    defer = SimpleNamespace(buffer=buf, then=None)
    proj = GroupProj(linear, "o_proj", torch.tensor([4, 5, 6, 7]), out=out, grads=None, first=True, defer=defer)
    proj(buf.reshape(1, 3, 4))
    assert defer.then is not None and not out.any()  # nothing read from the buffer yet
    buf.copy_(torch.randn(1, 3, 2, 2))
    defer.then()
    torch.testing.assert_close(out, linear(torch.cat([torch.zeros(1, 3, 4), buf.reshape(1, 3, 4)], -1)))
    with pytest.raises(ValueError, match="changes its attention output before o_proj.*turn head_chunk_overlap off"):
        proj(buf.reshape(1, 3, 4) * 2)


def test_head_chunk_overlap_flag_taken_and_refused_where_it_has_nothing_to_overlap():
    from ulysses_sp.cli.args import build_parser
    from ulysses_sp.run.checks import check_train_options
    from ulysses_sp.run.config import RunConfig

    assert build_parser().parse_args(["train", "--head-chunk-overlap"]).head_chunk_overlap is True
    check_train_options(RunConfig(sp=2, head_chunks=2, head_chunk_overlap=True))
    for sp, chunks in ((2, 1), (1, 2)):
        with pytest.raises(ValueError, match=rf"--head-chunk-overlap .* needs --head-chunks > 1 \(got {chunks}\) and "
                                             rf"--sp > 1 \(got {sp}, no exchange at 1\)"):  # fmt: skip
            check_train_options(RunConfig(sp=sp, head_chunks=chunks, head_chunk_overlap=True))


def test_rehearsal_time_projects_the_exchange_hidden_behind_the_core_under_overlap():
    """``rehearse.timing``: under overlap the forward passes' exchanges (2 of 4 with checkpointing) but each
    pass's first in and last out (1 of N) hide, up to the overlapped passes' attention cores (2 of 3)."""
    from types import SimpleNamespace

    from ulysses_sp.plan.hardware import DEVICES, link_gbps
    from ulysses_sp.rehearse.timing import project

    hw = DEVICES["h100"]
    a2a_bytes, second = 8e9, hw.tflops["bf16"] * 1e12 * hw.mfu  # FLOPs of one second
    a2a = a2a_bytes / (link_gbps(hw, 8) * 1e9)
    kw = dict(dtype="bf16", sp=8, shard_group=8, tokens=1 << 16, head_groups=4, checkpointed=True)
    for core_s, hidden in ((100 * a2a, a2a * 2 / 4 * 3 / 4), (a2a / 100, a2a / 100 * 2 / 3)):
        result = SimpleNamespace(flops=int(200 * a2a * second), attention_forward_flops=int(core_s * second),
                                 collectives={"alltoall_base": {"bytes": a2a_bytes}}, host_traffic={})  # fmt: skip
        plain, over = project(result, hw, **kw), project(result, hw, **kw, head_overlap=True)
        assert plain.all_to_all_hidden_s == 0 and plain.all_to_all_s == pytest.approx(a2a)
        assert over.all_to_all_hidden_s == pytest.approx(hidden, rel=1e-6)
        assert over.step_s == pytest.approx(plain.step_s - hidden) and over.all_to_all_hidden_fraction == pytest.approx(hidden / a2a)


def _register_refused(chunks):
    model = tiny_model("llama", heads=4, kv_heads=2)
    with pytest.raises(ValueError, match=rf"head_chunks {chunks}: .*valid head_chunks for 4 query / 2 kv heads over 2 "
                       r"Ulysses ranks: \[1, 2\]"):  # fmt: skip
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, mesh=init_mesh((1, 2)), head_chunks=chunks)


def test_bad_head_chunks_refused_at_registration_and_by_the_cli(pool):
    from dataclasses import replace

    from ulysses_sp.cli.args import build_parser, train_options
    from ulysses_sp.run.checks import check_train_options

    pool.run(_register_refused, 2, 4)  # a rank's 2 query heads cannot make 4 groups
    cfg, _ = train_options(build_parser().parse_args(["train", "--head-chunks", "2"]))
    assert cfg.head_chunks == 2
    check_train_options(cfg)
    with pytest.raises(ValueError, match="--head-chunks must be >= 1, got 0"):
        check_train_options(replace(cfg, head_chunks=0))
