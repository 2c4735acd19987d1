"""``ulysses-sp eval``: loss, accuracy and per-position loss of checkpoints on held-out data.

Each ``--model`` (a checkpoint directory, any HF model directory, or a preset = its untrained
initialisation from ``--seed``) is run over the same held-out samples — for ``recall`` samples the
training run never saw (a disjoint seed), for local data its ``--eval-split`` part — with or
without sequence parallelism (``--sp``), through ``train``'s forward: the same layout (``dp = nproc /
sp``; an SP group shares its samples, so every ``--sp`` scores the same ones), the same attention
registration (``run.loop.register_attention``), the same closed-world guard and mixer handlers
(``engine.build.shard_model``) and the same micro-batches (``run.stream.epoch_batches``). Every
sample is scored once: the last round is filled with blank samples that score nothing. Every rank
bins the loss of its own tokens by their *global* position (the shard's ``position_ids``), so one
all-reduce gives the per-position curve over the whole context. Unset, the data and its settings,
``--seq-len``, ``--seed``, ``--micro-batch-size``, ``--attn`` and ``--sp`` are the training run's (``eval_options``:
the manifest of the first ``--model`` that has one). Output: a JSON report (stdout and
``--output-json``) and a PNG plot (``--plot``; needs matplotlib, ``pip install 'ulysses-sp[plot]'``).
A Qwen-VL directory is scored on its chat JSONL with images, every sample (``cli.evaluate_vlm``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

from ulysses_sp.cli.evaluate_vlm import eval_run_config, model_inputs, vlm_eval_dataset
from ulysses_sp.cli.flags import LAUNCH_KEYS, add_data_args
from ulysses_sp.state import checkpoint as ckpt
from ulysses_sp.tasks import DataSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class EvalConfig(DataSettings):
    """The ``eval`` command's settings; the data flags (``DataSettings``) unset take the training run's."""

    models: tuple[str, ...] = ()
    """Checkpoint / model directories or presets; each becomes one curve."""
    data: str = "recall"
    """``recall`` (held-out samples) or local data as ``train`` reads it (its ``eval_split`` part)."""
    tokenizer: str | None = None
    """Tokenizer directory (default: each model directory's own, else byte-level)."""
    seq_len: int = 256
    """Tokens per sample."""
    sp: int = 1
    """Sequence-parallel size for evaluation (``dp = nproc / sp``)."""
    num_samples: int = 64
    """Recall samples to evaluate."""
    micro_batch_size: int = 8
    """Samples per forward per dp replica (an SP group shares them, as in ``train``)."""
    bins: int = 32
    """Position bins across the context."""
    seed: int = 0
    """Seed of the training run (presets' init; recall held-out samples use a disjoint seed)."""
    attn: str = "sdpa"
    """Core attention."""
    output_json: str = "eval.json"
    plot: str | None = "eval.png"
    """PNG path; ``None`` = no plot."""


FROM_RUN = ("data", "seq_len", "seed", "micro_batch_size", "attn", "data_format", "loss_on", "chat_template",
            "packing", "long_samples", "eval_split")  # fmt: skip
"""Settings an eval takes from the training run's manifest (its ``run`` section) unless given."""


def add_eval_args(p: argparse.ArgumentParser) -> None:
    d = EvalConfig()
    run = "the training run's, else"
    p.add_argument("--model", dest="models", nargs="+", required=True, metavar="MODEL",
                   help="checkpoint dir(s), run dir(s) (newest checkpoint), HF model dir(s) or preset(s) "
                        "(a preset = its untrained init)")  # fmt: skip
    p.add_argument("--data", default=None,
                   help=f"held-out data: 'recall', or local data as train's --data (its --eval-split part) "
                        f"(default: {run} recall)")  # fmt: skip
    p.add_argument("--tokenizer", default=d.tokenizer, metavar="DIR",
                   help="tokenizer directory or 'byte' (default: each model's own; refused if it has none)")  # fmt: skip
    p.add_argument("--seq-len", type=int, default=None, metavar="S", help=f"tokens per sample (default: {run} 256)")
    p.add_argument("--sp", type=int, default=None, metavar="P",
                   help=f"sequence-parallel size (default: {run} 1; the run's only if it divides --nproc)")  # fmt: skip
    p.add_argument("--num-samples", type=int, default=d.num_samples, metavar="N", help="recall samples to evaluate")
    p.add_argument("--micro-batch-size", type=int, default=None, metavar="B",
                   help=f"samples per forward per dp replica, shared by an SP group (default: {run} {d.micro_batch_size})")  # fmt: skip
    p.add_argument("--bins", type=int, default=d.bins, help="position bins across the context")
    p.add_argument("--seed", type=int, default=None,
                   help=f"the training run's seed: presets' init, the eval split (default: {run} 0)")  # fmt: skip
    p.add_argument("--attn", default=None,
                   help=f"core attention: sdpa, eager, flash_attention_2, ... (default: {run} {d.attn})")  # fmt: skip
    p.add_argument("--output-json", default=d.output_json, metavar="FILE", help="the JSON report")
    p.add_argument("--plot", default=d.plot, metavar="FILE", help="PNG path ('' or 'none' = no plot)")
    add_data_args(p, None, from_run=FROM_RUN)


def eval_options(ns: argparse.Namespace) -> tuple[EvalConfig, dict[str, Any]]:
    """``(EvalConfig, launch options)``: the flags given, the rest from the training run's manifest
    (``FROM_RUN``, and ``sp`` from its layout), else ``EvalConfig``'s defaults."""
    values = {k: v for k, v in vars(ns).items() if k != "command"}
    launch = {k: values.pop(k) for k in LAUNCH_KEYS if k in values}
    values["models"] = tuple(_resolve_model(m) for m in values["models"])
    values["plot"] = None if values["plot"] in ("", "none") else values["plot"]
    manifests = [
        ckpt.read_manifest(m) for m in values["models"] if os.path.isfile(os.path.join(m, ckpt.MANIFEST))
    ]
    trained = manifests[0] if manifests else {}
    for key in (*FROM_RUN, "data_cache", "data_workers"):  # unset: the training run's, else the default
        if values.get(key) is None:
            values[key] = trained.get("run", {}).get(key, getattr(EvalConfig, key))
    if values["sp"] is None:  # the run's layout, where it fits the processes asked for
        sp = trained.get("world", {}).get("sp", EvalConfig.sp)
        nproc = launch.get("nproc")
        values["sp"] = sp if nproc is None or (isinstance(nproc, int) and nproc > 0 and nproc % sp == 0) else 1
    return EvalConfig(**values), launch


def _resolve_model(path: str) -> str:
    """A run directory (checkpoints, no ``config.json``) means its newest checkpoint."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        found = ckpt.list_checkpoints(path)
        if found:
            return found[-1][1]
    return path


def validate_eval(cfg: EvalConfig, world_size: int) -> list[tuple[Any, int]]:
    """Check sizes, models and data before any process starts (``ValueError``); the checks shared
    with ``train`` are ``run.checks.check_run``'s, and at sp > 1 ``train``'s closed-world guard
    (``mixers.guard``) on each model built on the meta device. Returns each model's ``(config, ring size)``."""
    from ulysses_sp.mixers.guard import check_sequence_mixing
    from ulysses_sp.run.checks import check_run
    from ulysses_sp.run.model_checks import built_attn
    from ulysses_sp.run.vlm import is_vlm_config
    from ulysses_sp.state.loading import empty_model_from_config

    sizes = {"num_samples": cfg.num_samples, "micro_batch_size": cfg.micro_batch_size, "bins": cfg.bins}
    found = check_run(
        world_size, sp=cfg.sp, seq_len=cfg.seq_len, sizes=sizes, attn=cfg.attn, models=cfg.models,
        tokenizer=cfg.tokenizer, data=cfg.data, seed=cfg.seed, held_out=True, data_settings=cfg.data_settings(),
    )  # fmt: skip
    for model, (config, _) in zip(cfg.models, found):  # a VLM's chats read now: a bad sample stops the launch
        if is_vlm_config(config):
            vlm_eval_dataset(cfg, model, config)
    if cfg.sp > 1:  # the verdict depends on the modules only: no weights needed
        for config, _ in found:
            attn = built_attn(cfg, config)  # eager for a model without attention layers (Mamba-2)
            check_sequence_mixing(empty_model_from_config(config, attn_implementation=attn), sp_size=cfg.sp)
    return found


class _EveryOnce:
    """``dataset`` filled up to a multiple of ``multiple`` samples with blanks (sample 0 with every
    label ``-100``: they score nothing), so that every layout's last round is full and every sample
    is scored exactly once, whatever ``dp``, ``sp`` and the micro-batch."""

    def __init__(self, dataset, multiple: int) -> None:
        self.dataset, self.n = dataset, len(dataset)
        self.total = math.ceil(self.n / multiple) * multiple

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        from ulysses_sp.parallel.loss import IGNORE_INDEX

        sample = dict(self.dataset[i if i < self.n else 0])
        labels = sample.get("labels", sample["input_ids"])  # the adapter's default, explicit: blanks collate alike
        sample["labels"] = labels if i < self.n else torch.full_like(torch.as_tensor(labels), IGNORE_INDEX)
        return sample


def _evaluate_model(cfg: EvalConfig, model_name: str, model_config: Any, ring: int) -> dict[str, Any]:
    """``model_name`` through ``train``'s forward (module docstring) over the held-out samples."""
    from ulysses_sp import tasks
    from ulysses_sp.engine.build import shard_model
    from ulysses_sp.engine.divergence import check_finite_model
    from ulysses_sp.mixers.guard import check_sequence_mixing
    from ulysses_sp.parallel.comm import all_reduce_sum
    from ulysses_sp.parallel.mesh import init_mesh
    from ulysses_sp.run.loop import register_attention
    from ulysses_sp.run.model_checks import built_attn
    from ulysses_sp.run.vlm import is_vlm_config, vlm_shard

    mesh = init_mesh(sp_size=cfg.sp, ring_size=ring)  # train's layout: dp = nproc / sp
    tokenizer = tasks.run_tokenizer(cfg.tokenizer, model_name)
    vlm = is_vlm_config(model_config)  # chat JSONL with images, every sample (cli.evaluate_vlm)
    dataset = vlm_eval_dataset(cfg, model_name, model_config) if vlm else tasks.build_dataset(
        cfg.data, tokenizer=tokenizer, seq_len=cfg.seq_len, seed=cfg.seed, num_samples=cfg.num_samples,
        held_out=True, settings=cfg.data_settings())  # fmt: skip
    if len(dataset) == 0:
        raise ValueError(f"--data {cfg.data!r}: no held-out sequences to evaluate (--eval-split)")
    attn = built_attn(cfg, model_config)  # eager for a model without attention layers (Mamba-2)
    model = tasks.build_model(model_name, vocab_size=len(tokenizer), seed=cfg.seed, attn_implementation=attn,
                              config=model_config)  # fmt: skip
    check_finite_model(model.state_dict(), model_name)  # the same full weights on every rank
    forward = eval_run_config(cfg, model_name, attn=attn)  # the training run whose forward this is
    handles = [register_attention(forward, model, model_config, mesh), *vlm_shard(forward, model, mesh)]
    try:
        check_sequence_mixing(model, sp_size=cfg.sp)  # as initialize(): the closed-world guard, then the mixers
        handles.extend(shard_model(model, mesh))
        model.to(mesh.device).eval()
        filled = _EveryOnce(dataset, mesh.dp_size * mesh.sp_size * cfg.micro_batch_size)
        stats = _score(cfg, model, filled, mesh, pad_id=tokenizer.pad_token_id or 0, vlm=vlm)
    finally:
        for handle in reversed(handles):
            if handle is not None:
                handle.remove()
    # every rank binned its own tokens by global position: the sum is all tokens
    stats = all_reduce_sum(stats, mesh.reduce_group)
    return _report(cfg, model_name, stats.cpu())


def _score(cfg: EvalConfig, model, dataset, mesh, *, pad_id: int, vlm: bool = False):
    """Per position bin ``[loss sum, valid tokens, correct]`` (float64) of this rank's shards."""
    import torch
    import torch.nn.functional as F

    from ulysses_sp.parallel.loss import IGNORE_INDEX
    from ulysses_sp.run.stream import epoch_batches

    stats = torch.zeros(cfg.bins, 3, dtype=torch.float64, device=mesh.device)
    batches = epoch_batches(dataset, mesh, micro_batch_size=cfg.micro_batch_size, pad_id=pad_id, shuffle=False,
                            vlm=model if vlm else None)  # fmt: skip
    with torch.no_grad():
        for batch in batches:
            inputs, pos = model_inputs(batch, mesh, vlm=vlm)  # pos [B, S_l]: each token's place in its document
            logits = model(**inputs, use_cache=False).logits  # no cache: packed documents stay apart
            labels = batch["shift_labels"]  # [B, S_l]
            valid = labels != IGNORE_INDEX
            token_loss = F.cross_entropy(  # [B*S_l, V] -> [B, S_l]
                logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
            ).view_as(labels)
            correct = (logits.argmax(-1) == labels) & valid
            bins = (pos.clamp(0, cfg.seq_len - 1) * cfg.bins // cfg.seq_len).flatten()
            parts = torch.stack([token_loss.double(), valid.double(), correct.double()], -1).view(-1, 3)
            stats.index_add_(0, bins[valid.flatten()], parts[valid.flatten()])
            del logits  # [B, S_l, V]: not alive through the next batch's forward
    return stats


def _report(cfg: EvalConfig, model_name: str, stats) -> dict[str, Any]:
    from ulysses_sp import tasks

    def mean(rows, col: int):
        count = float(rows[:, 1].sum())
        return float(rows[:, col].sum()) / count if count else None

    edges = [i * cfg.seq_len // cfg.bins for i in range(cfg.bins + 1)]
    half = cfg.bins // 2
    per_position = [
        {"start": edges[i], "end": edges[i + 1], "tokens": int(stats[i, 1]),
         "loss": mean(stats[i : i + 1], 0), "accuracy": mean(stats[i : i + 1], 2)}
        for i in range(cfg.bins)
    ]  # fmt: skip
    report = {
        "model": model_name, "data": cfg.data, "seq_len": cfg.seq_len, "sp": cfg.sp,
        "loss": mean(stats, 0), "accuracy": mean(stats, 2), "tokens": int(stats[:, 1].sum()),
        "early_loss": mean(stats[:half], 0), "late_loss": mean(stats[half:], 0),
        "per_position": per_position,
    }  # fmt: skip
    if cfg.data == tasks.RECALL:
        report["chance_loss"] = tasks.CHANCE_LOSS
    return report


def run_eval(cfg: EvalConfig) -> list[dict[str, Any]]:
    """Evaluate every model (a collective); rank 0 writes the JSON and the plot."""
    import torch.distributed as dist

    from ulysses_sp import tasks

    found = validate_eval(cfg, dist.get_world_size())
    if cfg.data != tasks.RECALL and not cfg.eval_split and dist.get_rank() == 0:
        logger.warning("--eval-split 0: no samples of %s are held out; evaluating on all of them (a run "
                       "trained on them scores its training data)", cfg.data)  # fmt: skip
    reports = [_evaluate_model(cfg, m, config, ring) for m, (config, ring) in zip(cfg.models, found)]
    for r in reports:  # the same reduced numbers on every rank: every rank raises
        if r["loss"] is not None and not math.isfinite(r["loss"]):
            raise ValueError(
                f"{r['model']}: the loss is {r['loss']} (not finite) on finite weights; check the data"
            )
    if dist.get_rank() == 0:
        out = {"results": reports}
        os.makedirs(os.path.dirname(os.path.abspath(cfg.output_json)), exist_ok=True)
        with open(cfg.output_json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
        for r in reports:
            late = r["late_loss"]
            logger.info(
                "%s: loss %.4f, accuracy %.4f, late-half loss %s over %d tokens", r["model"], r["loss"],
                r["accuracy"], "n/a" if late is None else f"{late:.4f}", r["tokens"],
            )  # fmt: skip
        logger.info("wrote %s", cfg.output_json)
        if cfg.plot:
            plot_per_position(reports, cfg.plot)
    return reports


def _label(name: str) -> str:
    from ulysses_sp import tasks

    if tasks.is_preset(name):
        return f"{name} (untrained)"
    return os.path.basename(os.path.normpath(name)) or name


def plot_per_position(reports: list[dict[str, Any]], path: str) -> None:
    """Per-position loss of each report as one line; chance level dashed (recall)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot (pip install 'ulysses-sp[plot]')")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in reports:
        xs = [(b["start"] + b["end"]) / 2 for b in r["per_position"] if b["loss"] is not None]
        ys = [b["loss"] for b in r["per_position"] if b["loss"] is not None]
        ax.plot(xs, ys, marker="o", markersize=3, label=f"{_label(r['model'])} (mean {r['loss']:.3f})")
    chance = reports[0].get("chance_loss")
    if chance is not None:
        ax.axhline(chance, color="gray", linestyle="--", label=f"chance without looking back ({chance:.2f})")
    seq_len = reports[0]["seq_len"]
    if reports[0]["early_loss"] is None:  # recall: the first half (the span) carries no labels
        ax.axvspan(0, seq_len / 2, color="gray", alpha=0.08, label="span: stated once, not scored")
    ax.axvline(seq_len / 2, color="gray", linestyle=":", linewidth=1)
    ax.set_xlim(0, seq_len)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("position in the sequence (token predicted at this position)")
    ax.set_ylabel("loss (nats)")
    ax.set_title(f"per-position loss, {reports[0]['data']}, seq_len {seq_len}")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    logger.info("wrote %s", path)
