"""The VLM data path (issues 24, 35): chat JSONL with local image and video paths, the model directory's tokenizer
and PIL image processor (no torchvision), image tokens counted in the length, and every bad input a
clear error naming the sample before training."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from vlm_models import IMAGE, MERGE, V_END, V_START, VIDEO, save_video, save_vlm_dir

from ulysses_sp.vlm import prepare_vlm_batch
from ulysses_sp.vlm.data import load_vlm_chat


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vlm")
    save_vlm_dir(str(path / "model"))
    save_vlm_dir(str(path / "bare"), processor=False)
    save_vlm_dir(str(path / "qwen3"), "qwen3_vl")
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((20, 28, 3)) * 255).astype("uint8")).save(path / "a.png")
    Image.fromarray((rng.random((16, 16, 3)) * 255).astype("uint8")).save(path / "b.jpg")
    (path / "notes.png").write_text("not an image")
    save_video(str(path / "clip.mp4"))  # 10 frames of 20x28 at 4 fps
    (path / "noise.mp4").write_bytes(rng.bytes(2000))
    _save_tone(str(path / "tone.wav"))
    return path


def _save_tone(path: str) -> None:
    """A tenth of a second of silence: a file PyAV opens that holds no video."""
    import av

    with av.open(path, "w", format="wav") as out:
        stream = out.add_stream("pcm_s16le", rate=8000, layout="mono")
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), dtype=np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        out.mux(stream.encode(frame))
        out.mux(stream.encode())


def _chat(*parts, answer="a cat"):
    content = [
        {"type": "image", "image": p} if p.endswith((".png", ".jpg")) else {"type": "text", "text": p}
        for p in parts
    ]
    return {
        "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
    }


def _load(vlm_dir, records, *, model="model", seq_len=256, loss_on=None):
    from transformers import AutoConfig

    data = vlm_dir / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = AutoConfig.from_pretrained(vlm_dir / ("qwen3" if model == "qwen3" else "model"))
    return load_vlm_chat(str(data), str(vlm_dir / model), config=config, seq_len=seq_len, loss_on=loss_on)


def test_chat_with_images_becomes_model_inputs_with_image_tokens_in_the_length(vlm_dir):
    from transformers import AutoModelForImageTextToText

    (s,) = _load(vlm_dir, [_chat("a.png", "what is this?", "b.jpg")])
    grid = s["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 8], [1, 4, 4]]  # 20x28 -> 16x32 pixels, 16x16 as is (4-pixel patches)
    n_image = int(grid.prod(-1).sum()) // MERGE**2
    assert int((s["input_ids"] == IMAGE).sum()) == n_image == int((s["mm_token_type_ids"] == 1).sum())
    assert int((s["labels"] == -100).sum()) == n_image
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir / "model")
    assert torch.isfinite(model(**s).loss)  # the model's own placeholder check accepts it
    inputs = prepare_vlm_batch(model, s, sp_rank=1, sp_size=2)
    assert inputs["position_ids"].shape == (4, 1, s["input_ids"].shape[1] + s["input_ids"].shape[1] % 2)


@pytest.mark.parametrize(
    "records, kwargs, match",
    [
        (
            [_chat("a.png", "hi"), _chat("missing.png", "hi")],
            {},
            r"data.jsonl:2 \(sample 1\): image file 'missing.png' not found",
        ),
        ([_chat("notes.png", "hi")], {}, r"sample 0\): image 'notes.png' is not in a format PIL can read"),
        (
            [_chat("a.png", "see <|image_pad|> too")],
            {},
            r"sample 0\): the rendered chat has 2 image placeholders for 1 images",
        ),
        (
            [_chat("a.png", "a clip: <|video_pad|>")],
            {},
            r"sample 0\): the rendered chat has 1 video placeholders for 0 videos: each video part must render "
            r"exactly one placeholder \(check the chat template\)",
        ),
        (
            [_chat("a.png", "hi")],
            {"seq_len": 16},
            r"sample 0\): \d+ tokens \(8 of them image tokens\) exceed seq_len 16",
        ),
        ([_chat("a.png", "hi")], {"model": "bare"}, r"has no image processor \(preprocessor_config.json\)"),
    ],
    ids=["missing-file", "not-an-image", "placeholders", "video-placeholders", "too-long", "no-processor"],
)
def test_bad_input_is_refused_naming_the_sample(vlm_dir, records, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _load(vlm_dir, records, **kwargs)


def _video_chat(video: str = "clip.mp4") -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
                                                      {"type": "video", "video": video}, {"type": "text", "text": "?"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "a cat"}]}]}  # fmt: skip


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_chat_with_a_video_becomes_the_inputs_its_processor_makes(vlm_dir, family):
    """10 frames of 20x28 at 4 fps, the processor sampling 2 a second: Qwen2.5-VL 4 frames (0, 2, 5, 7:
    1.6 fps sampled, so 1.25 s a temporal patch) at 16x32 pixels; Qwen3-VL 5 frames (0, 2, 4, 7, 9, the
    last repeated) scaled within the clip's pixel budget to 8x16, each temporal patch after its time."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model_dir = "model" if family == "qwen2_5_vl" else "qwen3"
    (s,) = _load(vlm_dir, [_video_chat()], model=model_dir)
    ids, labels = s["input_ids"][0], s["labels"][0]
    video = ids == VIDEO
    assert bool((s["mm_token_type_ids"][0][video] == 2).all()) and bool((labels[video] == -100).all())
    text = AutoTokenizer.from_pretrained(vlm_dir / model_dir).decode(ids)
    if family == "qwen2_5_vl":
        assert s["video_grid_thw"].tolist() == [[2, 4, 8]] and int(video.sum()) == 2 * 4 * 8 // MERGE**2
        torch.testing.assert_close(s["second_per_grid_ts"], torch.tensor([1.25]))
        assert "<|vision_start|>" + "<|video_pad|>" * 16 + "<|vision_end|>?" in text
    else:
        assert s["video_grid_thw"].tolist() == [[3, 2, 4]] and "second_per_grid_ts" not in s
        frame = "<|vision_start|>" + "<|video_pad|>" * 2 + "<|vision_end|>"
        clip = "".join(f"<{t} seconds>{frame}" for t in ("0.2", "1.4", "2.2"))  # (0+2)/2/4, (4+7)/2/4, 9/4 s
        assert f"<|vision_start|>{clip}<|vision_end|>?" in text
        inserted = slice(text.index(clip), text.index(clip) + len(clip))  # character tokens: one a character
        assert bool((labels[inserted] == -100).all())  # timestamps and frame markers are not scored
    assert int((labels != -100).sum()) == int((s["mm_token_type_ids"][0] == 0).sum()) - (0 if family == "qwen2_5_vl" else 3 * 15)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir / model_dir)
    assert torch.isfinite(model(**s).loss)  # the model's own placeholder and grid checks accept it
    with pytest.raises(ValueError, match=r"sample 0\): \d+ tokens \(8 of them image tokens, \d+ video tokens\) exceed "
                                         r"seq_len 30; .* or the video processor's fps / max_pixels"):  # fmt: skip
        _load(vlm_dir, [_video_chat()], model=model_dir, seq_len=30)


def test_video_parts_without_pyav_installed_are_refused_naming_the_extra(vlm_dir, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "av" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"data.jsonl:1 \(sample 0\): video 'clip.mp4': reading video parts needs "
                                         r"PyAV, which is not installed; pip install 'ulysses-sp\[video\]'"):  # fmt: skip
        _load(vlm_dir, [_video_chat()])


def test_a_video_that_decodes_fewer_frames_than_its_header_counts_is_refused(vlm_dir, monkeypatch):
    import transformers.video_utils as video_utils

    load = video_utils.load_video

    def cut_short(*args, **kwargs):  # as a stream that ends before its header's frame count
        frames, meta = load(*args, **kwargs)
        return frames[:2], meta

    monkeypatch.setattr(video_utils, "load_video", cut_short)
    with pytest.raises(ValueError, match=r"sample 0\): video 'clip.mp4' ends early: 2 of the 4 frames sampled from "
                                         r"its header's 10 decode; re-encode it"):  # fmt: skip
        _load(vlm_dir, [_video_chat()])


def test_video_settings_fall_back_to_the_image_processor_file_and_the_class_defaults(tmp_path):
    """Without ``video_preprocessor_config.json`` the settings come from ``preprocessor_config.json``
    (as transformers' video processors load them), keys neither sets from transformers' class defaults."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ulysses_sp.vlm.video import video_settings

    Qwen2VLImageProcessorPil(patch_size=4, min_pixels=64, max_pixels=1024).save_pretrained(tmp_path)
    two, three = video_settings(str(tmp_path), "qwen2_5_vl"), video_settings(str(tmp_path), "qwen3_vl")
    assert (two.patch_size, two.min_pixels, two.max_pixels, three.max_pixels) == (4, 64, 1024, 1024)
    assert not two.do_sample_frames and two.fps is None  # Qwen2VLVideoProcessor: every frame
    assert three.do_sample_frames and three.fps == 2 and three.min_frames == 4  # Qwen3VLVideoProcessor
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"fps": 1, "max_pixels": 4096}))
    own = video_settings(str(tmp_path), "qwen2_5_vl")
    assert (own.fps, own.max_pixels, own.patch_size, own.min_pixels) == (1, 4096, 14, 128 * 28 * 28)


def test_video_frames_are_sampled_and_patched_as_transformers_does():
    """Qwen3-VL's frame choice against transformers' own ``sample_frames``; the patch layout against
    the image processor (a still frame twice is one temporal patch of the image's rows)."""
    from types import SimpleNamespace

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from ulysses_sp.vlm.video import VideoSettings, frame_indices, video_inputs

    common = dict(min_pixels=64, max_pixels=1024, patch_size=4, temporal_patch_size=2, merge_size=2,
                  rescale_factor=1 / 255, num_frames=None, cap_pixels_per_frame=False, max_video_tokens=768)  # fmt: skip
    for total, fps, want_fps, lo in [(10, 4.0, 2, 4), (300, 30.0, 2, 4), (7, 24.0, 1, 2), (3, 1.0, 2, 4)]:
        s = VideoSettings(family="qwen3_vl", mean=(0.5,) * 3, std=(0.5,) * 3, do_sample_frames=True, fps=want_fps,
                          min_frames=lo, max_frames=768, **common)  # fmt: skip
        own = SimpleNamespace(fps=want_fps, min_frames=lo, max_frames=768)
        want = Qwen3VLVideoProcessor.sample_frames(own, VideoMetadata(total_num_frames=total, fps=fps))
        assert frame_indices(s, total, fps).tolist() == want.tolist(), (total, fps)
    image = Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=64, max_pixels=1024)
    s = VideoSettings(family="qwen2_5_vl", mean=tuple(image.image_mean), std=tuple(image.image_std),
                      do_sample_frames=False, fps=None, min_frames=4, max_frames=768, **common)  # fmt: skip
    frame = (np.random.default_rng(0).random((20, 28, 3)) * 255).astype("uint8")
    rows = image(images=[Image.fromarray(frame)], return_tensors="pt")
    for frames in (np.stack([frame, frame]), frame[None]):  # one frame: repeated to fill the temporal patch
        pixels, grid = video_inputs(s, frames)
        assert grid.tolist() == rows["image_grid_thw"].tolist() == [[1, 4, 8]]
        torch.testing.assert_close(pixels, rows["pixel_values"], rtol=0, atol=1e-6)


def _parts(*parts):
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]}  # fmt: skip


@pytest.mark.parametrize(
    "part, match",
    [
        ({"type": "image"}, r"data.jsonl:2 \(sample 1\): the image part \(message 0, content part 0\) has no "
                            r"path; name the file under 'image', 'path' or 'url'"),
        ({"type": "image", "image": "folder"}, r"sample 1\): image path 'folder' is a directory \(.*folder'\), "
                                               r"not an image file"),
        ({"type": "image", "url": "https://x.org/a.png"}, r"sample 1\): image 'https://x.org/a.png' is a URL; "
                                                          r"ulysses-sp reads local image files only"),
        ({"type": "image", "image": {"bytes": "..."}}, r"names \"{'bytes': '...'}\" where a file path"),
        ({"type": "video"}, r"data.jsonl:2 \(sample 1\): the video part \(message 0, content part 0\) has no "
                            r"path; name the file under 'video', 'path' or 'url'"),
        ({"type": "video", "video": "gone.mp4"}, r"data.jsonl:2 \(sample 1\): video file 'gone.mp4' not found \("
                                                 r"looked at .*gone.mp4'\); paths are relative to the data file"),
        ({"type": "video", "video": "folder"}, r"sample 1\): video path 'folder' is a directory \(.*folder'\), "
                                               r"not a video file; name the file itself"),
        ({"type": "video", "video": "noise.mp4"}, r"data.jsonl:2 \(sample 1\): video 'noise.mp4' could not be "
                                                  r"decoded by PyAV \(InvalidDataError: .*\); is it a video file"),
        ({"type": "video", "video": "tone.wav"}, r"sample 1\): video 'tone.wav' has no video stream \(PyAV opened "
                                                 r"it but found no video in it\); name a video file"),
        ({"type": "video", "video": "a.png"}, r"sample 1\): video 'a.png' has 1 frames, and the video processor "
                                              r"samples 0 \(num_frames/fps"),
        ({"video": "clip.mp4"}, r"content part 0 has a 'video' but no 'type'; write it as \{'type': 'video', "
                                r"'video': 'clip.mp4'\}"),
        ({"type": "image_url", "image_url": {"url": "a.png"}}, r"content part 0 has type 'image_url', which "
                                                               r"this loader does not read"),
        ({"image": "a.png"}, r"content part 0 has an 'image' but no 'type'"),
        ("a.png", r"content part 0 is 'a.png', not a part such as \{'type': 'text', 'text': \.\.\.\} or"),
    ],
    ids=["no-path", "directory", "url", "embedded", "video-no-path", "video-missing", "video-directory",
         "video-corrupt", "video-audio-only", "video-one-frame", "video-no-type", "image-url", "no-type", "string"],
)
def test_a_bad_media_part_is_refused_naming_the_line_and_what_is_wrong(vlm_dir, part, match):
    (vlm_dir / "folder").mkdir(exist_ok=True)
    with pytest.raises(ValueError, match=match) as info:
        _load(vlm_dir, [_chat("a.png", "hi"), _parts(part)])
    assert "\n" not in str(info.value)  # one line


def test_the_fingerprint_names_the_local_files_a_chat_names_and_skips_parts_that_name_none(vlm_dir):
    """``named_files`` (the resume fingerprint) lists every local image and video file, each once; a
    part with no path or a URL used to enter as ``'None'`` or a URL joined to the directory."""
    from ulysses_sp.vlm.media import named_files

    data = vlm_dir / "media.jsonl"
    parts = [{"type": "image", "image": "a.png"}, {"type": "video", "video": "clip.mp4"}, {"type": "image"},
             {"type": "image", "url": "https://x.org/a.png"}, {"type": "video", "path": "b.jpg"}]  # fmt: skip
    data.write_text(json.dumps(_parts(*parts)) + "\n")
    assert named_files(str(data)) == [str(vlm_dir / n) for n in ("a.png", "clip.mp4", "b.jpg")]


@pytest.fixture(scope="module")
def bomb(vlm_dir):
    """A 15000 x 15000 PNG of ~27 KB: over PIL's decompression-bomb limit (2 x MAX_IMAGE_PIXELS)."""
    Image.new("1", (15000, 15000)).save(vlm_dir / "bomb.png", optimize=True)
    assert (vlm_dir / "bomb.png").stat().st_size < 64_000 and 15000**2 > 2 * Image.MAX_IMAGE_PIXELS
    return "bomb.png"


def test_a_decompression_bomb_is_refused_naming_its_size_and_the_fix(vlm_dir, bomb):
    with pytest.raises(ValueError) as info:
        _load(vlm_dir, [_chat("a.png", "hi"), _chat(bomb, "hi")])
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{vlm_dir / 'data.jsonl'}:2 (sample 1): ")
    limit = 2 * Image.MAX_IMAGE_PIXELS
    assert (f"image 'bomb.png' is 15000 x 15000 pixels, over PIL's safety limit of {limit} pixels (a "
            "decompression-bomb guard") in message  # fmt: skip
    assert "downscale the file (the image processor resizes every image to at most 1024 pixels anyway)" in message
    assert Image.MAX_IMAGE_PIXELS == 89478485  # PIL's own limit, untouched


def test_the_cli_reports_a_bad_image_in_one_line_before_launch(vlm_dir, bomb, tmp_path, monkeypatch, capsys):
    from ulysses_sp.cli.main import main

    (tmp_path / "data.jsonl").write_text(json.dumps(_chat(str(vlm_dir / bomb), "hi")) + "\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["train", "--model", str(vlm_dir / "model"), "--data", "data.jsonl", "--seq-len", "64", "--steps",
              "1", "--nproc", "1", "--sp", "1", "--output-dir", "out", "--no-progress", "--no-plot"])  # fmt: skip
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    assert line.startswith("ulysses-sp train: error: data.jsonl:1 (sample 0): image ") and "15000 x 15000" in line


def _dialogue(image: str | None, *, as_parts: bool = True) -> dict:
    """Two exchanges; ``image`` (if any) opens the second question. ``as_parts=False``: string
    contents, as text chats have them."""

    def say(role, text, img=None):
        if not as_parts:
            return {"role": role, "content": text}
        return {"role": role, "content": [*([{"type": "image", "image": img}] if img else []),
                                          {"type": "text", "text": text}]}  # fmt: skip

    return {"messages": [say("system", "be brief"), say("user", "hi"), say("assistant", "hello"),
                         say("user", "what is this?", image), say("assistant", "a cat")]}  # fmt: skip


@pytest.mark.parametrize("loss_on", ["assistant", "completion"])
def test_assistant_only_labels_are_the_text_chat_segmenting_with_image_tokens_unscored(vlm_dir, loss_on):
    from transformers import AutoTokenizer

    from ulysses_sp.data.chat import tokenize_record

    tok = AutoTokenizer.from_pretrained(vlm_dir / "model")
    ids, scored = tokenize_record(_dialogue(None, as_parts=False), fmt="chat", loss_on=loss_on, tokenizer=tok,
                                  template=tok.chat_template)  # fmt: skip
    want = [i if k else -100 for i, k in zip(ids, scored)]
    assert 0 < sum(scored) < len(ids)
    (plain,) = _load(vlm_dir, [_dialogue(None)], loss_on=loss_on)
    assert plain["input_ids"][0].tolist() == ids and plain["labels"][0].tolist() == want
    (s,) = _load(vlm_dir, [_dialogue("a.png")], loss_on=loss_on)
    vision = torch.isin(s["input_ids"][0], torch.tensor([IMAGE, V_START, V_END]))
    assert int((s["input_ids"][0] == IMAGE).sum()) == 8 and bool((s["labels"][0][vision] == -100).all())
    assert s["labels"][0][~vision].tolist() == want  # the image's tokens out: the text chat's labels
    (every,) = _load(vlm_dir, [_dialogue("a.png")])  # the default: every text token, as before
    assert int((every["labels"][0] == -100).sum()) == 8


def test_assistant_only_loss_on_chats_without_an_assistant_turn_is_refused(vlm_dir):
    record = {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}]}
    with pytest.raises(ValueError, match=r"no token is scored, so training would learn nothing \(loss 0\): "
                                         r"--loss-on assistant found no such tokens"):  # fmt: skip
        _load(vlm_dir, [record], loss_on="assistant")
    with pytest.raises(ValueError, match=r"--loss-on must be one of"):
        _load(vlm_dir, [record], loss_on="assistants")


def test_placeholders_that_do_not_match_the_grids_are_refused(vlm_dir):
    from transformers import AutoModelForImageTextToText

    (s,) = _load(vlm_dir, [_chat("a.png", "hi")])
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir / "model")
    s["image_grid_thw"] = torch.tensor([[1, 4, 4]])  # 4 embeddings for 8 placeholders
    with pytest.raises(
        ValueError, match=r"8 image placeholder tokens but its image_grid_thw \(\[\[1, 4, 4\]\]\) makes 4"
    ):
        prepare_vlm_batch(model, s, sp_rank=0, sp_size=2)


def test_the_cli_refuses_a_multimodal_directory_of_another_family(tmp_path):
    from transformers import Qwen2VLConfig

    from ulysses_sp.run.checks import model_config

    Qwen2VLConfig().save_pretrained(tmp_path)  # config.json only: refused before any weight is read
    with pytest.raises(ValueError, match=r"is a multimodal model \(qwen2_vl: vision_config\); `ulysses-sp train`.*"
                       r"qwen2_5_vl, qwen3_vl"):  # fmt: skip
        model_config(str(tmp_path), 256)


@pytest.mark.parametrize("family", ["llava", "gemma3", "fuyu"])
def test_the_cli_chat_path_refuses_a_llava_style_family_naming_the_python_path(family):
    """The chat reader makes Qwen's patch rows and grids; a LLaVA-style family's pixels (and Gemma 3's
    token types) are its own processor's, so a CLI run of one is refused before reading, not trained on
    Qwen-shaped inputs."""
    from types import SimpleNamespace

    from ulysses_sp.run.config import RunConfig
    from ulysses_sp.run.vlm import vlm_dataset

    cfg = RunConfig(model="/models/x", data="chat.jsonl", seq_len=64)
    with pytest.raises(ValueError, match=rf"is a {family} vision-language model: the CLI's chat data path reads "
                                         r"images with Qwen's image processor only .*prepare_vlm_batch"):  # fmt: skip
        vlm_dataset(cfg, SimpleNamespace(model_type=family))
