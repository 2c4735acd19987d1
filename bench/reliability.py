"""What the reliability checks cost (README, Reliability): ``python -m bench.reliability``.

1. The data fingerprint ``--resume`` records (``rundir.data_fingerprint``): bytes read (exact:
   whole files up to 16 MiB, sixteen 1 MiB blocks of larger ones) and wall time, for corpora from
   1 MiB to 64 GiB. Files above 256 MiB are sparse (``truncate``), which costs the same seeks and
   reads as a real file of that size but no disk space; their read time is page-cache time.
2. One checkpoint save of a small model in one process: ``checkpoint.save_checkpoint`` alone vs
   ``rundir.checked_save`` (finite-weights flag, free-space estimate, the save), median of 5, and
   the bytes the estimate predicts vs the bytes written.
3. Collectives per optimizer step with the divergence guard: counted by wrapping every
   ``torch.distributed`` collective during 3 training steps of a 2-rank sp=2 run (the guard
   adds none; the stop flag rides on the peak-memory reduction the loop already made).

Writes ``bench/results/reliability.md`` (``--out``); ``--max-mib 16`` is the quick check.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from bench import md
from bench.launch import finish_worker, init_worker, run_worker, under_torchrun

SIZES_MIB = [1, 16, 256, 4096, 65536]
def fingerprint_rows(root: str, max_mib: int) -> list[list]:
    from ulysses_sp.run.rundir import data_fingerprint

    rows = []
    for mib in (m for m in SIZES_MIB if m <= max_mib):
        path = os.path.join(root, f"corpus-{mib}.txt")
        if mib <= 256:
            with open(path, "wb") as f:
                f.write(os.urandom(mib << 20))
        else:
            with open(path, "wb") as f:
                f.truncate(mib << 20)
        read = min(mib, 16) << 20
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            data_fingerprint(path)
            times.append(time.perf_counter() - t0)
        kind = "sparse" if mib > 256 else "random"
        rows.append([f"{mib:,} MiB ({kind})", f"{read >> 20} MiB", f"{statistics.median(times) * 1e3:.1f} ms"])
        os.remove(path)
    return rows


def _save_times(root: str) -> tuple[float, float, int, int]:
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from ulysses_sp import initialize
    from ulysses_sp.run.rundir import checked_save, checkpoint_bytes
    from ulysses_sp.state import checkpoint as ckpt
    from ulysses_sp.tasks import byte_tokenizer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                      vocab_size=512, max_position_embeddings=256)  # fmt: skip
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = initialize(LlamaForCausalLM(cfg), config, mesh_param=(1, 1))
    ids = torch.randint(0, 512, (1, 64))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    kw = {"tokenizer": byte_tokenizer(), "manifest": {}, "train_state": {"step": 1}, "core_attn": "sdpa"}
    plain, checked = [], []
    for i in range(5):
        t0 = time.perf_counter()
        ckpt.save_checkpoint(engine, root, 2 * i + 1, **kw)
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        path = checked_save(engine, root, 2 * i + 2, last_good=None, **kw)
        checked.append(time.perf_counter() - t0)
    written = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    estimate = checkpoint_bytes(engine)
    dist.destroy_process_group()
    return statistics.median(plain), statistics.median(checked), estimate, written


def count_worker() -> dict[str, float]:
    """Under torchrun (2 ranks): collectives per optimizer step of a registered sp=2 model."""
    import torch.distributed as dist

    from ulysses_sp import UlyssesSPAttentionHF, initialize
    from ulysses_sp.data import UlyssesSPDataLoaderAdapter

    counts: dict[str, int] = {}
    for name in ("all_reduce", "all_gather", "all_gather_object", "all_to_all_single", "broadcast", "barrier"):
        original = getattr(dist, name)

        def counted(*a, _o=original, _n=name, **k):
            counts[_n] = counts.get(_n, 0) + 1
            return _o(*a, **k)

        setattr(dist, name, counted)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, vocab_size=64))  # fmt: skip
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, seq_length=16)
    data = [{"input_ids": torch.arange(16) % 64} for _ in range(8)]
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, loader, _ = initialize(model=model, config=config, mpu=mpu, training_data=data)
    batches = iter(UlyssesSPDataLoaderAdapter(loader, engine.sp_rank, engine.sp_group, 2, engine.device))
    engine.backward(engine(**next(batches)).loss)  # warm-up step (the first forward's one-off checks)
    engine.step()
    counts.clear()
    for _ in range(2):
        engine.backward(engine(**next(batches)).loss)
        engine.step()
    mpu.remove()
    return {k: v / 2 for k, v in sorted(counts.items())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-mib", type=int, default=SIZES_MIB[-1], help="largest corpus file of the fingerprint")
    ap.add_argument("--out", default=str(md.ROOT / "bench" / "results" / "reliability.md"))
    args = ap.parse_args(argv)
    if under_torchrun():
        init_worker()
        return finish_worker(count_worker(), args.out)
    run = md.provenance(" ".join(["python -m bench.reliability", *(argv if argv is not None else sys.argv[1:])]))
    with tempfile.TemporaryDirectory() as root:
        rows = fingerprint_rows(root, args.max_mib)
        plain, checked, estimate, written = _save_times(root)
        counts = run_worker("bench.reliability", 2, [])[0]
    md.page(args.out, "Reliability checks: what they cost", run, [
        "## Data fingerprint recorded for `--resume` (per file)",
        md.table(["corpus file", "bytes hashed", "time (median of 3)"], rows),
        "## One checkpoint save (4-layer Llama, hidden 256, AdamW; 1 process, median of 5)",
        md.table(["save", "time", "ratio"], [["`save_checkpoint`", f"{plain * 1e3:.0f} ms", "1.00"], [
            "`checked_save` (finite flag + free-space estimate + save)", f"{checked * 1e3:.0f} ms",
            f"{checked / plain:.2f}"]]),
        f"Estimated checkpoint size {estimate / 2**20:.2f} MiB (incl. 5% + 1 MiB margin) vs written "
        f"{written / 2**20:.2f} MiB.",
        "## Collectives per optimizer step (2 ranks, sp=2, registered tiny Llama, after one warm-up step)",
        md.table(["collective", "calls per step"], [[f"`{k}`", v] for k, v in counts.items()]),
        "The guard's verdict uses the already reduced loss and gradient norm; the batch-shape check rides "
        "on the per-forward length gather; the misuse check runs once, and only for unregistered models."])  # fmt: skip


if __name__ == "__main__":
    main()
