"""Linear-attention mixers under Ulysses: gated delta-net (Qwen3-Next, Qwen3.5 dense and MoE, OLMo hybrid) and
KDA (Kimi-Linear's low-rank gate, Bailing's full-rank one) at sp 2 and 4 equal the same models without sequence
parallelism.

The oracle is the unmodified model (same seed, full batch) on every rank. The SP run shards each
sequence, routes attention through UlyssesSPAttentionHF (kv heads < sp) and the mixers through
``apply_mixers(model, mesh)`` (``shard_mixers`` with the position tracker); per-position logits, the loss and every
parameter gradient (summed over SP) must match at fp32 tolerance. Linear key heads are fewer than
value heads (2 vs 4): at sp 4 each key head is replicated to two ranks. Packed documents are compared
with every document run on its own (the torch fallbacks of these models keep no document apart).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import WorkerError
from models import global_batch, shift
from oracle import assert_grads_close, assert_step_close

from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.memory.offload import enable_activation_checkpointing
from ulysses_sp.mixers import gated_delta, kda
from ulysses_sp.mixers.apply import HANDLERS, apply_mixers
from ulysses_sp.parallel.loss import sp_causal_lm_loss
from ulysses_sp.parallel.mesh import init_mesh

B, S, VOCAB = 2, 16, 64
ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear", "olmo_hybrid", "bailing_hybrid")
KDA_ARCHS = ("kimi_linear", "bailing_hybrid")  # MLA attention, the mixer at self_attn


def tiny_hybrid(arch: str, *, k_heads: int = 2, v_heads: int = 4, seed: int = 0):
    """A 3-layer hybrid (linear, full attention, linear), fp32, weights N(0, 0.2)."""
    import transformers as T

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False,
                  layer_types=["linear_attention", "full_attention", "linear_attention"], linear_conv_kernel_dim=4)  # fmt: skip
    gdn = dict(head_dim=8, linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
               linear_key_head_dim=8, linear_value_head_dim=6)  # fmt: skip
    moe = dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16
    )
    if arch == "qwen3_next":
        cfg = T.Qwen3NextConfig(**common, **gdn, **moe, intermediate_size=48, decoder_sparse_step=2)
        cls = T.Qwen3NextForCausalLM
    elif arch == "qwen3_5":
        cfg, cls = T.Qwen3_5TextConfig(**common, **gdn, intermediate_size=48), T.Qwen3_5ForCausalLM
    elif arch == "qwen3_5_moe":
        cfg, cls = T.Qwen3_5MoeTextConfig(**common, **gdn, **moe), T.Qwen3_5MoeForCausalLM
    elif arch == "olmo_hybrid":
        gdn.pop("head_dim")
        ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
        cfg, cls = T.OlmoHybridConfig(**common, **gdn, **ids, intermediate_size=48), T.OlmoHybridForCausalLM
    elif arch == "bailing_hybrid":  # MLA; the KDA mixer's heads are the attention's (4 x head_dim 8)
        common.update(num_key_value_heads=4, head_dim=8)
        cfg = T.BailingHybridConfig(**common, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                    num_experts_per_tok=2, n_group=1, topk_group=1,
                                    mlp_layer_types=["dense", "sparse", "dense"], kv_lora_rank=16, q_lora_rank=None,
                                    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, short_conv_kernel_size=4,
                                    pad_token_id=0, eos_token_id=2)  # fmt: skip
        cls = T.BailingHybridForCausalLM
    else:
        common["num_key_value_heads"] = 4  # MLA: keys and values expand to every head
        cfg = T.KimiLinearConfig(**common, intermediate_size=48, moe_intermediate_size=16, num_local_experts=4,
                                 num_experts_per_tok=2, mlp_layer_types=["dense", "sparse", "dense"],
                                 kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8,
                                 v_head_dim=8, linear_num_heads=v_heads, linear_head_dim=8,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
        cls = T.KimiLinearForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.float()


def _sharded(arch: str, mesh, core: str = "sdpa", **kw):
    ref = tiny_hybrid(arch, **kw)
    model = copy.deepcopy(ref)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, core, mesh.sp_size, B, mesh=mesh)
    handle = apply_mixers(model, mesh)
    assert [h for _, h in handle.wrapped] == 2 * [handler_of(arch).name]
    return ref, model, lambda: (handle.remove(), reg.remove())


def _equivalence(sp: int, archs: tuple[str, ...], checkpointing: bool = False) -> list[str]:
    mesh = init_mesh((1, sp))
    s_l, done = S // sp, []
    cols = slice(mesh.sp_rank * s_l, (mesh.sp_rank + 1) * s_l)
    for arch in archs:
        ref, model, undo = _sharded(arch, mesh)
        ids = global_batch(1, B, S, VOCAB)
        labels = shift(ids)
        ref_logits = ref(input_ids=ids, use_cache=False).logits
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        ref_loss.backward()
        if checkpointing:
            enable_activation_checkpointing(model)
        model.train()
        pos = torch.arange(S)[cols].expand(B, -1)
        out = model(input_ids=ids[:, cols], position_ids=pos, use_cache=False)
        # per-position logits of this rank's shard
        torch.testing.assert_close(out.logits, ref_logits[:, cols], rtol=1e-5, atol=1e-5)
        loss = sp_causal_lm_loss(out.logits, labels[:, cols], mesh.sp_group)
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        grads = {n: p.grad for n, p in model.named_parameters()}
        assert_step_close(
            loss.detach(), grads, ref_loss.detach(), {n: p.grad for n, p in ref.named_parameters()}
        )
        undo()
        _assert_restored(model, ref, ids)
        done.append(arch)
    return done


def _assert_restored(model, ref, ids) -> None:
    """After the undo: no wrapped forward, the modeling module's own functions, the same logits."""
    import sys

    from ulysses_sp.mixers.linear_attn import _Dispatch

    for m in model.modules():
        if any(h.matches(m) for h in (gated_delta.HANDLER, kda.HANDLER, kda.FULL_GATE_HANDLER)):
            assert "forward" not in m.__dict__
            modeling = vars(sys.modules[type(m).__module__])
            assert not any(isinstance(f, _Dispatch) for f in modeling.values())
    assert not model._forward_pre_hooks and not model._forward_hooks
    with torch.no_grad():
        assert torch.equal(
            model(input_ids=ids, use_cache=False).logits, ref(input_ids=ids, use_cache=False).logits
        )


@pytest.mark.parametrize("sp", [2, 4])  # sp 4: each of the 2 linear key heads replicated to 2 ranks
def test_linear_attention_hybrids_equal_no_sp(pool, sp):
    # Bailing at sp 2 only (cheaper): at sp 4 its exchange is Kimi-Linear's, one KDA head per rank
    archs = ARCHS if sp == 2 else tuple(a for a in ARCHS if a != "bailing_hybrid")
    assert pool.run(_equivalence, sp, sp, archs)[0] == list(archs)


def test_activation_checkpointing_recomputes_the_same_layout(pool):
    pool.run(_equivalence, 2, 2, ("qwen3_next", "kimi_linear"), checkpointing=True)


# 32 tokens a row. Row 0: a document starts exactly at a shard boundary (16) and one (2 tokens) is
# shorter than the conv kernel; row 1: a document spans the shards at sp 2.
ROWS = ((5, 2, 9, 6, 10), (12, 3, 17))


def _packed(sp: int, arch: str, rows: tuple[tuple[int, ...], ...]) -> None:
    """Rows of packed documents (each row its own boundaries) against every document run alone:
    per-position logits, the token-mean loss over all rows and every gradient."""
    mesh = init_mesh((1, sp))
    # Kimi's MLA has value heads narrower than keys, which the blockwise sdpa core (documents) refuses
    ref, model, undo = _sharded(arch, mesh, "eager" if arch in KDA_ARCHS else "sdpa")
    ids = global_batch(5, len(rows), sum(rows[0]), VOCAB)
    labels, pos, ref_logits, total, count = shift(ids), [], [], 0.0, 0
    for r, docs in enumerate(rows):
        starts = [0, *torch.tensor(docs).cumsum(0).tolist()]
        pieces = [
            ref(input_ids=ids[r : r + 1, a:e], use_cache=False).logits for a, e in zip(starts, starts[1:])
        ]
        for (a, e), logits in zip(zip(starts, starts[1:]), pieces):
            total = total + F.cross_entropy(logits[0, :-1], ids[r, a + 1 : e], reduction="sum")
            count += e - a - 1
            labels[r, e - 1] = -100  # no label across a document boundary
        ref_logits.append(torch.cat(pieces, dim=1))
        pos.append(torch.cat([torch.arange(n) for n in docs]))
    ref_loss = total / count
    ref_loss.backward()
    s_l = ids.shape[1] // sp
    cols = slice(mesh.sp_rank * s_l, (mesh.sp_rank + 1) * s_l)
    out = model(input_ids=ids[:, cols], position_ids=torch.stack(pos)[:, cols], use_cache=False)
    torch.testing.assert_close(out.logits, torch.cat(ref_logits)[:, cols], rtol=1e-5, atol=1e-5)
    loss = sp_causal_lm_loss(out.logits, labels[:, cols], mesh.sp_group)
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    assert_step_close(loss.detach(), {n: p.grad for n, p in model.named_parameters()}, ref_loss.detach(),
                      {n: p.grad for n, p in ref.named_parameters()})  # fmt: skip
    undo()


@pytest.mark.parametrize("sp, arch, rows", [
    (1, "qwen3_next", ROWS),  # sp 1 keeps documents apart too (sp 1 and sp 2 train the same model)
    (2, "qwen3_next", ROWS),  # two rows with different boundaries: run row by row
    (4, "qwen3_5", ROWS[:1]),  # one row: every row the same spans
    (2, "kimi_linear", ROWS),
    (2, "bailing_hybrid", ROWS),
])  # fmt: skip
def test_packed_documents_stay_apart_in_conv_and_scan(pool, sp, arch, rows):
    pool.run(_packed, sp, sp, arch, rows)


def _engine_zero3(sp: int, cases: tuple[tuple[str, bool], ...]) -> list[str]:
    """Two SGD steps through ``initialize`` at ZeRO-3 (FSDP2) with the mixers applied first: the loss,
    every reduced gradient and the parameters after the steps equal the plain model's."""
    from torch.distributed.tensor import DTensor

    from ulysses_sp.engine import initialize

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    mesh = init_mesh((1, sp))
    s, rows, done = sum(ROWS[0]), ROWS[:1], []
    cols = slice(mesh.sp_rank * s // sp, (mesh.sp_rank + 1) * s // sp)
    for arch, packed in cases:
        ref = tiny_hybrid(arch)
        model = copy.deepcopy(ref)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        core = "eager" if arch == "kimi_linear" and packed else "sdpa"
        reg = UlyssesSPAttentionHF.register_with_transformers(model, core, sp, 1, mesh=mesh)
        handle = apply_mixers(model, mesh)
        assert len(handle.wrapped) == 2
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}  # fmt: skip
        engine, _, _, _ = initialize(model=model, config=config, mpu=reg)
        for step in range(2):
            ids = global_batch(30 + step, 1, s, VOCAB)
            labels, pos = shift(ids), torch.arange(s)[None]
            if packed:
                starts = [0, *torch.tensor(rows[0]).cumsum(0).tolist()]
                pos = torch.cat([torch.arange(n) for n in rows[0]])[None]
                labels[0, torch.tensor(starts[1:]) - 1] = -100
            logits = ref(input_ids=ids, position_ids=None if packed else pos, use_cache=False).logits
            if packed:  # the oracle: every document on its own
                logits = torch.cat([ref(input_ids=ids[:, a:e], use_cache=False).logits
                                    for a, e in zip(starts, starts[1:])], dim=1)  # fmt: skip
            ref_loss = F.cross_entropy(logits[0], labels[0], ignore_index=-100)
            ref_opt.zero_grad()
            ref_loss.backward()
            ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
            ref_opt.step()
            out = engine(
                input_ids=ids[:, cols],
                position_ids=pos[:, cols],
                shift_labels=labels[:, cols],
                use_cache=False,
            )
            engine.backward(out.loss)
            grads = {n: full(p.grad) for n, p in engine.module.named_parameters()}
            loss = engine.step()
            torch.testing.assert_close(torch.tensor(float(loss)), ref_loss.detach(), rtol=1e-5, atol=0)
            assert_grads_close(grads, ref_grads)
        refs = dict(ref.named_parameters())
        for name, p in engine.module.named_parameters():
            torch.testing.assert_close(full(p.detach()), refs[name].detach(), rtol=1e-5, atol=1e-6)
        handle.remove()
        reg.remove()
        done.append(arch)
    return done


def test_zero3_engine_steps_equal_no_sp(pool):
    cases = (("qwen3_next", True), ("kimi_linear", False))
    assert pool.run(_engine_zero3, 2, 2, cases)[0] == ["qwen3_next", "kimi_linear"]


def _refused(arch: str, k_heads: int, v_heads: int) -> None:
    mesh = init_mesh((1, dist.get_world_size()))
    model = tiny_hybrid(arch, k_heads=k_heads, v_heads=v_heads)
    apply_mixers(model, mesh)


@pytest.mark.parametrize("arch, k, v, match", [
    ("qwen3_next", 3, 6, r"3 key heads and 6 value heads.*sp_size \(4\)"),
    ("kimi_linear", 6, 6, r"6 key heads and 6 value heads.*sp_size \(4\)"),
])  # fmt: skip
def test_heads_that_do_not_divide_are_refused_before_any_step(pool, arch, k, v, match):
    with pytest.raises(WorkerError, match=match) as err:
        pool.run(_refused, 4, arch, k, v)
    assert len(err.value.failures) == 4


def _exchanges(sp: int, arch: str) -> dict[str, list[int]]:
    """Every ``all_to_all_single`` of one forward+backward of a hybrid, with the bytes this rank
    sent to *other* ranks; checked against the analytic minimum per linear layer."""
    mesh = init_mesh((1, sp))
    ref, model, undo = _sharded(arch, mesh)
    s_l = S // sp
    ids = global_batch(2, B, S, VOCAB)[:, mesh.sp_rank * s_l : (mesh.sp_rank + 1) * s_l]
    pos = torch.arange(S)[mesh.sp_rank * s_l : (mesh.sp_rank + 1) * s_l].expand(B, -1)
    sent: list[int] = []
    real = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        row = input.numel() * input.element_size() // max(1, input.shape[0])  # bytes per dim-0 row
        splits = input_split_sizes or [input.shape[0] // sp] * sp
        sent.append(sum(n * row for r, n in enumerate(splits) if r != mesh.sp_rank))
        return real(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

    dist.all_to_all_single = counting
    try:
        out = model(input_ids=ids, position_ids=pos, use_cache=False)
        forward = list(sent)
        out.logits.sum().backward()
    finally:
        dist.all_to_all_single = real
    undo()
    return {"forward": forward, "backward": sent[len(forward) :]}


@pytest.mark.parametrize("arch", ["qwen3_next", "kimi_linear", "bailing_hybrid"])
def test_exchanges_per_linear_layer_are_one_in_one_out_plus_a_halo(pool, arch):
    sp, s_l, f32 = 2, S // 2, 4
    ranks = pool.run(_exchanges, sp, sp, arch)
    lin = tiny_hybrid(arch).model.layers[0]
    others = (sp - 1) / sp
    if arch == "kimi_linear":  # q, k, v and beta head-sharded; the gate's [D] feature to every rank
        lin = lin.self_attn
        h, d = lin.num_heads, lin.head_dim
        into = others * B * s_l * (3 * h * d + h) * f32 + (sp - 1) * B * s_l * d * f32
        back = others * B * s_l * h * d * f32
    elif arch == "bailing_hybrid":  # q, k, v, the per-channel decay and beta head-sharded
        lin = lin.self_attn
        h, d = lin.num_heads, lin.head_dim
        into = others * B * s_l * (4 * h * d + h) * f32
        back = others * B * s_l * h * d * f32
    else:  # q, k (Hk heads), v (Hv), decay and beta (Hv) head-sharded
        lin = lin.linear_attn
        hk, hv, dk, dv = lin.num_k_heads, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim
        into = others * B * s_l * (2 * hk * dk + hv * dv + 2 * hv) * f32
        back = others * B * s_l * hv * dv * f32
    halo = B * lin.conv_dim * (lin.conv_kernel_size - 1) * f32  # to the next rank only
    # the full-attention layer's exchange at these sizes goes packed (parallel/exchange_cost.py): one in, one out
    attn = 2
    for rank, seen in enumerate(ranks):
        fwd = seen["forward"]
        # layer order: linear (halo, in, out), full attention (q/k/v in, the output out), linear (halo, in, out)
        assert len(fwd) == 6 + attn, fwd
        want_halo = halo if rank < sp - 1 else 0
        assert fwd[:3] == [want_halo, into, back], (rank, fwd)
        assert fwd[-3:] == [want_halo, into, back], (rank, fwd)
        assert len(seen["backward"]) == len(fwd)  # each exchange mirrored once


@pytest.mark.parametrize("arch", ARCHS)
def test_each_linear_mixer_is_claimed_by_exactly_one_handler(arch):
    model = tiny_hybrid(arch)
    mine = handler_of(arch)
    claims = {n: [h.name for h in HANDLERS if h.matches(m)] for n, m in model.named_modules()}
    assert {n for n, c in claims.items() if c} == {f"model.layers.{i}.{mine_attr(arch)}" for i in (0, 2)}
    assert all(c in ([], [mine.name]) for c in claims.values()), claims


def mine_attr(arch: str) -> str:
    return "self_attn" if arch in KDA_ARCHS else "linear_attn"


def handler_of(arch: str):
    return {"kimi_linear": kda.HANDLER, "bailing_hybrid": kda.FULL_GATE_HANDLER}.get(arch, gated_delta.HANDLER)
