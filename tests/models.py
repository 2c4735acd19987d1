"""Tiny HuggingFace models for tests: real transformers modeling code, random weights, fp32."""

from __future__ import annotations

import torch


def tiny_config(
    arch: str,
    *,
    heads: int = 4,
    kv_heads: int | None = None,
    layers: int = 2,
    hidden: int = 32,
    vocab: int = 64,
    attn: str = "sdpa",
):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    extra = {"sliding_window": None} if arch == "mistral" else {}
    cfg = cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **extra,
    )
    cfg._attn_implementation = attn
    return cfg


def tiny_model(arch: str, seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **kw)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=cfg._attn_implementation)
    # Random (not near-zero) weights so gradients are far from the tolerance.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.float()


def global_batch(seed: int, n: int, seq: int, vocab: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, seq), generator=g)


def shift(ids: torch.Tensor) -> torch.Tensor:
    """Causal-LM labels shifted over the full sequence, -100 at the end: [B, S] -> [B, S]."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def reference_loss(ref, ids: torch.Tensor, labels: torch.Tensor, dp: int) -> torch.Tensor:
    """The no-SP oracle: mean over the ``dp`` groups (rows ``[d*B, (d+1)*B)``) of each group's
    token-mean loss, with torch's own cross-entropy. Differentiable."""
    import torch.nn.functional as F

    b = ids.shape[0] // dp
    losses = []
    for d in range(dp):
        logits = ref(input_ids=ids[d * b : (d + 1) * b]).logits
        lab = labels[d * b : (d + 1) * b]
        losses.append(F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100))
    return torch.stack(losses).mean()


def per_document_loss(ref, ids: torch.Tensor, docs: tuple[int, ...]) -> torch.Tensor:
    """The packed-documents oracle: token-mean loss of every document of the packed row ``ids [1, S]``
    (lengths ``docs``) run on its own through the unmodified model, no SP. Differentiable."""
    import torch.nn.functional as F

    total, count, start = 0.0, 0, 0
    for n in docs:
        doc = ids[:, start : start + n]
        logits = ref(input_ids=doc).logits
        total = total + F.cross_entropy(logits[0, :-1], doc[0, 1:], reduction="sum")
        count, start = count + n - 1, start + n
    return total / count
