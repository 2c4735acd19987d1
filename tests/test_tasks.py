"""The embedded defaults: byte tokenizer, recall task, model presets, local text data (in-process)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ulysses_sp import tasks
from ulysses_sp.parallel.mesh_shape import valid_sp_sizes
from ulysses_sp.tasks.recall import ALPHABET, SEPARATOR
from ulysses_sp.tasks.text import TextBlockDataset
from ulysses_sp.tasks.tokenizer import BOS_ID, EOS_ID, PAD_ID


# ---------------------------------------------------------------- tokenizer
def test_byte_tokenizer_round_trips_any_text_and_reloads_offline(tmp_path):
    tok = tasks.byte_tokenizer()
    text = "héllo wörld\n\t 0~\x00 ✓"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))  # token i is byte i
    assert tok.decode(ids) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, len(tok)) == (PAD_ID, BOS_ID, EOS_ID, 259)
    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert back.encode(text, add_special_tokens=False) == ids
    assert back.decode(ids) == text and len(back) == 259
    assert back.convert_tokens_to_ids(["<pad>", "<bos>", "<eos>"]) == [PAD_ID, BOS_ID, EOS_ID]


# ---------------------------------------------------------------- recall
@pytest.mark.parametrize("seq_len", [4, 5, 64, 257, 1024])
def test_recall_sample_layout(seq_len):
    ids, labels = tasks.recall_sample(0, 3, seq_len)
    start = tasks.recall_start(seq_len)
    span = ids[1 : start - 1]
    assert ids.shape == labels.shape == (seq_len,)
    assert ids[0] == BOS_ID and ids[start - 1] == SEPARATOR
    assert len(span) == (seq_len - 2) // 2 and start >= seq_len // 2
    assert set(span.tolist()) <= set(ALPHABET)
    # the recall half repeats the span; only it is labelled
    assert torch.equal(ids[start:], span.repeat(2)[: seq_len - start])
    assert (labels[:start] == -100).all() and torch.equal(labels[start:], ids[start:])


def test_recall_is_a_pure_function_of_seed_and_index():
    a = tasks.recall_sample(5, 7, 128)
    assert all(torch.equal(x, y) for x, y in zip(a, tasks.recall_sample(5, 7, 128)))
    assert not torch.equal(a[0], tasks.recall_sample(5, 8, 128)[0])
    assert not torch.equal(a[0], tasks.recall_sample(6, 7, 128)[0])
    ds = tasks.RecallDataset(seq_len=64, num_samples=4, seed=5)
    assert len(ds) == 4 and torch.equal(ds[2]["input_ids"], tasks.recall_sample(5, 2, 64)[0])
    with pytest.raises(IndexError):
        ds[4]


def test_recall_span_is_uniform_so_chance_is_ln_alphabet():
    # The recall half is unpredictable without the span iff the span tokens are ~uniform iid.
    spans = torch.cat([tasks.recall_sample(0, i, 258)[0][1:129] for i in range(400)])
    freq = torch.bincount(spans, minlength=256)[list(ALPHABET)].double() / len(spans)
    entropy = -(freq * freq.log()).sum().item()
    assert abs(entropy - tasks.CHANCE_LOSS) < 0.01
    assert tasks.CHANCE_LOSS == pytest.approx(math.log(221))


def test_recall_too_short():
    with pytest.raises(ValueError, match="seq-len >= 4, got 3"):
        tasks.RecallDataset(seq_len=3, num_samples=1, seed=0)


# ---------------------------------------------------------------- presets
@pytest.mark.parametrize("name", sorted(tasks.PRESETS))
def test_presets_build_deterministically_and_split_over_sp_up_to_4(name, tmp_path):
    a = tasks.build_model(name, vocab_size=259, seed=1)
    b = tasks.build_model(name, vocab_size=259, seed=1)
    c = tasks.build_model(name, vocab_size=259, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    cfg = a.config
    assert {1, 2, 4} <= set(valid_sp_sizes(cfg.num_attention_heads, cfg.num_key_value_heads))
    assert sum(p.numel() for p in a.parameters()) < 200_000
    a.save_pretrained(tmp_path)
    back = tasks.build_model(str(tmp_path), vocab_size=259, seed=0)
    assert type(back) is type(a) and torch.equal(back.lm_head.weight, a.lm_head.weight)


def test_model_errors(tmp_path):
    with pytest.raises(ValueError, match="not a preset .* and no such directory"):
        tasks.check_model_dir(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="has no config.json"):
        tasks.check_model_dir(str(tmp_path))
    with pytest.raises(ValueError, match="unknown model preset"):
        tasks.preset_config("tiny-gpt", vocab_size=259)
    assert AutoModelForCausalLM  # the presets are plain transformers models (see above)


# ---------------------------------------------------------------- local text
def test_text_file_jsonl_and_directory(tmp_path):
    tok = tasks.byte_tokenizer()
    (tmp_path / "a.txt").write_text("x" * 30)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jsonl").write_text(
        json.dumps({"text": "y" * 9}) + "\n\n" + json.dumps({"text": "z"}) + "\n"
    )
    (tmp_path / "ignored.csv").write_text("nope")
    ds = TextBlockDataset(str(tmp_path), tokenizer=tok, seq_len=8)
    # 31 + 10 + 2 tokens (each document + eos) -> 5 blocks of 8, remainder dropped
    assert len(ds) == 5
    flat = torch.cat([ds[i]["input_ids"] for i in range(5)]).tolist()
    assert flat[:31] == [ord("x")] * 30 + [EOS_ID] and flat[31:40] == [ord("y")] * 9
    assert torch.equal(ds[0]["labels"], ds[0]["input_ids"])
    single = tasks.build_dataset(str(tmp_path / "a.txt"), tokenizer=tok, seq_len=31, seed=0, num_samples=1)
    assert len(single) == 1


@pytest.mark.parametrize(
    "name, content, seq_len, match",
    [
        ("empty.txt", b"", 8, "is empty"),
        ("blank.jsonl", b"  \n\n", 8, "is empty"),
        ("bad.txt", b"\xff\xfe\xfa", 8, "cannot read"),
        ("short.txt", b"abc", 8, r"4 tokens, shorter than one sequence \(--seq-len 8\)"),
        ("bad.jsonl", b'{"text": 1}\n', 8, 'bad.jsonl:1 has no string "text" field'),
        ("broken.jsonl", b'{"text": \n', 8, "broken.jsonl:1 is not valid JSON"),
        ("data.csv", b"a,b", 8, "expected a .txt or .jsonl file"),
    ],
)
def test_text_errors(tmp_path, name, content, seq_len, match):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        TextBlockDataset(str(path), tokenizer=tasks.byte_tokenizer(), seq_len=seq_len)


def test_text_missing_and_empty_dir(tmp_path):
    tok = tasks.byte_tokenizer()
    with pytest.raises(ValueError, match="no such file or directory"):
        TextBlockDataset(str(tmp_path / "nope.txt"), tokenizer=tok, seq_len=8)
    with pytest.raises(ValueError, match="holds no .txt or .jsonl files"):
        TextBlockDataset(str(tmp_path), tokenizer=tok, seq_len=8)
