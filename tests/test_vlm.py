"""Vision-language models under sequence parallelism vs the same model without SP (issue 24).

Tiny Qwen2.5-VL and Qwen3-VL (transformers' own code, configs built here, fp32, weights at std 0.2):
each rank embeds its own ``S/P`` tokens and merges only the visual rows of its shard (``vlm.merge``),
the tower's frames split over the group (one all-to-all of merged rows) or, without a group or with
fewer frames than ranks, each rank encoding the frames its shard touches; the 3-D mrope positions
come from the whole sample's metadata; images straddle shard boundaries. No ``[B, S, Hd]`` tensor
exists on a rank (a dispatch mode records every tensor the step makes). Each case compares each rank's per-position logits, the
loss and every parameter gradient (vision tower, deepstack mergers and token embeddings included)
with the model run without SP: on the whole sample as its own forward computes it (positions from
its own ``get_rope_index``), or, for packed samples, each document run alone.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from oracle import assert_step_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from vlm_models import labels_for, pack, sample, tiny_vlm

from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.parallel.loss import sp_causal_lm_loss
from ulysses_sp.parallel.mesh import init_mesh
from ulysses_sp.vlm import prepare_vlm_batch, shard_vlm

# Several images, a video (Qwen3-VL: frames apart after timestamps), text between; lengths chosen
# so the sequences divide by 4 and shard edges fall inside images.
DOC_A = [5, ("image", 4, 4), 3, ("video", 2, 4, 8), 2, ("image", 8, 4), 3]
DOC_B = [3, ("image", 4, 8), 5]
DOC_C = [2, ("video", 2, 4, 4), 4]


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op makes (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes.update(tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _full_hidden(shapes: set[tuple[int, ...]], s: int, hd: int) -> list[tuple[int, ...]]:
    """The recorded ``[B, S, Hd]`` shapes: a whole sequence of hidden vectors."""
    return [sh for sh in shapes if len(sh) == 3 and sh[1:] == (s, hd)]


def _docs(family: str, case: str, files: dict | None = None) -> list[dict[str, torch.Tensor]]:
    if case == "file":  # read from files by the chat loader: an image and a video clip (``file_docs``)
        return [dict(files[family])]
    if case == "single":
        return [sample(DOC_A, family, seed=1)]
    if case == "one":  # one image (fewer frames than ranks): the second half's rank encodes none of it
        return [sample([3, ("image", 4, 8), 25], family, seed=2)]
    return [sample(DOC_A, family, seed=1), sample(DOC_B, family, seed=2), sample(DOC_C, family, seed=3)]


def _pad_last(docs: list[dict[str, torch.Tensor]], multiple: int = 4) -> None:
    """Trailing text on the last document so the packed row divides by the SP size (the reference
    sees the same tokens)."""
    n = -sum(d["input_ids"].shape[1] for d in docs) % multiple
    doc = docs[-1] = dict(docs[-1])
    for key in ("input_ids", "mm_token_type_ids"):
        doc[key] = torch.cat([doc[key], torch.full((1, n), 7 if key == "input_ids" else 0)], dim=1)


def _reference(ref, docs):
    """No-SP logits ``[1, S, V]`` of every document run alone by the model's own forward, and the
    token-mean loss over all documents (no label across a document boundary)."""
    logits = torch.cat([ref(**d, use_cache=False).logits for d in docs], dim=1)
    labels = torch.cat([F.pad(labels_for(d["input_ids"])[:, 1:], (0, 1), value=-100) for d in docs], dim=1)
    return logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _cases(sp, cases, files=None):
    mesh = init_mesh((1, sp))
    done = []
    for family, case, split in cases:
        ref = tiny_vlm(family)
        hd = ref.config.text_config.hidden_size
        model = copy.deepcopy(ref)
        reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, mesh=mesh)
        group = mesh.sp_group if split else None  # images split over the group (vlm.split)
        handle = shard_vlm(model, sp_rank=mesh.sp_rank, sp_size=sp, core="sdpa", split_images_over=group)
        docs = _docs(family, case, files)
        _pad_last(docs)
        batch = pack(docs)
        batch["labels"] = labels_for(batch["input_ids"])
        s = batch["input_ids"].shape[1]
        with _Shapes() as ref_shapes:
            ref_logits, ref_loss = _reference(ref, docs)
            ref_loss.backward()
        one = max(d["input_ids"].shape[1] for d in docs)  # the oracle holds [1, S_doc, Hd]: the probe sees it
        assert _full_hidden(ref_shapes.shapes, one, hd), sorted(ref_shapes.shapes)
        inputs = prepare_vlm_batch(model, batch, sp_rank=mesh.sp_rank, sp_size=sp)
        labels = inputs.pop("shift_labels")
        seen: list[int] = []  # patch rows this rank's vision tower encodes
        probe = model.model.visual.patch_embed.register_forward_pre_hook(
            lambda m, a, seen=seen: seen.append(a[0].shape[0])
        )
        with _Shapes() as shapes:
            out = model(**inputs, use_cache=False)
            loss = sp_causal_lm_loss(out.logits, labels, mesh.sp_group)
            loss.backward()
        probe.remove()
        assert not _full_hidden(shapes.shapes, s, hd), _full_hidden(shapes.shapes, s, hd)  # no [B, S, Hd]
        assert (1, s // sp, hd) in shapes.shapes  # this rank's embeddings [B, S_l, Hd]
        total = sum(batch[k].shape[0] for k in ("pixel_values", "pixel_values_videos") if k in batch)
        encoded = torch.tensor(sum(seen))
        dist.all_reduce(encoded, group=mesh.sp_group)
        if split and case != "one":  # each frame encoded once over the group
            assert sum(seen) < total and int(encoded) == total, (seen, total)
        else:  # each rank encodes the frames its shard touches
            assert sum(seen) < total or case == "one", (seen, total)
        for p in model.parameters():
            dist.all_reduce(p.grad, group=mesh.sp_group)
        cols = slice(mesh.sp_rank * s // sp, (mesh.sp_rank + 1) * s // sp)
        tag = (family, case, split, sp)
        torch.testing.assert_close(
            out.logits, ref_logits[:, cols], rtol=1e-5, atol=1e-5, msg=lambda m, t=tag: f"{t}: {m}"
        )
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        assert_step_close(
            loss.detach(), {n: p.grad for n, p in model.named_parameters()}, ref_loss.detach(), ref_grads
        )
        assert (
            reg.attention.calls == model.config.text_config.num_hidden_layers
        )  # the vision tower's are not SP's
        handle.remove()
        reg.remove()
        done.append(tag)
    return done


SP2 = [("qwen2_5_vl", "single", False), ("qwen3_vl", "single", False), ("qwen2_5_vl", "packed", False),
       ("qwen2_5_vl", "single", True), ("qwen3_vl", "packed", True), ("qwen3_vl", "one", True),
       ("qwen2_5_vl", "file", True), ("qwen3_vl", "file", False)]  # fmt: skip
SP4 = [("qwen3_vl", "packed", False), ("qwen2_5_vl", "packed", True)]  # kv heads 2 < sp 4: replicated


@pytest.fixture(scope="module")
def file_docs(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    """Per family, a sample ``vlm.data.load_vlm_chat`` reads from files: an image, then a 10-frame clip
    (Qwen2.5-VL: 2 temporal patches 1.25 s apart, ``second_per_grid_ts``; Qwen3-VL: 3, each after its
    timestamp tokens), then text. The directory's model is ``tiny_vlm(family)``, as the cases build."""
    import json

    import numpy as np
    from PIL import Image
    from transformers import AutoConfig
    from vlm_models import save_video, save_vlm_dir

    from ulysses_sp.vlm.data import load_vlm_chat

    path = tmp_path_factory.mktemp("vlm_files")
    Image.fromarray((np.random.default_rng(0).random((20, 28, 3)) * 255).astype("uint8")).save(path / "a.png")
    save_video(str(path / "clip.mp4"))
    parts = [{"type": "image", "image": "a.png"}, {"type": "video", "video": "clip.mp4"},
             {"type": "text", "text": "what happens next?"}]  # fmt: skip
    record = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "it moves"}]}
    (path / "chat.jsonl").write_text(json.dumps(record) + "\n")
    out = {}
    for family in ("qwen2_5_vl", "qwen3_vl"):
        save_vlm_dir(str(path / family), family)
        config = AutoConfig.from_pretrained(path / family)
        (sample_,) = load_vlm_chat(str(path / "chat.jsonl"), str(path / family), config=config, seq_len=512)
        assert "pixel_values_videos" in sample_ and ("second_per_grid_ts" in sample_) == (family == "qwen2_5_vl")
        out[family] = {k: v for k, v in sample_.items() if k != "labels"}
    return out


@pytest.mark.parametrize("sp, cases", [(2, SP2), (4, SP4)], ids=["sp2", "sp4"])
def test_vlm_logits_loss_and_every_gradient_equal_no_sp(pool, sp, cases, file_docs):
    results = pool.run(_cases, sp, sp, cases, file_docs)
    assert all(r == [(f, c, split, sp) for f, c, split in cases] for r in results)


def _engine_step(sp, stage):
    """One SGD step through ``initialize`` (DDP at stage 0, FSDP2 at 3 with the images split over the
    group) against the same step without SP; returns the largest parameter change so the test knows the step moved something."""
    from ulysses_sp import initialize

    mesh = init_mesh((1, sp))
    ref = tiny_vlm("qwen3_vl")
    model = copy.deepcopy(ref)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, mesh=mesh)
    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": stage},
           "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}  # fmt: skip
    if stage == 3:  # images split over the group, installed before initialize (which keeps it)
        shard_vlm(model, sp_rank=mesh.sp_rank, sp_size=sp, split_images_over=mesh.sp_group)
    engine, _, _, _ = initialize(model, cfg, mpu=reg)
    docs = _docs("qwen3_vl", "packed")
    _pad_last(docs)
    batch = pack(docs)
    batch["labels"] = labels_for(batch["input_ids"])
    _, ref_loss = _reference(ref, docs)
    ref_loss.backward()
    inputs = prepare_vlm_batch(model, batch, sp_rank=mesh.sp_rank, sp_size=sp)
    engine.backward(engine(**inputs).loss)
    engine.step()
    moved = 0.0
    with torch.no_grad():
        for (n, p), (_, r) in zip(engine.module.named_parameters(), ref.named_parameters()):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            want = r - 0.5 * r.grad
            torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
            moved = max(moved, float((want - r).abs().max()))
    engine.vlm.remove()
    reg.remove()
    return moved


def _engine_steps(sp, stages):
    return [_engine_step(sp, stage) for stage in stages]


def test_vlm_engine_step_equals_no_sp_with_ddp_and_fsdp2(pool):
    assert all(m > 1e-3 for ranks in pool.run(_engine_steps, 2, 2, (0, 3)) for m in ranks)


def test_zero3_shards_a_vlm_block_by_block_never_the_whole_language_model():
    """FSDP2's units of a VLM are its vision blocks and decoder layers (before this, the whole
    ``model.model`` was one unit: ZeRO 3 gathered every language-model weight at once)."""
    from ulysses_sp.engine.sharding import fsdp_units

    for family, layers in (("qwen2_5_vl", 2), ("qwen3_vl", 3)):
        model = tiny_vlm(family)
        units = {n for n, m in model.named_modules() if any(m is u for u in fsdp_units(model))}
        assert units == {"model.visual.blocks.0", "model.visual.blocks.1",
                         *(f"model.language_model.layers.{i}" for i in range(layers))}, (family, units)  # fmt: skip


def test_the_planner_counts_the_vision_tower_in_the_model_states():
    """``train``'s fit check and ``plan`` see a VLM's vision tower: its parameters join the language
    model's in the states (parameters, gradients, AdamW state), exactly the tower's count."""
    from ulysses_sp.plan.hardware import DEVICES
    from ulysses_sp.plan.inputs import ModelShape
    from ulysses_sp.plan.model import predict
    from ulysses_sp.run.config import RunConfig
    from ulysses_sp.run.preflight import settings_for, vision_params, vlm_shape

    settings = settings_for(RunConfig(seq_len=64, sp=1, zero_stage=0), 1, "cpu")
    for family in ("qwen2_5_vl", "qwen3_vl"):
        model = tiny_vlm(family)
        tower = sum(p.numel() for p in model.model.visual.parameters())
        assert vision_params(model.config) == tower and vision_params(model.config.get_text_config()) == 0
        alone = ModelShape.from_hf_config(model.config.get_text_config())
        with_tower = predict(vlm_shape(model.config, alone), settings, DEVICES["cpu"]).breakdown
        without = predict(alone, settings, DEVICES["cpu"]).breakdown
        assert with_tower["parameters"] - without["parameters"] == 4 * tower  # fp32
        assert with_tower["optimizer_state"] - without["optimizer_state"] == 8 * tower  # AdamW's two moments


def test_a_vlm_language_model_is_planned_as_built_experts_and_qk_norms_included():
    """transformers' causal-LM class cannot build a Qwen-VL text config, so ``plan`` and ``train``'s fit check read the
    language model off the whole model built on the ``meta`` device: Qwen3-VL-MoE's exact count (its 60 experts
    a layer: 13.5B, where the Llama formula gave 1.5B), its routed experts and Qwen3's q/k norms; the tower apart."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from ulysses_sp.run.preflight import vlm_shape

    config = AutoConfig.for_model("qwen3_vl_moe")
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    tower = sum(p.numel() for p in model.model.visual.parameters())
    shape = vlm_shape(config)
    assert shape.params == sum(p.numel() for p in model.parameters()) and shape.extra_params == tower
    assert shape.routed is not None and shape.routed.top_k == config.text_config.num_experts_per_tok and shape.qk_norm


def _trainer_run(sp_size: int, accum: int, lr: float = 1e-2) -> dict:
    """Two steps of ``transformers.Trainer`` on Qwen3-VL samples (batch 1 per rank), eval once;
    ``sp_size=0``: no ``prepare`` (the oracle, data parallel over the same 2 processes). Unpacked
    samples: transformers' own forward does not keep packed VLM documents apart (the model-path
    test above checks packing against each document run alone)."""
    import tempfile

    from hf_runs import accelerate_env
    from transformers import Trainer, TrainingArguments

    from ulysses_sp.integrations.transformers import prepare

    docs = [sample(DOC_A, "qwen3_vl", seed=1), sample(DOC_B, "qwen3_vl", seed=2), sample(DOC_C, "qwen3_vl", seed=3),
            sample(DOC_C + DOC_B, "qwen3_vl", seed=4)]  # fmt: skip
    rows = [{**d, "labels": labels_for(d["input_ids"])} for d in docs]
    model = tiny_vlm("qwen3_vl")
    with accelerate_env(), tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], save_strategy="no", max_steps=2,
                                 per_device_train_batch_size=1, per_device_eval_batch_size=1,
                                 gradient_accumulation_steps=accum, learning_rate=lr, logging_steps=1, seed=0,
                                 disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False)  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=rows * 2, eval_dataset=rows,
                          data_collator=lambda examples: examples[0])  # fmt: skip
        handle = prepare(trainer, sp_size=sp_size) if sp_size else None
        trainer.train()
        logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
        eval_loss = trainer.evaluate()["eval_loss"]
        if handle is not None:
            handle.remove()
    return {"logs": logs, "eval_loss": eval_loss}


def test_vlm_trainer_sp2_steps_and_eval_equal_trainer_without_sp(pool):
    pytest.importorskip("accelerate", reason="the hf extra (pip install ulysses-sp[hf]) is not installed")
    ref = pool.run(_trainer_run, 2, 0, 1)
    sp = pool.run(_trainer_run, 2, 2, 2)
    assert sp[0] == sp[1] and len(ref[0]["logs"]) == len(sp[0]["logs"]) == 2, (sp, ref)
    for (loss, norm), (ref_loss, ref_norm) in zip(sp[0]["logs"], ref[0]["logs"]):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4), (
            sp,
            ref,
        )
    assert sp[0]["eval_loss"] == pytest.approx(ref[0]["eval_loss"], rel=1e-5)
