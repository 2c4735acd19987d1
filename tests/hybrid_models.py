"""Tiny hybrid models for the mixer tests: transformers' own LFM2, Nemotron-H, Falcon-H1,
GraniteMoeHybrid, Bamba, Mamba-2, Mamba, Falcon-Mamba, Jamba and ZAYA code (and OPT and BioGPT: learned positions)
from local configs, random fp32
weights large enough that a wrong position shows (std 0.2, as ``models.tiny_model``)."""

from __future__ import annotations

import torch

V = 64
PURE = ("mamba2", "mamba", "falcon_mamba", "rwkv", "xlstm")
"""The architectures without attention layers (no SP attention to register)."""


def hybrid_config(
    arch: str, *, mamba_heads: int = 4, groups: int = 2, kv_heads: int = 2, vocab: int = V, **overrides
):
    """A tiny config of ``arch`` (``lfm2``, ``nemotron_h``, ``falcon_h1``, ``granitemoehybrid``, ``bamba``,
    ``mamba2``, ``mamba``, ``falcon_mamba``, ``jamba``, ``zamba``, ``opt``, ``biogpt``, ``zaya``, ``phimoe``, ``musicgen``,
    ``musicgen_melody``, ``recurrent_gemma``, ``rwkv``, ``minimax``, ``xlstm``); ``overrides`` go to the config's constructor."""
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=kv_heads, max_position_embeddings=512, tie_word_embeddings=False)  # fmt: skip
    common.update(overrides)
    if arch == "lfm2":
        return tf.Lfm2Config(
            num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3, **common
        )
    if arch == "nemotron_h":
        return tf.NemotronHConfig(
            head_dim=8, mamba_num_heads=mamba_heads, mamba_head_dim=8, ssm_state_size=8, n_groups=groups,
            chunk_size=8, conv_kernel=4, layers_block_type=["mamba", "attention", "mamba", "mlp"], **common,
        )  # fmt: skip
    mamba = dict(mamba_n_heads=mamba_heads, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=groups,
                 mamba_chunk_size=8, mamba_d_conv=4)  # fmt: skip
    if arch == "falcon_h1":
        return tf.FalconH1Config(
            num_hidden_layers=2, head_dim=8, mamba_d_ssm=8 * mamba_heads, **mamba, **common
        )
    if arch == "granitemoehybrid":
        return tf.GraniteMoeHybridConfig(
            # mamba layers only: its attention layers get no position_ids (refused under SP by the attention)
            num_hidden_layers=2, layer_types=["mamba", "mamba"], mamba_expand=1, num_local_experts=4,
            num_experts_per_tok=2, **mamba, **common,
        )  # fmt: skip
    if arch == "bamba":
        return tf.BambaConfig(num_hidden_layers=2, attn_layer_indices=[1], mamba_expand=1, **mamba, **common)
    if arch == "mamba2":  # Mamba-2 alone (no attention layers)
        return tf.Mamba2Config(vocab_size=vocab, hidden_size=32, expand=2, num_heads=mamba_heads, head_dim=64 // mamba_heads,
                               n_groups=groups, state_size=8, chunk_size=8, num_hidden_layers=2, tie_word_embeddings=False)  # fmt: skip
    if arch in ("mamba", "falcon_mamba"):  # Mamba-1 alone (no attention layers): I = 64 channels
        cls = tf.MambaConfig if arch == "mamba" else tf.FalconMambaConfig
        return cls(vocab_size=vocab, hidden_size=32, expand=2, state_size=8, conv_kernel=4, time_step_rank=4,
                   num_hidden_layers=2, tie_word_embeddings=False)  # fmt: skip
    if arch == "jamba":  # Mamba-1 (layer 0) beside attention (layer 1), experts in layer 1
        return tf.JambaConfig(num_hidden_layers=2, attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1,
                              expert_layer_period=2, num_experts=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                              mamba_dt_rank=4, **common)  # fmt: skip
    if arch == "zamba":  # Mamba-1 with 2 heads of 32 channels (per-head x_proj/dt_proj), a shared attention block
        return tf.ZambaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                              num_key_value_heads=4, n_mamba_heads=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                              mamba_dt_rank=4, num_hidden_layers=3, max_position_embeddings=512,
                              layers_block_type=["linear_attention", "hybrid", "hybrid"], tie_word_embeddings=False)  # fmt: skip
    if arch == "opt":  # learned positions from a cumulative sum of the mask, unless position_ids are given
        return tf.OPTConfig(vocab_size=vocab, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                            max_position_embeddings=512, word_embed_proj_dim=32, tie_word_embeddings=False, dropout=0.0)  # fmt: skip
    if arch == "biogpt":  # the same positions, scaled embeddings, pre-norm layers
        return tf.BioGptConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, max_position_embeddings=512, scale_embedding=True,
                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    own = _own_scores_config(arch, vocab, overrides)
    if own is not None:
        return own
    if arch == "zaya":  # convolutions inside the q/k projection (kernels 2 and 2), a delayed value half, both layer types
        return tf.ZayaConfig(vocab_size=vocab, hidden_size=32, num_attention_heads=4, num_key_value_heads=kv_heads,
                             head_dim=8, num_hidden_layers=2, layer_types=["hybrid", "hybrid_sliding"], sliding_window=8,
                             num_experts=4, num_experts_per_tok=1, moe_intermediate_size=32, router_hidden_size=16,
                             max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2, **overrides)  # fmt: skip
    if arch == "phimoe":  # a sliding window (8 of 32 tokens) applied only through the model's mask
        return tf.PhimoeConfig(num_hidden_layers=2, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                               **common)  # fmt: skip
    if arch in ("musicgen", "musicgen_melody"):  # a sinusoidal table that numbers its input 0..S-1; one codebook
        cls = tf.MusicgenDecoderConfig if arch == "musicgen" else tf.MusicgenMelodyDecoderConfig
        return cls(vocab_size=vocab, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                   num_codebooks=1, max_position_embeddings=16, dropout=0.0, pad_token_id=0, bos_token_id=1)  # fmt: skip
    if arch == "recurrent_gemma":  # Griffin: recurrent blocks (conv + RG-LRU) and local attention, W = 32 channels
        return tf.RecurrentGemmaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                       num_key_value_heads=kv_heads, num_hidden_layers=3, lru_width=32,
                                       attention_window_size=64, conv1d_width=4, logits_soft_cap=30.0,
                                       block_types=["recurrent", "attention", "recurrent"], pad_token_id=0)  # fmt: skip
    if arch == "rwkv":  # RWKV-4: token shift (a halo of 1) in both mixings, the WKV recurrence per channel
        return tf.RwkvConfig(vocab_size=vocab, hidden_size=32, attention_hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, context_length=64, rescale_every=0, tie_word_embeddings=False)  # fmt: skip
    if arch == "minimax":  # lightning attention (layers 0, 2; blocks of 8: several per document) beside attention
        return tf.MiniMaxConfig(num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
                                head_dim=8, block_size=8, num_local_experts=4, num_experts_per_tok=2, **common)  # fmt: skip
    if arch == "xlstm":  # mLSTM: 4 heads (q/k 4, v 8 wide), chunks of 4 (the default mode runs whole chunks
        # chunkwise, the rest with the step recurrence); no attention, no convolution
        return tf.xLSTMConfig(vocab_size=vocab, hidden_size=32, num_heads=4, num_hidden_layers=2, chunk_size=4,
                              tie_word_embeddings=False, **overrides)  # fmt: skip
    raise ValueError(arch)


OWN_SCORES = ("bloom", "falcon", "gpt_neo", "mpt", "doge", "trocr", "inkling", "inkling2", "inkling2_loop", "cpmant",
              "xlnet")
"""Attention that computes its own scores (the head-parallel fallback, ``mixers/own_scores.py``): eager only."""


def _own_scores_config(arch: str, vocab: int, overrides: dict):
    """4 heads of 8, 2 layers, no dropout: BLOOM (ALiBi, fused [H, 3, D] qkv), Falcon (rotary; multi-query by
    default, ``new_decoder_architecture`` + ``num_kv_heads``: grouped), GPT-Neo (a global and a local layer,
    window 8), MPT (ALiBi position bias, fused [3, H, D] Wqkv), Doge (2 kv heads, its dynamic mask: a key
    gate per kv head, each query's top 8 keys by it — ``keep_window_size`` 8 of 32 tokens), TrOCR's decoder (its
    width read from its input, a learned position table numbering its tokens itself, scaled embeddings)."""
    import transformers as tf

    if arch == "bloom":
        return tf.BloomConfig(vocab_size=vocab, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
                              attention_dropout=0.0, tie_word_embeddings=False, **overrides)  # fmt: skip
    if arch == "falcon":
        return tf.FalconConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=512,
                               tie_word_embeddings=False, **overrides)  # fmt: skip
    if arch == "gpt_neo":
        return tf.GPTNeoConfig(vocab_size=vocab, hidden_size=32, num_layers=2, num_heads=4, window_size=8,
                               attention_types=[[["global", "local"], 1]], max_position_embeddings=512,
                               embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0, **overrides)  # fmt: skip
    if arch == "mpt":
        return tf.MptConfig(vocab_size=vocab, d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=512,
                            resid_pdrop=0.0, emb_pdrop=0.0, **overrides)  # fmt: skip
    if arch == "doge":
        return tf.DogeConfig(**{**dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, keep_window_size=8,
                                       max_position_embeddings=512, tie_word_embeddings=False), **overrides})  # fmt: skip
    if arch == "trocr":
        return tf.TrOCRConfig(**{**dict(vocab_size=vocab, d_model=32, decoder_layers=2, decoder_attention_heads=4,
                                        decoder_ffn_dim=64, dropout=0.0, scale_embedding=True, use_cache=False,
                                        tie_word_embeddings=False), **overrides})  # fmt: skip
    if arch == "xlnet":  # relative attention over encodings its model builds, residual + LayerNorm inside
        return tf.XLNetConfig(**{**dict(vocab_size=vocab, d_model=32, n_head=4, d_inner=64, n_layer=2, dropout=0.0,
                                        use_mems_train=False, use_mems_eval=False), **overrides})  # fmt: skip
    if arch.startswith("inkling"):
        return _inkling_config(arch, vocab, overrides)
    if arch == "cpmant":  # a prompt of 3 tokens before the row, attention both ways, a segment/relative-bucket bias
        # (16 buckets to distance 32: log-spaced past 4); its prompt ids run to vocab + 3 x prompt_length
        return tf.CpmAntConfig(vocab_size=vocab, hidden_size=32, num_attention_heads=4, dim_head=8, dim_ff=64,
                               num_hidden_layers=2, dropout_p=0.0, position_bias_num_buckets=16,
                               position_bias_max_distance=32, prompt_types=3, prompt_length=3, segment_types=3,
                               use_cache=False, **overrides)  # fmt: skip
    return None


def _inkling_config(arch: str, vocab: int, overrides: dict):
    """Inkling / Inkling-2 / Inkling-2 Loop text: a sliding layer (window 8) and a full one, 4 heads of 8 and 2 kv
    heads in both, relative bias over 6 distances (``d_rel`` 4), log scaling from position 2 on, kernel-4 short
    convolutions (Inkling-2's full layer: dynamic), 4 experts; the Loop's second layer runs twice."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[f"{arch}_text"]
    kw = dict(vocab_size=vocab, unpadded_vocab_size=vocab, hidden_size=32, intermediate_size=64,
              moe_intermediate_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8, d_rel=4, rel_extent=6,
              sliding_window_size=8, log_scaling_n_floor=2, num_hidden_layers=2, layer_types=["hybrid_sliding", "hybrid"],
              n_routed_experts=4, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, attention_dropout=0.0, n_layers_per_attn_res_block=1,
              loop_layer_index_start=1, loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=8)  # fmt: skip
    known = cls().to_dict()
    return cls(**{k: v for k, v in {**kw, **overrides}.items() if k in known or k == "sliding_window_size"})


def hybrid_model(arch: str, seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    attn = "eager" if arch in PURE + OWN_SCORES else "sdpa"  # no attention layers: transformers refuses sdpa
    config = _own_scores_config(arch, V, kw) if arch in OWN_SCORES else hybrid_config(arch, **kw)
    if arch.startswith("musicgen"):  # the causal-LM registry pairs it with the composite config: its decoder's own
        import transformers as tf

        cls = tf.MusicgenForCausalLM if arch == "musicgen" else tf.MusicgenMelodyForCausalLM
        model = cls._from_config(config, attn_implementation=attn)
    else:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    if arch == "phimoe":  # in training mode its router samples experts at random (Gumbel): the route the
        model.eval()  # comparison needs is the deterministic one
    return model.float()
