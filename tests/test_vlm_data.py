"""The VLM data path (issue 24): chat JSONL with local image paths, the model directory's tokenizer
and PIL image processor (no torchvision), image tokens counted in the length, and every bad input a
clear error naming the sample before training."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from vlm_models import IMAGE, MERGE, save_vlm_dir

from ulysses_sp.vlm import prepare_vlm_batch
from ulysses_sp.vlm.data import load_vlm_chat


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vlm")
    save_vlm_dir(str(path / "model"))
    save_vlm_dir(str(path / "bare"), processor=False)
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((20, 28, 3)) * 255).astype("uint8")).save(path / "a.png")
    Image.fromarray((rng.random((16, 16, 3)) * 255).astype("uint8")).save(path / "b.jpg")
    (path / "notes.png").write_text("not an image")
    return path


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


def _load(vlm_dir, records, *, model="model", seq_len=256):
    from transformers import AutoConfig

    data = vlm_dir / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = AutoConfig.from_pretrained(vlm_dir / "model")
    return load_vlm_chat(str(data), str(vlm_dir / model), config=config, seq_len=seq_len)


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
            [_chat("a.png", "hi")],
            {"seq_len": 16},
            r"sample 0\): \d+ tokens \(8 of them image tokens\) exceed seq_len 16",
        ),
        ([_chat("a.png", "hi")], {"model": "bare"}, r"has no image processor \(preprocessor_config.json\)"),
    ],
    ids=["missing-file", "not-an-image", "placeholders", "too-long", "no-processor"],
)
def test_bad_input_is_refused_naming_the_sample(vlm_dir, records, kwargs, match):
    with pytest.raises(ValueError, match=match):
        _load(vlm_dir, records, **kwargs)


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
