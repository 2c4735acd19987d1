"""Attention families with per-head or per-layer structure, sequence-parallel vs no SP (issue 22).

Attention sinks (gpt-oss, MiMo-V2-Flash: one learned logit per query head, sliced to each rank's
heads, also with fewer kv heads than ranks), chunked attention and the token-index query temperature
(Llama 4 text), and the position contract (packed documents whose boundaries fall on the shard edges
are valid data; a model called without ``position_ids`` or not attached is refused). Every case
compares each rank's per-position logits and every parameter gradient with the same model run
without SP (fp32, weights at std 0.2), or, where transformers' own no-SP model ignores packed
position ids (gpt-oss builds its masks without them), with every document run on its own.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from family_models import family_model
from models import global_batch, shift, tiny_model
from oracle import assert_step_close

from ulysses_sp.attention.blockwise import AttnStructure, blockwise_attention
from ulysses_sp.attention.checks import check_head_chunk_sinks
from ulysses_sp.attention.core import generic_eager, run_ring
from ulysses_sp.attention.head_blocks import head_block_layout
from ulysses_sp.attention.heads import apply_sinks, local_view
from ulysses_sp.attention.indexed import IndexedStructure
from ulysses_sp.attention.layer_kinds import check_layer_kinds
from ulysses_sp.attention.positions import capture_call, split_at_chunks
from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.parallel.loss import sp_causal_lm_loss
from ulysses_sp.parallel.mesh import init_mesh

S = 32
DOCS = (5, 7, 4, 9, 7)  # boundaries inside shards at sp 2 and 4
V4_DOCS = (2, 9, 4, 11, 6)  # DeepSeek-V4 (rates 3, 5): 2 and 4 shorter than a window; 2-11, 15-26 cross edges


def _positions(kind: str, sp: int) -> torch.Tensor:
    if kind == "plain":
        return torch.arange(S)[None]
    if kind == "docs":
        return torch.cat([torch.arange(n) for n in DOCS])[None]
    if kind == "v4docs":
        return torch.cat([torch.arange(n) for n in V4_DOCS])[None]
    return torch.arange(S // sp).repeat(1, sp)  # "edges": one document per shard, 0..S_l-1 on every rank


def _reference(ref, ids, pos, labels, oracle):
    """No-SP logits ``[1, S, V]`` and the token-mean loss: the packed call, or each document alone."""
    if oracle == "model":
        logits = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
    else:
        starts = (pos[0] == 0).nonzero().flatten().tolist() + [S]
        logits = torch.cat(
            [ref(input_ids=ids[:, a:b], use_cache=False).logits for a, b in zip(starts, starts[1:])], 1
        )
    return logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


FP64 = {"deepseek_v4": torch.float64}
"""Families compared in float64: DeepSeek-V4's hyper-connection head bias gradient is a sum over tokens that
cancels to ~1e-3 of its terms, so fp32 rounding alone reaches rtol 1e-4 there (every other gradient agrees)."""


def _cases(sp, cases):
    mesh = init_mesh((1, sp))
    done = []
    for family, core, kv, kind, oracle, *chunks in cases:  # (head groups: the whole block per group)
        build = tiny_model if family == "llama" else family_model
        ref = (
            build(family, attn="eager", kv_heads=kv)
            if family == "llama"
            else build(family, num_key_value_heads=kv)
        )
        if family in FP64:  # grouped_mm has no float64 kernel: the experts' eager loop
            ref = ref.to(FP64[family])
            ref.set_experts_implementation("eager")
        model = copy.deepcopy(ref)
        n = chunks[0] if chunks else 1
        if n > 1:
            check_head_chunk_sinks(model, n)  # the launcher's check: the block cuts the sinks
        reg = UlyssesSPAttentionHF.register_with_transformers(model, core, sp, 1, mesh=mesh, head_chunks=n)
        ids, pos = global_batch(3, 1, S), _positions(kind, sp)
        labels = shift(ids)
        labels[0, :-1][pos[0, 1:] == 0] = -100  # no label across a document boundary
        ref_logits, ref_loss = _reference(ref, ids, pos, labels, oracle)
        ref_loss.backward()
        cols = slice(mesh.sp_rank * S // sp, (mesh.sp_rank + 1) * S // sp)
        out = model(input_ids=ids[:, cols], position_ids=pos[:, cols], use_cache=False)
        loss = sp_causal_lm_loss(out.logits, labels[:, cols], mesh.sp_group)
        loss.backward()
        for name, p in model.named_parameters():
            if ".indexer." in name:  # DSA's indexer runs under no_grad: no gradient, with or without SP
                assert p.grad is None and dict(ref.named_parameters())[name].grad is None, name
                continue
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad  # an expert no local token picked
            dist.all_reduce(p.grad)
        case = (family, core, kv, kind)
        torch.testing.assert_close(
            out.logits, ref_logits[:, cols], rtol=1e-5, atol=1e-5, msg=lambda m, c=case: f"{c}: {m}"
        )
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if ".indexer." not in n}
        grads = {n: p.grad for n, p in model.named_parameters() if ".indexer." not in n}
        assert_step_close(loss.detach().to(ref_loss.dtype), grads, ref_loss.detach(), ref_grads)
        # with head groups: every group's block in forward and again in backward; MLA (no q/k/v/o projections):
        # the function-level head groups (one call per layer)
        blocks = n > 1 and not isinstance(head_block_layout(model.model.layers[0].self_attn), str)
        assert reg.attention.calls == model.config.num_hidden_layers * (2 * n if blocks else 1)
        assert not blocks or (reg.head_blocks.calls == model.config.num_hidden_layers and not reg.head_blocks.skipped)
        reg.remove()
        assert not any("forward" in m.__dict__ or m._forward_pre_hooks for m in model.modules())  # indexers undone
        done.append(case)
    return done


SP2 = [
    ("gpt_oss", "eager", 2, "plain", "model"),  # sinks, sliding + full layers
    ("gpt_oss", "sdpa", 2, "docs", "documents"),  # sinks through the blockwise core, documents + window
    ("gpt_oss", "sdpa", 2, "docs", "documents", 2),  # the same, the attention block per head group: sinks cut
    ("mimo_v2_flash", "sdpa", 2, "plain", "model"),  # sinks in the sliding layer only
    ("llama4_text", "sdpa", 2, "docs", "documents"),  # chunks + documents + NoPE temperature (per document)
    ("llama4_text", "eager", 2, "edges", "documents"),  # documents exactly on the shard edges
    ("llama", "sdpa", 4, "edges", "documents"),
    ("longcat_flash", "sdpa", 4, "plain", "model"),  # MLA twice per layer, identity experts
]
SP4 = [
    ("gpt_oss", "eager", 2, "docs", "documents"),  # kv heads 2 < sp 4: replicated, sinks per query head
    ("gpt_oss", "sdpa", 2, "plain", "model"),
    ("llama4_text", "eager", 2, "docs", "documents"),
]  # fmt: skip


@pytest.mark.parametrize("sp, cases", [(2, SP2), (4, SP4)], ids=["sp2", "sp4"])
def test_sinks_chunks_and_shard_edge_documents_equal_no_sp(pool, sp, cases):
    assert pool.run(_cases, sp, sp, cases)[0] == [c[:4] for c in cases]


def _unattached_refused(mesh) -> list[str]:
    """A model pointed at the SP attention but never attached: refused naming why; attached: runs."""
    ids, pos = global_batch(3, 1, S)[:, :16], torch.arange(16)[None] + 16 * mesh.sp_rank
    found = []
    reg = UlyssesSPAttentionHF.register_with_transformers(tiny_model("llama"), "sdpa", 2, 1, mesh=mesh)
    for attach in (False, True):
        other = tiny_model("llama", attn="sdpa")
        other.set_attn_implementation("ulysses_sp")
        if attach:
            reg.attach(other)
        try:
            other(input_ids=ids, position_ids=pos)
            found.append("ran")
        except ValueError as e:
            found.append(str(e))
    reg.remove()
    return found


def test_unattached_model_is_refused_and_ring_refuses_sinks_naming_why(pool):
    for unseen, attached in pool.run(_checked_refusals, 2):
        assert "in a model whose call it did not see" in unseen and "mpu.attach(model)" in unseen
        assert attached == "ran"
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"attention sinks .* ring attention merges K/V chunks without them"):
        run_ring(torch.nn.Module(), q, q, q, AttnStructure(), {"s_aux": torch.zeros(2)}, group=None, chunk=None,
                 counts=None)  # fmt: skip


def _checked_refusals():
    return _unattached_refused(init_mesh((1, 2)))


@pytest.mark.parametrize("kv", [1, 2, 4])
def test_blockwise_with_sinks_equals_eager_softmax_with_a_sink_column(kv):
    g = torch.Generator().manual_seed(kv)
    q = torch.randn(2, 4, 24, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, kv, 24, 8, generator=g, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, generator=g, requires_grad=True)
    docs = torch.tensor([[0] * 9 + [1] * 15])
    structure = AttnStructure.build(docs, 6)
    got = apply_sinks(*blockwise_attention(q, k, v, structure=structure, chunk=5, return_lse=True), sinks)
    i = torch.arange(24)
    allowed = (i[None] <= i[:, None]) & (i[:, None] - i[None] < 6) & (docs[0][:, None] == docs[0][None])
    mask = torch.where(allowed, 0.0, float("-inf"))
    module = torch.nn.Module()
    want, _ = generic_eager(module, q, k, v, mask, scaling=8**-0.5, s_aux=sinks)
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=1e-5, atol=1e-6)
    w = torch.randn(want.shape, generator=g)
    grads = [torch.autograd.grad((t * w).sum(), (q, k, v, sinks)) for t in (got.transpose(1, 2), want)]
    for a, b in zip(*grads):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_blockwise_over_picked_keys_equals_a_dense_mask_of_the_picks():
    """DSA's picks in the blockwise core (``attention/indexed.py``): picked, causal and in-document keys only;
    ``-1`` (a short document's padding) and picks of future or other-document keys count for nothing."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 24, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 24, 8, generator=g, requires_grad=True) for _ in range(2))
    picks = torch.randint(0, 24, (2, 24, 5), generator=g, dtype=torch.int32)
    picks[:, :, 0], picks[:, :, -1] = torch.arange(24, dtype=torch.int32), -1  # itself; a padding slot
    docs = torch.tensor([[0] * 9 + [1] * 15])
    packed = []  # the picks are saved through autograd (activation checkpointing drops them), not held by the core
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        structure = IndexedStructure.of(AttnStructure.build(docs, None), picks)
        got = blockwise_attention(q, k, v, structure=structure, chunk=5)
    assert any(t is picks for t in packed)
    picked = torch.zeros(2, 24, 25, dtype=torch.bool).scatter_(-1, torch.where(picks < 0, 24, picks).long(), True)
    i = torch.arange(24)
    allowed = picked[..., :24] & (i[None] <= i[:, None]) & (docs[0][:, None] == docs[0][None])  # [2, 24, 24]
    assert allowed.sum(-1).min() >= 1 and (allowed.sum(-1) < (i + 1)).any()  # the picks leave keys out
    want, _ = generic_eager(torch.nn.Module(), q, k, v, torch.where(allowed[:, None], 0.0, float("-inf")),
                            scaling=8**-0.5)  # fmt: skip
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=1e-5, atol=1e-6)
    w = torch.randn(want.shape, generator=g)
    for a, b in zip(*[torch.autograd.grad((t * w).sum(), (q, k, v)) for t in (got.transpose(1, 2), want)]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_chunk_segments_restart_at_documents_and_chunk_multiples():
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6]])
    assert split_at_chunks(pos, 3).tolist() == [[0, 1, 2, 0, 1, 2, 0, 0, 1, 2, 0, 1, 2, 0]]
    assert split_at_chunks(torch.arange(5)[None] + 4, 4).tolist() == [[0, 1, 2, 3, 0]]


def test_call_capture_sees_keyword_and_positional_position_ids():
    model = tiny_model("llama")
    pos = torch.arange(4)[None]
    assert capture_call(model, (), {"position_ids": pos}).tensor() is pos
    assert capture_call(model, (torch.zeros(1, 4, dtype=torch.long), None, pos), {}).tensor() is pos
    assert not capture_call(model, (), {"input_ids": pos}).given


def test_deepseek_v4_pooled_kinds_are_accepted_without_a_ring_and_refused_with_one():
    from transformers import AutoConfig

    from ulysses_sp.attention.checks import check_sp_attention

    config = AutoConfig.for_model("deepseek_v4", num_hidden_layers=2, num_attention_heads=4,
                                  layer_types=["heavily_compressed_attention", "compressed_sparse_attention"])  # fmt: skip
    check_layer_kinds(config, 2)
    for core in ("sdpa", "eager"):
        assert check_sp_attention(config, core, 2) == 1  # local queries: attention/pooled_core.py
    with pytest.raises(ValueError, match=r"\['compressed_sparse_attention', 'heavily_compressed_attention'\] layers "
                       r"attend each rank's own queries.*got ring_size 2 \(zigzag shards\)"):  # fmt: skip
        check_sp_attention(config, "sdpa", 4, ring_size=2)


INDEXED = {
    "deepseek_v32": ({}, "top 2048 keys"),
    "glm_moe_dsa": ({}, "top 2048 keys"),
    "qwen4_exp_text": (dict(layer_types=["linear_attention", "indexed_attention"], indexer_budget=64,
                            indexer_compress_ratio=4, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, head_dim=16),
                       r"best key blocks \(64 tokens\)"),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(INDEXED))
def test_dsa_indexed_attention_is_accepted_on_sdpa_and_eager_without_a_ring(family):
    from transformers import AutoConfig

    from ulysses_sp.attention.checks import check_sp_attention

    overrides, picked = INDEXED[family]
    config = AutoConfig.for_model(family, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                  **overrides)  # fmt: skip
    for core in ("sdpa", "eager"):
        assert check_sp_attention(config, core, 2) == 1  # DSA / QSA: exact under SP (attention/indexer.py)
    for core, ring in (("flex_attention", None), ("sdpa", 2)):
        with pytest.raises(ValueError, match=rf"'indexed_attention' layers attend to each query's {picked}.*"
                           rf"got core '{core}', ring_size {ring or 1}"):  # fmt: skip
            check_sp_attention(config, core, 2, ring_size=ring)


def test_local_view_slices_sinks_to_the_rank_heads_and_refuses_per_query_inputs():
    module = torch.nn.Module()
    module.sinks = torch.nn.Parameter(torch.arange(8.0))
    kwargs = {"s_aux": module.sinks}
    view = local_view(module, kwargs, num_heads=8, local_heads=2, local_kv_heads=1, rank=2)
    assert view.sinks.tolist() == kwargs["s_aux"].tolist() == [4.0, 5.0]
    assert view.num_key_value_groups == 2 and not hasattr(module, "num_key_value_groups")
    (view.sinks * 3).sum().backward()
    assert module.sinks.grad.tolist() == [0, 0, 0, 0, 3, 3, 0, 0]  # full shape: the SP sum fills the rest
    with pytest.raises(
        ValueError, match=r"per-query 'sinks' of shape \(1, 8, 4, 1\), computed from this rank's shard"
    ):
        local_view(
            module, {"sinks": torch.zeros(1, 8, 4, 1)}, num_heads=8, local_heads=2, local_kv_heads=1, rank=0
        )


def _sp1_packed_gap(family: str) -> tuple[float, float]:
    """Max logit gap between a packed row and its documents run alone: the model's own forward, and
    the SP attention ``train`` registers at sp 1 (``run.model_checks.sp_attention_wanted``)."""
    from ulysses_sp.parallel.doc_layout import attach_layout, host_layout
    from ulysses_sp.run.config import config_from_dict
    from ulysses_sp.run.model_checks import sp_attention_wanted

    model = family_model(family, num_key_value_heads=2).eval()
    assert sp_attention_wanted(config_from_dict({"model": "tiny-llama", "sp": 1}), model.config)
    lens, starts = [10, 12, 10], [0, 10, 22]
    ids = torch.randint(0, 64, (1, sum(lens)), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in lens])[None]

    def logits(i: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=i, position_ids=p).logits

    alone = torch.cat([logits(ids[:, a : a + n], pos[:, a : a + n]) for a, n in zip(starts, lens)], 1)
    own = (logits(ids, pos) - alone).abs().max().item()
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "eager", 1, 1, mesh=init_mesh(sp_size=1))
    try:
        sp = (logits(ids, attach_layout(pos.clone(), host_layout(pos))) - alone).abs().max().item()
    finally:
        reg.remove()
    return own, sp


def test_packed_documents_stay_apart_at_sp1_where_the_model_s_own_forward_leaks(pool):
    """Issue 32: gpt-oss's own forward lets packed documents attend across each other (a packed row's
    logits differ from each document's alone); ``train`` at sp 1 runs the SP attention, which keeps
    them apart as at sp > 1."""
    own, sp = pool.run(_sp1_packed_gap, 1, "gpt_oss")[0]
    assert own > 0.1 and sp < 1e-4, (own, sp)


DSA_SP2 = [
    ("deepseek_v32", "sdpa", 4, "plain", "model"),  # top 4 of up to 32 keys: the picks decide the logits
    ("glm_moe_dsa", "eager", 4, "docs", "documents"),  # picks within each document; layer 1 reuses layer 0's
    ("deepseek_v32", "sdpa", 4, "docs", "documents", 2),  # the attention in two head groups: picks gathered once
]
DSA_SP4 = [("deepseek_v32", "sdpa", 4, "docs", "documents"), ("glm_moe_dsa", "sdpa", 4, "plain", "model")]
QSA_SP2 = [("qwen4_exp_text", "sdpa", 2, "plain", "model")]  # the block of tokens 15-17 straddles the shard edge
QSA_SP4 = [("qwen4_exp_text", "eager", 2, "docs", "documents")]  # blocks from each document's first token; 22-24


@pytest.mark.parametrize("sp, cases", [(2, DSA_SP2 + QSA_SP2), (4, DSA_SP4 + QSA_SP4)], ids=["sp2", "sp4"])
def test_dsa_indexed_attention_equals_no_sp(pool, sp, cases):
    """DeepSeek Sparse Attention (issue 36): each query's top-k over the whole sequence (the indexer's
    keys gathered), the attention over those keys only; per-position logits and every gradient. Qwen4-Exp's
    QSA (``attention/block_indexer.py``): each query's best key blocks over the whole sequence."""
    assert pool.run(_cases, sp, sp, cases)[0] == [c[:4] for c in cases]


def _qsa_reads_and_gap(family: str = "qwen4_exp_text", kind: str = "docs") -> tuple[list[str], float]:
    """Qwen4-Exp's QSA (or ``family``) at sp 1 through the SP attention with the adapter's host layout: the host
    reads of its forward and backward, and the largest logit gap to each packed document run alone."""
    from test_host_reads import HostReads

    from ulysses_sp.parallel.doc_layout import attach_layout, host_layout

    ref = family_model(family, num_key_value_heads=2 if family == "qwen4_exp_text" else 1)
    model = copy.deepcopy(ref)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 1, 1, mesh=init_mesh(sp_size=1))
    ids, pos = global_batch(3, 1, S), _positions(kind, 1)
    attached = attach_layout(pos.clone(), host_layout(pos))  # the adapter's host layout, before the step
    try:
        with HostReads() as reads:  # the model's own indexer reads the device once per query
            logits = model(input_ids=ids, position_ids=attached, use_cache=False).logits
            logits.sum().backward()
    finally:
        reg.remove()
    with torch.no_grad():
        want, _ = _reference(ref, ids, pos, shift(ids), "documents")
    return reads.found, (logits.detach() - want).abs().max().item()


@pytest.mark.parametrize("family, kind", [("qwen4_exp_text", "docs"), ("deepseek_v4", "v4docs")])
def test_qsa_and_v4_pooling_read_no_device_value(pool, family, kind):
    """The QSA picks (``attention/block_indexer.py``) and DeepSeek-V4's per-document pooling and picks
    (``attention/pooled_docs.py``) come from host layout values and device ops only."""
    found, gap = pool.run(_qsa_reads_and_gap, 1, family, kind)[0]
    assert found == [] and gap < 1e-5, (found, gap)


V4_SP2 = [("deepseek_v4", "eager", 1, "plain", "model"),  # HCA window 15-19 and CSA's 12-17 straddle the edge (16)
          ("deepseek_v4", "sdpa", 1, "v4docs", "documents")]  # packed: windows from each document's first token
V4_SP4 = [("deepseek_v4", "sdpa", 1, "plain", "model"),  # halos on three edges; CSA's reach the rank before the last
          ("deepseek_v4", "eager", 1, "v4docs", "documents")]  # ranks hold 2, 2, 2 and 1 documents' pieces


@pytest.mark.parametrize("sp, cases", [(1, V4_SP4), (2, V4_SP2), (4, V4_SP4)], ids=["sp1", "sp2", "sp4"])
def test_deepseek_v4_pooled_attention_equals_no_sp(pool, sp, cases):
    """DeepSeek-V4's compressed layers (issue 36): the model's compressor on ``[halo | local]`` tokens, the
    entries gathered, CSA's indexer over all of them, each rank's queries over their window, entries and sinks
    in one softmax (``attention/pooled_kv.py``, ``pooled_core.py``); per-position logits and every gradient.
    Packed rows against each document alone: windows restart at each document (two shorter than a window),
    its queries see its own entries and keys only, ranks with no entry of a layer join every gather."""
    assert pool.run(_cases, sp, sp, cases)[0] == [c[:4] for c in cases]


@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_pooled_core_in_query_blocks_equals_the_model_s_dense_softmax(kind, monkeypatch):
    """``attention/pooled_core.py`` alone (sp 1): local queries over a window of 5 keys and the pooled entries
    (HCA: ``w < (t+1)//4``; CSA: picks, ``-1`` none) with sinks, in one softmax, equal to the eager function
    over the dense mask the model builds; in blocks of one query too (each recomputed in backward)."""
    from ulysses_sp.attention import pooled_core
    from ulysses_sp.attention.pooled_kv import PooledCall

    g = torch.Generator().manual_seed(5)
    s, t, w = 20, 5, 5
    q = torch.randn(2, 4, s, 8, generator=g, requires_grad=True)
    kv = torch.randn(2, 1, s + t, 8, generator=g, requires_grad=True)
    sinks = torch.randn(4, generator=g, requires_grad=True)
    call = PooledCall(4, kind == "csa", 0, s, None, torch.arange(s)[None])
    i, ent = torch.arange(s)[:, None], torch.arange(t)[None]
    if kind == "csa":
        call.picks = torch.rand(2, s, t, generator=g).argsort(-1)[..., :2]  # distinct, as topk's
        call.picks[:, ::3, 1] = -1  # a pick past the query's complete windows
        seen = torch.zeros(2, s, t + 1, dtype=torch.bool).scatter_(-1, torch.where(call.picks < 0, t, call.picks), True)
        seen = seen[..., :t]
    else:
        seen = (ent < (i + 1) // 4).expand(2, s, t)
    allowed = torch.cat([((i[None] >= torch.arange(s)[None, None]) & (i - torch.arange(s)[None] < w)).expand(2, s, s),
                         seen], -1)  # fmt: skip
    mask = torch.where(allowed[:, None], 0.0, float("-inf"))  # [2, 1, S, S + T]
    want, _ = generic_eager(torch.nn.Module(), q, kv, kv, mask, scaling=0.3, s_aux=sinks)
    r = torch.randn(want.shape, generator=g)
    want_grads = torch.autograd.grad((want * r).sum(), (q, kv, sinks))
    for score_bytes in (pooled_core.SCORE_BYTES, 1):  # one block; one query per block
        monkeypatch.setattr(pooled_core, "SCORE_BYTES", score_bytes)
        got = pooled_core.pooled_attention(q, kv, kv, {"pooled": call, "scaling": 0.3, "sliding_window": w,
                                                       "s_aux": sinks})  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for a, b in zip(torch.autograd.grad((got * r).sum(), (q, kv, sinks)), want_grads):
            assert b.abs().max() > 0
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _halo_and_ragged(s_l: int, width: int) -> None:
    """``tokens_before`` (a halo longer than a shard reads several ranks) and ``all_gather_ragged``, with their
    gradients, against the same slices of the full tensor."""
    from ulysses_sp.parallel.seq_gather import all_gather_ragged, tokens_before

    mesh = init_mesh((1, dist.get_world_size()))
    p, r = mesh.sp_size, mesh.sp_rank
    full = torch.randn(2, p * s_l, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)
    first = [max(0, j * s_l - width + j % 2) for j in range(p)]  # halos of width or width - 1 tokens
    counts = [1, 3, 0, 2]
    weights = [torch.randn(2, j * s_l - first[j], 3, generator=torch.Generator().manual_seed(j)) for j in range(p)]
    mine = full.detach()[:, r * s_l : (r + 1) * s_l].clone().requires_grad_(True)
    halo = tokens_before(mine, first[r], width, mesh.sp_group)
    torch.testing.assert_close(halo, full[:, first[r] : r * s_l], rtol=0, atol=0)
    rows = all_gather_ragged(mine[:, : counts[r]], counts, mesh.sp_group)  # rank j's first counts[j] tokens
    want_rows = torch.cat([full[:, j * s_l : j * s_l + c] for j, c in enumerate(counts)], 1)
    torch.testing.assert_close(rows, want_rows, rtol=0, atol=0)
    ((halo * weights[r]).sum() + (rows * want_rows.detach()).sum()).backward()
    (sum((full[:, first[j] : j * s_l] * weights[j]).sum() for j in range(p)) + (want_rows * want_rows.detach()).sum() * p).backward()
    torch.testing.assert_close(mine.grad, full.grad[:, r * s_l : (r + 1) * s_l])


def test_halo_spanning_ranks_and_ragged_gather_with_gradients(pool):
    pool.run(_halo_and_ragged, 4, 3, 7)  # a 7-token halo over shards of 3: three ranks' tokens


SPANS = ((3, 11), (14, 20), (26, 30))  # image blocks crossing the shard edges at sp 2 (16) and sp 4 (8, 16, 24)
SPAN_DOCS = (18, 14)  # packed: the block (14, 20) crosses the documents' boundary (cut there, as transformers does)


def _gemma3(window: int):
    """Tiny Gemma 3 text model (a sliding then a full layer), eager, weights at std 0.2."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=window,
                           layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64,
                           attn_implementation="eager")  # fmt: skip
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.float()


def _gemma3_logits(ref, ids: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
    """No-SP logits with the image-block masks transformers' own Gemma 3 builds from ``token_types``."""
    from transformers.models.gemma3.modeling_gemma3 import (
        create_masks_for_vision_model,
        get_block_sequence_ids_for_mask,
    )

    pos = torch.arange(ids.shape[1])[None]
    masks = create_masks_for_vision_model(ref.config, ref.model.embed_tokens(ids), None, None, pos,
                                          get_block_sequence_ids_for_mask(token_types))  # fmt: skip
    return ref(input_ids=ids, position_ids=pos, attention_mask=masks, use_cache=False).logits


def _span_cases(sp: int, cases) -> list[tuple]:
    """Gemma 3 text with bidirectional image blocks (``SPANS``, crossing shard edges), SP vs transformers' own
    masks: per-position logits and every gradient; packed rows against each document run alone."""
    from test_host_reads import HostReads

    from ulysses_sp.parallel.doc_layout import attach_layout, bidirectional_spans, host_layout

    mesh, done = init_mesh((1, sp)), []
    for core, window, packed in cases:
        ref = _gemma3(window)
        model = copy.deepcopy(ref)
        reg = UlyssesSPAttentionHF.register_with_transformers(model, core, sp, 1, mesh=mesh,
                                                              attn_chunk=8 if core == "sdpa" else None)  # fmt: skip
        ids, types = global_batch(5, 1, S), torch.zeros(1, S, dtype=torch.long)
        for a, b in SPANS:
            types[0, a:b] = 1
        labels = shift(ids)
        docs = SPAN_DOCS if packed else (S,)
        pos = torch.cat([torch.arange(n) for n in docs])[None]
        labels[0, :-1][pos[0, 1:] == 0] = -100
        cuts = [0, *torch.tensor(docs).cumsum(0).tolist()]
        ref_logits = torch.cat([_gemma3_logits(ref, ids[:, a:b], types[:, a:b]) for a, b in zip(cuts, cuts[1:])], 1)
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        ref_loss.backward()
        cols = slice(mesh.sp_rank * S // sp, (mesh.sp_rank + 1) * S // sp)
        local = attach_layout(pos[:, cols].clone(), host_layout(pos, spans=bidirectional_spans(types)))
        with HostReads() if not done else contextlib.nullcontext() as reads:  # spans as host ints: no read back
            out = model(input_ids=ids[:, cols], position_ids=local, use_cache=False)
            loss = sp_causal_lm_loss(out.logits, labels[:, cols], mesh.sp_group)
            loss.backward()
        assert done or not reads.found, reads.found
        for p in model.parameters():
            dist.all_reduce(p.grad)
        case = (core, window, packed, reg.attention.last_path)
        torch.testing.assert_close(out.logits, ref_logits[:, cols], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, c=case: f"{c}: {m}")  # fmt: skip
        assert_step_close(loss.detach(), {n: p.grad for n, p in model.named_parameters()}, ref_loss.detach(),
                          {n: p.grad for n, p in ref.named_parameters()})  # fmt: skip
        if not done:  # the multimodal model given token_type_ids without the spans: refused, naming the fix
            fake = torch.nn.Module()
            fake.config = type("Config", (), {"model_type": "gemma3"})()
            with pytest.raises(ValueError, match="given token_type_ids.*bidirectional_spans_key='token_type_ids'"):
                reg._before_forward(fake, (), {"token_type_ids": types[:, cols], "position_ids": pos[:, cols]})
            reg._before_forward(fake, (), {"token_type_ids": types[:, cols], "position_ids": local})
        reg.remove()
        done.append(case)
    return done


SPAN_SP2 = [("sdpa", 6, False), ("eager", 6, True)]
SPAN_SP4 = [("sdpa", 5, True)]


@pytest.mark.parametrize("sp, cases", [(2, SPAN_SP2), (4, SPAN_SP4)], ids=["sp2", "sp4"])
def test_gemma3_bidirectional_image_spans_equal_transformers_masks(pool, sp, cases):
    """Image blocks that see each other (Gemma 3), honoured by the blockwise core (sdpa, blocks of 8 tokens)
    and eager, with sliding windows shorter than a block and packed documents (``attention/span_mask.py``)."""
    paths = {"sdpa": "blockwise", "eager": "eager"}
    assert pool.run(_span_cases, sp, sp, cases)[0] == [(*c, paths[c[0]]) for c in cases]


def test_bidirectional_spans_match_gemma3_blocks_and_bad_spans_and_cores_are_refused():
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    from ulysses_sp.attention.span_mask import check_span_core
    from ulysses_sp.parallel.doc_layout import HostLayout, bidirectional_spans

    types = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0, 1]])
    spans = bidirectional_spans(types)
    assert spans == (((0, 2), (4, 7)), ((7, 8),))
    ids = HostLayout(8, (((0, 0),), ((0, 0),)), spans=spans).span_ids("cpu")
    assert torch.equal(ids, get_block_sequence_ids_for_mask(types))  # the same block ids, -1 for text
    with pytest.raises(ValueError, match="sorted disjoint"):
        HostLayout(8, (((0, 0),),), spans=(((4, 6), (5, 7)),))
    with pytest.raises(ValueError, match="chunked attention"):
        HostLayout(8, (((0, 0),),), spans=(((4, 6),),)).split_at_chunks(4)
    with pytest.raises(ValueError, match="flash kernels take no mask.*'sdpa'"):
        check_span_core("flash_attention_2")
    with pytest.raises(ValueError, match="ring attention.*ring_size 1"):
        check_span_core("sdpa", ring_size=2)
    from torch.nn.attention.flex_attention import create_mask

    from ulysses_sp.attention.masks import SeqLayout, mask_for

    # flex's mask_mod and the dense mask (sdpa form) agree with spans, documents and a window of 2
    host = HostLayout(8, (((0, 0), (3, 0)), ((0, 0),)), spans=spans)  # row 0: documents [0, 3), [3, 8)
    layout = SeqLayout.from_host(host, torch.device("cpu"))
    dense = mask_for(layout, "sdpa", torch.float32, 2)  # [B, 1, S, S]
    assert dense[0, 0, 0, 1] and not dense[0, 0, 1, 4] and dense[0, 0, 4, 6] and not dense[0, 0, 6, 4]  # 6 -> 4: 2 back
    flex = mask_for(layout, "flex_attention", torch.float32, 2)
    assert torch.equal(create_mask(flex.mask_mod, 2, 1, 8, 8, device="cpu"), dense.expand(2, 1, 8, 8))
    from ulysses_sp.data.adapter import UlyssesSPDataLoaderAdapter
    from ulysses_sp.parallel.doc_layout import layout_of

    batch = {"input_ids": torch.arange(16).view(2, 8), "token_type_ids": types}
    for key, want in (("token_type_ids", spans), (None, None)):  # the data path: spans once per step, on the host
        adapter = UlyssesSPDataLoaderAdapter([batch], 0, None, 1, "cpu", bidirectional_spans_key=key)
        assert layout_of(next(iter(adapter))["position_ids"]).spans == want
