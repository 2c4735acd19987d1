"""The timed step loop of the DeepSpeed comparison, shared by bench/ours_worker.py and bench/ds_worker.py.

Both workers parse the same flags (``parser``), build the same model and per-rank data (bench/spec.py)
and hand this loop their ``forward(batch) -> loss``, ``backward(loss)`` and ``step()``. The loop is
the protocol both sides are measured by: step 0 counts the bytes through the collectives
(``CollectiveCounter``) and records the gradient norm before the optimizer step; the last step (when
there are several) is metered for peak tensor memory (``ulysses_sp.memory.track_peak_memory`` over
every live tensor: parameters, gradients, optimizer state), the others are timed per phase. Torch and
the library's meter only: runs in both venvs (the DeepSpeed one finds the meter in this checkout's src/).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import resource
import sys
import time

import torch
import torch.distributed as dist

from bench import spec as S
from bench.counters import CollectiveCounter, PhaseTimer
from bench.launch import ROOT

if importlib.util.find_spec("ulysses_sp") is None:  # the DeepSpeed venv: the meter from this checkout
    sys.path.append(str(ROOT / "src"))


def parser() -> argparse.ArgumentParser:
    """The flags of both workers (each adds its own)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=S.ModelSpec().to_json(), help="ModelSpec JSON")
    for flag, default in (("--dp", 1), ("--sp", 2), ("--zero", 1), ("--steps", 4), ("--seq-len", 64),
                          ("--micro-batch", 1), ("--seed", 0)):  # fmt: skip
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--out", required=True)
    return ap


def loader(args: argparse.Namespace, seq_len: int | None = None) -> torch.utils.data.DataLoader:
    """This rank's ordinary DataLoader (before either side's SP adapter): enough items for ``--steps``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != args.dp * args.sp:
        raise ValueError(f"world size ({world}) != dp ({args.dp}) * sp ({args.sp})")
    vocab = S.ModelSpec.from_json(args.model).vocab_size
    items = -(-args.steps // args.sp)
    stream = S.RankStream(rank, world, args.micro_batch, items, seq_len or args.seq_len, vocab)
    return torch.utils.data.DataLoader(stream, batch_size=args.micro_batch)


def norm(grads) -> float:
    return sum(float(g.float().pow(2).sum()) for g in grads if g is not None) ** 0.5


def spread(params, group) -> float:
    """Largest |difference| of any parameter between the ranks of ``group`` (0 when replicas agree)."""
    flat = torch.cat([p.detach().float().reshape(-1) for p in params])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    return float((hi - lo).max())


def _live_tensors() -> list[torch.Tensor]:
    gc.collect()
    live = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]
    return live + [t.grad for t in live if t.is_leaf and t.grad is not None]


def run(args, batches, *, forward, backward, step, grad_norm) -> dict:
    """``args.steps`` steps of ``forward``/``backward``/``step``; the measurements every worker reports."""
    from ulysses_sp.memory.meter import track_peak_memory

    world = dist.get_world_size()
    losses, times, counter, timer, it, peak = [], [], CollectiveCounter(), PhaseTimer(), iter(batches), 0
    for i in range(args.steps):
        batch = next(it)
        measure = i == args.steps - 1 and args.steps > 1  # the meter slows every op: time the others
        region = track_peak_memory("cpu", include=_live_tensors()) if measure else contextlib.nullcontext()
        timer.active = not measure
        t0 = time.perf_counter()
        with region as mem, counter if i == 0 else contextlib.nullcontext():  # bytes of one step
            with counter.label("forward"), timer("forward"):
                loss = forward(batch)
            with counter.label("backward"), timer("backward"):
                backward(loss)
            if i == 0:
                local_norms = [None] * world
                dist.all_gather_object(local_norms, grad_norm())
            with counter.label("step"), timer("step"):
                step()
        if measure:
            peak = mem.peak_bytes
        else:
            times.append(time.perf_counter() - t0)
        lv = loss.detach().clone()
        dist.all_reduce(lv)  # the DP mean of the SP-group losses (what the oracle reports)
        losses.append(float(lv) / world)
    tokens = args.micro_batch * batch["input_ids"].shape[1]
    steady = times[1:] or times
    return {"torch_version": torch.__version__, "args": vars(args), "losses": losses, "step_times": times,
            "tokens_per_rank_per_step": tokens,
            # min over the steady steps: the estimator least disturbed by other load on the machine
            "tokens_per_s_per_rank": tokens / min(steady), "phase_s": timer.best(),
            "peak_bytes": peak,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "grad_norm_step1": local_norms[dist.get_rank()], "grad_norm_step1_per_rank": local_norms,
            "comm_bytes": {f"{p}/{o}": v for (p, o), v in counter.sent.items()}}  # fmt: skip
