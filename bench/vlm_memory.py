"""Peak memory per rank of a Qwen2.5-VL step vs sp, at two lengths; the vision tower's own apart.

Run (about 5 minutes on 2 CPU cores): ``python -m bench.vlm_memory [--out bench/results/vlm_memory.md]``

A random Qwen2.5-VL (text: hidden 256, 4 layers, 8 heads, vocab 1024; vision: hidden 128, depth 4), one fp32 step on
one sample of 32x32-patch images (256 tokens each) then ~256 text tokens at sp 1, 2, 4 (gloo), each rank merging its
shard (``vlm.merge``), frames split over the group (``initialize``'s default) or those its shard touches (no group).
Per rank (``track_peak_memory``, CPU dispatch counter, parameters in the baseline): the step's extra bytes, and the
vision tower's forward + backward over this rank's share (``vlm.split``).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from bench import md
from bench.launch import max_over_ranks, parser, run_worker, serve
from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.memory.meter import track_peak_memory
from ulysses_sp.parallel.loss import sp_causal_lm_loss
from ulysses_sp.parallel.mesh import init_mesh
from ulysses_sp.vlm import prepare_vlm_batch, shard_vlm
from ulysses_sp.vlm.layout import rows_by_rank, shard_index
from ulysses_sp.vlm.split import encode, plan_frames

MIB, IMAGE_TOKENS, TEXT_TOKENS = 2**20, 256, 256


def _model():
    """The random Qwen2.5-VL of the module docstring, fp32, seed 0."""
    text = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 6, 6]})  # fmt: skip
    vision = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=32, out_hidden_size=256, fullatt_block_indexes=[3])  # fmt: skip
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=1000, video_token_id=1001,
                           vision_start_token_id=1002, vision_end_token_id=1003)  # fmt: skip
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration._from_config(cfg, attn_implementation="sdpa").float()


def _sample(images: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = [torch.tensor([1000] * IMAGE_TOKENS + [5]) for _ in range(images)]  # the images first (a prompt) ...
    ids = torch.cat(ids + [torch.randint(3, 900, (TEXT_TOKENS + -len(ids) % 4,), generator=g)])[None]  # ... the answer
    return {"input_ids": ids, "pixel_values": torch.randn(images * 4 * IMAGE_TOKENS, 96, generator=g),
            "image_grid_thw": torch.tensor([[1, 32, 32]] * images)}  # fmt: skip


def worker(images: int, split: bool) -> dict:
    """This rank's step and vision-tower peaks (max over ranks) with ``images`` images at sp = world size."""
    sp = dist.get_world_size()
    model, batch = _model(), _sample(images)
    mesh = init_mesh((1, sp))
    if sp > 1:
        UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, mesh=mesh)
        shard_vlm(model, sp_rank=mesh.sp_rank, sp_size=sp, split_images_over=mesh.sp_group if split else None)
    inputs = prepare_vlm_batch(model, batch, sp_rank=mesh.sp_rank, sp_size=sp)
    labels = inputs.pop("shift_labels")
    with track_peak_memory("cpu", include=model.parameters()) as step:
        sp_causal_lm_loss(model(**inputs, use_cache=False).logits, labels, mesh.sp_group if sp > 1 else None).backward()
    model.zero_grad(set_to_none=True)
    ids, group = inputs["input_ids"], mesh.sp_group if split and sp > 1 else None
    needed = rows_by_rank(ids == 1000, [shard_index(ids.shape[1], k, sp, 1, "cpu") for k in range(sp)])
    plan = plan_frames(batch["image_grid_thw"], needed, sp_rank=mesh.sp_rank, merge=4, split=group is not None)
    with track_peak_memory("cpu", include=model.parameters()) as vision:  # this rank's share of the tower
        encode(model.model.visual, [batch["pixel_values"]], plan, group)[0].sum().backward()
    return {"S": int(batch["input_ids"].shape[1]), "step": max_over_ranks(step.extra_bytes), "vision": max_over_ranks(vision.extra_bytes)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "vlm_memory.md")
    ap.add_argument("--images", type=int, help=argparse.SUPPRESS)  # the torchrun worker
    ap.add_argument("--split", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if serve(lambda: worker(args.images, args.split), args.out):
        return
    run = md.provenance(md.command("bench.vlm_memory", argv))
    rows = []
    for images in (4, 8):
        for sp, split in ((1, False), (2, False), (4, False), (2, True), (4, True)):
            r = run_worker("bench.vlm_memory", sp, ["--images", str(images)] + ["--split"] * split)[0]
            rows.append([r["S"], images * IMAGE_TOKENS, sp, "split" if split else ("its shard's" if sp > 1 else "all"), f"{r['step'] / MIB:.1f}", f"{r['vision'] / MIB:.1f}", f"{(r['step'] - r['vision']) / MIB:.1f}"])  # fmt: skip
    md.page(args.out, "vlm_memory: peak per rank of a Qwen2.5-VL step vs sp", run, [
        "Extra bytes over the parameters, max over ranks (CPU dispatch counter). The vision tower column is its forward "
        "+ backward over this rank's frames alone (split over the group, or those its shard touches).", md.table(["S", "image tokens", "sp", "frames encoded", "step peak MiB", "vision tower MiB", "step - vision MiB"], rows)])  # fmt: skip


if __name__ == "__main__":
    main()
