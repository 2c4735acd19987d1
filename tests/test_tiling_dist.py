"""Tiling and offload across ranks: FSDP2, Ulysses SP (sp=2), and the engine at ZeRO 0 and 3.

Oracle everywhere: the plain model, no SP, no tiling, run in one process on the full batch, with
``sp_causal_lm_loss``. The distributed run must give the same loss and every parameter gradient.
FSDP2: tiling must not change how often parameters are all-gathered (once per unit per pass).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from models import global_batch, shift, tiny_model
from oracle import assert_step_close

from ulysses_sp.memory.offload import enable_activation_checkpointing, enable_activation_offload
from ulysses_sp.memory.tiling import TiledCausalLMLoss, apply_tiled_mlp
from ulysses_sp.parallel.loss import sp_causal_lm_loss

VOCAB, B, S = 256, 2, 16
E = 4


def _checkpointed(model):
    enable_activation_checkpointing(model)
    return model.train()


def _data(seed=5):
    ids = global_batch(seed, B, S, VOCAB)
    labels = shift(ids)
    labels[1, : S // 2 + 2] = -100  # the second sequence's first SP shard has no valid label
    return ids, labels


def _reference(arch):
    model = tiny_model(arch, vocab=VOCAB)
    ids, labels = _data()
    loss = sp_causal_lm_loss(model(input_ids=ids).logits, labels, None)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _compare(loss, grads, ref):
    # loss rtol 1e-5; gradients rtol 1e-4, atol 1e-5 x the tensor's largest gradient
    assert_step_close(loss, grads, *ref, atol_cap=math.inf)


def _apply(model, techniques):
    handles = []
    if "ckpt" in techniques or "offload" in techniques:
        _checkpointed(model)
    if "offload" in techniques:
        handles.append(enable_activation_offload(model))
    if "mlp" in techniques:
        handles.append(apply_tiled_mlp(model, 3))
    loss_fn = TiledCausalLMLoss(num_shards=3) if "loss" in techniques else None
    return loss_fn, handles


# ---------------------------------------------------------------- FSDP2: gathers once per unit


def _fsdp_run(techniques, mlp_units=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

    model = tiny_model("llama", vocab=VOCAB)
    loss_fn, _ = _apply(model, techniques)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        if mlp_units:  # the MLP its own unit: a per-tile gather would show up here
            fully_shard(layer.mlp, mesh=mesh)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids, labels = _data()  # every rank the same batch: FSDP's mean over ranks is the plain gradient
    calls = []
    original = pg.foreach_all_gather

    def counting(fsdp_params, *args, **kwargs):
        calls.append(len(fsdp_params))
        return original(fsdp_params, *args, **kwargs)

    pg.foreach_all_gather = counting
    try:
        if loss_fn is None:
            loss = sp_causal_lm_loss(model(input_ids=ids).logits, labels, None)
        else:
            loss = loss_fn(model, {"input_ids": ids}, labels, None).loss
        n_forward = len(calls)
        loss.backward()
    finally:
        pg.foreach_all_gather = original
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return loss.detach(), grads, n_forward, len(calls)


@pytest.mark.parametrize("techniques", [("mlp", "loss"), ("mlp", "loss", "ckpt"), ("mlp", "loss", "offload")])
@pytest.mark.parametrize("mlp_units", [False, True])
def test_fsdp2_tiled_gathers_once_per_unit_and_matches(pool, techniques, mlp_units):
    plain = pool.run(_fsdp_run, 2, (), mlp_units)
    tiled = pool.run(_fsdp_run, 2, techniques, mlp_units)
    ref = _reference("llama")
    # forward: the root, 2 layers (+ 2 MLPs); backward: the resharded layers (+ MLPs) again; the
    # root keeps its parameters. Tiling 3 ways must not add a single gather.
    expected = (5, 9) if mlp_units else (3, 5)
    for rank in range(2):
        loss, grads, fwd_gathers, all_gathers = tiled[rank]
        _compare(loss, grads, ref)
        assert (fwd_gathers, all_gathers) == (plain[rank][2], plain[rank][3]) == expected


# ---------------------------------------------------------------- Ulysses SP, sp=2


def _sp_run(arch, techniques):
    from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
    from ulysses_sp.parallel.mesh import init_mesh

    mesh = init_mesh((1, 2))
    model = tiny_model(arch, vocab=VOCAB)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, B, mesh=mesh)
    loss_fn, handles = _apply(model, techniques)
    group = reg.get_sequence_parallel_group()
    k, s_l = mesh.sp_rank, S // 2
    ids, labels = _data()
    cols = slice(k * s_l, (k + 1) * s_l)
    batch = {"input_ids": ids[:, cols], "position_ids": torch.arange(S)[cols].expand(B, -1)}
    model.train()
    if loss_fn is None:
        loss = sp_causal_lm_loss(model(**batch).logits, labels[:, cols], group)
    else:
        loss = loss_fn(model, batch, labels[:, cols], group).loss
    loss.backward()
    for p in model.parameters():  # the gradient contract: sum over the SP group
        dist.all_reduce(p.grad, group=group)
    stats = [h.stats.offloaded_bytes for h in handles if hasattr(h, "stats")]
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, stats


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("techniques", [("mlp",), ("loss",), ("offload",), ("mlp", "loss", "offload")])
def test_sp2_each_technique_matches_no_sp(pool, arch, techniques):
    ref = _reference(arch)
    for loss, grads, stats in pool.run(_sp_run, 2, arch, techniques):
        _compare(loss, grads, ref)
        if "offload" in techniques:  # each rank offloads its own [B, S/2, h] input of each layer
            assert stats == [2 * B * (S // 2) * 32 * E]


# ---------------------------------------------------------------- the engine, ZeRO 0 and 3


def _engine_run(stage, techniques, arch="llama"):
    from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
    from ulysses_sp.engine import initialize
    from ulysses_sp.parallel.mesh import init_mesh

    model = tiny_model(arch, vocab=VOCAB)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, B, mesh=init_mesh((1, 2)))
    loss_fn, _ = _apply(model, techniques)
    cfg = {"train_batch_size": B, "zero_optimization": {"stage": stage, "partition": "all"}}
    engine, _, _, _ = initialize(model, cfg, mpu=reg, loss_fn=loss_fn)
    k, s_l = engine.sp_rank, S // 2
    ids, labels = _data()
    cols = slice(k * s_l, (k + 1) * s_l)
    engine.train()
    out = engine(
        input_ids=ids[:, cols], position_ids=torch.arange(S)[cols].expand(B, -1), shift_labels=labels[:, cols]
    )
    engine.backward(out.loss)
    grads = {}
    for n, p in engine.module.named_parameters():
        g = p.grad
        grads[n] = g.full_tensor() if hasattr(g, "full_tensor") else g.clone()
    return out.loss.detach(), grads


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize(
    "arch, techniques",
    [("llama", ()), ("llama", ("mlp", "loss", "offload")), ("qwen2", ("mlp", "loss", "offload"))],
)
def test_engine_zero_stages_with_tiling_and_offload_match_no_sp(pool, stage, arch, techniques):
    ref = _reference(arch)
    for loss, grads in pool.run(_engine_run, 2, stage, techniques, arch):
        _compare(loss, grads, ref)
