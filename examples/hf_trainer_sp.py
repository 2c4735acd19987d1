# hf_trainer_sp.py — run with: torchrun --nproc-per-node 2 hf_trainer_sp.py
"""TRL's SFTTrainer with Ulysses sequence parallelism: one `prepare` line on an ordinary script.

Nothing is downloaded: a tiny Llama is built from a config and ulysses-sp's byte tokenizer is used;
swap in `AutoModelForCausalLM.from_pretrained(...)` and your dataset for real work. Needs
`pip install ulysses-sp[hf]`. Runs on CPU (gloo) or on GPUs (NCCL), whichever the machine has.
"""

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig
from trl import SFTConfig, SFTTrainer

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
    words = "the quick brown fox jumps over the lazy dog".split()
    texts = [" ".join(words[i % 9 :] + words[: i % 9]) * (1 + i % 3) for i in range(64)]
    args = SFTConfig(
        output_dir="hf_trainer_sp_out",
        use_cpu=not torch.accelerator.is_available(),
        bf16=torch.accelerator.is_available(),
        packing=True,  # padding-free packed batches: document-causal under SP
        max_length=256,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=SP,  # an SP group shares its ranks' batches: same global batch
        max_steps=4,
        logging_steps=1,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"text": texts[:48]}),
        eval_dataset=Dataset.from_dict({"text": texts[48:]}),
    )
    prepare(trainer, sp_size=SP)  # <- the one new line
    trainer.train()
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(f"train losses {losses}; eval loss {metrics['eval_loss']:.4f}")


if __name__ == "__main__":
    main()
    shutdown()
