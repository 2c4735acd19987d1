"""Worker-side helpers for the HF Trainer / TRL tests: a real ``Trainer`` on a tiny model inside a
harness pool worker (gloo, already-initialised process group), with or without sequence parallelism.

accelerate takes the process group the harness started: it sees ``WORLD_SIZE`` > 1 with
``use_cpu=True`` (multi-CPU), finds ``torch.distributed`` initialised and does not start another.
Its state singletons are reset around each run, so runs in a long-lived worker do not leak.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from models import tiny_model

VOCAB = 259  # ulysses_sp's byte tokenizer


@contextlib.contextmanager
def accelerate_env() -> Iterator[None]:
    """The launcher variables accelerate reads, for this worker's rank; restored afterwards."""
    from accelerate.state import AcceleratorState, PartialState

    env = {
        "RANK": str(dist.get_rank()),
        "WORLD_SIZE": str(dist.get_world_size()),
        "LOCAL_RANK": str(dist.get_rank()),
        "LOCAL_WORLD_SIZE": str(dist.get_world_size()),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",  # unused: the process group exists already
        "OMP_NUM_THREADS": "1",
    }
    prev = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._reset_state()
        for k, v in prev.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def fsdp2_on_cpu() -> Iterator[None]:
    """accelerate's own FSDP2 (``fsdp2_prepare_model``: ``fully_shard`` per decoder layer) on the CPU.

    ``accelerate.state.AcceleratorState`` switches to ``DistributedType.FSDP`` only for accelerator
    distributed types (``MULTI_GPU``, ``MULTI_XPU``, ...), never for ``MULTI_CPU``: on a CPU an FSDP
    config (``accelerate launch --config_file``, ``TrainingArguments(fsdp=...)``) is dropped and the
    Trainer runs DDP. FSDP2 itself runs on gloo, so here every ``Accelerator`` built inside the block
    takes the branch accelerate takes on GPUs: the state becomes ``FSDP`` with an FSDP2 plugin
    (transformer-layer wrapping, reshard after forward), everything after that is accelerate's code.
    """
    import accelerate.accelerator as acc
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    init = acc.Accelerator.__init__

    def fsdp_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        state = AcceleratorState()
        if state.distributed_type == DistributedType.MULTI_CPU:
            state.distributed_type = DistributedType.FSDP
            state.fsdp_plugin = FullyShardedDataParallelPlugin(
                fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True
            )
            # as AcceleratorState.__init__ ends on GPUs: every later AcceleratorState() (accelerate's
            # set_seed(device_specific=True), which GRPOTrainer calls) copies PartialState's type back in
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    acc.Accelerator.__init__ = fsdp_init
    try:
        yield
    finally:
        acc.Accelerator.__init__ = init


def right_pad_collator(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample: attention_mask marks real tokens, labels -100 on padding."""
    s = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), s), 256)
    mask = torch.zeros((len(examples), s), dtype=torch.long)
    labels = torch.full((len(examples), s), -100)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        mask[i, :n] = 1
        labels[i, :n] = torch.tensor(e.get("labels", e["input_ids"]))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def token_rows(n: int, lengths: tuple[int, ...], seed: int) -> list[dict[str, list[int]]]:
    """``n`` random byte sequences with lengths cycling through ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(0, 256, (lengths[i % len(lengths)],), generator=g).tolist()}
        for i in range(n)
    ]


def text_rows(n: int, seed: int, *, completion: bool) -> list[dict[str, str]]:
    """Short texts (or prompt/completion pairs) of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]

    def text(k: int) -> str:
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (k,), generator=g))

    rows = []
    for i in range(n):
        if completion:
            rows.append({"prompt": text(2 + i % 3), "completion": text(1 + i % 2)})
        else:
            rows.append({"text": text(2 + i % 4)})
    return rows


CHAT_TEMPLATE = (
    "{% for m in messages %}<bos>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<eos>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<eos>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant\n{% endif %}"
)
"""ChatML-like with ``{% generation %}`` tags around the assistant turns (TRL's ``assistant_only_loss``)."""


def chat_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Conversations with a system turn and 1-2 user/assistant exchanges of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]

    def text(k: int) -> str:
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (k,), generator=g))

    rows = []
    for i in range(n):
        msgs = [{"role": "system", "content": text(1 + i % 2)}]
        for t in range(1 + i % 2):
            msgs += [{"role": "user", "content": text(1 + (i + t) % 3)}]
            msgs += [{"role": "assistant", "content": text(1 + (i + 2 * t) % 3)}]
        rows.append({"messages": msgs})
    return rows


def train_and_eval(
    sp_size: int,
    *,
    kind: str = "plain",
    steps: int = 3,
    accum: int = 1,
    lora: bool = False,
    arch: str = "llama",
    kv_heads: int | None = None,
    token_weighted: bool = True,
    ring_size: int | None = None,
    packing: bool | None = None,
    padding_free: bool = False,
    eval_steps: int | None = None,
    average_tokens: bool = True,
    eval_lengths: tuple[int, ...] = (11, 18),
    fsdp2: bool = False,
) -> dict[str, Any]:
    """Train ``steps`` optimizer steps and evaluate once; return the per-step logs and the eval loss.

    ``kind``: ``plain`` (Trainer, right-padded variable lengths), ``packed`` (SFTTrainer, BFD
    packing = padding-free), ``completion`` (SFTTrainer, prompt/completion: completion-only loss),
    ``chat`` (SFTTrainer, conversations with a system turn, ``assistant_only_loss``). ``packing`` /
    ``padding_free``: SFTConfig's (``packing`` defaults to ``kind == "packed"``). ``eval_steps``:
    evaluate during training every that many steps (the eval losses are in ``logs_eval``).
    ``average_tokens``: ``TrainingArguments.average_tokens_across_devices``. ``eval_lengths``: the
    ``plain`` eval rows' lengths (uneven ones give eval batches with different token counts).
    ``fsdp2``: the Trainer's accelerate runs FSDP2 (``fsdp2_on_cpu``) instead of DDP.
    ``sp_size=0`` means no ``prepare`` call (the oracle). ``token_weighted=False``: the Trainer's
    per-batch-mean loss (what it does for models that take no ``num_items_in_batch``).
    """
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from ulysses_sp.integrations.transformers import prepare
    from ulysses_sp.tasks.tokenizer import byte_tokenizer

    model = tiny_model(arch, seed=0, vocab=VOCAB, kv_heads=kv_heads)
    peft_config = None
    if lora:  # the plain Trainer gets a PEFT model; SFTTrainer its peft_config (the TRL path, docs/how-to/trl-lora.md)
        from peft import LoraConfig, get_peft_model

        # init_lora_weights=False: a non-zero B, so that every adapter weight has a gradient at step 1
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        torch.manual_seed(1)  # the same adapter weights on every rank and in every run
        if kind == "plain":
            model, peft_config = get_peft_model(model, peft_config), None
    common = dict(
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        max_steps=steps,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=accum,
        learning_rate=1e-2,
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        average_tokens_across_devices=average_tokens,
    )
    if eval_steps:
        common.update(eval_strategy="steps", eval_steps=eval_steps)
    fsdp = fsdp2_on_cpu() if fsdp2 else contextlib.nullcontext()
    with accelerate_env(), fsdp, tempfile.TemporaryDirectory() as out:
        if kind == "plain":
            args = TrainingArguments(output_dir=out, remove_unused_columns=False, **common)
            train = Dataset.from_list(token_rows(24, (13, 20, 7, 16), seed=1))
            evals = Dataset.from_list(token_rows(8, eval_lengths, seed=2))
            trainer = Trainer(
                model=model,
                args=args,
                train_dataset=train,
                eval_dataset=evals,
                data_collator=right_pad_collator,
            )
        else:
            from trl import SFTConfig, SFTTrainer

            tokenizer = byte_tokenizer()
            if kind == "chat":
                tokenizer.chat_template = CHAT_TEMPLATE
                train_rows, eval_rows = chat_rows(32, 1), chat_rows(8, 2)
            else:
                completion = kind == "completion"
                train_rows = text_rows(32, 1, completion=completion)
                eval_rows = text_rows(8, 2, completion=completion)
            packing = kind == "packed" if packing is None else packing
            args = SFTConfig(
                output_dir=out,
                packing=packing,
                padding_free=padding_free,
                assistant_only_loss=kind == "chat",
                # TRL enforces no max_length on padding-free batches without packing (the rows are short)
                max_length=None if padding_free and not packing else 160 if kind == "chat" else 40,
                bf16=False,  # exact fp32 comparison (TRL defaults to bf16 autocast)
                dataset_num_proc=None,
                **common,
            )
            trainer = SFTTrainer(
                model=model,
                args=args,
                processing_class=tokenizer,
                train_dataset=Dataset.from_list(train_rows),
                eval_dataset=Dataset.from_list(eval_rows),
                peft_config=peft_config,
            )
            if lora:
                from peft import PeftModel

                assert isinstance(trainer.model, PeftModel), type(trainer.model)
        trainer.model_accepts_loss_kwargs = token_weighted
        handle = prepare(trainer, sp_size=sp_size, ring_size=ring_size) if sp_size else None
        name = type(trainer).__name__
        trainer.train()
        logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
        logs_eval = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
        eval_loss = trainer.evaluate()["eval_loss"]
        trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
        sharded = any(type(p).__name__ == "DTensor" for p in trainer.model.parameters())  # FSDP2
        saved = []
        if lora:  # rank 0 writes (each rank has its own temporary output_dir)
            trainer.save_model(os.path.join(out, "adapter"))
            if dist.get_rank() == 0:
                saved = sorted(os.listdir(os.path.join(out, "adapter")))
        if handle is not None:
            handle.remove()
        restored = (type(trainer).__name__, trainer.model.config._attn_implementation)
    return {
        "logs": logs,
        "logs_eval": logs_eval,
        "eval_loss": eval_loss,
        "trained": trained,
        "name": name,
        "saved": saved,
        "restored": restored,
        "fsdp2": sharded,
    }


def prepared_run(trainer: Any, sp_size: int | None, *, evaluate: bool) -> dict[str, Any]:
    """``prepare(trainer, sp_size)`` (none when ``sp_size`` is falsy), train, maybe evaluate, undo: every
    training log with a loss, the eval metrics, the trainer's class before and after ``remove()``, and
    whether the model's parameters were FSDP2-sharded (shared by the DPO and GRPO runs)."""
    from ulysses_sp.integrations.transformers import prepare

    handle = prepare(trainer, sp_size=sp_size) if sp_size else None
    name = type(trainer).__name__
    trainer.train()
    logs = [dict(h) for h in trainer.state.log_history if "loss" in h]
    evals = trainer.evaluate() if evaluate else {}
    if handle is not None:
        handle.remove()
    sharded = any(type(p).__name__ == "DTensor" for p in trainer.model.parameters())
    return {"logs": logs, "eval": evals, "name": name, "restored": type(trainer).__name__, "fsdp2": sharded}
