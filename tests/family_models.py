"""Tiny random models of the attention families with per-layer structure: attention sinks (gpt-oss,
MiMo-V2-Flash), chunked attention with NoPE query temperature (Llama 4 text), LongCat-Flash. Real transformers
modeling code, fp32, weights drawn at std 0.2 so one wrong position shows."""

from __future__ import annotations

import torch

COMMON = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    attention_dropout=0.0,
)

FAMILIES = {
    # sinks in every layer; layer 0 slides (window 8), layer 1 is full attention
    "gpt_oss": dict(
        num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),
    # sinks only in the sliding layer (layer 1); v head dim differs from q/k's
    "mimo_v2_flash": dict(
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, head_dim=16, v_head_dim=16,
        sliding_window=8,
    ),
    # layer 0: rope + chunked attention (chunk 6); layer 1: NoPE full attention whose queries are
    # scaled by the token index (floor_scale 4: it varies along a short sequence)
    "llama4_text": dict(
        attention_chunk_size=6, head_dim=16, num_local_experts=2, intermediate_size_mlp=128,
        no_rope_layers=[1, 0], floor_scale=4, attn_scale=1.0, attn_temperature_tuning=True,
    ),
    # two MLA sublayers per layer (num_hidden_layers = 2 x num_layers), routed + identity experts
    "longcat_flash": dict(
        num_layers=1, n_routed_experts=4, moe_topk=2, zero_expert_num=2, expert_ffn_hidden_size=32,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=16,
    ),
    # DeepSeek Sparse Attention: MLA + an indexer keeping each query's top 4 of up to 32 keys (4 index heads)
    "deepseek_v32": dict(
        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, index_topk=4, index_n_heads=4, index_head_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
    ),
    # GLM-5: layer 1 reuses layer 0's picks (prev_topk_indices); interleaved rotary in the indexer
    "glm_moe_dsa": dict(
        num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, index_topk=4, index_n_heads=4, index_head_dim=16, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1,
        indexer_types=["full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse"],
    ),
    # Qwen4-Exp's QSA: blocks of 3 keys from each document's first token, each query keeps its best block (+ its
    # incomplete block): up to 10 blocks at 32 tokens; both layers QSA (the gated delta-net layers are
    # the mixers' and the engine's: the sweep runs the hybrid)
    "qwen4_exp_text": dict(
        layer_types=["indexed_attention", "indexed_attention"], head_dim=16, indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=16, indexer_budget=3, indexer_compress_ratio=3, hc_lowrank=16, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    ),
    # DeepSeek-V4: HCA (K/V pooled every 5 tokens) then CSA (every 3, over two overlapping windows, an indexer keeping
    # each query's top 2 entries), both beside a sliding window of 6 keys with sinks; windows straddle the shard edges
    "deepseek_v4": dict(
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"], num_key_value_heads=1,
        compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 5}, sliding_window=6,
        head_dim=16, q_lora_rank=16, o_groups=2, o_lora_rank=16, index_topk=2, index_n_heads=2, index_head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, hc_mult=2, mlp_layer_types=["moe", "moe"],
    ),
}  # fmt: skip


def family_model(family: str, *, attn: str = "eager", seed: int = 0, **overrides):
    """The tiny ``family`` causal LM with ``attn`` as its attention implementation."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(family, **{**COMMON, **FAMILIES[family], **overrides})
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.float()
