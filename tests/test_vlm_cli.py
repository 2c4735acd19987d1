"""``ulysses-sp train`` on a local vision-language model directory with chat JSONL with images
(issue 24) and videos (issue 35): at sp 2 exactly as at sp 1 (per-step losses and gradient norms, fp32),
for the README's tiny Qwen2.5-VL run as documented (images and a video clip, the frames split over the
group) and for a Qwen3-VL on packed rows with assistant-only loss, one sample with a clip
(each document's first-step loss as alone) loaded shard by shard at ZeRO 3 with activation
checkpointing and --split-images off; real tokens counted; bad input
and options that do not apply are refused before launch, naming the sample or the flag."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image
from vlm_models import save_video, save_vlm_dir

from ulysses_sp.cli.main import main
from ulysses_sp.run.config import RunConfig
from ulysses_sp.run.resolve import resolve_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = [sys.executable, "-m", "ulysses_sp.cli.main"]


def _readme_vlm_example() -> tuple[str, list[str]]:
    """The VLM guide's (docs/readme/vlm.md) tiny-VLM script and its `ulysses-sp train` command
    (argv after the program)."""
    text = open(os.path.join(ROOT, "docs", "readme", "vlm.md"), encoding="utf-8").read()
    script = re.search(r"```python\n(# make_tiny_vlm\.py — .*?)```", text, re.S).group(1)
    command = re.search(r"```bash\n(ulysses-sp train --model tiny-vlm [^\n]*)\n```", text).group(1)
    return script, command.split()[1:]


def _train(cwd, args: list[str], out: str, **flags) -> list[dict]:
    args = [*args, "--output-dir", out, "--no-progress", "--no-plot", "--timeout", "120"]
    for flag, value in flags.items():
        name = "--" + flag.replace("_", "-")
        if name in args:
            args[args.index(name) + 1] = str(value)
        else:
            args += [name, str(value)]
    if flags.get("nproc") == 1:  # one process: the CLI runs it without a launcher, here in this process
        with contextlib.chdir(cwd):
            main(args)
    else:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=400, cwd=cwd, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (cwd / out / "metrics.jsonl").read_text().splitlines()]


def _same(one: list[dict], two: list[dict], steps: int) -> None:
    assert len(one) == len(two) == steps
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"], (a, b)
        assert a["grad_norm"] > 0.1  # large weights: one wrong token would show


def _real_tokens(cwd, args: list[str], steps: int) -> tuple[list[int], int]:
    """The cumulative real (unpadded) tokens of the first ``steps`` steps of ``train args`` (dp 1, the
    default seed, one micro-step a step): the samples' lengths in the sampler's order; and how many
    of those samples hold a video."""
    from ulysses_sp.data import sp_dataloader

    flag = lambda name: args[args.index(name) + 1]  # noqa: E731
    mbs = int(flag("--micro-batch-size"))
    cfg = RunConfig(model=str(cwd / flag("--model")), data=str(cwd / flag("--data")),
                    seq_len=int(flag("--seq-len")), output_dir=str(cwd / "unused"), sp=1)  # fmt: skip
    samples = resolve_run(cfg, 1).dataset
    order = sp_dataloader(range(len(samples)), batch_size=mbs, dp_size=1, sp_size=1, dp_rank=0, sp_rank=0)
    batches = [[samples[int(i)] for i in batch] for batch in order][:steps]
    per_step = [sum(s["input_ids"].shape[1] for s in batch) for batch in batches]
    return np.cumsum(per_step).tolist(), sum("video_grid_thw" in s for batch in batches for s in batch)


def _chat(images: list[str], text: str, answer: str) -> dict:
    parts = [{"type": "image", "image": p} for p in images] + [{"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": parts},
                         {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vlm_cli")
    save_vlm_dir(str(path / "qwen3"), "qwen3_vl")
    rng = np.random.default_rng(1)
    for i, (h, w) in enumerate([(16, 24), (32, 16), (12, 12)]):
        Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")).save(path / f"p{i}.png")
    records = [_chat([f"p{i % 3}.png", f"p{(i + 1) % 3}.png"][: 1 + i % 2], f"describe {i}", "dots " * (1 + i))
               for i in range(6)]  # fmt: skip
    # sample 3 with a 2-frame clip too: one temporal patch after its timestamp (Qwen3-VL), 21 tokens
    save_video(str(path / "clip.mp4"), frames=2, height=16, width=16)
    records[3]["messages"][0]["content"].insert(-1, {"type": "video", "video": "clip.mp4"})
    (path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_readme_vlm_cli_example_trains_at_sp2_as_at_sp1(tmp_path):
    script, args = _readme_vlm_example()
    (tmp_path / "make_tiny_vlm.py").write_text(script)
    subprocess.run(
        [sys.executable, "make_tiny_vlm.py"], cwd=tmp_path, check=True, capture_output=True, timeout=300
    )
    two = _train(tmp_path, args, "sp2")  # as documented: --sp 2 --nproc 2, micro-batches of 2 (padded)
    one = _train(tmp_path, args, "sp1", sp=1, nproc=1)
    _same(one, two, steps=3)
    # tokens: the samples' real tokens, padding (micro-batches of 2 padded to the longer) not counted
    real, videos = _real_tokens(tmp_path, args, steps=3)
    assert [m["tokens"] for m in one] == [m["tokens"] for m in two] == real and real[-1] < 3 * 2 * 128
    assert videos > 0  # the clip read from clip.mp4 is in the steps compared


def _documents_alone_loss(path, seq_len: int, loss_on: str) -> tuple[float, int]:
    """The first step's loss by the model's own forward (no SP, no packing) on each document of the
    first packed row alone: the token mean over the row's documents (the oracle of a packed run); and
    how many samples with a video the first two rows hold."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForImageTextToText

    from ulysses_sp.data import sp_dataloader
    from ulysses_sp.data.bestfit import plan_blocks

    cfg = RunConfig(model=str(path / "qwen3"), data=str(path / "chat.jsonl"), seq_len=seq_len, sp=1,
                    output_dir=str(path / "unused"), loss_on=loss_on)  # fmt: skip
    samples = resolve_run(cfg, 1).dataset  # unpacked: one sample a row
    plan = plan_blocks(np.array([s["input_ids"].shape[1] for s in samples]), seq_len, packing="best-fit",
                       long_samples="truncate")  # fmt: skip
    rows = [int(r[0]) for r in sp_dataloader(range(len(plan)), batch_size=1, dp_size=1, sp_size=1, dp_rank=0,
                                             sp_rank=0)][:2]  # fmt: skip
    first = rows[0]
    videos = sum("video_grid_thw" in samples[int(i)] for r in rows for i in plan.sample[plan.offsets[r] : plan.offsets[r + 1]])
    model = AutoModelForImageTextToText.from_pretrained(str(path / "qwen3"), attn_implementation="sdpa")
    total, count = 0.0, 0
    for i in plan.sample[plan.offsets[first] : plan.offsets[first + 1]]:
        doc = samples[int(i)]
        with torch.no_grad():
            logits = model(**{k: v for k, v in doc.items() if k != "labels"}, use_cache=False).logits
        target = F.pad(doc["labels"][:, 1:], (0, 1), value=-100)
        total += float(F.cross_entropy(logits[0], target[0], ignore_index=-100, reduction="sum"))
        count += int((target != -100).sum())
    assert len(plan) < len(samples) and int(np.diff(plan.offsets)[first]) > 1  # the row packs documents
    return total / count, videos


def test_cli_trains_packed_qwen3_vl_chats_assistant_only_with_a_video_at_zero3_at_sp2_as_at_sp1(qwen3_dir):
    """Issue 35's done-when in one run: assistant-only loss, packing and a video, sp 2 = sp 1."""
    args = ["train", "--model", "qwen3", "--data", "chat.jsonl", "--seq-len", "160", "--steps", "2",
            "--micro-batch-size", "1", "--packing", "best-fit", "--loss-on", "assistant"]  # fmt: skip
    one = _train(qwen3_dir, args, "z0sp1", sp=1, nproc=1)
    # packed rows at sp 1 go through the SP path (transformers' own forward would mix the documents): its
    # first loss is that of each document alone through the model's own forward, assistant tokens only
    alone, videos = _documents_alone_loss(qwen3_dir, 160, "assistant")
    assert abs(one[0]["loss"] - alone) <= 1e-5 * one[0]["loss"]
    assert videos > 0  # the sample with the clip is in the two steps compared
    # weights loaded shard by shard; --split-images off: each rank encodes the frames its shard touches (the
    # README run above splits them over the group: auto, every micro-batch of two samples has >= 2 frames)
    three = _train(qwen3_dir, [*args, "--activation-checkpointing", "--split-images", "off"], "z3sp2", sp=2,
                   nproc=2, zero_stage=3)  # fmt: skip
    _same(one, three, steps=2)


def _resolve(path, **kw):
    kw = {"model": str(path / "qwen3"), "data": str(path / "chat.jsonl"), "seq_len": 96,
          "output_dir": str(path / "unused"), **kw}  # fmt: skip
    cfg = RunConfig(sp=2, steps=1, **kw)
    return resolve_run(cfg, 2, progress=False)


def test_resolve_reads_the_chat_once_with_image_tokens_in_the_length(qwen3_dir):
    run = _resolve(qwen3_dir)
    assert len(run.dataset) == 6 and run.model_config.model_type == "qwen3_vl"
    assert [("video_grid_thw" in s) for s in run.dataset] == [False] * 3 + [True] + [False] * 2
    s = run.dataset[1]  # two images: 32x16 -> 8x4 patches, 12x12 -> 16x16 pixels (min_pixels) -> 4x4
    assert s["image_grid_thw"].tolist() == [[1, 8, 4], [1, 4, 4]]
    assert (
        int((s["mm_token_type_ids"] == 1).sum()) == 8 + 4 == int((s["labels"][0] == -100).sum())
    )  # 2x2 merge


def test_packing_puts_whole_samples_in_rows_with_positions_restarting(qwen3_dir):
    import torch
    from vlm_models import tiny_vlm

    from ulysses_sp.vlm import prepare_vlm_batch

    samples = _resolve(qwen3_dir, seq_len=160).dataset
    rows = _resolve(qwen3_dir, seq_len=160, packing="best-fit").dataset
    assert len(rows) < len(samples)
    seen = []
    for row in rows:  # each row: whole samples (tokens, labels, images in order), positions from 0 at each
        starts = (row["position_ids"][0] == 0).nonzero().flatten().tolist() + [row["input_ids"].shape[1]]
        docs = [next(j for j, s in enumerate(samples) if j not in seen and s["input_ids"].shape[1] == hi - lo
                     and torch.equal(s["input_ids"][0], row["input_ids"][0, lo:hi])) for lo, hi in zip(starts, starts[1:])]  # fmt: skip
        seen += docs
        for key in ("labels", "image_grid_thw", "pixel_values"):
            assert torch.equal(row[key], torch.cat([samples[j][key] for j in docs], dim=1 if key == "labels" else 0))
    assert sorted(seen) == list(range(len(samples)))
    # a row of 96 tokens, as wide as a patch's pixel features (3 x 2 x 4 x 4): not taken for a per-token tensor
    row = next(r for r in rows if r["input_ids"].shape[1] == r["pixel_values"].shape[1] == 96)
    inputs = prepare_vlm_batch(tiny_vlm("qwen3_vl"), row, sp_rank=0, sp_size=2)
    assert torch.equal(inputs["pixel_values"], row["pixel_values"]) and inputs["position_ids"].shape == (4, 1, 96)


def test_resolve_takes_loss_on_assistant_for_a_vlm_chat(qwen3_dir):
    run = _resolve(qwen3_dir, loss_on="assistant")
    for i, s in enumerate(run.dataset):  # the assistant turn: "dots " * (1 + i), then <|im_end|> and "\n"
        scored = s["labels"][0][s["labels"][0] != -100]
        assert len(scored) == 5 * (1 + i) + 2 and scored[-2] == 125


@pytest.mark.parametrize(
    "kw, records, match",
    [
        ({}, [_chat(["gone.png"], "hi", "x")], r"chat.jsonl:1 \(sample 0\): image file 'gone.png' not found"),
        ({"seq_len": 32}, None, r"sample 0\): \d+ tokens \(6 of them image tokens\) exceed seq_len 32"),
        ({"tiled_loss": True}, None, r"vision-language model: --tiled-loss computes the loss"),
        ({"data": "recall"}, None, r"--data recall is a text task"),
        ({"split_images": "on"}, None, r"--split-images on: --data .*chat.jsonl', sample 0, has 1 frame\(s\) "
                                       r"\(patches \[24\]\), which cannot give each of the 2 SP ranks a whole frame"),
        ({"split_images": "sometimes"}, None, r"--split-images must be auto, on or off, got 'sometimes'"),
    ],
    ids=["missing-image", "too-long", "tiled-loss", "recall", "split-on-one-image", "split-bad"],
)
def test_bad_input_and_options_refused_before_launch(qwen3_dir, tmp_path, kw, records, match):
    if records is not None:
        (tmp_path / "qwen3").symlink_to(qwen3_dir / "qwen3")
        (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(ValueError, match=match):
        _resolve(tmp_path if records is not None else qwen3_dir, **kw)


def test_split_images_is_refused_where_there_is_nothing_to_split(qwen3_dir, tmp_path):
    with pytest.raises(ValueError, match=r"--split-images on splits the vision tower's frames over the SP group, "
                                         r"and --sp 1 has none"):  # fmt: skip
        resolve_run(RunConfig(model=str(qwen3_dir / "qwen3"), data=str(qwen3_dir / "chat.jsonl"), seq_len=96, sp=1,
                              split_images="on", output_dir=str(tmp_path / "o")), 1)  # fmt: skip
    with pytest.raises(ValueError, match=r"--split-images off: --model 'tiny-llama' is not a vision-language model"):
        resolve_run(RunConfig(model="tiny-llama", split_images="off", output_dir=str(tmp_path / "o")), 2)


def _eval(cwd, out: str, *args: str) -> dict:
    args = ["eval", "--model", "qwen3", "--data", "chat.jsonl", "--seq-len", "160", "--micro-batch-size", "1",
            "--output-json", out, "--plot", "none", *args]  # fmt: skip
    if "--nproc" not in args:  # one process: in this one
        with contextlib.chdir(cwd):
            main([*args, "--sp", "1", "--nproc", "1"])
    else:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=400, cwd=cwd, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((cwd / out).read_text())["results"][0]


def test_eval_of_a_vlm_packed_at_sp2_equals_each_sample_alone_at_sp1_per_position(qwen3_dir):
    # the oracle: one sample a row at sp 1, transformers' own forward; against packed rows at sp 2
    one = _eval(qwen3_dir, "eval1.json")
    two = _eval(qwen3_dir, "eval2.json", "--packing", "best-fit", "--sp", "2", "--nproc", "2")
    assert one["tokens"] == two["tokens"] > 200 and abs(one["loss"] - two["loss"]) <= 1e-5 * one["loss"]
    bins = [(a, b) for a, b in zip(one["per_position"], two["per_position"]) if a["tokens"]]
    assert len(bins) > 10 and all(a["tokens"] == b["tokens"] for a, b in bins)
    assert all(abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"] for a, b in bins), bins  # position by position


def test_eval_refuses_vlm_and_text_models_together(qwen3_dir):
    from ulysses_sp.run.checks import check_run

    with pytest.raises(ValueError, match=r"qwen3' is a vision-language model and 'tiny-llama' is not; they read "
                                         r"different data, evaluate them one by one"):  # fmt: skip
        check_run(2, sp=2, seq_len=96, sizes={}, attn="sdpa", models=[str(qwen3_dir / "qwen3"), "tiny-llama"],
                  tokenizer=None, data=str(qwen3_dir / "chat.jsonl"), seed=0)  # fmt: skip


def test_a_vlm_resume_after_an_image_changed_is_refused_naming_the_image(qwen3_dir, tmp_path):
    (tmp_path / "qwen3").symlink_to(qwen3_dir / "qwen3")
    for name in ("chat.jsonl", "p0.png", "p1.png", "p2.png", "clip.mp4"):
        (tmp_path / name).write_bytes((qwen3_dir / name).read_bytes())
    run = _resolve(tmp_path, output_dir=str(tmp_path / "run"))
    named = [f[0] for f in run.manifest["data_fingerprint"]["files"]]
    assert named == ["chat.jsonl", "p0.png", "p1.png", "p2.png", "clip.mp4"]  # the JSONL, then every file it names
    ckpt_dir = tmp_path / "run" / "checkpoint-1"  # a checkpoint's manifest is what a resume compares
    ckpt_dir.mkdir(parents=True)
    (ckpt_dir / "manifest.json").write_text(json.dumps({"format": 2, "step": 1, **run.manifest}))
    with pytest.raises(ValueError, match="checkpoint-1/model.safetensors|is damaged"):  # same data: on to the files
        _resolve(tmp_path, output_dir=str(tmp_path / "run"), resume="latest")
    pixels = np.asarray(Image.open(tmp_path / "p2.png"))
    Image.fromarray(255 - pixels).save(tmp_path / "p2.png")  # the same image size, other pixels
    with pytest.raises(ValueError, match=r"the data changed since the checkpoint was saved \(files differing in "
                                         r"size or content: \['p2.png'\]\)"):  # fmt: skip
        _resolve(tmp_path, output_dir=str(tmp_path / "run"), resume="latest")


def test_split_images_on_checks_each_micro_batch_by_its_frames():
    import torch

    from ulysses_sp.vlm.split import check_split

    two = {"image_grid_thw": torch.tensor([[1, 4, 4]]), "video_grid_thw": torch.tensor([[2, 2, 2]])}
    check_split(two, 2)  # an image and a 2-frame video: 3 frames, one run each side
    check_split({"image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2], [1, 2, 4]])}, 3)
    # 3 frames for 3 ranks, but the last frame's patches take the middle of the run: no frame for rank 2
    with pytest.raises(ValueError, match=r"a micro-batch has 3 frame\(s\) \(patches \[4, 4, 400\]\), which cannot "
                                         r"give each of the 3 SP ranks a whole frame"):  # fmt: skip
        check_split({"image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2], [1, 20, 20]])}, 3)
    with pytest.raises(ValueError, match=r"has 0 frame\(s\)"):  # text only
        check_split({"input_ids": torch.zeros(1, 4)}, 2)


def test_the_fit_check_counts_the_towers_patches_on_the_busiest_rank(qwen3_dir):
    """``--memory`` between the language model's peak and that peak plus the tower's activations (the
    chat's biggest micro-batch, split over the group: ``plan.vision``) refuses the run before launch."""
    import torch

    from ulysses_sp.run.preflight import check_before_launch, prediction, vision_patches

    run = _resolve(qwen3_dir)
    patches = vision_patches(run.cfg, run.model_config, run.dataset)
    assert patches > 0
    text, whole = (prediction(run.cfg, 2, run.model_config, torch.device("cpu"), vision_patches=n) for n in (0, patches))
    assert whole.breakdown["vision_tower"] > 0 and whole.peak_bytes > text.peak_bytes
    cfg = replace(run.cfg, memory=str((text.peak_bytes + whole.peak_bytes) // 2))
    with pytest.raises(ValueError, match=r"predicted peak per rank [\d,]+ bytes > [\d,]+ bytes \(--memory\)"):
        check_before_launch(cfg, 2, run.model_config, vision_patches=patches)
    check_before_launch(cfg, 2, run.model_config, vision_patches=0)  # without the tower it would have fit
