"""Worker-side helpers for the KTO and reward-model tests: a real TRL ``KTOTrainer`` / ``RewardTrainer`` on a tiny
llama inside a harness pool worker, with or without ``prepare(trainer, sp_size=...)``; every logged value of every
step (and of ``evaluate()``)."""

from __future__ import annotations

import contextlib
import tempfile
from typing import Any

import torch
from hf_dpo_runs import preference_rows
from hf_runs import VOCAB, accelerate_env, fsdp2_on_cpu, prepared_run
from models import tiny_config, tiny_model

COMMON = dict(use_cpu=True, report_to=[], save_strategy="no", per_device_train_batch_size=2,
              per_device_eval_batch_size=2, learning_rate=1e-2, logging_steps=1, seed=0, disable_tqdm=True,
              dataloader_num_workers=0, bf16=False, dataset_num_proc=None)  # fmt: skip


def unpaired_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """KTO's unpaired rows: each preference pair's chosen (label True) and rejected (False) completion."""
    rows = []
    for r in preference_rows((n + 1) // 2, seed):
        rows += [{"prompt": r["prompt"], "completion": r["chosen"], "label": True},
                 {"prompt": r["prompt"], "completion": r["rejected"], "label": False}]  # fmt: skip
    return rows[:n]


def kto_train(sp_size: int, *, steps: int = 2, accum: int = 1, evaluate: bool = False, **config: Any) -> dict[str, Any]:
    """``steps`` optimizer steps of ``KTOTrainer`` (fp32, 2 completions per device batch, a separate reference
    model, the KL term from mismatched completions); ``sp_size=0``: no ``prepare`` (the oracle)."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    from ulysses_sp.tasks.tokenizer import byte_tokenizer

    model, ref = tiny_model("llama", seed=0, vocab=VOCAB), tiny_model("llama", seed=3, vocab=VOCAB)
    with accelerate_env(), tempfile.TemporaryDirectory() as out:
        args = KTOConfig(output_dir=out, max_steps=steps, gradient_accumulation_steps=accum, **COMMON, **config)
        trainer = KTOTrainer(
            model=model, ref_model=ref, args=args, processing_class=byte_tokenizer(),
            train_dataset=Dataset.from_list(unpaired_rows(16, seed=1)),
            eval_dataset=Dataset.from_list(unpaired_rows(8, seed=2)) if evaluate else None,
        )  # fmt: skip
        return prepared_run(trainer, sp_size, evaluate=evaluate)


def reward_train(sp_size: int, *, steps: int = 2, accum: int = 1, evaluate: bool = False, fsdp2: bool = False,
                 **config: Any) -> dict[str, Any]:  # fmt: skip
    """``steps`` optimizer steps of ``RewardTrainer`` on a tiny llama sequence classifier (one score; fp32, 2
    pairs per device batch of varied lengths: each row's last token on a different shard)."""
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    from ulysses_sp.tasks.tokenizer import byte_tokenizer

    tokenizer = byte_tokenizer()
    cfg = tiny_config("llama", vocab=VOCAB)
    cfg.num_labels, cfg.pad_token_id = 1, tokenizer.pad_token_id
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(cfg, attn_implementation="sdpa").float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    fsdp = fsdp2_on_cpu() if fsdp2 else contextlib.nullcontext()
    with accelerate_env(), fsdp, tempfile.TemporaryDirectory() as out:
        args = RewardConfig(output_dir=out, max_steps=steps, gradient_accumulation_steps=accum, **COMMON, **config)
        trainer = RewardTrainer(
            model=model, args=args, processing_class=tokenizer,
            train_dataset=Dataset.from_list(preference_rows(16, seed=1)),
            eval_dataset=Dataset.from_list(preference_rows(8, seed=2)) if evaluate else None,
        )  # fmt: skip
        return prepared_run(trainer, sp_size, evaluate=evaluate)
