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
from oracle import assert_step_close

from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
from ulysses_sp.data import PackingCollator, UlyssesSPDataLoaderAdapter
from ulysses_sp.parallel.loss import sp_causal_lm_loss
from ulysses_sp.parallel.mesh import init_mesh

VOCAB = 64
# Per SP rank: 3 documents packed into one sequence; rank 0's is 17 tokens (padded to 18 for sp=2),
# rank 1's 20. Boundaries fall inside shards and (rank 1: 6 | 4, shard edge at 10) on a shard edge.
DOCS = {0: (5, 8, 4), 1: (6, 4, 10)}


def _docs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in DOCS[rank]]


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
    info = mesh
    dl = torch.utils.data.DataLoader([_docs(info.sp_rank)], batch_size=None, collate_fn=collate)
    ad = UlyssesSPDataLoaderAdapter(dl, info.sp_rank, mesh.sp_group, 2, "cpu")
    steps = 0
    for src, batch in enumerate(ad):  # micro-step i works on SP rank i's packed batch
        assert set(batch) == {"input_ids", "position_ids", "shift_labels"}
        model.zero_grad()
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        loss = sp_causal_lm_loss(out.logits, batch["shift_labels"], mesh.sp_group)
        loss.backward()
        for p in model.parameters():  # the engine's rule with dp=1: sum over SP
            dist.all_reduce(p.grad, group=mesh.sp_group)
        assert_step_close(
            loss.detach(), {n: p.grad for n, p in model.named_parameters()}, *_reference(ref, _docs(src))
        )
        steps += 1
    return steps


@pytest.mark.parametrize("core", ["sdpa", "eager"])
def test_packed_documents_with_sp2_equal_documents_run_separately(pool, core):
    assert pool.run(_packed_documents, 2, core) == [[2, 2], [2, 2]]


# ----------------------------------------------------------------------------- training equivalence

B, STEPS, N_SAMPLES = 2, 3, 24
SGD = {"lr": 0.2, "momentum": 0.9}


def _sample(i: int) -> dict:
    """Token sequences of 9..16 tokens: odd lengths (padded by the adapter) and padding in a batch."""
    g = torch.Generator().manual_seed(1000 + i)
    return {"input_ids": torch.randint(1, VOCAB, (9 + (5 * i) % 8,), generator=g)}


def _pad_collate(samples: list[dict]) -> dict:
    """Right-pad to the longest sample; attention_mask marks the real tokens."""
    s = max(x["input_ids"].numel() for x in samples)
    ids = torch.zeros(len(samples), s, dtype=torch.long)
    mask = torch.zeros(len(samples), s, dtype=torch.long)
    for r, x in enumerate(samples):
        ids[r, : x["input_ids"].numel()] = x["input_ids"]
        mask[r, : x["input_ids"].numel()] = 1
    return {"input_ids": ids, "attention_mask": mask}


class _Samples(torch.utils.data.Dataset):
    def __len__(self):
        return N_SAMPLES

    def __getitem__(self, i):
        return _sample(i)


def _train_sp(dp: int, sp: int, stage: int):
    from ulysses_sp.engine import initialize

    mesh = init_mesh((dp, sp))
    model = tiny_model("llama", attn="sdpa", vocab=VOCAB, kv_heads=2)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, B, mesh=mesh)
    cfg = {
        "train_micro_batch_size_per_gpu": B,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": SGD},
    }
    engine, _, dl, _ = initialize(model, cfg, mpu=reg, training_data=_Samples(), collate_fn=_pad_collate)
    loader = UlyssesSPDataLoaderAdapter(dl, engine.sp_rank, engine.sp_group, engine.sp_size, engine.device)
    losses = []
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        assert "attention_mask" not in batch
        out = engine(**batch)
        engine.backward(out.loss)
        losses.append(engine.step())
    params = {}
    for n, p in engine.module.named_parameters():
        params[n] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    reg.remove()
    return losses, params


def _train_reference(dp: int):
    """No SP, by hand: replica d's step-s batch from a plain DistributedSampler over dp replicas; the
    step's loss is the mean over replicas of each replica's token-mean loss (what DDP averages)."""
    model = tiny_model("llama", attn="sdpa", vocab=VOCAB, kv_heads=2)
    opt = torch.optim.SGD(model.parameters(), **SGD)
    loaders = [
        iter(
            torch.utils.data.DataLoader(
                _Samples(),
                batch_size=B,
                sampler=torch.utils.data.DistributedSampler(_Samples(), num_replicas=dp, rank=d, seed=0),
                collate_fn=_pad_collate,
            )
        )
        for d in range(dp)
    ]
    losses = []
    for _ in range(STEPS):
        per_replica = []
        for d in range(dp):
            batch = next(loaders[d])
            ids, mask = batch["input_ids"], batch["attention_mask"]
            logits = model(input_ids=ids).logits
            target = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
            per_replica.append(
                F.cross_entropy(logits[:, :-1].flatten(0, 1), target.flatten(), ignore_index=-100)
            )
        loss = torch.stack(per_replica).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dp, sp, stage", [(1, 2, 0), (2, 2, 2)])
def test_three_training_steps_through_the_adapter_equal_training_without_sp(pool, dp, sp, stage):
    ref_losses, ref_params = _train_reference(dp)
    start = tiny_model("llama", vocab=VOCAB, kv_heads=2).state_dict()
    for losses, params in pool.run(_train_sp, dp * sp, dp, sp, stage):
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
        assert set(params) == set(ref_params)
        for name, p in params.items():
            # every tensor moved by far more than the tolerance: a wrong batch or gradient shows
            assert (ref_params[name] - start[name]).abs().max() > 1e-4, f"{name} did not train"
            torch.testing.assert_close(
                p, ref_params[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )


def _packed_documents_sp1():
    """The engine at sp = 1 (transformers' own attention, no SP registered) on one packed row."""
    from ulysses_sp.data import prepare_batch
    from ulysses_sp.engine import initialize

    mesh = init_mesh((1, 1))
    ref = tiny_model("llama", attn="sdpa", vocab=VOCAB)
    model = copy.deepcopy(ref)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
           "optimizer": {"type": "SGD", "params": SGD}}  # fmt: skip
    engine, _, _, _ = initialize(model, cfg, mpu=mesh.mpu)
    docs = _docs(1)
    batch = prepare_batch(PackingCollator()(docs), 1)
    engine.backward(loss := engine(**batch).loss)
    grads = {n.removeprefix("module."): p.grad for n, p in engine.module.named_parameters()}
    assert_step_close(loss.detach(), grads, *_reference(ref, docs))
    return True


def test_packed_documents_with_sp1_engine_equal_documents_run_separately(pool):
    """Without SP the model's own attention must keep packed documents apart too: transformers does
    so from the restarting position ids only when no KV cache is made (the engine turns it off)."""
    assert pool.run(_packed_documents_sp1, 1) == [True]
