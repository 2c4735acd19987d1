"""Tiled compute (single process): tiled == untiled to fp32 rounding, undo, bad input, and memory.

Equivalence: the same model and batch run with and without tiling must give the same loss and
every parameter gradient (``assert_close`` at fp32 tolerances; the gradients are O(1), so a
missing tile or a doubled one cannot pass). Memory: measured with ``ulysses_sp.memory.meter`` on CPU at
shapes where the tiled tensors dominate; each test states its prediction from the shapes.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import pytest
import torch
from models import global_batch, shift, tiny_model
from oracle import assert_step_close
from torch import nn
from transformers.utils import ModelOutput

from ulysses_sp.memory._tiled import auto_num_shards
from ulysses_sp.memory.meter import track_peak_memory
from ulysses_sp.memory.offload import enable_activation_checkpointing
from ulysses_sp.memory.tiling import (
    TiledCausalLMLoss,
    TiledMLP,
    apply_tiled_mlp,
    sequence_tiled_compute,
    tiled_causal_lm_loss,
)
from ulysses_sp.parallel.loss import sp_causal_lm_loss

VOCAB, B, S = 256, 2, 24
ARCHS = ("llama", "qwen2")
E = 4  # bytes per fp32 element


def _batch(seq=S):
    ids = global_batch(3, B, seq, VOCAB)
    labels = shift(ids)
    labels[0, : seq // 3] = -100  # a run of ignored labels: whole tiles without a valid token
    return ids, labels


def _step(model, ids, labels, *, tiled_loss=None):
    model.zero_grad(set_to_none=True)
    if tiled_loss is None:
        loss = sp_causal_lm_loss(model(input_ids=ids, use_cache=False).logits, labels, None)
    else:
        loss = tiled_loss(model, {"input_ids": ids}, labels, None).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(a, b):
    # loss rtol 1e-6; gradients rtol 1e-5, atol 1e-5 x the tensor's largest gradient
    assert_step_close(*a, *b, loss_rtol=1e-6, rtol=1e-5, atol_cap=math.inf)


def _checkpointing(model, mode):
    if mode is None:
        return
    enable_activation_checkpointing(model, use_reentrant=mode == "reentrant")
    model.train()


# ---------------------------------------------------------------- the generic mechanism


@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_sequence_tiled_compute_equals_whole_call(n):
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(8, 16), nn.Linear(16, 8)
    params = [*lin1.parameters(), *lin2.parameters()]

    def fn(t):
        return lin2(torch.tanh(lin1(t)))

    x = torch.randn(3, 7, 8, requires_grad=True)
    g = torch.randn(3, 7, 8)
    ref = fn(x)
    ref_grads = torch.autograd.grad(ref, [x, *params], g)
    out = sequence_tiled_compute(fn, x, n, params=params)
    grads = torch.autograd.grad(out, [x, *params], g)
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_sum_reduction_with_aux_and_dropout_rng_replayed():
    torch.manual_seed(0)
    lin = nn.Linear(6, 6)
    drop = nn.Dropout(0.5)
    w = torch.randn(2, 9)

    def fn(t, wt):  # per-token weights as aux; dropout must see the same masks in the recompute
        return (drop(lin(t)).pow(2).sum(-1) * wt).sum()

    x = torch.randn(2, 9, 6, requires_grad=True)
    torch.manual_seed(1)
    out = sequence_tiled_compute(fn, x, 3, params=list(lin.parameters()), aux=(w,), reduction="sum")
    gx, gw = torch.autograd.grad(out, [x, lin.weight])
    torch.manual_seed(1)  # the same three dropout draws, one per tile, on the whole-call path
    parts = [fn(x[:, i : i + 3], w[:, i : i + 3]) for i in (0, 3, 6)]
    ref = sum(parts)
    rx, rw = torch.autograd.grad(ref, [x, lin.weight])
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


def test_parameters_missing_from_params_are_detected():
    lin = nn.Linear(4, 4)
    x = torch.randn(1, 4, 4, requires_grad=True)
    out = sequence_tiled_compute(lin, x, 2)  # lin's parameters not passed
    with pytest.raises(ValueError, match=r"not passed in params .*\(4, 4\)"):
        out.sum().backward()


def test_deepspeed_style_tiledmlp_apply():
    model = tiny_model("llama", vocab=VOCAB)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 10, 32, requires_grad=True)
    ref = mlp(x)
    ref_g = torch.autograd.grad(ref.sum(), [x, *mlp.parameters()])
    out = TiledMLP.apply(lambda self, t: type(self).forward(self, t), mlp, x, 4)
    g = torch.autograd.grad(out.sum(), [x, *mlp.parameters()])
    torch.testing.assert_close(out, ref)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b)


def test_auto_num_shards_rule():
    assert auto_num_shards(4096, 4096) == 1
    assert auto_num_shards(8192, 4096) == 2
    assert auto_num_shards(100, 32) == 4  # ceil(100 / 32)
    assert auto_num_shards(64, 32, batch_size=3) == 6
    assert auto_num_shards(5, 1, batch_size=8) == 5  # never more tiles than tokens


# ---------------------------------------------------------------- on HF models: equality


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ckpt", [None, "non_reentrant", "reentrant"])
def test_tiled_mlp_same_loss_and_gradients(arch, ckpt):
    ref = tiny_model(arch, vocab=VOCAB)
    model = copy.deepcopy(ref)
    _checkpointing(ref, ckpt)
    _checkpointing(model, ckpt)
    ids, labels = _batch()
    handle = apply_tiled_mlp(model, 5)  # 24 tokens -> tiles of 5,5,5,5,4
    assert handle.module_names == [f"model.layers.{i}.mlp" for i in range(2)]
    _assert_same(_step(model, ids, labels), _step(ref, ids, labels))


def test_tiled_mlp_finds_feed_forward_blocks_of_hybrids():
    """Bamba and Falcon-H1 name their MLP ``feed_forward``, Nemotron-H its MLP block ``mixer`` (``--tiled-mlp``
    said "no submodule named 'mlp'"): those blocks are tiled by default, with the untiled loss and gradients."""
    from hybrid_models import hybrid_model

    blocks = {"bamba": [f"model.layers.{i}.feed_forward" for i in range(2)],
              "falcon_h1": [f"model.layers.{i}.feed_forward" for i in range(2)], "nemotron_h": ["model.layers.3.mixer"]}  # fmt: skip
    for arch, names in blocks.items():
        ref = hybrid_model(arch, vocab=VOCAB)
        model = copy.deepcopy(ref)
        ids, labels = _batch()
        handle = apply_tiled_mlp(model, 5)
        assert handle.module_names == names
        _assert_same(_step(model, ids, labels), _step(ref, ids, labels))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n", [None, 1, 4, 24])
def test_tiled_loss_same_loss_and_gradients(arch, n):
    ref = tiny_model(arch, vocab=VOCAB)
    model = copy.deepcopy(ref)
    ids, labels = _batch()
    out = _step(model, ids, labels, tiled_loss=TiledCausalLMLoss(num_shards=n))
    _assert_same(out, _step(ref, ids, labels))


@pytest.mark.parametrize("arch", ARCHS)
def test_all_techniques_together_with_checkpointing(arch):
    ref = tiny_model(arch, vocab=VOCAB)
    model = copy.deepcopy(ref)
    _checkpointing(model, "non_reentrant")
    ids, labels = _batch()
    with apply_tiled_mlp(model, 3):
        out = _step(model, ids, labels, tiled_loss=TiledCausalLMLoss(num_shards=6))
    _assert_same(out, _step(ref, ids, labels))


def test_tiled_loss_all_ignored_is_zero_not_nan():
    model = tiny_model("llama", vocab=VOCAB)
    ids, _ = _batch()
    labels = torch.full_like(ids, -100)
    loss, grads = _step(model, ids, labels, tiled_loss=TiledCausalLMLoss(num_shards=4))
    assert loss.item() == 0.0
    assert all(torch.isfinite(g).all() and not g.any() for g in grads.values())


@dataclass
class _LogitsOnly(ModelOutput):
    """A model output with no ``loss`` field: setting ``.loss`` alone does not make it an item."""

    logits: torch.Tensor | None = None


class _LogitsOnlyLM(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm, self.config = lm, lm.config

    def get_output_embeddings(self) -> nn.Module:
        return self.lm.get_output_embeddings()

    def forward(self, **inputs) -> _LogitsOnly:
        return _LogitsOnly(logits=self.lm(**inputs).logits)


@pytest.mark.parametrize("wrapped", [False, True])
def test_tiled_loss_output_holds_the_loss_as_item_and_attribute(wrapped):
    # transformers' ModelOutput is a mapping: out["loss"] must work as on the engine's untiled path
    model = tiny_model("llama", vocab=VOCAB)
    ids, labels = _batch()
    ref = sp_causal_lm_loss(model(input_ids=ids, use_cache=False).logits, labels, None)
    out = TiledCausalLMLoss(num_shards=3)(
        _LogitsOnlyLM(model) if wrapped else model, {"input_ids": ids}, labels, None
    )
    assert "loss" in out and out["loss"] is out.loss
    torch.testing.assert_close(out["loss"], ref, rtol=1e-6, atol=0)


def test_tiled_loss_function_matches_sp_causal_lm_loss_directly():
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=True)
    h = torch.randn(3, 11, 16, requires_grad=True)
    labels = torch.randint(0, 50, (3, 11))
    labels[1] = -100
    ref = sp_causal_lm_loss(head(h), labels, None)
    ref_g = torch.autograd.grad(ref, [h, *head.parameters()])
    loss = tiled_causal_lm_loss(h, head, labels, None, num_shards=4)
    g = torch.autograd.grad(loss, [h, *head.parameters()])
    torch.testing.assert_close(loss, ref)
    for a, b in zip(g, ref_g):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- undo


def test_undo_restores_the_untouched_model():
    model = tiny_model("qwen2", vocab=VOCAB)
    ids, labels = _batch()
    before = _step(model, ids, labels)
    mlps = [layer.mlp for layer in model.model.layers]
    forwards = [m.forward for m in mlps]
    handle = apply_tiled_mlp(model, 4)
    assert all("forward" in m.__dict__ for m in mlps)
    handle.remove()
    for m, f in zip(mlps, forwards):
        assert "forward" not in m.__dict__  # the class's forward again, not a copy of it
        assert m.forward.__func__ is type(m).forward is f.__func__
    after = _step(model, ids, labels)
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    for n in before[1]:
        torch.testing.assert_close(after[1][n], before[1][n], rtol=0, atol=0)
    handle.remove()  # idempotent


def test_undo_restores_a_previously_patched_forward_object():
    model = tiny_model("llama", vocab=VOCAB)
    mlp = model.model.layers[0].mlp
    own = mlp.forward
    mlp.forward = own  # someone else's instance-level forward
    apply_tiled_mlp(model, 2).remove()
    assert mlp.__dict__["forward"] is own


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("n", [0, -3, True, 2.0])
def test_bad_num_shards(n):
    model = tiny_model("llama", vocab=VOCAB)
    with pytest.raises(ValueError, match="num_shards"):
        apply_tiled_mlp(model, n)
    with pytest.raises(ValueError, match="num_shards"):
        TiledCausalLMLoss(num_shards=n)


def test_num_shards_larger_than_local_sequence():
    model = tiny_model("llama", vocab=VOCAB)
    ids, labels = _batch(seq=8)
    apply_tiled_mlp(model, 9)
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.mlp: tiled MLP num_shards \(9\) is larger than the local sequence length \(8\)",
    ):
        model(input_ids=ids)
    with pytest.raises(ValueError, match=r"\(9\) is larger than the local sequence length \(8\)"):
        tiled_causal_lm_loss(torch.randn(2, 8, 4), nn.Linear(4, 5), labels, None, num_shards=9)


class _ConvMLP(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.proj = nn.Linear(h, h)
        self.mix = nn.Conv1d(h, h, 3, padding=1)  # mixes neighbouring tokens

    def forward(self, x):
        return self.mix(self.proj(x).transpose(1, 2)).transpose(1, 2)


class _CumsumMLP(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.proj = nn.Linear(h, h)

    def forward(self, x):  # only Linear submodules, but the forward mixes the sequence
        return self.proj(x).cumsum(dim=1)


def test_mlp_that_is_not_token_local_is_refused_and_named():
    model = tiny_model("llama", vocab=VOCAB)
    model.model.layers[1].mlp = _ConvMLP(32)
    with pytest.raises(
        ValueError, match=r"model\.layers\.1\.mlp\.mix \(Conv1d\) is not known to be token-local"
    ):
        apply_tiled_mlp(model)
    model.model.layers[1].mlp = _CumsumMLP(32)
    with pytest.raises(
        ValueError, match=r"cannot tile model\.layers\.1\.mlp \(_CumsumMLP\): it is not token-local"
    ):
        apply_tiled_mlp(model)
    assert "forward" not in model.model.layers[0].mlp.__dict__  # nothing half-applied


def test_applying_twice_is_refused():
    model = tiny_model("llama", vocab=VOCAB)
    handle = apply_tiled_mlp(model, 2)
    assert repr(handle) == "TiledMLPHandle(modules=2, num_shards=2)"
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp is already tiled"):
        apply_tiled_mlp(model)
    handle.remove()
    apply_tiled_mlp(model).remove()


def test_no_mlp_and_shape_errors():
    with pytest.raises(ValueError, match="no submodule named 'mlp' or 'feed_forward'"):
        apply_tiled_mlp(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match=r"expected hidden_states \[B, S_l, h\]"):
        tiled_causal_lm_loss(torch.randn(2, 8, 4), nn.Linear(4, 5), torch.zeros(2, 7, dtype=torch.long), None)


# ---------------------------------------------------------------- memory (CPU, memory.py)


def _fwd_bwd_peak(fn, x, grad=None):
    with track_peak_memory("cpu") as m:
        y = fn(x)
        y.backward(grad)
    return m.peak_bytes


def test_tiled_mlp_cuts_the_mlp_activation_peak_by_the_predicted_factor():
    """Shapes: S=1024 tokens, h=32, I=512 (I >> h, so the [tokens, I] tensors dominate), n=8.

    Prediction. Untiled, the MLP's backward holds 6 [S, I] tensors at once (gate, act(gate), up
    and act*up saved by forward; the gradients of the product's two factors and of act*up), so
    peak >= 6*S*I. Tiled, the same 6 exist for one tile of S/n tokens, plus at most one [T, h],
    two [S, h] (output, input gradient) and two copies of the weight gradients (the running sum
    and one tile's): peak <= 6*T*I + T*h + 2*S*h + 2*3*h*I (+ 4 KiB of scalars).
    Predicted factor >= 6SI / that = 5.59.
    """
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    s, h, i, n = 1024, 32, 512, 8
    t = s // n
    torch.manual_seed(0)
    mlp = LlamaMLP(LlamaConfig(hidden_size=h, intermediate_size=i))
    params = list(mlp.parameters())
    x = torch.randn(1, s, h, requires_grad=True)
    g = torch.randn(1, s, h)
    untiled = _fwd_bwd_peak(mlp, x, g)
    mlp.zero_grad(set_to_none=True)
    tiled = _fwd_bwd_peak(lambda v: sequence_tiled_compute(mlp.forward, v, n, params=params), x, g)
    lower_untiled = 6 * s * i * E
    upper_tiled = (6 * t * i + t * h + 2 * s * h + 2 * 3 * h * i) * E + 4096
    predicted = lower_untiled / upper_tiled
    measured = untiled / tiled
    report = f"MLP peak: untiled {untiled} B, tiled {tiled} B; factor measured {measured:.2f}, predicted {predicted:.2f}"
    assert untiled >= lower_untiled and tiled <= upper_tiled, report
    assert measured >= predicted > 5.5, report


def test_tiled_loss_cuts_the_logits_peak_by_the_predicted_factor():
    """Shapes: S=512 tokens, h=32, V=2048 (V >> h: logits dominate), n=8, fp32.

    Prediction. Untiled, cross-entropy's backward holds 3 [S, V] tensors (the saved log-softmax,
    its gradient, the logits' gradient): peak >= 3*S*V. Tiled, 3 [T, V] for one tile plus the
    hidden-state gradient [S, h] and two copies of the lm_head weight gradient [V, h]:
    peak <= 3*T*V + 2*S*h + 2*V*h (+ 4 KiB). Predicted factor >= 5.5.
    """
    s, h, v, n = 512, 32, 2048, 8
    t = s // n
    torch.manual_seed(0)
    head = nn.Linear(h, v, bias=False)
    labels = torch.randint(0, v, (1, s))
    x = torch.randn(1, s, h, requires_grad=True)
    untiled = _fwd_bwd_peak(lambda z: sp_causal_lm_loss(head(z), labels, None), x)
    head.zero_grad(set_to_none=True)
    tiled = _fwd_bwd_peak(lambda z: tiled_causal_lm_loss(z, head, labels, None, num_shards=n), x)
    lower_untiled = 3 * s * v * E
    upper_tiled = (3 * t * v + 2 * s * h + 2 * v * h) * E + 4096
    predicted = lower_untiled / upper_tiled
    measured = untiled / tiled
    report = f"loss peak: untiled {untiled} B, tiled {tiled} B; factor measured {measured:.2f}, predicted {predicted:.2f}"
    assert untiled >= lower_untiled and tiled <= upper_tiled, report
    assert measured >= predicted > 5.5, report


def test_tiled_mlp_in_a_model_frees_exactly_the_saved_intermediates():
    """Whole model, after forward: an untiled MLP keeps 4 [B, S, I] tensors per layer for backward
    (gate, act(gate), up, act*up); a tiled one keeps only its input, which the untiled projections
    keep too. Predicted difference: exactly L * 4 * B * S * I * 4 bytes."""
    ref = tiny_model("llama", vocab=VOCAB, hidden=32)
    model = copy.deepcopy(ref)
    apply_tiled_mlp(model, 8)
    ids = global_batch(0, 1, 256, VOCAB)
    live = []
    for m in (ref, model):
        with track_peak_memory("cpu") as mem:
            out = m(input_ids=ids, use_cache=False).logits.sum()
            live.append(mem.current_bytes)
        del out
    layers, i = ref.config.num_hidden_layers, ref.config.intermediate_size
    assert live[0] - live[1] == layers * 4 * 1 * 256 * i * E


def test_tiled_recompute_runs_under_the_forwards_autocast():
    """A bf16-autocast forward is recomputed in backward under the same autocast (backward runs outside the
    forward's context): the input gradient equals the untiled one bitwise; recomputed in fp32 it differed by
    ~0.4 % (relative norm). Parameter gradients differ only by the per-tile bf16 rounding of their sums."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    plain = nn.Sequential()
    plain.mlp = LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=256, hidden_act="silu"))
    tiled = copy.deepcopy(plain)
    apply_tiled_mlp(tiled, 4)
    x = torch.randn(1, 512, 64) * 3

    def grads(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        xx = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model.mlp(xx)
        assert y.dtype == torch.bfloat16
        y.float().pow(2).sum().backward()  # outside the autocast block, as training loops do
        return xx.grad, [p.grad for p in model.parameters()]

    (gx0, gp0), (gx1, gp1) = grads(plain), grads(tiled)
    assert torch.equal(gx0, gx1)
    for a, b in zip(gp0, gp1):
        assert (a - b).norm() / a.norm() < 3e-3
