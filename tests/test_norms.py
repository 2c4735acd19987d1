"""Norm recompute (``memory.norms``): exact against the same model without it, and the memory it saves.

Exactness: per-position logits and every parameter gradient equal those of the run without norm
recompute (fp32, ``rtol=1e-6, atol=1e-6``: the same ops per token; the norm weights' gradients summed
over 4 tiles, the input gradients accumulated in another order) at sp 1 in process and at sp 2 through the engine at ZeRO 0 (DDP)
and 3 (FSDP2), each with and without activation checkpointing, with tiled MLP; the SP runs are also
checked against the plain no-SP oracle. Memory: ``track_peak_memory``
shows the saving derived from what the norm's ops save (fp32 and bf16).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from models import global_batch, shift, tiny_model
from oracle import assert_step_close

from ulysses_sp.memory.meter import track_peak_memory
from ulysses_sp.memory.norms import apply_norm_recompute
from ulysses_sp.memory.offload import enable_activation_checkpointing
from ulysses_sp.memory.tiling import apply_tiled_mlp
from ulysses_sp.parallel.loss import sp_causal_lm_loss

VOCAB, B, S = 256, 2, 16


def _assert_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


def _sp1_step(arch: str, recompute: bool, ckpt: bool, mlp: bool, shards: int = 4) -> dict[str, torch.Tensor]:
    model = tiny_model(arch, vocab=VOCAB).train()
    if ckpt:
        enable_activation_checkpointing(model)
    handles = [apply_tiled_mlp(model, 3)] if mlp else []
    if recompute:
        handles.append(apply_norm_recompute(model, shards))
    ids = global_batch(3, B, S, VOCAB)
    logits = model(input_ids=ids).logits
    sp_causal_lm_loss(logits, shift(ids), None).backward()
    return {"logits": logits.detach(), **{n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("mlp", [False, True])
def test_sp1_same_logits_and_gradients(ckpt, mlp):
    _assert_exact(_sp1_step("llama", True, ckpt, mlp), _sp1_step("llama", False, ckpt, mlp))


def _norm_output_saved(recompute: bool, norm: str = "post_attention_layernorm", mlp: bool = True) -> bool:
    """Whether layer 0's ``norm`` output is kept for backward."""
    model = tiny_model("llama", vocab=VOCAB).train()
    if mlp:
        apply_tiled_mlp(model, 3)
    if recompute:
        apply_norm_recompute(model, 4)
    outs, saved = [], set()
    getattr(model.model.layers[0], norm).register_forward_hook(lambda m, a, o: outs.append(o))

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=global_batch(3, B, S, VOCAB))
    return outs[0].untyped_storage().data_ptr() in saved


def test_a_tiled_mlp_absorbs_the_recomputed_norm_before_it():
    """With norm recompute the tiled MLP tiles ``mlp(norm(h))`` over the norm's input: the norm's
    ``[B, S, h]`` output is not kept for backward (it is without recompute); the values and every
    gradient stay exact (``test_sp1_same_logits_and_gradients``)."""
    assert _norm_output_saved(recompute=False)
    assert not _norm_output_saved(recompute=True)


@pytest.mark.parametrize("norm", ["input_layernorm", "post_attention_layernorm"])
def test_projections_absorb_the_recomputed_norm_before_them(norm):
    """Untiled MLP too: the q/k/v (and gate/up) projections tile ``proj(norm(h))`` over the norm's
    input, so neither norm's output is kept; exact (``test_sp1_same_logits_and_gradients``)."""
    assert _norm_output_saved(recompute=False, norm=norm, mlp=False)
    assert not _norm_output_saved(recompute=True, norm=norm, mlp=False)


def test_one_tile_matches_too():
    _assert_exact(_sp1_step("llama", True, True, False, 1), _sp1_step("llama", False, True, False))


def test_q_k_norms_are_matched_and_exact():
    from transformers import AutoModelForCausalLM, Qwen3Config

    def step(recompute: bool):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen3Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)).train()  # fmt: skip
        enable_activation_checkpointing(model)
        handle = apply_norm_recompute(model, 4) if recompute else None
        ids = global_batch(4, B, S, VOCAB)
        logits = model(input_ids=ids).logits
        sp_causal_lm_loss(logits, shift(ids), None).backward()
        return handle, {"logits": logits.detach(), **{n: p.grad for n, p in model.named_parameters()}}

    handle, got = step(True)
    assert sorted(n.rsplit(".", 1)[-1] for n in handle.module_names if ".layers.0." in n) == [
        "input_layernorm", "k_norm", "post_attention_layernorm", "q_norm"]  # fmt: skip
    assert "model.norm" in handle.module_names  # the final norm too
    _assert_exact(got, step(False)[1])


def test_undo_and_refusals():
    model = tiny_model("llama", vocab=VOCAB)
    classes = {type(m).forward for m in model.modules()}
    with apply_norm_recompute(model) as handle:
        assert len(handle.module_names) == 5  # 2 layers x 2, the final norm
        with pytest.raises(ValueError, match="already recomputes: remove the previous handle"):
            apply_norm_recompute(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert classes == {type(m).forward for m in model.modules()}
    with pytest.raises(ValueError, match="Linear has no RMSNorm-like module"):
        apply_norm_recompute(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="norm recompute num_shards"):
        apply_norm_recompute(model, 0)


# ---------------------------------------------------------------- the engine at sp 2, ZeRO 0 and 3


def _engine_step(stage: int, ckpt: bool, recompute: bool):
    from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
    from ulysses_sp.engine import initialize
    from ulysses_sp.parallel.mesh import init_mesh

    model = tiny_model("llama", vocab=VOCAB)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, B, mesh=init_mesh((1, 2)))
    if ckpt:
        enable_activation_checkpointing(model)
    handles = [apply_tiled_mlp(model, 2)] + ([apply_norm_recompute(model, 4)] if recompute else [])
    cfg = {"train_batch_size": B, "zero_optimization": {"stage": stage, "partition": "all"}}
    engine, _, _, _ = initialize(model, cfg, mpu=reg)
    k, s_l = engine.sp_rank, S // 2
    ids = global_batch(5, B, S, VOCAB)
    cols = slice(k * s_l, (k + 1) * s_l)
    engine.train()
    out = engine(input_ids=ids[:, cols], position_ids=torch.arange(S)[cols].expand(B, -1),
                 shift_labels=shift(ids)[:, cols])  # fmt: skip
    engine.backward(out.loss)
    grads = {}
    for n, p in engine.module.named_parameters():
        g = p.grad
        grads[n.replace("_fsdp_wrapped_module.", "").replace("module.", "", 1)] = (
            g.full_tensor() if hasattr(g, "full_tensor") else g.clone()
        )
    for h in handles:
        h.remove()
    reg.remove()
    dist.barrier()
    return out.loss.detach(), out.logits.detach(), grads


def _engine_runs():
    return {(stage, ckpt, rec): _engine_step(stage, ckpt, rec)
            for stage in (0, 3) for ckpt in (False, True) for rec in (False, True)}  # fmt: skip


def test_sp2_engine_zero0_and_zero3_exact(pool):
    model = tiny_model("llama", vocab=VOCAB)
    ids = global_batch(5, B, S, VOCAB)
    ref_loss = sp_causal_lm_loss(model(input_ids=ids).logits, shift(ids), None)
    ref_loss.backward()
    ref = ref_loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    for runs in pool.run(_engine_runs, 2):
        for (stage, ckpt, rec), (loss, logits, grads) in runs.items():
            if rec:  # the same run without norm recompute: the same numbers
                plain_loss, plain_logits, plain_grads = runs[(stage, ckpt, False)]
                _assert_exact({"loss": loss, "logits": logits, **grads},
                              {"loss": plain_loss, "logits": plain_logits, **plain_grads})  # fmt: skip
            assert_step_close(loss, grads, *ref, atol_cap=math.inf)  # and the no-SP oracle


# ---------------------------------------------------------------- the meter: the bytes saved


def _peak(dtype: torch.dtype, ckpt: bool, recompute: bool, seq: int, hidden: int) -> int:
    model = tiny_model("llama", hidden=hidden, vocab=64).to(dtype).train()  # a small head: the peak in the layers
    if ckpt:
        enable_activation_checkpointing(model)
    handle = apply_norm_recompute(model) if recompute else None
    ids = global_batch(6, 1, seq, 64)
    with track_peak_memory("cpu", include=model.parameters()) as mem:
        loss = model(input_ids=ids).logits.float().pow(2).mean()
        loss.backward()
    if handle is not None:
        handle.remove()
    return mem.peak_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ckpt", [False, True])
def test_meter_shows_the_saving(dtype, ckpt):
    """Without checkpointing the peak is the end of the forward, every norm (2 per layer, 2 layers,
    the final norm) saved: fp32 the normalised input (4 bytes per element of ``[S, h]``); bf16 the fp32 input copy
    and the bf16 normalised input (6), less the bf16 input the recomputed norm now keeps (2).
    With checkpointing the peak is one layer's backward: its two norms, fp32 4, bf16 6 (the layer
    input is kept by the checkpoint anyway). On top: the norm outputs the projections absorb."""
    seq, hidden = 512, 64
    per = {(torch.float32, False): 4, (torch.bfloat16, False): 4, (torch.float32, True): 4,
           (torch.bfloat16, True): 6}[(dtype, ckpt)]  # fmt: skip
    # and the layers' norm outputs the projections no longer keep (they absorb the norm): the
    # input norm's (q/k/v) and the post-attention norm's (gate/up), in the model's dtype
    absorbed = (2 if ckpt else 4) * seq * hidden * dtype.itemsize
    predicted = (2 if ckpt else 5) * seq * hidden * per + absorbed
    saved = _peak(dtype, ckpt, False, seq, hidden) - _peak(dtype, ckpt, True, seq, hidden)
    assert 0.8 * predicted <= saved <= 1.2 * predicted, (saved, predicted)


class _GatedNorm(torch.nn.Module):
    """A gated RMSNorm (as in sequence mixers): matched by its ``variance_epsilon`` and 1-D weight."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = torch.nn.Parameter(torch.ones(hidden)), 1e-6

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight
        return y if gate is None else y * torch.sigmoid(gate)


def test_a_norm_called_with_a_gate_runs_unchanged():
    norm = _GatedNorm(8)
    x, gate = torch.randn(2, 6, 8, requires_grad=True), torch.randn(2, 6, 8)
    want = norm(x, gate)
    with apply_norm_recompute(torch.nn.Sequential(norm), 3) as handle:
        assert handle.module_names == ["0"]
        torch.testing.assert_close(norm(x, gate), want, rtol=0, atol=0)
        torch.testing.assert_close(norm(x), norm.forward.__wrapped__(x), rtol=1e-6, atol=1e-6)
