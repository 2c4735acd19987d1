"""The attention exchange chosen by size (``parallel/exchange_cost.py``, ``parallel/headwise.py``): packed and
head by head are both exact (per-position logits and every gradient vs the model without SP: MHA, GQA,
kv heads fewer than ranks, packed documents, the hybrid ring), send the same bytes through the
collectives (only their number differs), and ``auto`` picks packed below the backend's per-piece
threshold and head by head above it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from models import global_batch, tiny_model
from oracle import assert_grads_close

from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.parallel.exchange_cost import (
    GLOO_SHM,
    NCCL_IB,
    NCCL_NVLINK,
    check_exchange,
    fake_backend_as,
    link_for_backend,
    use_packed,
)
from ulysses_sp.parallel.mesh import init_mesh
from ulysses_sp.parallel.mesh_shape import shard_spans

DOCS = (9, 13, 10)  # 32 tokens: boundaries inside shards at sp 2 and 4 (and inside ring zigzag chunks)


def _reference(ref, ids, docs, weight):
    """No SP, each document alone: logits ``[1, S, V]``; the loss ``sum(logits * weight)`` backpropagated."""
    logits = torch.cat([ref(input_ids=ids[:, a - n : a]).logits for a, n in zip(torch.tensor(docs).cumsum(0), docs)], 1)
    (logits * weight).sum().backward()
    return logits.detach(), {n: p.grad for n, p in ref.named_parameters()}


def _sp_run(ref, mesh, sp, ring, exchange, ids, pos, weight, counted):
    """One SP forward+backward with ``exchange``; logits, summed gradients, the rank's columns, path, and
    ``(calls, bytes)`` through ``all_to_all_single`` in forward and in backward."""
    model = copy.deepcopy(ref)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, mesh=mesh, exchange=exchange)
    cols = torch.cat([torch.arange(a, b) for a, b in shard_spans(ids.shape[1], mesh.sp_rank, sp, ring)])
    real, sent = dist.all_to_all_single, []

    def counting(output, input, *args, **kw):
        sent.append(input.numel() * input.element_size())
        return real(output, input, *args, **kw)

    dist.all_to_all_single = counting
    try:
        logits = model(input_ids=ids[:, cols], position_ids=pos[:, cols]).logits
        fwd = list(sent)
        (logits * weight[:, cols]).sum().backward()
    finally:
        dist.all_to_all_single = real
    bwd = sent[len(fwd) :]
    counted[exchange] = ((len(fwd), sum(fwd)), (len(bwd), sum(bwd)))
    for p in model.parameters():  # each rank's share of the gradient, summed over the SP group
        dist.all_reduce(p.grad, group=mesh.sp_group)
    path, chosen = reg.attention.last_path, reg.attention.last_exchange
    reg.remove()
    assert chosen == exchange, (chosen, exchange)
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}, cols, path


def _compare(sp, ring, heads, kv, packed_docs, batch=1):
    mesh = init_mesh((1, sp), ring_size=ring)
    ref = tiny_model("llama", heads=heads, kv_heads=kv, hidden=8 * heads)
    ids = global_batch(5, batch, sum(DOCS))
    docs = DOCS if packed_docs else (sum(DOCS),)
    pos = torch.cat([torch.arange(n) for n in docs])[None].expand(batch, -1)
    weight = torch.randn(batch, ids.shape[1], ref.config.vocab_size, generator=torch.Generator().manual_seed(7))
    ref_logits, ref_grads = [], None
    for b in range(batch):  # each row and document alone; the gradients summed over the rows
        one = copy.deepcopy(ref)
        logits, grads = _reference(one, ids[b : b + 1], docs, weight[b : b + 1])
        ref_logits.append(logits)
        ref_grads = grads if ref_grads is None else {n: g + grads[n] for n, g in ref_grads.items()}
    ref_logits = torch.cat(ref_logits)
    counted, runs = {}, {}
    for exchange in ("packed", "headwise"):
        runs[exchange] = _sp_run(ref, mesh, sp, ring, exchange, ids, pos, weight, counted)
        logits, grads, cols, _ = runs[exchange]
        torch.testing.assert_close(logits, ref_logits[:, cols], rtol=1e-5, atol=1e-6)
        assert_grads_close(grads, ref_grads)
    # pure data movement: the same logits bit for bit either way
    assert torch.equal(runs["packed"][0], runs["headwise"][0])
    return runs["packed"][3], counted


@pytest.mark.parametrize(
    "sp, ring, heads, kv, packed_docs, path",
    [
        (2, 1, 8, 2, False, "sdpa"),  # GQA, kv heads split over the ranks
        (4, 1, 4, 2, True, "segments"),  # kv heads fewer than ranks (un-replicated head by head); documents
        (2, 1, 4, 1, False, "sdpa"),  # MQA
        (4, 2, 4, 2, True, "ring"),  # hybrid: 2 Ulysses x 2 ring
    ],
)
def test_packed_and_headwise_exchange_equal_no_sp(pool, sp, ring, heads, kv, packed_docs, path):
    results = pool.run(_compare, sp, sp, ring, heads, kv, packed_docs)
    assert {r[0] for r in results} == {path}


def test_both_exchanges_send_the_same_bytes_in_fewer_collectives_packed(pool):
    """Batch 2, 8 query / 2 kv heads at sp 4 (kv fewer than ranks): per layer head by head sends
    ``B (H_l + 2 Hkv_l)`` pieces in and ``B H_l`` out, packed one collective each way; the bytes equal."""
    sp, heads, kv, b, layers = 4, 8, 2, 2, 2
    for _, counted in pool.run(_compare, sp, sp, 1, heads, kv, False, batch=b):
        h_l, hkv_l = heads // sp, max(kv, sp) // sp
        for direction in (0, 1):  # forward, backward
            (pc, pb), (hc, hb) = counted["packed"][direction], counted["headwise"][direction]
            assert pb == hb > 0, counted
            assert pc == 2 * layers, counted  # q/k/v in, the output out (backward: their gradients)
            assert hc == layers * (b * (h_l + 2 * hkv_l) + b * h_l), counted


def test_auto_is_packed_below_the_per_piece_threshold_and_headwise_above():
    for link in (GLOO_SHM, NCCL_NVLINK, NCCL_IB):
        t = link.threshold_bytes
        assert use_packed("auto", t, link) and not use_packed("auto", t + 1, link)
        assert use_packed("packed", 1 << 40, link) and not use_packed("headwise", 1, link)
        # at the threshold the model's two times cross: n pieces of b bytes, n alpha vs one alpha + n b gamma
        n = 96
        below, above = (link.seconds(n * b, n, packed=True) < link.seconds(n * b, n, packed=False)
                        for b in (t // 2, 2 * t))  # fmt: skip
        assert below and not above
    # gloo's measured threshold: the speed bench's S 8192 (D 16, fp32) goes packed, the longest-fit runs'
    # sequences (S >= 11264, bench/longest_fit.py) head by head
    assert 8192 * 16 * 4 <= GLOO_SHM.threshold_bytes < 11264 * 16 * 4
    # NCCL: Llama-3-8B's pieces (D 128, bf16) go packed to ~100K tokens, head by head at 1M
    assert 65536 * 128 * 2 <= NCCL_NVLINK.threshold_bytes < (1 << 20) * 128 * 2
    with pytest.raises(ValueError, match="exchange must be one of auto, packed, headwise, got 'fast'"):
        check_exchange("fast")


def _auto_choice():
    mesh = init_mesh((1, 2))
    model = tiny_model("llama", heads=4, kv_heads=4, hidden=64)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, mesh=mesh)
    seen = []
    for s in (64, 2 * GLOO_SHM.threshold_bytes // (16 * 4)):  # pieces of S D 4 bytes: below, above
        s_l = s // 2
        with torch.no_grad():
            model(input_ids=global_batch(1, 1, s_l), position_ids=torch.arange(s_l)[None] + mesh.sp_rank * s_l)
        seen.append(reg.attention.last_exchange)
    reg.remove()
    return seen


def test_auto_exchange_goes_headwise_at_long_sequences(pool):
    assert pool.run(_auto_choice, 2) == [["packed", "headwise"]] * 2


def test_planner_models_the_packed_buffer_where_it_runs_and_keeps_capacity():
    """The planner decides as the layer does: packed at short sequences (its transient buffer in the peak,
    fewer collectives in the time), head by head at long ones, so the longest fitting sequence is the same
    as with head by head always."""
    from dataclasses import replace

    from ulysses_sp.plan.exchange import exchange_collectives, packed_exchange
    from ulysses_sp.plan.hardware import DEVICES
    from ulysses_sp.plan.inputs import LLAMA_8B, Settings
    from ulysses_sp.plan.model import max_seq_len, predict

    hw = DEVICES["h100"]
    short = Settings(seq_len=32768, sp=8, dtype="bf16", zero_stage=3, partition="all", activation_checkpointing=True,
                     tiled_mlp=True, tiled_loss=True)
    assert packed_exchange(LLAMA_8B, short, hw) and not packed_exchange(LLAMA_8B, replace(short, seq_len=1 << 20), hw)
    assert not packed_exchange(LLAMA_8B, replace(short, head_chunks=2), hw)  # head groups: their own exchange
    assert not packed_exchange(LLAMA_8B, replace(short, sp=1), hw)
    head = replace(short, exchange="headwise")
    packed, headwise = predict(LLAMA_8B, short, hw), predict(LLAMA_8B, head, hw)
    assert packed.peak_bytes >= headwise.peak_bytes and packed.comm_s < headwise.comm_s
    assert exchange_collectives(LLAMA_8B, short, hw) == 2 * LLAMA_8B.layers
    assert exchange_collectives(LLAMA_8B, head, hw) == LLAMA_8B.layers * (2 * 32 // 8 + 2 * 8 // 8)
    for s in (short, replace(short, sp=4, offload_activations=True, recompute_norms=True)):
        assert max_seq_len(LLAMA_8B, s, hw) == max_seq_len(LLAMA_8B, replace(s, exchange="headwise"), hw) > 1 << 17
    # CPU (gloo's threshold): the bench's S 8192 step goes packed, and the longest fit is unchanged
    cpu, tiny = DEVICES["cpu"], replace(LLAMA_8B, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=4,
                                        head_dim=16, vocab=256)  # fmt: skip
    bench = Settings(seq_len=8192, sp=2, zero_stage=1, device_type="cpu")
    assert packed_exchange(tiny, bench, cpu) and not packed_exchange(tiny, replace(bench, seq_len=1 << 16), cpu)
    budget = 2 << 30
    assert max_seq_len(tiny, bench, cpu, budget=budget) == max_seq_len(tiny, replace(bench, exchange="headwise"), cpu,
                                                                       budget=budget)  # fmt: skip


def test_train_takes_the_exchange_and_refuses_an_unknown_one_before_launch():
    from ulysses_sp.cli.args import build_parser
    from ulysses_sp.run.checks import check_train_options
    from ulysses_sp.run.config import RunConfig

    assert build_parser().parse_args(["train", "--exchange", "headwise"]).exchange == "headwise"
    check_train_options(RunConfig(exchange="packed"))
    with pytest.raises(ValueError, match="--exchange must be one of auto, packed, headwise, got 'fast'"):
        check_train_options(RunConfig(exchange="fast"))


def test_a_rehearsals_fake_group_exchanges_as_the_backend_it_stands_for():
    """A rehearsal of a gloo CPU run (``--device cpu``) must choose packed or head-by-head as gloo does
    (640 KiB per piece), not as NCCL (30 MB): the choice changes the step's transient buffers."""
    assert link_for_backend("fake") is NCCL_NVLINK
    with fake_backend_as("gloo"):
        assert link_for_backend("fake") is GLOO_SHM and link_for_backend("nccl") is NCCL_NVLINK
        with fake_backend_as("nccl"):
            assert link_for_backend("fake") is NCCL_NVLINK
        assert link_for_backend("fake") is GLOO_SHM
    assert link_for_backend("fake") is NCCL_NVLINK
