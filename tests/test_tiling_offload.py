"""Activation offload: same numbers, checkpointed inputs off the device-side count, undo, bad input.

On CPU the offload copies each checkpointed layer input to a second storage allocated as
"host-side" (``memory.host_allocations``); the CPU tracker counts those bytes apart, which is what
lets these tests see the mechanism work on a machine without an accelerator.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from models import global_batch, shift, tiny_model
from oracle import assert_step_close

from ulysses_sp.memory.meter import track_peak_memory
from ulysses_sp.memory.offload import enable_activation_checkpointing, enable_activation_offload
from ulysses_sp.memory.tiling import TiledCausalLMLoss, apply_tiled_mlp
from ulysses_sp.parallel.loss import sp_causal_lm_loss

VOCAB, E = 256, 4


def _checkpointed(model, reentrant=False):
    enable_activation_checkpointing(model, use_reentrant=reentrant)
    return model.train()


def _step(model, ids, labels, loss_fn=None):
    model.zero_grad(set_to_none=True)
    if loss_fn is None:
        loss = sp_causal_lm_loss(model(input_ids=ids, use_cache=False).logits, labels, None)
    else:
        loss = loss_fn(model, {"input_ids": ids}, labels, None).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(a, b):
    # loss rtol 1e-6; gradients rtol 1e-5, atol 1e-5 x the tensor's largest gradient
    assert_step_close(*a, *b, loss_rtol=1e-6, rtol=1e-5, atol_cap=math.inf)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_offload_same_loss_and_gradients(arch, reentrant):
    ref = _checkpointed(tiny_model(arch, vocab=VOCAB), reentrant)
    model = copy.deepcopy(ref)
    ids = global_batch(0, 2, 16, VOCAB)
    labels = shift(ids)
    handle = enable_activation_offload(model)
    out = _step(model, ids, labels)
    layers, h = model.config.num_hidden_layers, model.config.hidden_size
    assert handle.stats.offloaded_tensors == layers
    assert handle.stats.offloaded_bytes == handle.stats.restored_bytes == layers * 2 * 16 * h * E
    _assert_same(out, _step(ref, ids, labels))


def test_offload_with_tiled_mlp_and_tiled_loss():
    ref = tiny_model("llama", vocab=VOCAB)
    model = _checkpointed(copy.deepcopy(ref))
    ids = global_batch(1, 2, 16, VOCAB)
    labels = shift(ids)
    with enable_activation_offload(model), apply_tiled_mlp(model, 4):
        out = _step(model, ids, labels, TiledCausalLMLoss(num_shards=4))
    _assert_same(out, _step(ref, ids, labels))


def test_offload_removes_checkpointed_inputs_from_the_device_count():
    """L=4 layers, B=1, S=2048, h=64: with checkpointing each layer keeps its input [B, S, h].

    Prediction: after forward the device-side count is lower by exactly L*B*S*h*4 bytes with
    offload, and the host-side count holds exactly those bytes; the peak (inside some layer's
    backward recompute) is lower by at least one layer input.
    """
    layers, s, h = 4, 2048, 64
    model = _checkpointed(tiny_model("llama", vocab=VOCAB, hidden=h, layers=layers))
    ids = global_batch(0, 1, s, VOCAB)
    labels = shift(ids)
    loss_fn = TiledCausalLMLoss(num_shards=16)  # keep the logits out of the way
    result = {}
    for offload in (False, True):
        handle = enable_activation_offload(model) if offload else None
        model.zero_grad(set_to_none=True)
        with track_peak_memory("cpu", include=model.parameters()) as mem:
            loss = loss_fn(model, {"input_ids": ids}, labels, None).loss
            after_forward = (mem.current_bytes, mem.host_current_bytes)
            loss.backward()
        result[offload] = (after_forward, mem.peak_bytes, mem.host_peak_bytes)
        if handle:
            handle.remove()
    inputs = layers * 1 * s * h * E
    (dev_off, host_off), peak_off, host_peak = result[True]
    (dev_on, host_on), peak_on, _ = result[False]
    report = (
        f"after forward: device {dev_on} -> {dev_off} B, host {host_off} B; peak {peak_on} -> {peak_off} B"
    )
    assert dev_on - dev_off == inputs, report
    assert (host_on, host_off, host_peak) == (0, inputs, inputs)
    assert peak_on - peak_off >= s * h * E, report


def test_offload_without_checkpointing_is_refused_with_the_reason():
    model = tiny_model("llama", vocab=VOCAB)
    with pytest.raises(
        ValueError, match=r"needs activation checkpointing.*enable_activation_checkpointing\(model\)"
    ):
        enable_activation_offload(model)
    with pytest.raises(ValueError, match="has 0 checkpointable layer"):
        enable_activation_offload(torch.nn.Linear(2, 2))


def test_enable_activation_checkpointing_turns_on_every_layer_without_deprecation_warning():
    import warnings

    model = tiny_model("llama", vocab=VOCAB)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the deprecated alias would warn here
        enable_activation_checkpointing(model)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


def test_enable_activation_checkpointing_falls_back_to_the_transformers_4_name():
    calls = []

    class OldModel(torch.nn.Module):  # transformers 4.x: no activation_checkpointing_enable
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            calls.append(gradient_checkpointing_kwargs)

    enable_activation_checkpointing(OldModel(), use_reentrant=True)
    assert calls == [{"use_reentrant": True}]


def test_enable_activation_checkpointing_refuses_a_model_without_it():
    with pytest.raises(ValueError, match="Linear is not a transformers model with activation checkpointing"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))


def test_remove_and_eval_do_not_offload():
    model = _checkpointed(tiny_model("qwen2", vocab=VOCAB))
    hooks_before = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.model.layers]
    ids = global_batch(2, 1, 8, VOCAB)
    handle = enable_activation_offload(model)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    assert handle.stats.offloaded_tensors == 0  # nothing is saved for backward: nothing to move
    model.train()
    model(input_ids=ids).logits.sum().backward()
    assert handle.stats.offloaded_tensors == 2
    handle.remove()
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.model.layers] == hooks_before
    model(input_ids=ids).logits.sum().backward()
    assert handle.stats.offloaded_tensors == 2


def test_disk_layers_write_the_first_inputs_to_files_same_numbers_no_host_bytes(tmp_path):
    """``disk_layers=2`` of 4: those layers' inputs go to files (off both the device and the host count),
    the other two to host memory; the same loss and gradients; every file gone after the backward."""
    import os

    layers, s, h = 4, 256, 64
    ref = _checkpointed(tiny_model("llama", vocab=VOCAB, hidden=h, layers=layers))
    model = copy.deepcopy(ref)
    ids = global_batch(2, 1, s, VOCAB)
    labels = shift(ids)
    handle = enable_activation_offload(model, disk_dir=str(tmp_path), disk_layers=2)
    written = []
    with track_peak_memory("cpu", include=model.parameters()) as mem:
        model.zero_grad(set_to_none=True)
        loss = sp_causal_lm_loss(model(input_ids=ids, use_cache=False).logits, labels, None)
        handle._disk._writer.submit(lambda: None).result()  # the writes queued so far have finished
        written = [f for d in os.listdir(tmp_path) for f in os.listdir(tmp_path / d)]
        host_after_forward = mem.host_current_bytes
        loss.backward()
    out = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    one = s * h * E
    assert handle.stats.disk_bytes == 2 * one and handle.stats.offloaded_bytes == 2 * one
    assert handle.stats.restored_bytes == 4 * one
    assert len(written) == 2 and host_after_forward == 2 * one  # two layers' inputs in files, two on the host
    assert [f for d in os.listdir(tmp_path) for f in os.listdir(tmp_path / d)] == []  # read back and removed
    _assert_same(out, _step(ref, ids, labels))
    handle.remove()
    assert os.listdir(tmp_path) == []  # the store's directory too


def test_disk_layers_out_of_range_is_refused():
    model = _checkpointed(tiny_model("llama", vocab=VOCAB, layers=2))
    with pytest.raises(ValueError, match=r"disk_layers 3 must be in \[0, 2\]"):
        enable_activation_offload(model, disk_layers=3)


@pytest.mark.parametrize("flags, match", [
    ({"disk_layers": 2, "activation_checkpointing": True}, r"--disk-layers 2: must be >= 0, and > 0 only with --offload-activations"),
    ({"disk_layers": -1}, r"--disk-layers -1: must be >= 0"),
    ({"offload_dir": "/nvme", "activation_checkpointing": True, "offload_activations": True}, r"--offload-dir .* give --disk-layers N too"),
])  # fmt: skip
def test_disk_layer_options_that_do_nothing_are_refused(flags, match):
    from ulysses_sp.run.checks import check_train_options
    from ulysses_sp.run.config import RunConfig

    with pytest.raises(ValueError, match=match):
        check_train_options(RunConfig(**flags))


def test_disk_layers_are_the_decoders_first_layers_not_a_vlms_vision_blocks(tmp_path):
    """A VLM's vision blocks come first in ``model.modules()``; the disk tier takes the decoder's first layers,
    the ones the planner's host term counts (``memory.offload.decoder_layers``)."""
    from vlm_models import tiny_vlm

    model = _checkpointed(tiny_vlm("qwen2_5_vl"))  # 2 vision blocks, then 2 decoder layers
    handle = enable_activation_offload(model, disk_dir=str(tmp_path), disk_layers=1)
    first = model.get_decoder().layers[0]
    assert handle._on_disk == {id(first)}
    handle.remove()
    with pytest.raises(ValueError, match=r"disk_layers 3 must be in \[0, 2\] \(the decoder's"):
        enable_activation_offload(model, disk_layers=3)
