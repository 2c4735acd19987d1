# dpo_sp.py — run with: torchrun --nproc-per-node 2 dpo_sp.py
"""TRL's DPOTrainer with Ulysses sequence parallelism: one `prepare` line on an ordinary DPO script.

Nothing is downloaded: a tiny Llama (policy and reference) is built from a config and ulysses-sp's
byte tokenizer is used; swap in `from_pretrained(...)` and your preference pairs for real work. Needs
`pip install ulysses-sp[hf]`. Runs on CPU (gloo) or on GPUs (NCCL), whichever the machine has.
"""

import copy

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig
from trl import DPOConfig, DPOTrainer

from ulysses_sp import shutdown
from ulysses_sp.integrations.transformers import prepare
from ulysses_sp.tasks.tokenizer import byte_tokenizer

SP = 2  # ranks per sequence-parallel group; torchrun's world size / SP ranks are data parallel


def main() -> None:
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    ref_model = copy.deepcopy(model)  # the frozen reference: a copy of the policy before training
    words = "the quick brown fox jumps over the lazy dog".split()
    pairs = [{"prompt": " ".join(words[: 2 + i % 5]) + " ->",
              "chosen": " " + " ".join(words[2 + i % 5 :]) * 3,
              "rejected": " " + " ".join(reversed(words)) * 2} for i in range(32)]  # fmt: skip
    args = DPOConfig(
        output_dir="dpo_sp_out",
        use_cpu=not torch.accelerator.is_available(),
        bf16=torch.accelerator.is_available(),
        max_length=256,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=SP,  # an SP group shares its ranks' batches: same global batch
        max_steps=3,
        logging_steps=1,
        learning_rate=1e-3,
        beta=0.1,
        report_to=[],
        save_strategy="no",
    )
    trainer = DPOTrainer(
        model=model, ref_model=ref_model, args=args, processing_class=tokenizer,
        train_dataset=Dataset.from_list(pairs[:24]), eval_dataset=Dataset.from_list(pairs[24:]),
    )  # fmt: skip
    prepare(trainer, sp_size=SP)  # <- the one new line
    trainer.train()
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        logs = [h for h in trainer.state.log_history if "loss" in h]
        print("losses", [round(h["loss"], 4) for h in logs], "reward margins",
              [round(h["rewards/margins"], 4) for h in logs], f"eval loss {metrics['eval_loss']:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
    shutdown()
