# grpo_sp.py — run with: torchrun --nproc-per-node 2 grpo_sp.py
"""TRL's GRPOTrainer with Ulysses sequence parallelism: one `prepare` line on an ordinary GRPO script.

Generation runs without SP (each rank samples its own prompts' completions, as without SP); the
training passes (the policy's per-token log-probabilities and their backward) run with SP. Nothing is
downloaded: a tiny Llama is built from a config and ulysses-sp's byte tokenizer is used; swap in
`from_pretrained(...)`, your prompts and reward for real work. Needs `pip install ulysses-sp[hf]`.
Runs on CPU (gloo) or on GPUs (NCCL), whichever the machine has.
"""

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, LlamaConfig
from trl import GRPOConfig, GRPOTrainer

from ulysses_sp import shutdown
from ulysses_sp.integrations.transformers import prepare
from ulysses_sp.tasks.tokenizer import byte_tokenizer

SP = 2  # ranks per sequence-parallel group; torchrun's world size / SP ranks are data parallel


def lowercase(completions: list[str], **_) -> list[float]:
    """The reward: the number of lowercase letters in each completion."""
    return [float(sum(ch.islower() for ch in c)) for c in completions]


def main() -> None:
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    words = "the quick brown fox jumps over the lazy dog".split()
    prompts = [{"prompt": " ".join(words[i % 5 : i % 5 + 3])} for i in range(32)]
    args = GRPOConfig(
        output_dir="grpo_sp_out",
        use_cpu=not torch.accelerator.is_available(),
        bf16=torch.accelerator.is_available(),
        per_device_train_batch_size=4,
        num_generations=4,  # completions per prompt
        max_completion_length=16,
        max_steps=2,  # unchanged: no extra accumulation (generation is spread over all ranks)
        logging_steps=1,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
    )
    trainer = GRPOTrainer(model=model, reward_funcs=lowercase, args=args, processing_class=tokenizer,
                          train_dataset=Dataset.from_list(prompts))  # fmt: skip
    prepare(trainer, sp_size=SP)  # <- the one new line
    trainer.train()
    if trainer.is_world_process_zero():
        logs = [h for h in trainer.state.log_history if "loss" in h]
        print("losses", [round(h["loss"], 4) for h in logs], "rewards", [round(h["reward"], 2) for h in logs],
              "completion lengths", [h["completions/mean_length"] for h in logs])  # fmt: skip


if __name__ == "__main__":
    main()
    shutdown()
