"""Shared model and data definitions for the benchmarks (torch + transformers only).

Imported by workers in both virtual environments (ours and bench/.venv-deepspeed), so both sides build
bit-identical models and batches from the same seed. Nothing here imports ulysses_sp or deepspeed.
"""

from __future__ import annotations

import dataclasses

import torch

IGNORE_INDEX = -100


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A tiny Llama: every field is a LlamaConfig field."""

    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    num_hidden_layers: int = 2
    intermediate_size: int = 128
    vocab_size: int = 256
    max_position_embeddings: int = 65536


def llama(*, seed: int = 0, attn_implementation: str = "sdpa", **fields):
    """A freshly initialised fp32 ``LlamaForCausalLM`` in train mode, untied; ``fields`` are LlamaConfig's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{"tie_word_embeddings": False, **fields}, attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().train()
    model.config._attn_implementation = attn_implementation
    return model


def build_model(spec: ModelSpec, *, seed: int = 0, attn_implementation: str = "sdpa"):
    """The benchmark model of ``spec`` (same weights for the same seed, in any process)."""
    return llama(seed=seed, attn_implementation=attn_implementation, **dataclasses.asdict(spec))


def packed_positions(seq: int) -> torch.Tensor:
    """Position ids ``[1, S]`` of three packed documents of ``S/2, S/4, S/4`` tokens (they restart)."""
    return torch.cat([torch.arange(n) for n in (seq // 2, seq // 4, seq - seq // 2 - seq // 4)])[None]


def pack_documents(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``sample`` ([S] or [B, S]) as ``packed_positions``' documents: no label across a document boundary."""
    pos = packed_positions(sample["input_ids"].shape[-1])[0].expand_as(sample["input_ids"])
    return {**sample, "position_ids": pos, "labels": sample["labels"].masked_fill(pos == 0, IGNORE_INDEX)}


def make_sample(index: int, seq_len: int, vocab: int, *, seed: int = 1234) -> dict[str, torch.Tensor]:
    """One learnable sample ``{input_ids, labels, position_ids}`` [1, seq_len]: a noisy affine recurrence (the
    loss falls over a few steps); labels = input_ids, the first ignored (the loss / SP adapter shifts them)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    a = int(torch.randint(1, vocab, (1,), generator=g))
    ids = torch.empty(seq_len, dtype=torch.long)
    ids[0] = int(torch.randint(0, vocab, (1,), generator=g))
    noise = torch.randint(0, 8, (seq_len,), generator=g)
    for t in range(1, seq_len):
        ids[t] = (ids[t - 1] * a + 7 + (noise[t] == 0) * noise[t - 1]) % vocab
    labels = ids.clone()
    labels[0] = IGNORE_INDEX
    return {"input_ids": ids[None], "labels": labels[None], "position_ids": torch.arange(seq_len)[None]}


def make_batch(indices: list[int], seq_len: int, vocab: int) -> dict[str, torch.Tensor]:
    """Stack samples into a micro-batch [B, seq_len]."""
    samples = [make_sample(i, seq_len, vocab) for i in indices]
    return {k: torch.cat([s[k] for s in samples], 0) for k in samples[0]}


def rank_samples(rank: int, world: int, mb: int, items: int, seq_len: int, vocab: int) -> list[dict]:
    """The samples one global rank's ordinary DataLoader yields (before any SP adapter): item ``j`` of rank ``r``
    is sample ``(j * world + r) * mb + e`` for ``e`` in the micro-batch, so ranks never repeat each other's data."""
    samples = (make_sample((j * world + rank) * mb + e, seq_len, vocab) for j in range(items) for e in range(mb))
    return [{key: v[0] for key, v in s.items()} for s in samples]


def adapter_sample_ids(step: int, dp_rank: int, dp_size: int, sp_size: int, mb: int) -> list[int]:
    """Sample ids that SP group ``dp_rank`` trains on at ``step`` under the round-robin SP adapter: it gathers one
    loader item from each of the group's ``P`` ranks and processes them on consecutive steps, so step ``s`` uses
    item ``s // P`` of global rank ``dp_rank * P + s % P`` (ranks dp-major, as DeepSpeed and ulysses-sp lay them)."""
    rank, j = dp_rank * sp_size + step % sp_size, step // sp_size
    return [(j * dp_size * sp_size + rank) * mb + e for e in range(mb)]


def make_optimizer(params, lr: float) -> torch.optim.Optimizer:
    """AdamW without weight decay: the same optimizer on every side of a comparison."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def causal_lm_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross entropy of a full (unsharded) batch: the oracle's loss."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits  # [B, S, V]
    shift = torch.nn.functional.pad(batch["labels"], (0, 1), value=IGNORE_INDEX)[:, 1:]  # [B, S], next tokens
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), shift.flatten(), ignore_index=IGNORE_INDEX)


def sp_loss_combine(loss_sum, good, group, combine: str = "all_gather") -> torch.Tensor:
    """The global token mean over the SP group from each rank's loss sum and scored-token count."""
    import torch.distributed.nn.functional as dnn

    if combine == "all_gather":  # DeepSpeed's documented recipe: differentiable all-gather of sums and counts
        return sum(dnn.all_gather(loss_sum, group=group)) / max(int(sum(dnn.all_gather(good, group=group))), 1)
    goods = good.clone()  # all_reduce: the same value and the same (P x local share) gradient
    torch.distributed.all_reduce(goods, group=group)
    return dnn.all_reduce(loss_sum, group=group) / max(int(goods), 1)


def reference_run(spec: ModelSpec, *, steps: int, dp_size: int, sp_size: int, mb: int, seq_len: int, lr: float,
                  packed: bool = False) -> dict:  # fmt: skip
    """The oracle: the same optimizer steps in one process without parallelism; each step averages the dp
    replicas' mean losses (equal token counts: the global token mean), as DP gradient averaging does.
    ``packed``: every sample as ``pack_documents``' documents. Returns per-step losses and the step-1 gradient norm."""
    model = build_model(spec)  # seed 0, as the workers'
    opt = make_optimizer(model.parameters(), lr)
    losses, grad_norm = [], None
    for step in range(steps):
        batches = [make_batch(adapter_sample_ids(step, d, dp_size, sp_size, mb), seq_len, spec.vocab_size)
                   for d in range(dp_size)]  # fmt: skip
        batches = [pack_documents(b) for b in batches] if packed else batches
        loss = sum(causal_lm_loss(model, b) for b in batches) / dp_size
        loss.backward()
        if step == 0:
            grad_norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {"losses": losses, "grad_norm_step1": grad_norm}
