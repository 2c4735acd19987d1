"""Built-in model presets (transformers configs built in code) and model loading.

``tiny-llama``, ``tiny-qwen2``, ``tiny-mistral``: real transformers modeling code with random
weights, small enough that the default run learns the recall task in a few minutes on 2 CPU cores
(~115k parameters). Every preset has 4 query heads, so ``sp`` may be 1, 2 or 4; Qwen2 and Mistral
have 2 kv heads (GQA; at ``sp=4`` the attention replicates kv heads).
"""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers' modeling code is imported only when a model is built
    from transformers import PretrainedConfig, PreTrainedModel

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=1 << 17,  # RoPE: any --seq-len
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
PRESETS: dict[str, tuple[str, dict]] = {
    "tiny-llama": ("llama", dict(num_key_value_heads=4)),
    "tiny-qwen2": ("qwen2", dict(num_key_value_heads=2, use_sliding_window=False)),
    "tiny-mistral": ("mistral", dict(num_key_value_heads=2, sliding_window=None)),
}


def is_preset(name: str) -> bool:
    return name in PRESETS


def preset_config(name: str, *, vocab_size: int) -> PretrainedConfig:
    """The transformers config of preset ``name`` for a tokenizer of ``vocab_size`` tokens.

    The embedding is padded to a multiple of 8 rows (usual practice, and headroom: transformers'
    ``AutoTokenizer`` reloads a byte tokenizer saved next to a Qwen2 config as ``Qwen2Tokenizer``,
    which appends ``<|endoftext|>`` as token 259).
    """
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    model_type, extra = PRESETS[name]
    padded = -(-vocab_size // 8) * 8
    return AutoConfig.for_model(model_type, vocab_size=padded, **_COMMON, **extra)


def check_model_dir(path: str) -> None:
    """Raise ``ValueError`` unless ``path`` is a directory holding a ``config.json``."""
    if not os.path.isdir(path):
        raise ValueError(f"--model {path!r}: not a preset ({', '.join(PRESETS)}) and no such directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"--model {path!r}: directory has no config.json (not a HF model directory)")


def build_model(
    name_or_path: str, *, vocab_size: int, seed: int, attn_implementation: str = "sdpa",
    config: PretrainedConfig | None = None,
) -> PreTrainedModel:  # fmt: skip
    """A preset with weights drawn from ``seed`` (identical on every rank), or a local HF model.

    ``config``: the model's config when the caller already has it (not read or built again).
    A directory whose config has a ``vision_config`` (a vision-language model) is built with
    ``AutoModelForImageTextToText`` (its ``*ForConditionalGeneration``), any other with
    ``AutoModelForCausalLM``. The model is fp32 on the CPU; the engine moves it to the run's device.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    if is_preset(name_or_path):
        config = (
            copy.deepcopy(config)
            if config is not None
            else preset_config(name_or_path, vocab_size=vocab_size)
        )
        config._attn_implementation = attn_implementation
        fork = torch.random.fork_rng(devices=[])
        with fork:
            torch.manual_seed(seed)
            return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    check_model_dir(name_or_path)
    extra = {} if config is None else {"config": copy.deepcopy(config)}
    seen = config if config is not None else AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    auto = AutoModelForImageTextToText if getattr(seen, "vision_config", None) is not None else AutoModelForCausalLM
    return auto.from_pretrained(
        name_or_path, attn_implementation=attn_implementation, dtype=torch.float32, **extra
    )
