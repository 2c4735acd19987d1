"""The data path end to end with a real model: what the adapter yields trains exactly like no SP.

Packed documents: ``PackingCollator`` -> ``UlyssesSPDataLoaderAdapter`` (sp=2) -> Ulysses attention ->
SP loss must equal the documents run one by one through the plain model (loss and every gradient).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import tiny_model

from ulysses_sp.attention import UlyssesSPAttentionHF
from ulysses_sp.data import PackingCollator, UlyssesSPDataLoaderAdapter
from ulysses_sp.loss import sp_causal_lm_loss
from ulysses_sp.mesh import init_mesh, mesh_info, sp_group

VOCAB = 64
# Per SP rank: 3 documents packed into one sequence; rank 0's is 17 tokens (padded to 18 for sp=2),
# rank 1's 20. Boundaries fall inside shards and (rank 1: 6 | 4, shard edge at 10) on a shard edge.
DOCS = {0: (5, 8, 4), 1: (6, 4, 10)}


def _docs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in DOCS[rank]]


def _compare(loss, grads, ref_loss, ref_grads):
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for name, g in grads.items():
        r = ref_grads[name]
        scale = r.abs().max().item()
        assert scale > 0, f"{name}: zero reference gradient tests nothing"
        torch.testing.assert_close(
            g, r, rtol=1e-4, atol=min(1e-6, 1e-5 * scale), msg=lambda m, n=name: f"{n}: {m}"
        )


def _reference(ref, docs):
    """Every document on its own through the plain model; mean over all documents' valid tokens."""
    ref.zero_grad()
    total, count = 0.0, 0
    for doc in docs:
        logits = ref(input_ids=doc[None]).logits
        total = total + F.cross_entropy(logits[0, :-1], doc[1:], reduction="sum")
        count += doc.numel() - 1
    loss = total / count
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in ref.named_parameters()}


def _without_labels(features):
    """Packed input_ids and position_ids only: the adapter alone must find the document boundaries."""
    out = PackingCollator()(features)
    del out["labels"]
    return out


def _packed_documents(core: str):
    mesh = init_mesh((1, 2))
    ref = tiny_model("llama", attn=core, vocab=VOCAB)
    model = copy.deepcopy(ref)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, core, 2, 1, mesh=mesh)
    model.train()
    # no max_length: as long as the documents; then the same without the collator's labels
    steps = [_packed_steps(model, ref, mesh, c) for c in (PackingCollator(pad_token_id=0), _without_labels)]
    reg.remove()
    return steps


def _packed_steps(model, ref, mesh, collate):
    info = mesh_info(mesh)
    dl = torch.utils.data.DataLoader([_docs(info.sp_rank)], batch_size=None, collate_fn=collate)
    ad = UlyssesSPDataLoaderAdapter(dl, info.sp_rank, sp_group(mesh), 2, "cpu")
    steps = 0
    for src, batch in enumerate(ad):  # micro-step i works on SP rank i's packed batch
        assert set(batch) == {"input_ids", "position_ids", "shift_labels"}
        model.zero_grad()
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        loss = sp_causal_lm_loss(out.logits, batch["shift_labels"], sp_group(mesh))
        loss.backward()
        for p in model.parameters():  # the engine's rule with dp=1: sum over SP
            dist.all_reduce(p.grad, group=sp_group(mesh))
        _compare(
            loss.detach(), {n: p.grad for n, p in model.named_parameters()}, *_reference(ref, _docs(src))
        )
        steps += 1
    return steps


@pytest.mark.parametrize("core", ["sdpa", "eager"])
def test_packed_documents_with_sp2_equal_documents_run_separately(pool, core):
    assert pool.run(_packed_documents, 2, core) == [[2, 2], [2, 2]]
