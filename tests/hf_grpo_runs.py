"""Worker-side helper for the RL trainer tests: a real TRL ``GRPOTrainer`` / ``RLOOTrainer`` on a tiny llama
inside a harness pool worker, with or without ``prepare(trainer, sp_size=...)``; returns every logged value of
every step.

The completions are sampled (temperature 1): the tiny model's generation config lists 30 more end-of-sequence
ids so completions stop at varied lengths within ``max_completion_length``; prompts have varied lengths (TRL
left-pads them). The reward is the number of lowercase letters in the completion."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from hf_dpo_runs import shared_dir
from hf_runs import VOCAB, accelerate_env, fsdp2_on_cpu, prepared_run
from models import tiny_model

EOS_IDS = [258, *range(30)]
"""The byte tokenizer's ``<eos>`` and 30 punctuation bytes: completions end early, at varied lengths."""


def lowercase(completions: list[str], **_: Any) -> list[float]:
    """The reward: how many lowercase letters a completion holds (1 token in 10 of the tiny model's samples)."""
    return [float(sum(ch.islower() for ch in c)) for c in completions]


def prompt_rows(n: int, seed: int) -> list[dict[str, str]]:
    """Prompts of 1-4 words (byte tokens: one per character)."""
    g = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    return [{"prompt": " ".join(words[int(i)] for i in torch.randint(0, 8, (1 + k % 4,), generator=g))}
            for k in range(n)]  # fmt: skip


def rl_train(sp_size: int, *, trainer: str = "grpo", steps: int = 2, lora: bool = False, evaluate: bool = False,
             fsdp2: bool = False, **config: Any) -> dict[str, Any]:  # fmt: skip
    """Train ``steps`` optimizer steps (fp32, 4 completions per device batch, 2 per prompt, 8 tokens at most);
    ``sp_size=0``: no ``prepare`` (the oracle). ``config``: more ``GRPOConfig`` / ``RLOOConfig`` fields (``beta``
    > 0 builds the reference model from the policy's directory, or disables the LoRA adapter). Returns the
    logged dicts of every step (and of ``evaluate()``), the trainer's class name, what ``remove()`` restored and
    whether the parameters were sharded (``fsdp2``: accelerate's FSDP2, ``hf_runs.fsdp2_on_cpu``)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from ulysses_sp.tasks.tokenizer import byte_tokenizer

    config_cls, trainer_cls = (GRPOConfig, GRPOTrainer) if trainer == "grpo" else (RLOOConfig, RLOOTrainer)
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    fsdp = fsdp2_on_cpu() if fsdp2 else contextlib.nullcontext()
    with accelerate_env(), fsdp, tempfile.TemporaryDirectory() as out, shared_dir() as shared:
        model_dir = os.path.join(shared, "model")  # TRL builds the reference model (beta > 0) from the policy's path
        if dist.get_rank() == 0:  # transformers writes on the main process only
            model = tiny_model("llama", seed=0, vocab=VOCAB)
            model.generation_config.eos_token_id = EOS_IDS
            model.save_pretrained(model_dir)
        dist.barrier()
        config.setdefault("num_generations", 2)
        args = config_cls(
            output_dir=out, use_cpu=True, report_to=[], save_strategy="no", max_steps=steps,
            per_device_train_batch_size=4, per_device_eval_batch_size=4, max_completion_length=8,
            learning_rate=1e-2, logging_steps=1, seed=0, disable_tqdm=True, dataloader_num_workers=0,
            bf16=config.pop("bf16", False), model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"}, **config,
        )  # fmt: skip
        trainer_obj = trainer_cls(
            model=model_dir, reward_funcs=lowercase, args=args, processing_class=byte_tokenizer(),
            train_dataset=Dataset.from_list(prompt_rows(32, seed=1)),
            eval_dataset=Dataset.from_list(prompt_rows(8, seed=2)) if evaluate else None, peft_config=peft_config,
        )  # fmt: skip
        return prepared_run(trainer_obj, sp_size, evaluate=evaluate)


def refusals() -> list[str]:
    """The messages ``prepare`` raises for a GRPOTrainer with what the RL SP path refuses (one process)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from ulysses_sp.integrations.transformers import prepare
    from ulysses_sp.tasks.tokenizer import byte_tokenizer

    class OwnLogps(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    messages = []
    with accelerate_env(), tempfile.TemporaryDirectory() as out:
        for cls, extra, kw in ((GRPOTrainer, {"use_transformers_continuous_batching": True}, {}),
                               (GRPOTrainer, {}, {"tiled_loss": True}), (OwnLogps, {}, {})):  # fmt: skip
            args = GRPOConfig(output_dir=out, use_cpu=True, report_to=[], per_device_train_batch_size=2,
                              num_generations=2, max_completion_length=4, **extra)  # fmt: skip
            trainer = cls(model=tiny_model("llama", seed=0, vocab=VOCAB), reward_funcs=lowercase, args=args,
                          processing_class=byte_tokenizer(), train_dataset=Dataset.from_list(prompt_rows(4, 1)))  # fmt: skip
            try:
                prepare(trainer, sp_size=2, **kw)
            except ValueError as e:
                messages.append(str(e))
    return messages
