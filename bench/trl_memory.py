"""Peak memory per rank and step time of TRL's DPO and GRPO training steps on long sequences vs sp (issue 34).

Run (2 CPU cores: 8K and 16K about 15 minutes, 32K alone 20):
``python -m bench.trl_memory [--lengths 8192 16384 32768] [--sp 1 2 4]``

A random Llama (h=64, MLP 2048, 2 layers, 4 heads / 2 kv heads, vocab 8192, fp32, sdpa; a wide MLP so that the
per-token memory is a model's, not a toy's, at an attention cost a CPU can pay at 16K) trains one optimizer step of
TRL's own trainer (its defaults: activation checkpointing on) on ``sp`` gloo ranks (dp 1), through
``prepare(trainer, sp_size=sp)`` for sp > 1:

- ``DPOTrainer``: one pair per step, a 64-token prompt and a chosen / rejected completion of ``S - 64`` tokens
  (the ``[2, S]`` batch), a separate reference model (another random Llama), sigmoid loss;
- ``GRPOTrainer``: 2 completions of ``S - 64`` tokens per rank per step, synthetic (TRL's ``rollout_func``
  returns random tokens: token-by-token generation on a CPU is not what is measured), beta 0, TRL's default loss.

TRL's fused LM head computes the log-probs in tiles of 4096 tokens x ``_CHUNKED_LOGPROB_CHUNK_SIZE`` vocabulary
columns: 32768 by default, whose fp32 scratch on the CPU (torch, not Triton) is ~1.5 GiB whatever ``S`` is and
would hide the per-token memory; here 4096 columns (~0.2 GiB, set in ``trl.trainer.utils``). Each rank meters the
step (``on_step_begin`` to ``on_step_end``: the forward passes, loss, backward and AdamW step) with ``ulysses_sp.memory.track_peak_memory`` (CPU dispatch
counter): the bytes it adds over what is live at its start, max over ranks; and its wall time, max over ranks.
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import TrainerCallback

from bench import md
from bench.launch import max_over_ranks, parser, run_worker, serve
from bench.spec import llama
from ulysses_sp.integrations.transformers import prepare
from ulysses_sp.memory.meter import track_peak_memory
from ulysses_sp.tasks.tokenizer import byte_tokenizer

MIB, PROMPT = 2**20, 64
MODEL = dict(vocab_size=8192, hidden_size=64, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip


class Probe(TrainerCallback):
    """The step's extra bytes and wall seconds on this rank."""

    def on_step_begin(self, args, state, control, **kw):
        self.t, self.cm = time.perf_counter(), track_peak_memory("cpu")
        self.mem = self.cm.__enter__()

    def on_step_end(self, args, state, control, **kw):
        self.cm.__exit__(None, None, None)
        self.peak, self.seconds = self.mem.extra_bytes, time.perf_counter() - self.t


def _text(n: int, g: torch.Generator) -> str:
    return "".join(chr(97 + int(c)) for c in torch.randint(0, 26, (n,), generator=g))


def _trainer(kind: str, s: int, out: str, probe: Probe):
    """TRL's trainer of ``kind`` on sequences of ``s`` tokens (module docstring)."""
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

    g, n = torch.Generator().manual_seed(0), dist.get_world_size()
    common = dict(output_dir=out, use_cpu=True, report_to=[], save_strategy="no", max_steps=1, logging_steps=1,
                  learning_rate=1e-3, seed=0, disable_tqdm=True, dataloader_num_workers=0, bf16=False)  # fmt: skip
    model = llama(**MODEL, max_position_embeddings=s)
    if kind == "DPO":
        rows = [{"prompt": _text(PROMPT, g), "chosen": _text(s - PROMPT - 1, g), "rejected": _text(s - PROMPT - 1, g)}
                for _ in range(4)]  # fmt: skip  (+ <eos>: S tokens)
        args = DPOConfig(per_device_train_batch_size=1, max_length=None, dataset_num_proc=None, **common)
        return DPOTrainer(model=model, ref_model=llama(**MODEL, seed=1, max_position_embeddings=s), args=args, processing_class=byte_tokenizer(), callbacks=[probe],
                          train_dataset=Dataset.from_list(rows))  # fmt: skip

    def rollout(prompts: list, trainer) -> dict:  # synthetic completions of S - 64 tokens
        ids = [torch.randint(3, 256, (s - PROMPT,), generator=g).tolist() for _ in prompts]
        return {"prompt_ids": [[97] * PROMPT for _ in prompts], "completion_ids": ids, "logprobs": None}

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    args = GRPOConfig(per_device_train_batch_size=2, num_generations=2, max_completion_length=s, **common)
    return GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [float(c.count("a")) for c in completions],
                       args=args, processing_class=byte_tokenizer(), rollout_func=rollout, callbacks=[probe],
                       train_dataset=Dataset.from_list([{"prompt": "a"}] * 8 * n))  # fmt: skip


def worker(lengths: list[int]) -> dict:
    """``{kind: {S: (extra bytes, seconds)}}`` of the step at sp = world size, max over ranks."""
    import trl.trainer.utils

    sp, res = dist.get_world_size(), {}
    trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE = 4096  # the head's vocabulary tile (module docstring)
    for kind in ("DPO", "GRPO"):
        for s in lengths:
            with tempfile.TemporaryDirectory() as out:
                trainer = _trainer(kind, s, out, probe := Probe())
                handle = prepare(trainer, sp_size=sp) if sp > 1 else None
                trainer.train()
                _ = handle and handle.remove()
            res.setdefault(kind, {})[s] = (max_over_ranks(probe.peak), max_over_ranks(probe.seconds))
    return res


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, "trl_memory.md")
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args(argv)
    if serve(lambda: worker(args.lengths), args.out, timeout_s=3600):
        return
    run = md.provenance(md.command("bench.trl_memory", argv))
    flags = ["--lengths", *map(str, args.lengths)]
    got = {sp: run_worker("bench.trl_memory", sp, flags, timeout=7200)[0] for sp in args.sp}
    rows = [[kind, s, sp, f"{r[str(s)][0] / MIB:.0f}", f"{r[str(s)][0] / got[args.sp[0]][kind][str(s)][0]:.2f}",
             f"{r[str(s)][1]:.1f}"] for kind in ("DPO", "GRPO") for s in args.lengths for sp, r in
            ((sp, got[sp][kind]) for sp in args.sp)]  # fmt: skip
    md.page(args.out, "trl_memory: TRL's DPO and GRPO step on long sequences vs sp", run, [
        "One optimizer step of TRL's trainer (through prepare(trainer, sp_size=sp) for sp > 1), dp 1: the "
        "bytes it adds over what is live at its start (activations, gathered log-probs, gradients, AdamW state; "
        "parameters excluded), max over ranks; its wall time on a shared 2-core CPU machine (sp ranks share 2 cores).",
        md.table(["trainer", "S (tokens per sequence)", "sp", "step peak MiB per rank", "vs sp 1", "step s"], rows)])  # fmt: skip


if __name__ == "__main__":
    main()
