"""The ``ulysses-sp`` argument parser: the ``train`` / ``eval`` / ``plan`` flags, and ``RunConfig``
from defaults <- ``--config`` JSON <- the flags given. Pure: no processes, no environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from ulysses_sp.checks import positive_int
from ulysses_sp.cli.flags import LAUNCH_KEYS, REHEARSAL_KEYS, add_data_args, show_default

DEFAULT_TIMEOUT_S = 300.0


def _tiles(value: str) -> str | int:
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tiles or 'auto', got {value!r}") from None
    try:
        return positive_int("number of tiles", n)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ring_size(value: str) -> int | None:
    """``"auto"`` -> ``None``; otherwise a positive ring size."""
    if value == "auto":
        return None
    try:
        return positive_int("--ring-size", int(value))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive ring size or 'auto', got {value!r}") from None


def _attn_chunk(value: str) -> int | None:
    """``"auto"`` -> ``None``; otherwise a positive number of tokens."""
    if value == "auto":
        return None
    try:
        return positive_int("--attn-chunk", int(value))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive number of tokens or 'auto', got {value!r}"
        ) from None


def _betas(value: str) -> tuple[float, float]:
    """``"B1,B2"`` -> ``(B1, B2)``; the range is checked with the other settings (``check_recipe``)."""
    try:
        b1, b2 = (float(v) for v in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected two numbers B1,B2 (e.g. 0.9,0.95), got {value!r}"
        ) from None
    return b1, b2


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default stated once: appended as ``(default X)`` unless the help
    text states it itself, or there is none to state (``None``, a switch, a required flag). Flags
    whose parser default is ``SUPPRESS`` (``train``'s: only given flags override ``--config``) show
    the value of ``defaults`` (the config's field) instead."""

    defaults: dict[str, Any] = {}

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        value = self.defaults.get(action.dest, action.default)
        if "default" in text or action.nargs == 0 or action.required or value is None:
            return text
        if isinstance(value, bool) or value == argparse.SUPPRESS:
            return text
        return f"{text} (default {show_default(value)})"


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    s = argparse.SUPPRESS
    p.add_argument("--nproc", type=int, default=s, metavar="N",
                   help="local processes to launch, dp = nproc / sp (default: --sp, i.e. dp 1); "
                        "ignored under torchrun")  # fmt: skip
    p.add_argument("--timeout", type=float, default=s, metavar="SECONDS",
                   help=f"collective timeout: a dead rank fails the others after it (default {DEFAULT_TIMEOUT_S:g})")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    from ulysses_sp.run.config import MODEL_DIR_DEFAULTS as own
    from ulysses_sp.run.config import PRESET_DEFAULTS as pre
    from ulysses_sp.run.config import RunConfig

    s = argparse.SUPPRESS  # only flags actually given override --config and the defaults

    class TrainHelp(HelpFormatter):
        defaults = {f.name: f.default for f in dataclasses.fields(RunConfig)}

    parser = argparse.ArgumentParser(
        prog="ulysses-sp",
        description="Ulysses sequence-parallel training for HF models: train, evaluate, plan the memory",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model (default: the embedded recall task)", formatter_class=TrainHelp,
                       description="Train with Ulysses sequence parallelism on nproc local processes "
                       "(or under torchrun). With no flags: the embedded recall task, tiny-llama, sp 2.")  # fmt: skip
    t.add_argument("--config", default=s, metavar="FILE",
                   help="JSON file with any of these options, underscored names (flags override it)")  # fmt: skip
    t.add_argument(
        "--model", default=s, help="preset (tiny-llama, tiny-qwen2, tiny-mistral) or local HF model dir"
    )
    t.add_argument("--data", default=s,
                   help="'recall' (the embedded task) or local data: a .txt, .jsonl, .json, .parquet or .arrow "
                        "file, a directory of them, or a datasets save_to_disk directory")  # fmt: skip
    t.add_argument("--tokenizer", default=s, metavar="DIR",
                   help="tokenizer directory, or 'byte' (the built-in byte-level one); default: the model "
                        "directory's own (refused if it has none), a preset's is byte-level")  # fmt: skip
    t.add_argument("--seq-len", type=int, default=s, metavar="S",
                   help="tokens per sample: a multiple of --sp, at most the model's max_position_embeddings")  # fmt: skip
    t.add_argument("--sp", type=int, default=s, metavar="P", help="sequence-parallel size: ranks sharing each sequence")
    _add_launch_args(t)
    t.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=s,
                   help="0 DDP, 1 + sharded optimizer state, 2 FSDP2 + sharded gradients, 3 + sharded parameters")  # fmt: skip
    t.add_argument("--micro-batch-size", type=int, default=s, metavar="B",
                   help=f"samples per micro-step per dp replica; default {pre['micro_batch_size']} for a preset, "
                        f"{own['micro_batch_size']} for a model directory")  # fmt: skip
    t.add_argument("--grad-accum", type=int, default=s, metavar="N", help="micro-steps per optimizer step")
    t.add_argument("--steps", type=int, default=s, help="optimizer steps (in total, across resumes)")
    t.add_argument("--lr", type=float, default=s,
                   help=f"peak learning rate (AdamW, warmup then cosine); default {pre['lr']:g} for a preset "
                        f"(random init), {own['lr']:g} for a model directory (fine-tuning)")  # fmt: skip
    t.add_argument("--warmup-steps", type=int, default=s, metavar="N",
                   help="warmup steps (default: --warmup-ratio's, else min(20, steps/10))")  # fmt: skip
    t.add_argument("--warmup-ratio", type=float, default=s, metavar="R",
                   help="warmup as a fraction of --steps, ceil(R*steps); instead of --warmup-steps")  # fmt: skip
    t.add_argument("--weight-decay", type=float, default=s, help="AdamW weight decay")
    t.add_argument("--betas", type=_betas, default=s, metavar="B1,B2", help="AdamW betas")
    t.add_argument("--grad-clip", type=float, default=s, metavar="NORM", help="max gradient norm, 0 = off")
    t.add_argument("--seed", type=int, default=s, help="seed for init, data order, recall samples")
    t.add_argument("--attn", default=s, help="core attention: sdpa, eager, flash_attention_2, ...")
    t.add_argument("--output-dir", default=s, metavar="DIR", help="checkpoints and metrics go here")
    t.add_argument("--save-every", type=int, default=s, metavar="N",
                   help="checkpoint every N steps; 0 = at the end only")  # fmt: skip
    t.add_argument("--resume", nargs="?", const="latest", default=s, metavar="DIR",
                   help="resume the newest checkpoint in --output-dir, or the given checkpoint/run dir")  # fmt: skip
    t.add_argument("--overwrite", action="store_true", default=s, help="replace another run's checkpoints")
    t.add_argument("--metrics-file", default=s, metavar="FILE",
                   help="JSONL metrics (default <output-dir>/metrics.jsonl)")  # fmt: skip
    t.add_argument("--tiled-mlp", nargs="?", const="auto", type=_tiles, default=s, metavar="N",
                   help="tiled MLP, in N tiles (auto when N is omitted)")  # fmt: skip
    t.add_argument("--tiled-loss", nargs="?", const="auto", type=_tiles, default=s, metavar="N",
                   help="tiled logits+loss, in N tiles (auto when N is omitted)")  # fmt: skip
    t.add_argument(
        "--activation-checkpointing", action="store_true", default=s, help="recompute layers in backward"
    )
    t.add_argument("--offload-activations", action="store_true", default=s,
                   help="checkpointed layer inputs to host memory (needs --activation-checkpointing)")  # fmt: skip
    t.add_argument("--disk-layers", type=int, default=s, metavar="N",
                   help="with --offload-activations: the first N layers' inputs to files under --offload-dir "
                   "instead of host memory (when they outgrow the node's RAM)")  # fmt: skip
    t.add_argument("--offload-dir", default=s, metavar="DIR",
                   help="directory for --disk-layers' files, a local NVMe (default: the system's temporary directory)")  # fmt: skip
    t.add_argument("--recompute-norms", action="store_true", default=s,
                   help="RMSNorms in the layers keep only input and output, recomputed in backward (exact)")  # fmt: skip
    t.add_argument("--no-progress", dest="progress", action="store_false", default=s, help="no progress bar")
    t.add_argument("--ring-size", type=_ring_size, default=s, metavar="R|auto",
                   help="hybrid Ulysses x Ring: --sp = R ring groups x sp/R Ulysses ranks (default auto: "
                   "1 when the heads split over --sp, else the smallest R that makes them)")  # fmt: skip
    t.add_argument("--attn-chunk", type=_attn_chunk, default=s, metavar="N|auto",
                   help="tokens per block of the blockwise attention core (sdpa; default auto)")  # fmt: skip
    t.add_argument("--head-chunks", type=int, default=s, metavar="N",
                   help="the attention block (projections, exchange, core) in N head groups, one at a time (sp 1 too): "
                   "less peak memory, one more attention forward per layer (default 1)")  # fmt: skip
    t.add_argument("--exchange", choices=("auto", "packed", "headwise"), default=s,
                   help="SP attention all-to-all: one collective (packed), one per head (headwise), or auto: packed "
                   "below a per-piece byte threshold of the backend (default auto)")  # fmt: skip
    t.add_argument("--split-images", choices=("auto", "on", "off"), default=s,
                   help="VLM: split the vision tower's frames over the SP group (one all-to-all of the merged rows); "
                   "auto: for each micro-batch with a whole frame for every rank, off: each rank encodes the frames "
                   "its shard touches, on: refuse a micro-batch that cannot be split (default auto)")  # fmt: skip
    t.add_argument("--head-chunk-overlap", action="store_true", default=s,
                   help="with --head-chunks and --sp > 1: the next head group's exchange runs behind this group's core "
                   "in forward (two groups' q/k/v alive; off by default)")  # fmt: skip
    t.add_argument("--offload-attention", action="store_true", default=s,
                   help="Ulysses-Offload: attention K/V on the host between forward and backward (sdpa)")  # fmt: skip
    t.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=s,
                   help="compute dtype; bf16/fp16 keep fp32 master weights and optimizer state")  # fmt: skip
    t.add_argument("--cpu-offload", action="store_true", default=s,
                   help="parameters, gradients and optimizer step in host memory (needs --zero-stage 3)")  # fmt: skip
    t.add_argument("--save-dtype", choices=("fp32", "bf16", "fp16"), default=s,
                   help="dtype of the exported HF weights (default: the fp32 master weights)")  # fmt: skip
    t.add_argument("--memory", default=s, help="memory budget per rank for the fit check, e.g. 20GB "
                   "(default: the accelerator's memory; CPU: available host memory / local ranks)")  # fmt: skip
    t.add_argument(
        "--force", action="store_true", default=s, help="start even if the planner predicts no fit"
    )
    t.add_argument("--profile-comm", action="store_true", default=s,
                   help="time collectives (device syncs): comm_s, dp_comm_s, compute_s per metrics line")  # fmt: skip
    t.add_argument("--memory-every", type=int, default=s, metavar="N",
                   help="measure peak_mem_bytes on steps 1-3, the last and every N-th (default: every step on a "
                        "GPU, every 25th on CPU, where measuring doubles a small model's step time)")  # fmt: skip
    t.add_argument("--zero-partition", choices=("auto", "data_parallel", "all"), default=s,
                   help="ZeRO partitions over the DP axis (data_parallel) or all dp*sp ranks (all); auto: all "
                        "where dp is 1 (a DP axis of one rank partitions nothing), else data_parallel")  # fmt: skip
    t.add_argument("--report-to", default=s, metavar="none|tensorboard|wandb",
                   help="also log the metrics, under the HF Trainer's names, to tensorboard (<output-dir>/runs) "
                        "or wandb (offline unless WANDB_MODE is set), or both comma-separated")  # fmt: skip
    t.add_argument("--plot", action=argparse.BooleanOptionalAction, default=s,
                   help="draw loss.png beside the metrics file at the end of the run (needs matplotlib)")  # fmt: skip
    add_data_args(t, s)
    r = t.add_argument_group("rehearsal (--rehearse: one step on fake tensors at the real shapes; nothing runs)")
    r.add_argument("--rehearse", action="store_true", default=s,
                   help="rehearse one step of this run on fake tensors and a fake process group: peak memory, "
                   "the largest tensors, collectives, FLOPs, beside the planner's prediction; exit 1 if it does not fit")  # fmt: skip
    r.add_argument("--gpus", type=int, default=s, metavar="N", help="ranks to rehearse (default: --nproc, else --sp)")
    r.add_argument("--device", choices=("cuda", "cpu"), default=s, help="the rehearsed device (default cuda)")
    r.add_argument("--gpu-memory", default=s, metavar="SIZE", help="memory of one GPU (default 80GB, an H100)")
    r.add_argument("--host-memory", default=s, metavar="SIZE",
                   help="host memory of one node (default 2TiB, a DGX H100-class node)")  # fmt: skip
    r.add_argument("--json", action="store_true", default=s, help="print the rehearsal as JSON")
    r.add_argument("--images", type=int, default=s, metavar="N",
                   help="a Qwen-VL model: images per sample of the synthetic batch (default: one per 8,192 tokens)")
    r.add_argument("--image-size", type=image_size, default=s, metavar="HxW",
                   help="a Qwen-VL model: pixels of each synthetic image (default 1344x1344)")  # fmt: skip
    t.add_argument("--max-nonfinite-steps", type=int, default=s, metavar="N",
                   help="skip up to N steps in a row with a non-finite loss/gradient, then stop")  # fmt: skip
    t.add_argument("--save-on-signal", type=float, nargs="?", const=60.0, default=s, metavar="SECONDS",
                   help="on SIGTERM, finish the step, save it and exit once saved, the save given up to "
                        "SECONDS (60 when omitted; default: off, SIGTERM stops at once)")  # fmt: skip
    t.add_argument("--allow-data-change", action="store_true", default=s,
                   help="--resume although the data's fingerprint differs from the checkpoint's")  # fmt: skip

    from ulysses_sp.cli.evaluate import add_eval_args

    e = sub.add_parser("eval", help="evaluate checkpoints: loss, accuracy, per-position loss (JSON + PNG)",
                       formatter_class=HelpFormatter,
                       description="Loss, accuracy and per-position loss of each --model on held-out data. "
                       "Unset, --data and its settings, --seq-len, --seed and --sp are the training run's "
                       "(the manifest.json of the first --model that has one).")  # fmt: skip
    add_eval_args(e)
    _add_launch_args(e)

    from ulysses_sp.cli.plan import add_plan_args

    pl = sub.add_parser("plan", help="predict memory and speed per setting; recommend a train command line",
                        formatter_class=HelpFormatter,
                        description="Predict each setting's peak memory per device and speed from the model's "
                        "config alone (nothing is built), and recommend a train command line that fits.")  # fmt: skip
    add_plan_args(pl)
    env = sub.add_parser("env", help="print versions, devices and memory for a bug report",
                         description="Print ulysses-sp, Python, torch (CUDA/NCCL/cuDNN), transformers, "
                         "accelerate, TRL, PEFT and the kernels' versions, the devices and the host memory.")  # fmt: skip
    env.add_argument("--json", action="store_true", help="print a JSON object instead of the text report")
    return parser


def _load_json_config(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--config {path!r}: {e}") from e
    if not isinstance(values, dict):
        raise ValueError(f"--config {path!r}: expected a JSON object, got {type(values).__name__}")
    return {k.replace("-", "_"): v for k, v in values.items()}


def train_options(ns: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """``(RunConfig, launch options)`` from defaults <- ``--config`` JSON <- given flags."""
    from ulysses_sp.run.config import config_from_dict

    given = {k: v for k, v in vars(ns).items() if k != "command"}
    values = _load_json_config(given.pop("config")) if "config" in given else {}
    values.update(given)
    for name in ("tiled_mlp", "tiled_loss"):
        if name in values and not isinstance(values[name], bool):
            tiles = values[name]
            values[name] = tiles is not None
            values[f"{name}_shards"] = None if tiles in (None, "auto") else int(tiles)
    for name in ("attn_chunk", "ring_size"):
        if values.get(name) == "auto":  # a --config file may say "auto" too
            values[name] = None
    launch = {k: values.pop(k) for k in LAUNCH_KEYS if k in values}
    launch.update({k: values.pop(k) for k in REHEARSAL_KEYS if k in values})
    return config_from_dict(values), launch


def image_size(text: str) -> tuple[int, int]:
    """``--image-size HxW`` (pixels) -> ``(H, W)``."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--image-size takes HxW in pixels (e.g. 1344x1344), got {text!r}")
    return int(parts[0]), int(parts[1])
