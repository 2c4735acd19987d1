"""Packed chat data through sequence parallelism: sp = 2 trains exactly like sp = 1 (that only the
assistant's turns are learned with ``--loss-on assistant``: ``test_data_chat_learn.py``)."""

from __future__ import annotations

import copy
import random

import torch.distributed as dist
import torch.nn.functional as F
from chatdata import chat_tokenizer, conversation, write_jsonl
from models import tiny_model
from oracle import assert_step_close

from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.data import UlyssesSPDataLoaderAdapter, prepare_batch, sp_dataloader
from ulysses_sp.parallel.loss import sp_causal_lm_loss
from ulysses_sp.parallel.mesh import init_mesh
from ulysses_sp.tasks import DataSettings, build_local_dataset

VOCAB = 264  # the byte tokenizer's 259, padded


def _chat_blocks(root: str, seq_len: int):
    rows = [{"messages": conversation(random.Random(i), turns=1 + i % 3)} for i in range(10)]
    path = write_jsonl(f"{root}/chat.jsonl", rows)
    settings = DataSettings(data_cache=f"{root}/cache", long_samples="split")
    return build_local_dataset(path, tokenizer=chat_tokenizer(), seq_len=seq_len, seed=0, settings=settings)


def _reference(ref, row):
    """Each document of the packed row on its own through the plain model (no SP, no packing);
    the mean over all their scored tokens."""
    ref.zero_grad()
    batch = prepare_batch({k: v[None] for k, v in row.items()}, 1)
    starts = [*(row["position_ids"] == 0).nonzero().flatten().tolist(), row["input_ids"].numel()]
    total, count = 0.0, 0
    for lo, hi in zip(starts[:-1], starts[1:]):  # the tail padding rides with the last document
        logits = ref(input_ids=batch["input_ids"][:, lo:hi]).logits
        labels = batch["shift_labels"][0, lo:hi]
        total = total + F.cross_entropy(logits[0], labels, ignore_index=-100, reduction="sum")
        count += int((labels != -100).sum())
    loss = total / count
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters()}


def _sp2_packed_chat(root: str):
    mesh = init_mesh((1, 2))
    if mesh.sp_rank == 0:
        dataset = _chat_blocks(root, 96)  # rank 0 tokenizes into the cache, rank 1 waits on the lock
    dist.barrier()
    if mesh.sp_rank == 1:
        dataset = _chat_blocks(root, 96)
    ref = tiny_model("llama", vocab=VOCAB)
    model = copy.deepcopy(ref)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, mesh=mesh)
    loader = sp_dataloader(dataset, batch_size=1, dp_size=1, sp_size=2, dp_rank=0, sp_rank=mesh.sp_rank,
                           shuffle=False)  # fmt: skip
    adapter = UlyssesSPDataLoaderAdapter(loader, mesh.sp_rank, mesh.sp_group, 2, "cpu")
    steps = 0
    for i, batch in enumerate(adapter):
        if i == 4:
            break
        model.zero_grad()
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        loss = sp_causal_lm_loss(out.logits, batch["shift_labels"], mesh.sp_group)
        loss.backward()
        for p in model.parameters():  # the engine's rule with dp=1: sum over SP
            dist.all_reduce(p.grad, group=mesh.sp_group)
        # micro-step i works on the block SP rank i % 2 loaded: block (i // 2) * 2 + i % 2 in order
        assert_step_close(loss.detach(), {n: p.grad for n, p in model.named_parameters()},
                          *_reference(ref, dataset[i]))  # fmt: skip
        steps += 1
    reg.remove()
    return steps, dataset.stats()["blocks"]


def test_packed_chat_with_sp2_equals_sp1(pool, tmp_path):
    results = pool.run(_sp2_packed_chat, 2, str(tmp_path))
    assert results[0] == results[1] and results[0][0] == 4 and results[0][1] >= 4
