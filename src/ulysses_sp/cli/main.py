"""``ulysses-sp``: the command line (``train``, ``eval``), a thin layer over the library.

Launch: ``--nproc N`` starts N local processes through PyTorch's elastic launcher (the machinery
behind ``torchrun``); under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set) the command
runs as one of the launched ranks instead, multi-node included::

    ulysses-sp train                                    # default: recall task, 2 processes, sp=2
    ulysses-sp train --model ./my-llama --data ./texts --sp 4 --nproc 4 --seq-len 8192
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m ulysses_sp.cli.main train --sp 8 ...

Only this module reads argv and the launcher's environment variables. Bad input is reported
before any process is started (exit code 2); a failed worker makes the command exit 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import uuid
from datetime import timedelta
from typing import Any

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_TIMEOUT_S = 300.0
LAUNCH_KEYS = ("nproc", "timeout")


def under_launcher() -> bool:
    """Whether this process is a rank started by torchrun / the elastic launcher."""
    return all(v in os.environ for v in LAUNCHER_VARS)


# ---------------------------------------------------------------- argument parsing
def _tiles(value: str) -> str | int:
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tiles or 'auto', got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"number of tiles must be >= 1, got {n}")
    return n


def _add_launch_args(p: argparse.ArgumentParser) -> None:
    s = argparse.SUPPRESS
    p.add_argument(
        "--nproc", type=int, default=s, help="local processes to launch (dp = nproc / sp); default 2"
    )
    p.add_argument("--timeout", type=float, default=s,
                   help=f"collective timeout in seconds: a dead rank fails the others after it (default {DEFAULT_TIMEOUT_S:g})")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    s = argparse.SUPPRESS  # only flags actually given override --config and the defaults
    parser = argparse.ArgumentParser(
        prog="ulysses-sp", description="Ulysses sequence-parallel training for HF models"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model (default: the embedded recall task)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    t.add_argument("--config", default=s, help="JSON file with any of these options (flags override it)")
    t.add_argument(
        "--model", default=s, help="preset (tiny-llama, tiny-qwen2, tiny-mistral) or local HF model dir"
    )
    t.add_argument("--data", default=s, help="'recall' or a local .txt/.jsonl file or directory")
    t.add_argument(
        "--tokenizer", default=s, help="tokenizer directory (default: the model's, else byte-level)"
    )
    t.add_argument("--seq-len", type=int, default=s, help="tokens per sample (default 256)")
    t.add_argument("--sp", type=int, default=s, help="sequence-parallel size (default 2)")
    _add_launch_args(t)
    t.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=s, help="ZeRO stage (default 0)")
    t.add_argument(
        "--micro-batch-size", type=int, default=s, help="samples per micro-step per dp replica (default 8)"
    )
    t.add_argument("--grad-accum", type=int, default=s, help="micro-steps per optimizer step (default 1)")
    t.add_argument("--steps", type=int, default=s, help="optimizer steps (default 300)")
    t.add_argument("--lr", type=float, default=s, help="peak learning rate (default 1e-2)")
    t.add_argument("--warmup-steps", type=int, default=s, help="warmup steps (default min(20, steps/10))")
    t.add_argument("--grad-clip", type=float, default=s, help="max gradient norm, 0 = off (default 1.0)")
    t.add_argument(
        "--seed", type=int, default=s, help="seed for init, data order, recall samples (default 0)"
    )
    t.add_argument(
        "--attn", default=s, help="core attention: sdpa, eager, flash_attention_2, ... (default sdpa)"
    )
    t.add_argument("--output-dir", default=s, help="checkpoints go here (default runs/ulysses-sp)")
    t.add_argument("--save-every", type=int, default=s, help="checkpoint every N steps; 0 = at the end only")
    t.add_argument("--resume", nargs="?", const="latest", default=s,
                   help="resume the newest checkpoint in --output-dir, or the given checkpoint/run dir")  # fmt: skip
    t.add_argument("--overwrite", action="store_true", default=s, help="replace another run's checkpoints")
    t.add_argument("--metrics-file", default=s, help="JSONL metrics (default <output-dir>/metrics.jsonl)")
    t.add_argument("--tiled-mlp", nargs="?", const="auto", type=_tiles, default=s, help="tiled MLP [N tiles]")
    t.add_argument(
        "--tiled-loss", nargs="?", const="auto", type=_tiles, default=s, help="tiled logits+loss [N tiles]"
    )
    t.add_argument(
        "--activation-checkpointing", action="store_true", default=s, help="recompute layers in backward"
    )
    t.add_argument("--offload-activations", action="store_true", default=s,
                   help="checkpointed layer inputs to host memory (needs --activation-checkpointing)")  # fmt: skip
    t.add_argument("--no-progress", dest="progress", action="store_false", default=s, help="no progress bar")

    from .evaluate import add_eval_args

    e = sub.add_parser("eval", help="evaluate checkpoints: loss, accuracy, per-position loss (JSON + PNG)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    add_eval_args(e)
    _add_launch_args(e)
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
    """``(TrainConfig, launch options)`` from defaults <- ``--config`` JSON <- given flags."""
    from ..train import config_from_dict

    given = {k: v for k, v in vars(ns).items() if k != "command"}
    values = _load_json_config(given.pop("config")) if "config" in given else {}
    values.update(given)
    for name in ("tiled_mlp", "tiled_loss"):
        if name in values and not isinstance(values[name], bool):
            tiles = values[name]
            values[name] = tiles is not None
            values[f"{name}_shards"] = None if tiles in (None, "auto") else int(tiles)
    launch = {k: values.pop(k) for k in LAUNCH_KEYS if k in values}
    return config_from_dict(values), launch


# ---------------------------------------------------------------- processes
def _configure_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(message)s" if rank == 0 else f"[rank {rank}] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    for noisy in ("torch.distributed", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _init_process_group(timeout_s: float, *, single: bool) -> None:
    import torch
    import torch.distributed as dist

    from ..mesh import default_backend

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:  # one core per local rank: CPU ranks sharing a machine must not oversubscribe it
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    timeout = timedelta(seconds=timeout_s)
    if single:
        dist.init_process_group(
            default_backend(), store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    else:
        dist.init_process_group(default_backend(), timeout=timeout)


def _run_rank(command: str, options: Any, timeout_s: float, single: bool = False) -> Any:
    """Body of one rank: process group, the command, teardown."""
    rank = int(os.environ.get("RANK", "0"))
    _configure_logging(rank)
    _init_process_group(timeout_s, single=single)
    try:
        if command == "train":
            from ..train import run

            return run(options)
        from .evaluate import run_eval

        return run_eval(options)
    finally:
        from ..mesh import shutdown

        shutdown()


def _launch(command: str, options: Any, nproc: int, timeout_s: float) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"ulysses-sp-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
        start_method="spawn",
    )  # fmt: skip
    try:
        elastic_launch(config, _run_rank)(command, options, timeout_s)
    except ChildFailedError as e:
        ranks = ", ".join(f"rank {r} (exit {f.exitcode})" for r, f in sorted(e.failures.items()))
        print(f"ulysses-sp {command}: failed: {ranks}; see the errors above", file=sys.stderr)
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    """Console entry point ``ulysses-sp``."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            options, launch = train_options(args)
        else:
            from .evaluate import eval_options

            options, launch = eval_options(args)
        timeout_s = float(launch.get("timeout", DEFAULT_TIMEOUT_S))
        if under_launcher():
            _run_rank(args.command, options, timeout_s)
            return
        nproc = int(launch.get("nproc", 2 if args.command == "train" else 1))
        if nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {nproc}")
        _check_before_launch(args.command, options, nproc)
    except ValueError as e:
        print(f"ulysses-sp {args.command}: error: {e}", file=sys.stderr)
        sys.exit(2)
    if nproc == 1:
        _run_rank(args.command, options, timeout_s, single=True)
    else:
        _launch(args.command, options, nproc, timeout_s)


def _check_before_launch(command: str, options: Any, nproc: int) -> None:
    if command == "train":
        from ..train import validate

        validate(options, nproc)
    else:
        from .evaluate import validate_eval

        validate_eval(options, nproc)


if __name__ == "__main__":
    main()
