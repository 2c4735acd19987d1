"""Worker-side helpers for the KTO and reward-model tests: a real TRL ``KTOTrainer`` / ``RewardTrainer`` on a tiny
llama inside a harness pool worker, with or without ``prepare(trainer, sp_size=...)``; every logged value of every
step (and of ``evaluate()``)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import torch
from hf_dpo_runs import on_disk, preference_rows, shared_dir
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


def kto_train(sp_size: int, *, steps: int = 2, accum: int = 1, evaluate: bool = False, reference: str = "model",
              **config: Any) -> dict[str, Any]:  # fmt: skip
    """``steps`` optimizer steps of ``KTOTrainer`` (fp32, 2 completions per device batch, the KL term from
    mismatched completions unless ``loss_type='apo_zero_unpaired'``); ``sp_size=0``: no ``prepare`` (the oracle).
    ``reference``: ``model`` (a separate reference model), ``peft`` (a LoRA adapter, the reference is the adapter
    disabled) or ``precompute`` (the reference's log-probs, KL ones included, computed by a separate model when the
    trainer is built: before prepare, no SP there)."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    from ulysses_sp.tasks.tokenizer import byte_tokenizer

    model = tiny_model("llama", seed=0, vocab=VOCAB)
    ref = None if reference == "peft" else tiny_model("llama", seed=3, vocab=VOCAB)
    peft_config = None
    if reference == "peft":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    with accelerate_env(), tempfile.TemporaryDirectory() as out, shared_dir() as data:
        args = KTOConfig(output_dir=out, max_steps=steps, gradient_accumulation_steps=accum,
                         precompute_ref_log_probs=reference == "precompute", **COMMON, **config)  # fmt: skip

        def rows(n: int, seed: int, name: str) -> Any:  # precomputing caches next to the dataset's own files
            if reference == "precompute":
                return on_disk(unpaired_rows(n, seed), os.path.join(data, name))
            return Dataset.from_list(unpaired_rows(n, seed))

        trainer = KTOTrainer(
            model=model, ref_model=ref, args=args, processing_class=byte_tokenizer(),
            train_dataset=rows(16, 1, "train"), eval_dataset=rows(8, 2, "eval") if evaluate else None,
            peft_config=peft_config,
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
