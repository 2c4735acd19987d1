"""Worker-side helper for the DPO tests: a real TRL ``DPOTrainer`` on a tiny llama inside a harness pool
worker, with or without ``prepare(trainer, sp_size=...)``; returns every logged value of every step."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from hf_runs import VOCAB, accelerate_env, fsdp2_on_cpu, prepared_run
from models import tiny_model


def preference_rows(n: int, seed: int) -> list[dict[str, str]]:
    """Prompt / chosen / rejected texts of varied lengths (byte tokens: one per character)."""
    g = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]

    def text(k: int) -> str:
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (k,), generator=g))

    return [
        {"prompt": text(1 + i % 3), "chosen": " " + text(1 + i % 2), "rejected": " " + text(1 + (i + 1) % 3)}
        for i in range(n)
    ]


@contextlib.contextmanager
def shared_dir() -> Iterator[str]:
    """A directory every rank sees (rank 0's, broadcast): TRL's precomputed reference log-probs are
    written by rank 0 next to the dataset's files and read by every rank."""
    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    try:
        yield path[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)


def on_disk(rows: list[dict[str, str]], path: str) -> Any:
    """``rows`` as a dataset saved by rank 0 under ``path`` and loaded by every rank (its cache files there)."""
    from datasets import Dataset, load_from_disk

    if dist.get_rank() == 0:
        Dataset.from_list(rows).save_to_disk(path)
    dist.barrier()
    return load_from_disk(path)


def dpo_train(
    sp_size: int,
    *,
    steps: int = 2,
    accum: int = 1,
    loss_type: tuple[str, ...] = ("sigmoid",),
    reference: str = "model",
    evaluate: bool = False,
    fsdp2: bool = False,
    **config: Any,
) -> dict[str, Any]:
    """Train ``steps`` optimizer steps of ``DPOTrainer`` (fp32, 2 pairs per device batch); ``sp_size=0``:
    no ``prepare`` (the oracle). ``reference``: ``model`` (a separate reference model), ``peft`` (a LoRA
    adapter, the reference is the adapter disabled) or ``precompute`` (reference log-probs computed
    when the trainer is built, with a separate model). Returns the logged dicts of every step (and of
    ``evaluate()``), the trainer's class name and what ``remove()`` restored."""
    from trl import DPOConfig, DPOTrainer

    from ulysses_sp.tasks.tokenizer import byte_tokenizer

    model = tiny_model("llama", seed=0, vocab=VOCAB)
    ref_model = None if reference == "peft" else tiny_model("llama", seed=3, vocab=VOCAB)
    peft_config = None
    if reference == "peft":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    fsdp = fsdp2_on_cpu() if fsdp2 else contextlib.nullcontext()
    with accelerate_env(), fsdp, tempfile.TemporaryDirectory() as out, shared_dir() as data:
        args = DPOConfig(
            output_dir=out, use_cpu=True, report_to=[], save_strategy="no", max_steps=steps,
            per_device_train_batch_size=2, per_device_eval_batch_size=2, gradient_accumulation_steps=accum,
            learning_rate=1e-2, logging_steps=1, seed=0, disable_tqdm=True, dataloader_num_workers=0,
            bf16=config.pop("bf16", False), dataset_num_proc=None, loss_type=list(loss_type),
            precompute_ref_log_probs=reference == "precompute", **config,
        )  # fmt: skip
        trainer = DPOTrainer(
            model=model, ref_model=ref_model, args=args, processing_class=byte_tokenizer(),
            train_dataset=on_disk(preference_rows(16, seed=1), os.path.join(data, "train")),
            eval_dataset=on_disk(preference_rows(8, seed=2), os.path.join(data, "eval")) if evaluate else None,
            peft_config=peft_config,
        )  # fmt: skip
        return prepared_run(trainer, sp_size, evaluate=evaluate)
