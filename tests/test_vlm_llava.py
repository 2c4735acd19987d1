"""LLaVA-style vision-language models under sequence parallelism vs the same model without SP (issue 35).

Tiny LLaVA, GOT-OCR2, Mistral 3, Aya Vision, InternVL and Fuyu (transformers' own code, configs built in
``llava_models``, fp32, weights at std 0.2): each rank embeds its own ``S/P`` tokens and scatters
only the image rows of its shard (``vlm.scatter``), images straddling the shard boundaries, packed
documents kept apart by their positions. Each case compares each rank's per-position logits, the
loss and every parameter gradient (vision tower and projector included) with the model run without
SP (each document alone, by its own forward), and checks that no ``[B, S, Hd]`` tensor exists on a
rank. A wrong merge (the rows of the shard taken from the first placeholder on, as if the shard were
the whole sequence) is checked to change the logits. Fuyu (issue 36: patch rows through one Linear, a
Persimmon decoder whose layers do not pass position_ids to their attention) is admitted by its
``SCATTER_VLMS`` entry and refused without it. Gemma 3 also makes each image's tokens see each other
(``token_type_ids``): those spans, shipped with the positions' host layout, are checked the same way, and
checked to change the logits when left out.

Gemma 3n (``vlm.gemma3n``, ``gemma3n_model``): an image and an audio clip each across the shard edge, in a
``[2, S]`` batch and in packed documents; its hard-embedded media ids, per-layer inputs and padded audio soft
tokens included. Its layouts hold at sp 4 too (``S`` divides by 8; run there once by hand: exact).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from llava_models import FAMILIES, llava_labels, llava_pack, llava_sample, tiny_llava
from oracle import assert_step_close
from test_vlm import _full_hidden, _Shapes

from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.parallel.doc_layout import attach_layout, host_layout
from ulysses_sp.parallel.loss import sp_causal_lm_loss
from ulysses_sp.parallel.mesh import init_mesh
from ulysses_sp.vlm import prepare_vlm_batch, shard_vlm

DOC_A = [5, "image", 3, "image", 6]
DOC_B = [3, "image", 5]
DOC_C = [6]


def _reference(ref, docs):
    """No-SP logits ``[1, S, V]`` of every document run alone, and the token-mean loss over all."""
    logits = torch.cat([ref(**d, use_cache=False).logits for d in docs], dim=1)
    labels = torch.cat([F.pad(llava_labels(d["input_ids"])[:, 1:], (0, 1), value=-100) for d in docs], dim=1)
    return logits, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _wrong_rows(model, inputs):
    """The logits with the shard's rows counted from the batch's first placeholder (no shard offset)."""
    import ulysses_sp.vlm.scatter as scatter

    right = scatter.rows_by_rank
    scatter.rows_by_rank = lambda mask, idx: [r - r.min() if r.numel() else r for r in right(mask, idx)]
    try:
        with torch.no_grad():
            return model(**inputs, use_cache=False).logits
    finally:
        scatter.rows_by_rank = right


def _cases(sp, cases):
    mesh = init_mesh((1, sp))
    done = []
    for family, case in cases:
        ref = tiny_llava(family)
        hd = ref.config.text_config.hidden_size
        model = copy.deepcopy(ref)
        reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, mesh=mesh)
        handle = shard_vlm(model, sp_rank=mesh.sp_rank, sp_size=sp, core="sdpa")
        specs = [DOC_A] if case == "single" else [DOC_A, DOC_B, DOC_C]
        docs, batch = llava_pack([llava_sample(spec, family, seed=i) for i, spec in enumerate(specs)], 2 * sp)
        batch["labels"] = llava_labels(batch["input_ids"])
        s = batch["input_ids"].shape[1]
        ref_logits, ref_loss = _reference(ref, docs)
        ref_loss.backward()
        inputs = prepare_vlm_batch(model, batch, sp_rank=mesh.sp_rank, sp_size=sp)
        labels = inputs.pop("shift_labels")
        with _Shapes() as shapes:
            out = model(**inputs, use_cache=False)
            loss = sp_causal_lm_loss(out.logits, labels, mesh.sp_group)
            loss.backward()
        assert not _full_hidden(shapes.shapes, s, hd), _full_hidden(shapes.shapes, s, hd)  # no [B, S, Hd]
        assert (1, s // sp, hd) in shapes.shapes  # this rank's embeddings [B, S_l, Hd]
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=mesh.sp_group)
        cols = slice(mesh.sp_rank * s // sp, (mesh.sp_rank + 1) * s // sp)
        tag = (family, case, sp)
        torch.testing.assert_close(
            out.logits, ref_logits[:, cols], rtol=1e-5, atol=1e-5, msg=lambda m, t=tag: f"{t}: {m}"
        )
        # parameters the forward does not use (a tower's unused last norm or pooling head) have no gradient, and
        # a key bias's is zero in exact arithmetic (softmax is shift-invariant): both are rounding noise at most
        floor = 1e-7 * max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
        used = {n for n, p in ref.named_parameters() if p.grad is not None and float(p.grad.abs().max()) > floor}
        grads = {n: p.grad for n, p in model.named_parameters() if n in used}
        assert all(p.grad is None or float(p.grad.abs().max()) <= 10 * floor
                   for n, p in model.named_parameters() if n not in used), tag  # fmt: skip
        tower = "model.vision_embed_tokens." if family == "fuyu" else "model.vision_tower."  # Fuyu: one Linear, no projector
        assert any(n.startswith(tower) for n in used) and (family == "fuyu" or any("projector" in n for n in used)), tag
        assert_step_close(loss.detach(), grads, ref_loss.detach(), {n: p.grad for n, p in ref.named_parameters() if n in used})
        assert reg.attention.calls == model.config.text_config.num_hidden_layers  # the tower's are not SP's
        if case == "single":  # every rank runs it (the SP attention's collectives); the last shard's rows move
            wrong = _wrong_rows(model, inputs)
            assert mesh.sp_rank < sp - 1 or not torch.allclose(wrong, out.logits, atol=1e-3), tag
            full = torch.arange(s)[None]  # the text adapter's shard (S_l ids, the layout of all S): refused by name
            shard = attach_layout(full[:, cols].clone(), host_layout(full))
            with pytest.raises(ValueError, match=rf"got one shard's inputs \({s // sp} of {s} tokens.*VLMDataLoaderAdapter"):
                model(**{**inputs, "input_ids": inputs["input_ids"][:, cols], "position_ids": shard}, use_cache=False)
        handle.remove()
        reg.remove()
        done.append(tag)
    return done


SP2 = [*((f, "packed") for f in FAMILIES), ("got_ocr2", "single"), ("fuyu", "single")]  # the single case also proves a wrong merge fails


@pytest.mark.parametrize("sp, cases", [(2, SP2)], ids=["sp2"])
def test_llava_style_vlm_logits_loss_and_every_gradient_equal_no_sp(pool, sp, cases):
    results = pool.run(_cases, sp, sp, cases)
    assert all(r == [(f, c, sp) for f, c in cases] for r in results)


def _fuyu_admitted_then_refused() -> bool:
    from ulysses_sp.mixers.guard import check_sequence_mixing
    from ulysses_sp.vlm.families import SCATTER_VLMS, SUPPORTED_VLMS

    model = tiny_llava("fuyu")
    check_sequence_mixing(model, sp_size=2)  # admitted: the scatter path shards its merge
    patches = torch.randn(1, 15, 48)  # its processor's legacy image_patches [B, N, C*p*p], N == S: not per token
    batch = prepare_vlm_batch(model, {"input_ids": torch.randint(3, 100, (1, 15)), "image_patches": patches},
                              sp_rank=0, sp_size=2)  # fmt: skip
    assert batch["input_ids"].shape == (1, 16) and batch["image_patches"] is patches  # ids padded, patches whole
    family = SCATTER_VLMS.pop("fuyu"), SUPPORTED_VLMS.pop("fuyu")
    try:
        with pytest.raises(ValueError, match=r"FuyuForCausalLM is a multimodal model \(fuyu: its forward takes "
                           r"pixel_values, image_patches into model.vision_embed_tokens\)"):  # fmt: skip
            check_sequence_mixing(model, sp_size=2)
    finally:
        SCATTER_VLMS["fuyu"], SUPPORTED_VLMS["fuyu"] = family
    return True


def test_fuyu_is_admitted_by_its_scatter_entry_and_refused_without_it(pool):
    """Fuyu has no vision sub-config: its image path (``vision_embed_tokens``) is what the guard refuses without
    ``SCATTER_VLMS["fuyu"]`` (its own forward would merge over the whole sequence). On the pool: its workers have
    transformers' VLM classes imported already."""
    assert pool.run(_fuyu_admitted_then_refused, 1) == [True]


def _gemma3_cases(sp, cases):
    """Gemma 3 (``vlm.scatter`` with ``token_type_ids``): each image's 16 tokens see each other in the sliding
    (window 4) and full layers; the spans, found on the host by ``prepare_vlm_batch``, reach every rank's
    attention with the positions' layout. Packed documents, an image across the shard edge."""
    import dataclasses

    from ulysses_sp.parallel.doc_layout import attach_layout, layout_of
    from ulysses_sp.vlm import VLMDataLoaderAdapter

    mesh, done = init_mesh((1, sp)), []
    for core, chunk in cases:
        ref = tiny_llava("gemma3")
        model = copy.deepcopy(ref)
        reg = UlyssesSPAttentionHF.register_with_transformers(model, core, sp, 1, mesh=mesh, attn_chunk=chunk)
        handle = shard_vlm(model, sp_rank=mesh.sp_rank, sp_size=sp, core=core)
        docs, batch = llava_pack([llava_sample(spec, "gemma3", seed=i) for i, spec in enumerate((DOC_A, DOC_B, DOC_C))], 2 * sp)
        batch["labels"] = llava_labels(batch["input_ids"])
        ref_logits, ref_loss = _reference(ref, docs)  # each document alone, transformers' own image-block masks
        ref_loss.backward()
        inputs = prepare_vlm_batch(model, batch, sp_rank=mesh.sp_rank, sp_size=sp)
        labels = inputs.pop("shift_labels")
        out = model(**inputs, use_cache=False)
        loss = sp_causal_lm_loss(out.logits, labels, mesh.sp_group)
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=mesh.sp_group)
        s, tag = batch["input_ids"].shape[1], ("gemma3", core, sp)
        cols = slice(mesh.sp_rank * s // sp, (mesh.sp_rank + 1) * s // sp)
        torch.testing.assert_close(out.logits, ref_logits[:, cols], rtol=1e-5, atol=1e-5, msg=lambda m, t=tag: f"{t}: {m}")
        floor = 1e-7 * max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
        used = {n for n, p in ref.named_parameters() if p.grad is not None and float(p.grad.abs().max()) > floor}
        assert any(n.startswith("model.vision_tower.") for n in used) and any("projector" in n for n in used), tag
        assert all(p.grad is None or float(p.grad.abs().max()) <= 10 * floor
                   for n, p in model.named_parameters() if n not in used), tag  # fmt: skip
        assert_step_close(loss.detach(), {n: p.grad for n, p in model.named_parameters() if n in used},
                          ref_loss.detach(), {n: p.grad for n, p in ref.named_parameters() if n in used})  # fmt: skip
        # the spans not shipped (the same layout without them: causal over the images) move both ranks' logits
        pos = inputs["position_ids"]
        causal = attach_layout(pos.clone(), dataclasses.replace(layout_of(pos), spans=None))
        with torch.no_grad():
            wrong = model(**{**inputs, "token_type_ids": None, "position_ids": causal}, use_cache=False).logits
        assert not torch.allclose(wrong, out.logits, atol=1e-3), tag
        with pytest.raises(ValueError, match="given token_type_ids.*prepare_vlm_batch"):  # types without the spans
            model.model(**{**inputs, "position_ids": pos.clone()}, use_cache=False)
        handle.remove()
        reg.remove()
        done.append(tag)
    adapter = VLMDataLoaderAdapter([batch], 0, None, 1, "meta", model=ref)  # the spans survive the move to a device
    assert layout_of(next(iter(adapter))["position_ids"]).spans == (((5, 21), (24, 40), (49, 65)),)
    _gemma3_image_token_outside_the_vocabulary()
    return done


def _gemma3_image_token_outside_the_vocabulary():
    """An image token id past the text vocabulary is embedded as id 0, as Gemma 3's own forward does (one shard)."""
    from llava_models import IMAGE

    ref = tiny_llava("gemma3")
    ref.config.image_token_id = oov = 2 * ref.config.text_config.vocab_size
    model = copy.deepcopy(ref)
    _, batch = llava_pack([llava_sample(DOC_B, "gemma3")], 2)
    batch["input_ids"] = batch["input_ids"].masked_fill(batch["input_ids"] == IMAGE, oov)
    del batch["token_type_ids"]
    handle = shard_vlm(model, sp_rank=0, sp_size=1, core="sdpa")  # the per-shard forward, one shard
    inputs = prepare_vlm_batch(model, batch, sp_rank=0, sp_size=1)
    inputs.pop("shift_labels")
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, ref(**batch).logits, rtol=1e-5, atol=1e-5)
    handle.remove()


GEMMA3_SP2 = [("sdpa", 8), ("eager", None)]  # sdpa: the blockwise core, blocks of 8 (spans reach across them)


@pytest.mark.parametrize("sp, cases", [(2, GEMMA3_SP2)], ids=["sp2"])
def test_gemma3_image_blocks_bidirectional_logits_loss_and_every_gradient_equal_no_sp(pool, sp, cases):
    results = pool.run(_gemma3_cases, sp, sp, cases)
    assert all(r == [("gemma3", c, sp) for c, _ in cases] for r in results)

GEMMA3N_BATCH = [[12, "image", 2, "audio", 8], [21, "audio", 1, "image"]]  # sp 2: an image, a clip over the edge
GEMMA3N_PACKED = [[3, "audio", 10, "image", 2], ["audio", 2, "image", 3]]  # packed, an image over the edge (S = 72)
"""Gemma 3n's documents (ints: text runs): S = 48 and 72; at sp 4 the image of row 0 spans an edge, the clip of row 1
another, and row 1's image a third."""


def _gemma3n_cases(sp):
    """Gemma 3n (``vlm.gemma3n``): a ``[2, S]`` batch without packing, then packed documents."""
    from gemma3n_model import gemma3n_join, gemma3n_labels, gemma3n_sample, tiny_gemma3n

    mesh = init_mesh((1, sp))
    ref = tiny_gemma3n()
    model = copy.deepcopy(ref)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, mesh=mesh)
    handle = shard_vlm(model, sp_rank=mesh.sp_rank, sp_size=sp, core="sdpa")
    done = []
    for case, specs in (("batch", GEMMA3N_BATCH), ("packed", GEMMA3N_PACKED)):
        ref.zero_grad()
        model.zero_grad()
        docs = [gemma3n_sample(spec, seed=i) for i, spec in enumerate(specs)]
        batch = gemma3n_join(docs, packed=case == "packed")
        runs = docs if case == "packed" else [batch]  # the reference: each document alone, or the batch
        ref_logits = torch.cat([ref(**d, use_cache=False).logits for d in runs], dim=1)  # [B, S, V]
        labels = torch.cat([F.pad(gemma3n_labels(d["input_ids"])[:, 1:], (0, 1), value=-100) for d in runs], dim=1)
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        ref_loss.backward()
        inputs = prepare_vlm_batch(model, {**batch, "labels": gemma3n_labels(batch["input_ids"])}, sp_rank=mesh.sp_rank,
                                   sp_size=sp)  # fmt: skip
        shift = inputs.pop("shift_labels")
        b, s = batch["input_ids"].shape
        with _Shapes() as shapes:
            out = model(**inputs, use_cache=False)
            loss = sp_causal_lm_loss(out.logits, shift, mesh.sp_group)
            loss.backward()
        assert not _full_hidden(shapes.shapes, s, 64) and (b, s // sp, 64) in shapes.shapes  # [B, S_l, Hd] only
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=mesh.sp_group)
        cols = slice(mesh.sp_rank * s // sp, (mesh.sp_rank + 1) * s // sp)
        tag = ("gemma3n", case, sp)
        torch.testing.assert_close(out.logits, ref_logits[:, cols], rtol=1e-5, atol=1e-5, msg=lambda m, t=tag: f"{t}: {m}")
        # a key bias's gradient is zero in exact arithmetic (softmax is shift-invariant): rounding noise at most
        floor = 1e-7 * max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None and float(p.grad.abs().max()) > floor}
        grads = {n: p.grad for n, p in model.named_parameters() if n in ref_grads}
        assert all(p.grad is None or float(p.grad.abs().max()) <= 10 * floor
                   for n, p in model.named_parameters() if n not in ref_grads), tag  # fmt: skip
        for part in ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.", "embed_tokens_per_layer"):
            assert any(part in n for n in grads), (tag, part)
        assert_step_close(loss.detach(), grads, ref_loss.detach(), ref_grads)
        done.append(tag)
    one_clip = {k: v[:1] if k.startswith("input_features") else v for k, v in inputs.items()}
    with pytest.raises(ValueError, match=r"12 audio placeholder tokens \(id 105\) but its audio inputs make 6 soft"):
        model(**one_clip, use_cache=False)  # a clip short: named before any collective
    handle.remove()
    reg.remove()
    return done


def test_gemma3n_image_and_audio_logits_loss_and_every_gradient_equal_no_sp(pool):
    results = pool.run(_gemma3n_cases, 2, 2)
    assert all(r == [("gemma3n", c, 2) for c in ("batch", "packed")] for r in results)


PHI4_A = [3, ("image", 32, 64), 2, ("audio", 40), 2, ("image", 64, 32), 3]
"""Phi-4-multimodal: 3 text, 17 image rows, 2 text, 5 audio rows, 2 text, 19 image rows (29-47), 3 text (51 tokens)."""
PHI4_B = [4, ("audio", 40), 1, ("image", 32, 64), 5]
"""32 tokens packed after PHI4_A (84 with padding): the sp-2 boundary (42) falls in PHI4_A's second image, and rank
1's audio rows are the batch's 6th to 10th."""


def _phi4_reference(ref, docs):
    """No-SP logits ``[1, S, V]`` of each document alone (the conformer's numpy draw the same each call), the loss."""
    import numpy as np
    from phi4_models import phi4_labels

    logits = []
    for d in docs:
        np.random.seed(0)
        logits.append(ref(**d, use_cache=False).logits)
    ref_logits = torch.cat(logits, dim=1)
    labels = torch.cat([F.pad(phi4_labels(d["input_ids"])[:, 1:], (0, 1), value=-100) for d in docs], dim=1)
    return ref_logits, F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _phi4_cases(sp):
    """Through ``initialize`` at ZeRO 0 (DDP, which installs the merge): the towers' unused parameters (layers
    past the feature layer, the pooling head, the speech projection beside images) must not keep DDP from
    summing the other gradients over the SP group."""
    import numpy as np
    from phi4_models import phi4_labels, phi4_pack, phi4_sample, tiny_phi4

    from ulysses_sp import initialize

    mesh = init_mesh((1, sp))
    ref = tiny_phi4()
    hd = ref.config.hidden_size
    model = copy.deepcopy(ref)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, mesh=mesh)
    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": 0}, "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}
    engine, _, _, _ = initialize(model, cfg, mpu=reg)
    docs = [phi4_sample(spec, seed=i) for i, spec in enumerate((PHI4_A, PHI4_B))]
    batch = phi4_pack(docs, 2 * sp)
    s = batch["input_ids"].shape[1]
    batch["labels"] = phi4_labels(batch["input_ids"])
    ref_logits, ref_loss = _phi4_reference(ref, docs)
    ref_loss.backward()
    inputs = prepare_vlm_batch(model, batch, sp_rank=mesh.sp_rank, sp_size=sp)
    np.random.seed(0)
    with _Shapes() as shapes:
        out = engine(**inputs, use_cache=False)
        engine.backward(out.loss)  # gradients summed over the SP group by DDP's hook
    assert not _full_hidden(shapes.shapes, s, hd), _full_hidden(shapes.shapes, s, hd)  # no [B, S, Hd]
    cols = slice(mesh.sp_rank * s // sp, (mesh.sp_rank + 1) * s // sp)
    n = ref_logits.shape[1]  # the padding's logits are not the oracle's
    torch.testing.assert_close(out.logits[:, : max(0, n - cols.start)], ref_logits[:, cols], rtol=1e-5, atol=1e-5)
    floor = 1e-7 * max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
    used = {n for n, p in ref.named_parameters() if p.grad is not None and float(p.grad.abs().max()) > floor}
    assert all(p.grad is None or float(p.grad.abs().max()) <= 10 * floor
               for n, p in model.named_parameters() if n not in used)  # fmt: skip
    towers = ("image_embed.img_processor.", "image_embed.img_projection", "audio_embed.encoder.", "audio_embed.up_proj")
    assert all(any(t in n for n in used) for t in towers), sorted(used)
    grads = {n: p.grad for n, p in model.named_parameters() if n in used}
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if n in used}
    assert_step_close(out.loss.detach().to(ref_loss.dtype), grads, ref_loss.detach(), ref_grads)  # SP loss: fp32 sums
    assert reg.attention.calls == ref.config.num_hidden_layers  # the towers' attention is not SP's
    engine.vlm.remove()
    reg.remove()
    return "phi4_multimodal"


def test_phi4_multimodal_image_and_audio_rows_equal_no_sp(pool):
    assert pool.run(_phi4_cases, 2, 2) == ["phi4_multimodal"] * 2


def _tiny_git():
    """A tiny GIT (CLIP tower of 17 tokens an image: 4x4 patches + class), fp32, weights at std 0.2, no dropout."""
    from transformers import GitConfig, GitForCausalLM

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)  # fmt: skip
    config = GitConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       max_position_embeddings=64, bos_token_id=1, eos_token_id=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       vision_config=vision)  # fmt: skip
    torch.manual_seed(0)
    model = GitForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() >= 2 else p.normal_(1.0, 0.1)
    return model.float().eval()


def _git_cases(sp):
    """GIT (image prefix prepended inside its forward, ``vlm.prefix``) at ``sp`` against no SP: two rows with an
    image each (the 17-token prefix straddles the shard boundaries, the text padded to ``N + S`` a multiple of
    ``sp``), and text alone; logits, loss and every gradient (tower and projection included)."""
    import ulysses_sp.mixers.prefix_attention as prefix_attention
    from ulysses_sp.mixers.apply import apply_mixers

    mesh, done = init_mesh((1, sp)), []
    for case in ("image", "text"):
        ref = _tiny_git()
        model = copy.deepcopy(ref)
        g = torch.Generator().manual_seed(sp)
        batch = {"input_ids": torch.randint(3, 64, (2, 12), generator=g)}
        if case == "image":
            batch["pixel_values"] = torch.randn(2, 3, 32, 32, generator=g)
        n = 17 if case == "image" else 0
        ref_logits = ref(**batch, use_cache=False).logits  # [2, N + S, V]
        ref_labels = F.pad(batch["input_ids"][:, 1:], (n, 1), value=-100)  # the logit at N + i predicts text i + 1
        ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), ref_labels.flatten(), ignore_index=-100)
        ref_loss.backward()
        reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, mesh=mesh)
        handles = [reg, shard_vlm(model, sp_rank=mesh.sp_rank, sp_size=sp, core="sdpa"), apply_mixers(model, mesh)]
        inputs = prepare_vlm_batch(model, batch, sp_rank=mesh.sp_rank, sp_size=sp)
        labels = inputs.pop("shift_labels")
        out = model(**inputs, use_cache=False)
        loss = sp_causal_lm_loss(out.logits, labels, mesh.sp_group)
        loss.backward()
        for p in model.parameters():  # a rank without text (or image) tokens has no gradient for their modules
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            dist.all_reduce(p.grad, group=mesh.sp_group)
        t_l, total = out.logits.shape[1], n + 12
        lo, hi = mesh.sp_rank * t_l, min((mesh.sp_rank + 1) * t_l, total)  # the padded tail has no reference
        tag = (case, sp)
        torch.testing.assert_close(out.logits[:, : hi - lo], ref_logits[:, lo:hi], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, t=tag: f"{t}: {m}")  # fmt: skip
        # a key bias's gradient is zero in exact arithmetic (softmax is shift-invariant): rounding noise, not compared
        floor = 1e-7 * max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
        used = {n for n, p in ref.named_parameters() if p.grad is not None and float(p.grad.abs().max()) > floor}
        assert all(float(p.grad.abs().max()) <= 10 * floor for n, p in model.named_parameters() if n not in used), tag
        tower = any(n.startswith("git.image_encoder.") for n in used) and any("visual_projection" in n for n in used)
        assert case == "text" or tower, tag
        assert_step_close(loss.detach(), {n: p.grad for n, p in model.named_parameters() if n in used}, ref_loss.detach(),
                          {n: p.grad for n, p in ref.named_parameters() if n in used})  # fmt: skip
        assert reg.attention.calls == 2  # both layers' self-attention ran head-parallel
        if case == "image":  # a causal mask over the image (its prefix dropped) changes every rank's logits
            right = prefix_attention.prefix_mask
            prefix_attention.prefix_mask = lambda prefix, *a, right=right: right(0, *a)
            try:
                with torch.no_grad():
                    wrong = model(**inputs, use_cache=False).logits
            finally:
                prefix_attention.prefix_mask = right
            assert not torch.allclose(wrong, out.logits, atol=1e-3), tag
        for h in reversed(handles):
            h.remove()
        done.append(tag)
    return done


@pytest.mark.parametrize("sp", [2])  # sp 4 passes too (``_git_cases(4)``: 3 s warm), left out for the suite's time
def test_git_image_prefix_logits_loss_and_every_gradient_equal_no_sp(pool, sp):
    assert all(r == [("image", sp), ("text", sp)] for r in pool.run(_git_cases, sp, sp))


def test_git_batch_pads_the_text_to_n_plus_s_and_refuses_packed_rows():
    """``prepare_vlm_batch`` for GIT: its sequence is the 17 image tokens + the text, padded on the right to a
    multiple of sp; the labels ``-100`` over the image; packed positions refused (the image is the row's prefix)."""
    model = _tiny_git()
    ids = torch.arange(3, 15)[None]  # S = 12: N + S = 29 -> 32 at sp 4
    batch = {"input_ids": ids, "pixel_values": torch.zeros(1, 3, 32, 32)}
    shards = [prepare_vlm_batch(model, batch, sp_rank=r, sp_size=4, pad_token_id=0) for r in range(4)]
    assert shards[0]["input_ids"].shape == (1, 15) and shards[0]["input_ids"][0, 12:].tolist() == [0, 0, 0]
    labels = torch.cat([s["shift_labels"] for s in shards], dim=1)  # [1, 32]
    assert labels[0, :17].eq(-100).all() and labels[0, 17:28].tolist() == list(range(4, 15))
    assert labels[0, 28:].eq(-100).all()
    with pytest.raises(ValueError, match="a row packs no documents"):
        prepare_vlm_batch(model, {**batch, "position_ids": torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])},
                          sp_rank=0, sp_size=2)  # fmt: skip
