"""One layout per run: ``init_mesh`` reuses communicators, the engine adopts the attention's layout,
registrations stack and unstack in any order, and a step's masks do not outlive the step."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
import torch.distributed as dist
from harness import WorkerError
from models import global_batch, tiny_model

from ulysses_sp import initialize
from ulysses_sp.attention.registration import ATTN_NAME
from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.parallel.mesh import init_mesh

ENGINE_CONFIG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _one_layout_per_shape():
    m1 = init_mesh((1, 2))
    out = {"same_shape_reused": init_mesh(sp_size=2) is m1, "other_shape_new": init_mesh((2, 1)) is not m1}
    model = tiny_model("llama")
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1)
    out["registration_reuses"] = reg.mesh is m1
    engine, *_ = initialize(model, ENGINE_CONFIG, mesh_param=(1, 2))
    out["engine_reuses"] = engine.mesh is m1 and engine.sp_group is reg.get_sequence_parallel_group()
    reg.remove()
    return out


def _engine_adopts_a_device_mesh_registration():
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "sequence_parallel"))
    model = tiny_model("llama")
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, mesh=device_mesh)
    engine, *_ = initialize(model, ENGINE_CONFIG, mesh_param=(1, 2))
    adopted = engine.mesh is reg.mesh
    reg.remove()
    return adopted


def test_engine_adopts_the_layout_of_an_attention_registered_on_a_device_mesh(pool):
    assert pool.run(_engine_adopts_a_device_mesh_registration, 2) == [True, True]


def test_init_mesh_reuses_a_live_layout_and_the_engine_adopts_the_attentions(pool):
    for out in pool.run(_one_layout_per_shape, 2):
        assert out == dict.fromkeys(out, True)


def _engine_on_other_layout():
    model = tiny_model("llama")
    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1)
    initialize(model, ENGINE_CONFIG, mesh_param=(2, 1))


def test_engine_refuses_a_layout_other_than_the_attentions(pool):
    with pytest.raises(WorkerError) as ei:
        pool.run(_engine_on_other_layout, 2)
    assert len(ei.value.failures) == 2
    for msg in ei.value.messages():
        assert "sequence-parallel attention was registered on SPMesh(dp_size=1, sp_size=2" in msg
        assert "would train on SPMesh(dp_size=2, sp_size=1" in msg


def _registrations_unstack_in_any_order(order):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    mesh = init_mesh((1, 2))
    models = [tiny_model("llama", seed=i) for i in range(3)]
    regs = [UlyssesSPAttentionHF.register_with_transformers(m, "sdpa", 2, 1, mesh=mesh) for m in models]
    seen = []
    for i in order:
        regs[i].remove()
        top = ALL_ATTENTION_FUNCTIONS.get(ATTN_NAME)
        seen.append(next((j for j, r in enumerate(regs) if r.attention is top), None))
    impls = [m.config._attn_implementation for m in models]
    return seen, impls


@pytest.mark.parametrize(
    "order, tops",
    [
        ((0, 1, 2), [2, 2, None]),
        ((1, 2, 0), [2, 0, None]),  # the fixed-name bug: removing 2 restored the removed 1
        ((2, 1, 0), [1, 0, None]),
        ((0, 2, 1), [2, 1, None]),
    ],
)
def test_registrations_removed_out_of_order_leave_no_stale_entry(pool, order, tops):
    for seen, impls in pool.run(_registrations_unstack_in_any_order, 2, order):
        assert seen == tops
        assert impls == ["sdpa"] * 3


def _attach_several_models():
    mesh = init_mesh((1, 2))
    first, second = tiny_model("llama"), tiny_model("qwen2", attn="eager")
    ids = global_batch(1, 1, 8)
    before = [m(input_ids=ids).logits.detach() for m in (first, second)]
    reg = UlyssesSPAttentionHF.register_with_transformers(first, "sdpa", 2, 1, mesh=mesh)
    reg.attach(second)
    attached = [m.config._attn_implementation for m in (first, second)]
    reg.remove()
    hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in (first, second)]
    after = [m(input_ids=ids).logits.detach() for m in (first, second)]
    restored = [m.config._attn_implementation for m in (first, second)]
    return attached, restored, hooks, all(torch.equal(b, a) for b, a in zip(before, after))


def test_remove_restores_every_attached_model(pool):
    for attached, restored, hooks, same in pool.run(_attach_several_models, 2):
        assert attached == [ATTN_NAME, ATTN_NAME]
        assert restored == ["sdpa", "eager"]
        assert hooks == [0, 0] and same


def _tensor_bytes(obj, seen=None) -> int:
    """Bytes of the tensors ``obj`` holds strongly (through attributes, containers, dataclasses)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    if dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
        return sum(_tensor_bytes(v, seen) for k, v in vars(obj).items() if k != "registration")
    return 0


def _step_state_after_backward(seq, core):
    mesh = init_mesh((1, 2))
    model = tiny_model("llama", attn=core)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, core, 2, 1, mesh=mesh)
    s_l, k = seq // 2, mesh.sp_rank
    # three packed documents: position ids restart, so eager needs the dense document mask (sdpa's
    # blockwise core the O(S) document ids)
    positions = torch.cat([torch.arange(n) for n in (seq // 2, seq // 4, seq - seq // 2 - seq // 4)])[None]
    ids = global_batch(2, 1, seq)
    batch = {
        "input_ids": ids[:, k * s_l : (k + 1) * s_l],
        "position_ids": positions[:, k * s_l : (k + 1) * s_l],
    }
    out = model(**batch)
    out.logits.float().pow(2).mean().backward()
    during = _tensor_bytes(reg.attention)
    del batch, out
    gc.collect()
    after = _tensor_bytes(reg.attention)
    reg.remove()
    dist.barrier()
    return during, after


def test_step_masks_are_released_with_the_steps_position_ids(pool):
    seq = 512  # eager: the one core that still builds a dense mask (sdpa's is O(S): the test below)
    for during, after in pool.run(_step_state_after_backward, 2, seq, "eager"):
        assert during >= seq * seq  # the [1, 1, S, S] boolean document mask, held for the step
        assert after == 0, f"{after} bytes of the finished step still held by the attention"


def test_packed_documents_on_sdpa_hold_no_dense_mask_and_release_their_state(pool):
    seq = 512
    for during, after in pool.run(_step_state_after_backward, 2, seq, "sdpa"):
        # the blockwise core's per-forward state: document ids (device + host copy), O(S), no [S, S]
        assert 0 < during <= 4 * 8 * seq, during
        assert after == 0, f"{after} bytes of the finished step still held by the attention"
