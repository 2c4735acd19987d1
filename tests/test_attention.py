"""Ulysses attention: a sequence-parallel run equals the same run without sequence parallelism.

The oracle is the plain model (same seed, same global batch) run on every rank without SP, loss
computed by torch's own cross-entropy. The SP run shards each sequence over the SP group, routes
attention through UlyssesSPAttentionHF, computes the SP loss, sums gradients over SP and averages
over DP. Loss and every parameter's gradient must match to fp32 tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import WorkerError
from models import global_batch, reference_loss, shift, tiny_model
from oracle import assert_step_close
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.memory.offload import enable_activation_checkpointing
from ulysses_sp.parallel.loss import sp_causal_lm_loss
from ulysses_sp.parallel.mesh import init_mesh
from ulysses_sp.parallel.mesh_shape import check_heads, valid_sp_sizes

B, S = 2, 16
ARCHS = ("llama", "qwen2", "mistral")
CORES = ("sdpa", "eager")


def _reference(ref, ids, labels, dp):
    """Mean over DP groups of each group's token-mean loss; gradients of that."""
    loss = reference_loss(ref, ids, labels, dp)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters()}


def _sp_step(model, mesh, ids, labels, *, checkpointing=False):
    info = mesh
    s_l = ids.shape[1] // info.sp_size
    rows = slice(info.dp_rank * B, (info.dp_rank + 1) * B)
    cols = slice(info.sp_rank * s_l, (info.sp_rank + 1) * s_l)
    if checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    pos = torch.arange(ids.shape[1])[cols].expand(B, -1)
    out = model(input_ids=ids[rows, cols], position_ids=pos)
    loss = sp_causal_lm_loss(out.logits, labels[rows, cols], mesh.sp_group)
    loss.backward()
    # The engine's rule, by hand: sum over SP, mean over DP.
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= info.dp_size
    avg = loss.detach().clone()
    dist.all_reduce(avg, group=mesh.dp_group)
    return avg / info.dp_size, {n: p.grad for n, p in model.named_parameters()}


def _equivalence(dp, sp, cases, seq=S, kill_shard=None, checkpointing=False, exchange="auto"):
    mesh = init_mesh((dp, sp))
    compared = []
    for arch, core, heads, kv in cases:
        ref = tiny_model(arch, attn=core, heads=heads, kv_heads=kv)
        model = copy.deepcopy(ref)
        reg = UlyssesSPAttentionHF.register_with_transformers(model, core, sp, B, mesh=mesh, exchange=exchange)
        ids = global_batch(1, dp * B, seq)
        labels = shift(ids)
        if kill_shard is not None:  # one SP shard of the first sequences holds only -100 labels
            s_l = seq // sp
            labels[:, kill_shard * s_l : (kill_shard + 1) * s_l] = -100
        ref_loss, ref_grads = _reference(ref, ids, labels, dp)
        loss, grads = _sp_step(model, mesh, ids, labels, checkpointing=checkpointing)
        assert reg.attention.calls == model.config.num_hidden_layers * (2 if checkpointing else 1)
        assert reg.attention.last_seq_len == seq
        # loss rtol 1e-5; gradients rtol 1e-4, atol min(1e-6, 1e-5 x the largest): a 2x (or 1.01x) error fails
        assert_step_close(loss, grads, ref_loss, ref_grads)
        compared.append((arch, core, heads, kv))
        reg.remove()
    return compared


MHA_CASES = [(a, c, 4, 4) for a in ARCHS for c in CORES]


@pytest.mark.parametrize("dp, sp", [(1, 2), (1, 4), (2, 2)])
def test_sp_loss_and_every_gradient_equal_no_sp(pool, dp, sp):
    results = pool.run(_equivalence, dp * sp, dp, sp, MHA_CASES)
    assert set(results[0]) == set(MHA_CASES)


@pytest.mark.parametrize("exchange", ["packed", "headwise"])  # auto: packed at these sizes
@pytest.mark.parametrize("heads, kv", [(4, 1), (8, 2), (8, 4)])
def test_gqa_with_fewer_kv_heads_than_sp_ranks_is_exact(pool, heads, kv, exchange):
    cases = [("llama", "sdpa", heads, kv), ("qwen2", "eager", heads, kv)]
    pool.run(_equivalence, 4, 1, 4, cases, exchange=exchange)


def test_shard_with_only_ignored_labels_contributes_zero_not_nan(pool):
    pool.run(_equivalence, 2, 1, 2, [("llama", "sdpa", 4, 4)], kill_shard=1)
    pool.run(_equivalence, 4, 2, 2, [("qwen2", "eager", 4, 4)], kill_shard=0)


@pytest.mark.parametrize("exchange", ["packed", "headwise"])
def test_activation_checkpointing_gives_same_gradients(pool, exchange):
    pool.run(_equivalence, 2, 1, 2, [("llama", "sdpa", 4, 4), ("mistral", "eager", 4, 4)], checkpointing=True,
             exchange=exchange)


def _undo_restores_model():
    mesh = init_mesh((1, dist.get_world_size()))
    model = tiny_model("llama", attn="sdpa")
    ids = global_batch(3, B, S)
    before = model(input_ids=ids).logits.detach()
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", mesh.sp_size, B, mesh=mesh)
    assert model.config._attn_implementation == "ulysses_sp"
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert ALL_ATTENTION_FUNCTIONS["ulysses_sp"] is reg.attention
    reg.remove()
    assert model.config._attn_implementation == "sdpa"
    assert "ulysses_sp" not in ALL_ATTENTION_FUNCTIONS
    assert not model._forward_hooks and not model._forward_pre_hooks
    after = model(input_ids=ids).logits.detach()
    return torch.equal(before, after)


def test_unregister_restores_exact_outputs(pool):
    assert pool.run(_undo_restores_model, 2) == [True, True]


def test_heads_not_divisible_error_names_numbers_and_valid_sizes():
    with pytest.raises(
        ValueError,
        match=r"num_attention_heads \(6\) is not divisible by sequence_parallel_size \(4\); valid sequence_parallel_size values for Ulysses alone: \[1, 2, 3, 6\] \(a ring",
    ):
        check_heads(6, 6, 4)
    with pytest.raises(
        ValueError,
        match=r"num_key_value_heads \(6\) neither divides nor is divisible by sequence_parallel_size \(4\)",
    ):
        check_heads(12, 6, 4)
    assert valid_sp_sizes(8, 2) == [1, 2, 4, 8]
    check_heads(8, 1, 8)


def _bad_input(kind):
    sp = dist.get_world_size()
    mesh = init_mesh((1, sp))
    kw = {}
    heads = 4
    if kind == "heads":
        heads = 6
    if kind == "max_length":
        kw = {"seq_length_is_variable": False, "max_length": 64}
    core = "flashy" if kind == "core" else "sdpa"
    model = tiny_model("llama", heads=heads, hidden=48)
    UlyssesSPAttentionHF.register_with_transformers(model, core, sp, B, mesh=mesh, **kw)
    rank = dist.get_rank()
    s_l = 8 if (kind != "lengths" or rank == 0) else 4
    if kind == "bypass":
        model.set_attn_implementation("sdpa")
    ids = global_batch(0, B, s_l * sp)[:, :s_l]
    pos = torch.arange(s_l)[None] + rank * s_l
    if kind == "cross":  # keys of another length than the queries: cross-attention to an encoder's states
        q, kv = torch.randn(B, heads, s_l, 12), torch.randn(B, heads, 5, 12)
        ALL_ATTENTION_FUNCTIONS["ulysses_sp"](model.model.layers[0].self_attn, q, kv, kv, None, position_ids=pos)
    model(input_ids=ids, position_ids=None if kind == "local_pos" else pos)


@pytest.mark.parametrize(
    "kind, match",
    [
        (
            "heads",
            r"ulysses size sp/ring = 4 cannot split 6 attention heads.*\[2, 4\].*init_mesh\(\.\.\., ring_size=R\)",
        ),
        ("core", r"unknown core_attn_implementation 'flashy'"),
        ("lengths", r"local sequence lengths differ between SP ranks: \[8, 4, 4, 4\]"),
        ("max_length", r"S_l \(8\) \* sp_size \(4\) = 32 != max_length \(64\)"),
        (
            "local_pos",
            r"the model was called without position_ids on SP rank\(s\) \[0, 1, 2, 3\] of a sequence-parallel forward",
        ),
        ("bypass", r"sequence-parallel attention ran in 0 of 2 attention layers.*attn_implementation='sdpa'"),
        ("cross", r"LlamaAttention: 5 keys for 8 queries on this rank: cross-attention \(to an encoder's states\) or a "
         r"cache; sequence parallelism shards self-attention over the same tokens only"),
    ],
)
def test_bad_input_fails_every_rank_with_clear_message(pool, kind, match):
    with pytest.raises(WorkerError) as ei:
        pool.run(_bad_input, 4, kind)
    assert len(ei.value.failures) == 4, ei.value
    import re

    for msg in ei.value.messages():
        assert re.search(match, msg), msg


DOCS = (5, 7, 4)  # one packed sequence of 16 tokens; boundaries fall inside both sp=2 shards


def _packed_documents(core):
    mesh = init_mesh((1, 2))
    info = mesh
    ref = tiny_model("llama", attn=core)
    model = copy.deepcopy(ref)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, core, 2, 1, mesh=mesh)
    ids = global_batch(5, 1, sum(DOCS))
    # Reference: every document on its own, no SP; token-mean over all documents' valid tokens.
    total, count, start = 0.0, 0, 0
    for n in DOCS:
        doc = ids[:, start : start + n]
        logits = ref(input_ids=doc).logits
        total = total + F.cross_entropy(logits[0, :-1], doc[0, 1:], reduction="sum")
        count += n - 1
        start += n
    ref_loss = total / count
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    # Packed: positions restart at each document; the label of each document's last token is -100.
    pos = torch.cat([torch.arange(n) for n in DOCS])[None]
    labels = shift(ids)
    ends = torch.tensor(DOCS).cumsum(0) - 1
    labels[0, ends] = -100
    s_l = ids.shape[1] // 2
    cols = slice(info.sp_rank * s_l, (info.sp_rank + 1) * s_l)
    out = model(input_ids=ids[:, cols], position_ids=pos[:, cols])
    loss = sp_causal_lm_loss(out.logits, labels[:, cols], mesh.sp_group)
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    reg.remove()
    assert_step_close(
        loss.detach(), {n: p.grad for n, p in model.named_parameters()}, ref_loss.detach(), ref_grads
    )


@pytest.mark.parametrize("core", CORES)
def test_packed_documents_do_not_attend_across_boundaries(pool, core):
    pool.run(_packed_documents, 2, core)


def _sliding_window(core):
    mesh = init_mesh((1, 2))
    ref = tiny_model("mistral", attn=core)
    ref.config.sliding_window = 5  # shorter than the sequence: the window mask matters
    model = copy.deepcopy(ref)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, core, 2, B, mesh=mesh)
    ids = global_batch(2, B, S)
    labels = shift(ids)
    ref_loss, ref_grads = _reference(ref, ids, labels, 1)
    loss, grads = _sp_step(model, mesh, ids, labels)
    reg.remove()
    assert_step_close(loss, grads, ref_loss, ref_grads)


@pytest.mark.parametrize("core", CORES)
def test_sliding_window_model_matches_its_own_windowed_attention(pool, core):
    pool.run(_sliding_window, 2, core)


def _flex_forward(docs):
    """flex_attention has no CPU backward in torch: its forward (the mask) is what CPU can test."""
    mesh = init_mesh((1, 2))
    info = mesh
    ref = tiny_model("llama", attn="sdpa")
    model = copy.deepcopy(ref)
    UlyssesSPAttentionHF.register_with_transformers(model, "flex_attention", 2, 1, mesh=mesh)
    ids = global_batch(5, 1, sum(DOCS))
    with torch.no_grad():
        if docs:
            pos = torch.cat([torch.arange(n) for n in DOCS])[None]
            starts = [0, *torch.tensor(DOCS).cumsum(0).tolist()]
            want = torch.cat([ref(input_ids=ids[:, a:b]).logits for a, b in zip(starts, starts[1:])], dim=1)
        else:
            pos = torch.arange(ids.shape[1])[None]
            want = ref(input_ids=ids).logits
        s_l = ids.shape[1] // 2
        cols = slice(info.sp_rank * s_l, (info.sp_rank + 1) * s_l)
        got = model(input_ids=ids[:, cols], position_ids=pos[:, cols]).logits
    torch.testing.assert_close(got, want[:, cols], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("docs", [False, True], ids=["causal", "packed"])
def test_flex_attention_forward_matches_no_sp(pool, docs):
    pool.run(_flex_forward, 2, docs)


def _eval_modes():
    """Eval at other sizes than training just works; disable_in_eval runs plain attention."""
    mesh = init_mesh((1, 2))
    info = mesh
    ref = tiny_model("qwen2", attn="sdpa")
    model = copy.deepcopy(ref)
    reg = UlyssesSPAttentionHF.register_with_transformers(
        model, "sdpa", 2, micro_batch_size=2, seq_length=16, disable_in_eval=False
    )
    model.eval()
    ids = global_batch(7, 3, 24)  # batch 3 and length 24: neither is what was registered
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        cols = slice(info.sp_rank * 12, (info.sp_rank + 1) * 12)
        got = model(input_ids=ids[:, cols], position_ids=torch.arange(24)[cols].expand(3, -1)).logits
    torch.testing.assert_close(got, want[:, cols], rtol=1e-5, atol=1e-5)
    reg.remove()
    reg = UlyssesSPAttentionHF.register_with_transformers(
        model, "sdpa", 2, 2, disable_in_eval=True, mesh=mesh
    )
    model.eval()
    with torch.no_grad():  # each rank evaluates whole sequences on its own: no SP, no collectives
        got = model(input_ids=ids[info.sp_rank :]).logits
    torch.testing.assert_close(got, want[info.sp_rank :], rtol=1e-5, atol=1e-5)
    reg.remove()


def test_eval_other_sizes_and_disable_in_eval(pool):
    pool.run(_eval_modes, 2)


def _fresh_positions_every_forward():
    """Each forward's own position ids are used, even when a freed tensor's id is reused."""
    mesh = init_mesh((1, 2))
    info = mesh
    ref = tiny_model("llama", attn="sdpa")
    model = copy.deepcopy(ref)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, mesh=mesh)
    ids = global_batch(5, 1, sum(DOCS))
    packed = torch.cat([torch.arange(n) for n in DOCS])[None]
    starts = [0, *torch.tensor(DOCS).cumsum(0).tolist()]
    s_l = ids.shape[1] // 2
    cols = slice(info.sp_rank * s_l, (info.sp_rank + 1) * s_l)
    with torch.no_grad():
        want = {
            False: ref(input_ids=ids).logits[:, cols],
            True: torch.cat([ref(input_ids=ids[:, a:b]).logits for a, b in zip(starts, starts[1:])], 1)[
                :, cols
            ],
        }
        buf = torch.arange(ids.shape[1])[None][:, cols].clone()
        for i in range(12):
            docs = bool(i % 2)
            # A new tensor every time (the previous one freed: CPython may hand out its id again) ...
            pos = (packed if docs else torch.arange(ids.shape[1])[None])[:, cols].clone()
            got = model(input_ids=ids[:, cols], position_ids=pos).logits
            torch.testing.assert_close(got, want[docs], rtol=1e-5, atol=1e-5)
            del pos, got
        # ... and the same tensor edited in place.
        for docs in (False, True, False):
            buf.copy_((packed if docs else torch.arange(ids.shape[1])[None])[:, cols])
            got = model(input_ids=ids[:, cols], position_ids=buf).logits
            torch.testing.assert_close(got, want[docs], rtol=1e-5, atol=1e-5)
    reg.remove()


def test_each_forward_uses_its_own_position_ids(pool):
    pool.run(_fresh_positions_every_forward, 2)


def _mixed_dtype_exchange(packed_path):
    from ulysses_sp.parallel.comm import seq_to_heads
    from ulysses_sp.parallel.headwise import qkv_seq_to_heads

    mesh = init_mesh((1, dist.get_world_size()))
    g = torch.Generator().manual_seed(dist.get_rank())
    # under autocast, rotary leaves q and k in fp32 while v comes out of its projection in bf16
    q, k = (torch.randn(2, 4, 3, 5, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 2, 3, 5, generator=g).to(torch.bfloat16).requires_grad_()
    packed = qkv_seq_to_heads(q, k, v, mesh.sp_group, packed=packed_path)
    alone = [seq_to_heads(t, mesh.sp_group) for t in (q, k, v)]
    assert [t.dtype for t in packed] == [torch.float32, torch.float32, torch.bfloat16]
    grads = []
    for outs in (packed, alone):
        torch.autograd.backward(list(outs), [torch.ones_like(o) * (i + 1) for i, o in enumerate(outs)])
        grads.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    return all(torch.equal(a, b) for a, b in zip(packed, alone)) and all(
        torch.equal(a, b) for a, b in zip(*grads)
    )


@pytest.mark.parametrize("packed_path", [True, False])
def test_packed_qkv_exchange_keeps_mixed_dtypes_and_equals_separate_exchanges(pool, packed_path):
    assert pool.run(_mixed_dtype_exchange, 2, packed_path) == [True, True]
