"""Fine-tuning data in one process: loss masks token-exact, every file format, the packer, the
tokenization cache (reuse, invalidation, parallel workers) and the eval split."""

from __future__ import annotations

import json
import os
import random
import re

import numpy as np
import pytest
import torch
from chatdata import CHATML, INST, chat_tokenizer, conversation, write_jsonl

from ulysses_sp.data import cache as cache_mod
from ulysses_sp.data import packed_dataset, plan_blocks, tokenized_corpus
from ulysses_sp.data.chat import tokenize_record
from ulysses_sp.data.packed import split_samples
from ulysses_sp.parallel.loss import IGNORE_INDEX
from ulysses_sp.tasks import DataSettings, build_local_dataset
from ulysses_sp.tasks.tokenizer import BOS_ID, EOS_ID

MSGS = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "HEY"},
    {"role": "user", "content": "more"},
    {"role": "assistant", "content": "OK"},
]
# the two templates rendered by hand: (text, assistant turn or -1)
HAND = {
    CHATML: [("<bos>system\nsys<eos>\n<bos>user\nhi<eos>\n<bos>assistant\n", -1), ("HEY<eos>\n", 2),
             ("<bos>user\nmore<eos>\n<bos>assistant\n", -1), ("OK<eos>\n", 4)],
    INST: [("<bos><<SYS>>sys<</SYS>>[INST] hi [/INST]", -1), (" HEY<eos>", 2), ("[INST] more [/INST]", -1),
           (" OK<eos>", 4)],
}  # fmt: skip


def _bytes(text: str) -> list[int]:
    """The byte tokenizer by hand: ``<bos>``/``<eos>`` by id, every other character its UTF-8 bytes."""
    special = {"<bos>": BOS_ID, "<eos>": EOS_ID}
    return [i for piece in re.split("(<bos>|<eos>)", text)
            for i in ([special[piece]] if piece in special else list(piece.encode()))]  # fmt: skip


@pytest.mark.parametrize("template", [CHATML, INST], ids=["chatml", "inst"])
@pytest.mark.parametrize("loss_on", ["assistant", "completion", "all"])
def test_chat_loss_mask_is_token_exact_against_a_hand_rendering(template, loss_on):
    tok = chat_tokenizer(template)
    ids, scored = tokenize_record(
        {"messages": MSGS}, fmt="chat", loss_on=loss_on, tokenizer=tok, template=template
    )
    want_ids, want_scored = [], []
    for text, turn in HAND[template]:
        part = _bytes(text)
        keep = loss_on == "all" or turn == 4 or (turn == 2 and loss_on == "assistant")
        want_ids += part
        want_scored += [keep] * len(part)
    assert ids == want_ids
    assert scored == want_scored
    assert (
        tok.decode([i for i, s in zip(ids, scored) if s])
        == {
            "assistant": "HEY<eos>\nOK<eos>\n" if template == CHATML else " HEY<eos> OK<eos>",
            "completion": "OK<eos>\n" if template == CHATML else " OK<eos>",
            "all": tok.decode(ids),
        }[loss_on]
    )


def test_chat_without_a_template_names_the_flag():
    with pytest.raises(ValueError, match="--chat-template FILE"):
        tokenize_record({"messages": MSGS}, fmt="chat", loss_on="assistant", tokenizer=chat_tokenizer(None),
                        template=cache_mod.chat_template_of(chat_tokenizer(None), None))  # fmt: skip


def test_template_that_rewrites_earlier_turns_is_refused_unless_every_token_is_scored():
    odd = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ messages | length }}"
    for loss_on in ("assistant", "completion"):
        with pytest.raises(ValueError, match="turn 2 \\(assistant\\) as a prefix.*or --loss-on all"):
            tokenize_record({"messages": MSGS}, fmt="chat", loss_on=loss_on, tokenizer=chat_tokenizer(odd),
                            template=odd)  # fmt: skip
    # the fix the message names works: --loss-on all scores the conversation rendered whole
    tok = chat_tokenizer(odd)
    ids, scored = tokenize_record({"messages": MSGS}, fmt="chat", loss_on="all", tokenizer=tok, template=odd)
    assert tok.decode(ids) == "".join(m["content"] for m in MSGS) + str(len(MSGS)) and all(scored)


def test_prompt_completion_scores_the_completion_and_eos():
    tok = chat_tokenizer(None)
    rec = {"prompt": "2+2=", "completion": "4"}
    ids, scored = tokenize_record(
        rec, fmt="prompt-completion", loss_on="completion", tokenizer=tok, template=None
    )
    assert ids == [BOS_ID, *b"2+2=", ord("4"), EOS_ID]
    assert scored == [False] * 5 + [True, True]


# ---------------------------------------------------------------- formats
ROWS = [{"messages": conversation(random.Random(i), turns=1 + i % 3)} for i in range(12)]


def _write(kind: str, root) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    table = pa.Table.from_pylist(ROWS)
    if kind == "jsonl":
        return write_jsonl(root / "d.jsonl", ROWS)
    if kind == "json":
        (root / "d.json").write_text(json.dumps(ROWS))
        return str(root / "d.json")
    if kind == "parquet":
        pq.write_table(table, root / "d.parquet")
        return str(root / "d.parquet")
    if kind == "arrow":
        with pa.OSFile(str(root / "d.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
            w.write_table(table)
        return str(root / "d.arrow")
    if kind == "dir-of-parquet":
        (root / "parts" / "sub").mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(ROWS[:5]), root / "parts" / "a.parquet")
        pq.write_table(pa.Table.from_pylist(ROWS[5:]), root / "parts" / "sub" / "b.parquet")
        return str(root / "parts")
    Dataset.from_list(ROWS).save_to_disk(str(root / "saved"))
    return str(root / "saved")


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "arrow", "dir-of-parquet", "save_to_disk"])
def test_every_format_reads_the_same_samples(tmp_path, kind):
    tok = chat_tokenizer()
    corpus = tokenized_corpus(_write(kind, tmp_path), tok, cache_dir=str(tmp_path / "cache"))
    assert corpus.meta["format"] == "chat" and corpus.meta["loss_on"] == "assistant"
    want = [tokenize_record(r, fmt="chat", loss_on="assistant", tokenizer=tok, template=CHATML) for r in ROWS]
    assert corpus.lengths.tolist() == [len(ids) for ids, _ in want]
    assert corpus.ids.tolist() == [i for ids, _ in want for i in ids]
    assert corpus.scored.tolist() == [s for _, sc in want for s in sc]


def test_formats_auto_detection_and_errors(tmp_path):
    tok = chat_tokenizer()
    pc = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}])
    assert tokenized_corpus(pc, tok, cache_dir=str(tmp_path / "c")).meta["format"] == "prompt-completion"
    with pytest.raises(ValueError, match=r"missing column\(s\) \['messages'\]"):
        tokenized_corpus(pc, tok, data_format="chat", cache_dir=str(tmp_path / "c"))
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"question": "a"}])
    with pytest.raises(ValueError, match="fit no format"):
        tokenized_corpus(odd, tok, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="--loss-on assistant needs chat or prompt/completion data"):
        tokenized_corpus(write_jsonl(tmp_path / "t.jsonl", [{"text": "x"}]), tok, loss_on="assistant",
                         cache_dir=str(tmp_path / "c"))  # fmt: skip


def test_hub_names_and_remote_locations_are_refused(tmp_path):
    tok = chat_tokenizer()
    with pytest.raises(ValueError, match="looks like a hub dataset name.*downloads nothing"):
        tokenized_corpus("HuggingFaceH4/ultrachat_200k", tok, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="a remote location"):
        tokenized_corpus("hf://datasets/org/name", tok, cache_dir=str(tmp_path))


# ---------------------------------------------------------------- the tokenization cache
def test_cache_is_reused_and_invalidated_by_input_and_settings(tmp_path, monkeypatch):
    tok, root = chat_tokenizer(), str(tmp_path / "cache")
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    first = tokenized_corpus(path, tok, cache_dir=root)
    real = cache_mod._tokenize_all

    def forbidden(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(cache_mod, "_tokenize_all", forbidden)
    again = tokenized_corpus(path, tok, cache_dir=root)
    assert again.path == first.path and np.array_equal(again.ids, first.ids)
    monkeypatch.setattr(cache_mod, "_tokenize_all", real)
    entries = {first.path}
    for kwargs in ({"loss_on": "all"}, {"chat_template": INST}):
        entries.add(tokenized_corpus(path, tok, cache_dir=root, **kwargs).path)
    # the template is what counts, wherever it comes from: the tokenizer's own INST is the same entry
    assert tokenized_corpus(path, chat_tokenizer(INST), cache_dir=root).path in entries
    write_jsonl(tmp_path / "d.jsonl", ROWS[:-1])  # the input changes
    changed = tokenized_corpus(path, tok, cache_dir=root)
    entries.add(changed.path)
    assert len(entries) == 4 and len(changed) == len(ROWS) - 1


def test_parallel_tokenization_equals_in_process(tmp_path, monkeypatch):
    tok = chat_tokenizer()
    path = write_jsonl(tmp_path / "d.jsonl", ROWS * 4)
    one = tokenized_corpus(path, tok, cache_dir=str(tmp_path / "a"), workers=1)
    monkeypatch.setattr(cache_mod, "MIN_ROWS_PER_WORKER", 1)
    monkeypatch.setattr(cache_mod, "CHUNK_ROWS", 7)
    two = tokenized_corpus(path, tok, cache_dir=str(tmp_path / "b"), workers=2)
    assert np.array_equal(one.ids, two.ids) and np.array_equal(one.scored, two.scored)
    assert np.array_equal(one.offsets, two.offsets)


# ---------------------------------------------------------------- packing
def test_best_fit_decreasing_packs_every_piece_once_within_the_block():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(4, 1, 500).astype(int), 1, None)
    plan = plan_blocks(lengths, 256, packing="best-fit", long_samples="split")
    sizes = np.add.reduceat(plan.end - plan.start, plan.offsets[:-1])
    assert (sizes <= 256).all()
    assert plan.real_tokens == lengths.sum()  # split: nothing lost
    assert len(plan) == int(np.ceil(lengths.sum() / 256)) or len(plan) <= 1.05 * lengths.sum() / 256 + 1
    none = plan_blocks(lengths, 256, packing="none", long_samples="split")
    assert len(none) == len(none.sample) and len(plan) < len(none) / 2


def test_best_fit_chooses_the_tightest_block():
    # 6 and 5 open two blocks of 10 (room 4 and 5); 4 goes to the room-4 block, 5 then fits room 5
    plan = plan_blocks(np.array([6, 5, 4, 5]), 10, packing="best-fit", long_samples="truncate")
    blocks = [sorted(plan.sample[plan.offsets[b] : plan.offsets[b + 1]].tolist()) for b in range(len(plan))]
    assert blocks == [[0, 2], [1, 3]]


@pytest.mark.parametrize("mode, counts, tokens", [("truncate", (1, 0, 0), 3 + 4), ("split", (0, 1, 0), 3 + 9),
                                                  ("drop", (0, 0, 1), 3)])  # fmt: skip
def test_long_samples_are_truncated_split_or_dropped_and_counted(mode, counts, tokens):
    plan = plan_blocks(np.array([3, 9]), 4, packing="best-fit", long_samples=mode)
    assert (plan.truncated, plan.split, plan.dropped) == counts
    assert plan.real_tokens == tokens


def test_packed_rows_restart_positions_and_mask_unscored_tokens(tmp_path):
    tok = chat_tokenizer()
    corpus = tokenized_corpus(write_jsonl(tmp_path / "d.jsonl", ROWS), tok, cache_dir=str(tmp_path / "c"))
    ds = packed_dataset(corpus, seq_len=128, pad_id=tok.pad_token_id)
    seen = 0
    for row in (ds[i] for i in range(len(ds))):
        assert row["input_ids"].shape == (128,)
        starts = (row["position_ids"] == 0).nonzero().flatten().tolist()
        seen += len(starts)
        assert all(row["input_ids"][s] == BOS_ID for s in starts)  # each document opens with <bos>
        scored = row["labels"] != IGNORE_INDEX
        assert torch.equal(row["labels"][scored], row["input_ids"][scored])
    assert seen == len(ROWS)
    st = ds.stats()
    assert st["real_tokens"] == corpus.lengths.sum() and 0 < st["scored_share"] < st["efficiency"] <= 1
    assert sum(int((ds[i]["labels"] != IGNORE_INDEX).sum()) for i in range(len(ds))) == st["scored_tokens"]
    # the attention_mask marks the real tokens (the adapter's tokens/s counts them): right padding only
    masks = [ds[i]["attention_mask"] for i in range(len(ds))]
    assert sum(int(m.sum()) for m in masks) == st["real_tokens"] < len(ds) * 128
    assert all(torch.equal(m, torch.arange(128) < int(m.sum())) for m in masks)


def test_eval_split_is_deterministic_disjoint_and_complete(tmp_path):
    train, held = split_samples(100, 0.1, seed=3)
    assert len(held) == 10 and set(train).isdisjoint(held) and len(train) + len(held) == 100
    assert np.array_equal(held, split_samples(100, 0.1, seed=3)[1])
    assert not np.array_equal(held, split_samples(100, 0.1, seed=4)[1])
    with pytest.raises(ValueError, match="--eval-split must be a fraction in \\[0, 1\\)"):
        split_samples(10, 1.5, 0)
    settings = DataSettings(eval_split=0.25, data_cache=str(tmp_path / "c"))
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    kw = dict(tokenizer=chat_tokenizer(), seq_len=64, seed=0, settings=settings)
    tr, ev = build_local_dataset(path, **kw), build_local_dataset(path, held_out=True, **kw)
    assert len(tr.samples) == 9 and len(ev.samples) == 3 and set(tr.samples).isdisjoint(ev.samples)
    assert os.path.isdir(tr.corpus.path) and tr.corpus.path == ev.corpus.path  # tokenized once for both
