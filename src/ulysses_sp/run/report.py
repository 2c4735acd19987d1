"""Where a run's metrics go: ``metrics.jsonl`` always; TensorBoard and W&B on request; ``loss.png``.

``MetricsReport(cfg, resumed_step=...)`` is opened on rank 0 only, after ``rundir.prepare_output_dir``.
``log(record)`` appends the step's JSON line to ``cfg.metrics_path`` (the file's schema is the
README's) and, with ``--report-to``, the same numbers under the names the HF Trainer logs
(``HF_NAMES``: ``train/loss``, ``train/grad_norm``, ``train/learning_rate``, ...; any other number
as ``train/<key>``) at the run's global step. ``close()`` closes them and draws ``loss.png`` beside
the metrics file from the whole file (a resumed run's earlier steps included); matplotlib is
optional (``ulysses-sp[plot]``): without it one info line says so and the run goes on.

- ``tensorboard``: ``torch.utils.tensorboard`` event files in ``<output_dir>/runs`` (``tensorboard
  --logdir <output_dir>/runs``). A fresh run removes the event files an earlier run left there; a
  resumed one hides the old events past its checkpoint (``purge_step``), as the metrics file drops
  its lines past it.
- ``wandb``: one W&B run in ``<output_dir>/wandb``, **offline** unless ``WANDB_MODE`` is set: nothing
  leaves the machine unless the user says so (``wandb sync`` uploads an offline run later).

Where it sits: ``run.loop`` writes every step through it; ``run.checks`` calls ``check_report_to``
before launch, so a missing package is refused by name before any process starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import os
from typing import Any

logger = logging.getLogger(__name__)

REPORTERS = ("tensorboard", "wandb")
"""What ``--report-to`` takes besides ``none`` (comma-separated for both)."""
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""The package each reporter imports (``pip install <name>``)."""
HF_NAMES = {
    "loss": "train/loss",
    "grad_norm": "train/grad_norm",
    "lr": "train/learning_rate",
    "tokens": "train/num_input_tokens_seen",
    "tokens_per_s": "train/tokens_per_second",
}
"""A metrics-file key -> the name the HF Trainer logs it under; other numbers go as ``train/<key>``."""
TB_DIR = "runs"
"""TensorBoard's directory inside the output directory (the HF Trainer's ``logging_dir`` default)."""
PLOT_NAME = "loss.png"


def parse_report_to(value: str) -> tuple[str, ...]:
    """``"none"`` -> ``()``; ``"tensorboard,wandb"`` -> both (``ValueError`` naming the choices)."""
    names = tuple(dict.fromkeys(v.strip() for v in str(value).split(",") if v.strip()))
    if names in ((), ("none",)):
        return ()
    bad = [n for n in names if n not in REPORTERS]
    if bad:
        raise ValueError(f"--report-to takes none, {', '.join(REPORTERS)} or a comma-separated list of them; "
                         f"got {value!r}")  # fmt: skip
    return names


def check_report_to(value: str) -> None:
    """``parse_report_to``, and each reporter's package importable (``ValueError`` with the install line)."""
    for name in parse_report_to(value):
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise ValueError(f"--report-to {name} needs the {PACKAGES[name]} package, which is not installed: "
                             f"pip install {PACKAGES[name]} (or drop --report-to {name})")  # fmt: skip


def hf_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics line under the HF Trainer's names (``step`` is the x axis, not a scalar)."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[HF_NAMES.get(key, f"train/{key}")] = float(value)
    return out


class MetricsReport:
    """Rank 0's metrics writers for one run (see the module docstring); ``close()`` exactly once."""

    def __init__(self, cfg: Any, *, resumed_step: int | None = None) -> None:
        self.cfg = cfg
        self.file = open(cfg.metrics_path, "a", encoding="utf-8")
        self.tb: Any = None
        self.wandb: Any = None
        reporters = parse_report_to(cfg.report_to)
        if "tensorboard" in reporters:
            self.tb = _tensorboard(cfg, resumed_step)
        if "wandb" in reporters:
            self.wandb = _wandb(cfg)

    def log(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")  # one write per line: a torn line is the last
        self.file.flush()
        scalars = hf_scalars(record)
        if self.tb is not None:
            for tag, value in scalars.items():
                self.tb.add_scalar(tag, value, record["step"])
        if self.wandb is not None:
            self.wandb.log({**scalars, "train/global_step": record["step"]}, step=record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if getattr(self.cfg, "plot", True):
            plot_loss(self.cfg.metrics_path, os.path.join(os.path.dirname(self.cfg.metrics_path), PLOT_NAME))


def _tensorboard(cfg: Any, resumed_step: int | None) -> Any:
    from torch.utils.tensorboard import SummaryWriter

    log_dir = os.path.join(cfg.output_dir, TB_DIR)
    if resumed_step is None and os.path.isdir(log_dir):  # a fresh run: no curve of an earlier one
        for name in os.listdir(log_dir):
            if name.startswith("events.out.tfevents."):
                os.remove(os.path.join(log_dir, name))
    writer = SummaryWriter(log_dir=log_dir, purge_step=None if resumed_step is None else resumed_step + 1)
    writer.add_text("args", "```\n" + json.dumps(dataclasses.asdict(cfg), indent=1, default=str) + "\n```")
    return writer


def _wandb(cfg: Any) -> Any:
    import wandb

    mode = None if os.environ.get("WANDB_MODE") else "offline"  # None: wandb follows the user's WANDB_MODE
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "ulysses-sp"), dir=cfg.output_dir, mode=mode,
                     name=os.path.basename(os.path.abspath(cfg.output_dir)), config=dataclasses.asdict(cfg))  # fmt: skip
    if mode == "offline":
        logger.info("W&B runs offline (nothing is uploaded): %s; `wandb sync` uploads it, WANDB_MODE=online "
                    "reports live", os.path.join(cfg.output_dir, "wandb"))  # fmt: skip
    return run


def plot_loss(metrics_path: str, png_path: str) -> str | None:
    """Draw the loss per step of ``metrics_path`` into ``png_path``; return it, or ``None`` when there is
    nothing to draw or no matplotlib (one info line). Never raises: a plot must not fail a run."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        logger.info("matplotlib is not installed: no %s (pip install 'ulysses-sp[plot]')", PLOT_NAME)
        return None
    try:
        steps, losses = _loss_curve(metrics_path)
        if not steps:
            return None
        fig = Figure(figsize=(8, 4.5))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        ax.plot(steps, losses, linewidth=1.2, marker="o" if len(steps) <= 50 else None, markersize=3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="optimizer step", ylabel="training loss", title=f"{os.path.dirname(metrics_path) or '.'}: loss")
        ax.grid(alpha=0.3)
        fig.savefig(png_path, dpi=100, bbox_inches="tight")
    except Exception as e:  # noqa: BLE001 - the run's result is its checkpoint, not its picture
        logger.warning("no %s: %s: %s", PLOT_NAME, type(e).__name__, e)
        return None
    return png_path


def _loss_curve(metrics_path: str) -> tuple[list[int], list[float]]:
    """``(steps, losses)`` of the finite, not-skipped lines (a torn last line is left out)."""
    steps, losses = [], []
    with open(metrics_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            loss = rec.get("loss") if isinstance(rec, dict) else None
            if isinstance(loss, (int, float)) and math.isfinite(loss) and not rec.get("skipped"):
                steps.append(rec["step"])
                losses.append(float(loss))
    return steps, losses
