"""The run directory: what a checkpoint records about its run, and readying ``--output-dir``.

``manifest_for`` is what a checkpoint records and a resume compares (world layout, the settings
that fix the batches and the model, the model config, a fingerprint of the data);
``check_output_dir`` refuses an output directory that cannot be written or holds another run
(unless ``--overwrite``), or a resume that does not match (a changed dataset included, unless
``--allow-data-change``); ``prepare_output_dir`` readies it on rank 0 and drops a torn last line
of the metrics file. ``checked_save`` (a collective) wraps ``checkpoint.save_checkpoint`` with what
must hold before and during a save: finite weights, enough free space, a clear error on ENOSPC.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ulysses_sp.engine.divergence import HINT, DivergenceError, local_nonfinite
from ulysses_sp.parallel.comm import all_reduce_max, all_reduce_sum, raise_if_any_rank_failed
from ulysses_sp.run.resume import check_checkpoint_files, read_checkpoint
from ulysses_sp.state import checkpoint as ckpt

if TYPE_CHECKING:
    from ulysses_sp.run.config import RunConfig

logger = logging.getLogger(__name__)

RESHARDABLE = ("world.world_size:", "world.sp:", "world.zero_stage:")
"""Manifest differences a resume accepts: the training state is resharded to the new layout."""

RUN_KEYS = ("model", "data", "seq_len", "micro_batch_size", "grad_accum", "seed", "attn",
            "data_format", "loss_on", "chat_template", "packing", "long_samples", "eval_split")  # fmt: skip
"""Settings a resumed run must share with its checkpoint (else the batches or model differ)."""


def manifest_for(cfg: RunConfig, world_size: int, model_cfg) -> dict[str, Any]:
    """The ``world`` / ``run`` / ``model_config`` sections a checkpoint records and resume compares."""
    mc = model_cfg.to_dict()
    # what may legitimately differ between the saving and the resuming run: not the architecture
    ignore = (
        "_attn_implementation_autoset",
        "attn_implementation",
        "transformers_version",
        "dtype",
        "_name_or_path",
    )
    for key in ignore:
        mc.pop(key, None)
    return {
        "world": {
            "world_size": world_size,
            "sp": cfg.sp,
            "dp": world_size // cfg.sp,
            "zero_stage": cfg.zero_stage,
        },
        "run": {k: getattr(cfg, k) for k in RUN_KEYS},
        "model_config": json.loads(json.dumps(mc, default=str)),
        "steps": cfg.steps,
        "lr": cfg.lr,
        "data_fingerprint": data_fingerprint(cfg.data, media=_is_vlm(model_cfg)),
    }


_SAMPLE_BYTES = 1 << 20
_SAMPLES = 16


def _file_digest(path: str, size: int) -> str:
    """sha256 of the whole file up to ``_SAMPLES`` MiB, else of ``_SAMPLES`` 1 MiB blocks spread
    evenly over it (first and last included): cheap for large corpora, and with the size it catches
    appended, truncated or rewritten files."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= _SAMPLES * _SAMPLE_BYTES:
            for block in iter(lambda: f.read(_SAMPLE_BYTES), b""):
                h.update(block)
        else:
            for i in range(_SAMPLES):
                f.seek((size - _SAMPLE_BYTES) * i // (_SAMPLES - 1))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def _is_vlm(model_cfg: Any) -> bool:
    from ulysses_sp.run.vlm import is_vlm_config

    return is_vlm_config(model_cfg)


def data_fingerprint(data: str, *, media: bool = False) -> dict[str, Any]:
    """What ``--data`` read: ``{"recall": ...}`` for the generated task (the seed fixes it), else
    every file the data layer reads (``data.formats.data_files``: ``.txt``/``.jsonl``/``.json``/
    ``.parquet``/``.arrow`` files, or all files of a ``save_to_disk`` directory) with its path
    (relative to ``data``), size and content digest (``_file_digest``). ``media`` (a VLM run): also
    every image or video file a chat JSONL names (``vlm.media.named_files``), digested the same way:
    the launcher decodes each of them anyway, so hashing costs at most a second read of bytes just
    read (and a sampled digest above 16 MiB); a size+mtime stamp would be cheaper but refuses a
    copied dataset and misses a rewrite within the clock's resolution."""
    from ulysses_sp.data.formats import data_files
    from ulysses_sp.tasks import RECALL

    if data == RECALL:
        return {"source": RECALL}
    root = data if os.path.isdir(data) else os.path.dirname(data)
    files = []
    for item in data_files(data):
        inner = (
            sorted(os.path.join(r, f) for r, _, names in os.walk(item) for f in names)
            if os.path.isdir(item)
            else [item]
        )
        for path in inner:
            named = _named_media(path) if media else []
            for file in [path, *named]:
                size = os.path.getsize(file) if os.path.isfile(file) else -1  # -1: missing (named, refused later)
                digest = _file_digest(file, size) if size >= 0 else ""
                files.append([os.path.relpath(file, root), size, digest])
    return {"source": "files", "files": files}


def _named_media(path: str) -> list[str]:
    """The media files a chat JSONL names (``[]`` for other formats)."""
    if not path.endswith(".jsonl"):
        return []
    from ulysses_sp.vlm.media import named_files

    return named_files(path)


def _check_writable(output_dir: str) -> None:
    """The output directory (or, before it exists, its nearest existing parent) takes files."""
    where = os.path.abspath(output_dir)
    while not os.path.exists(where):
        where = os.path.dirname(where)
    if not os.path.isdir(where):
        raise ValueError(f"--output-dir {output_dir!r}: {where!r} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        raise ValueError(
            f"--output-dir {output_dir!r}: cannot write into {where!r} ({e.strerror}); choose a writable "
            "--output-dir"
        ) from None


def _check_data_unchanged(
    cfg: RunConfig, saved: dict[str, Any], manifest: dict[str, Any], path: str
) -> None:
    old, new = saved.get("data_fingerprint"), manifest["data_fingerprint"]
    if old is None or old == new or cfg.allow_data_change:
        return
    before = {f[0]: f[1:] for f in old.get("files", [])}
    after = {f[0]: f[1:] for f in new.get("files", [])}
    changed = sorted(n for n in set(before) | set(after) if before.get(n) != after.get(n))
    raise ValueError(
        f"--resume {path!r}: the data changed since the checkpoint was saved (files differing in size or "
        f"content: {changed[:5] or [old.get('source'), new.get('source')]}); resuming would not continue the "
        "same batches. Restore the data, start a new run, or pass --allow-data-change to resume anyway"
    )


def check_output_dir(cfg: RunConfig, manifest: dict[str, Any]) -> None:
    """Refuse to mix runs: another run's checkpoints need ``--resume`` or ``--overwrite``;
    ``--resume`` needs a compatible checkpoint (the message lists every difference) and unchanged data."""
    _check_writable(cfg.output_dir)
    if cfg.resume is not None:
        if cfg.overwrite:
            raise ValueError("--resume and --overwrite contradict each other; pass one of them")
        path = ckpt.resolve_resume(cfg.resume, cfg.output_dir)
        saved = read_checkpoint(path, cfg.output_dir)  # damaged: named, with the previous checkpoint
        # the training state reshards: another nproc, sp or ZeRO stage is fine (dp fixes the data order)
        diffs = ckpt.compare_manifests(saved, manifest)
        if any(not d.startswith(RESHARDABLE) for d in diffs):
            raise ValueError(
                f"--resume {path!r} does not match this run:\n  "
                + "\n  ".join(d + (" (fine: resharded)" if d.startswith(RESHARDABLE) else "") for d in diffs)
                + "\nresume with the checkpoint's settings (--nproc, --sp and --zero-stage may change, with "
                "dp = nproc / sp as saved), or start a new run in another --output-dir"
            )
        _check_data_unchanged(cfg, saved, manifest, path)
        check_checkpoint_files(path, cfg.output_dir)  # last: a mismatch says more than a damaged file
        return
    existing = ckpt.list_checkpoints(cfg.output_dir)
    if existing and not cfg.overwrite:
        raise ValueError(
            f"--output-dir {cfg.output_dir!r} already holds checkpoints of a run "
            f"({', '.join(os.path.basename(p) for _, p in existing[-3:])}); pass --resume to continue it, "
            "--overwrite to replace it, or choose another --output-dir"
        )


def prepare_output_dir(cfg: RunConfig, resumed_step: int | None) -> None:
    """Rank 0: create the output dir; with ``--overwrite`` remove the old run's checkpoints and
    metrics (only those); on resume drop metrics lines past the resumed step."""
    os.makedirs(cfg.output_dir, exist_ok=True)
    if cfg.overwrite:
        for _, path in ckpt.list_checkpoints(cfg.output_dir):
            shutil.rmtree(path)
        if os.path.exists(cfg.metrics_path):
            os.remove(cfg.metrics_path)
    for name in os.listdir(cfg.output_dir):
        if name.startswith(ckpt.TMP_PREFIX):  # left by a run killed while saving
            shutil.rmtree(os.path.join(cfg.output_dir, name), ignore_errors=True)
    metrics_dir = os.path.dirname(cfg.metrics_path)
    if metrics_dir:
        os.makedirs(metrics_dir, exist_ok=True)
    if resumed_step is not None and os.path.exists(cfg.metrics_path):
        keep = [
            line for line in read_metrics_lines(cfg.metrics_path) if json.loads(line)["step"] <= resumed_step
        ]
        with open(cfg.metrics_path, "w", encoding="utf-8") as f:
            f.writelines(keep)
    elif resumed_step is None and os.path.exists(cfg.metrics_path):
        os.remove(cfg.metrics_path)


def read_metrics_lines(path: str) -> list[str]:
    """The complete lines of a metrics JSONL file. A line that is not a whole JSON object — the torn
    last line of a run killed mid-write, or a disk that filled — is dropped with a warning."""
    keep = []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ok = line.endswith("\n") and isinstance(json.loads(line), dict) and "step" in json.loads(line)
        except json.JSONDecodeError:
            ok = False
        if ok:
            keep.append(line)
        else:
            logger.warning("%s: dropping line %d of %d, which is incomplete (a run stopped while writing it): "
                           "%.60r", path, i, len(lines), line)  # fmt: skip
    return keep


# ---------------------------------------------------------------- saving, checked
class NoSpaceError(RuntimeError):
    """The output directory's file system cannot hold the checkpoint."""


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def checkpoint_bytes(engine: Any, *, save_dtype: torch.dtype | None = None) -> int:
    """An estimate of the disk one checkpoint needs at its peak (a collective over the run's ranks):
    the exported HF weights (in ``save_dtype``; ``None``: as held) twice — DCP's HF writer keeps
    every rank's pieces until rank 0 has consolidated them into the full files — plus the
    reshardable model state (the weights as held), every rank's optimizer state as it holds it,
    5% and 1 MiB."""
    from torch.distributed.tensor import DTensor

    params = list(engine.module.parameters())  # DTensor.numel() is the global count
    held = sum(p.numel() * p.element_size() for p in params)
    exported = held if save_dtype is None else sum(p.numel() for p in params) * save_dtype.itemsize
    local = 0
    for state in engine.optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                v = v.to_local() if isinstance(v, DTensor) else v
                local += v.numel() * v.element_size()
    states = all_reduce_sum(torch.tensor(float(local)), engine.mesh.reduce_group)
    return int((2 * exported + held + states.item()) * 1.05) + 2**20


def checked_save(engine: Any, output_dir: str, step: int, *, last_good: str | None, **save_kw: Any) -> str:
    """``checkpoint.save_checkpoint`` with the checks a save needs (every rank calls it):

    1. the weights are finite on every rank (one ``all_reduce_max`` of a flag; a non-finite model is
       never saved: ``DivergenceError`` naming ``last_good``);
    2. the file system of ``output_dir`` has room for ``checkpoint_bytes`` (``NoSpaceError`` naming
       what is needed and what is free, on every rank, before anything is written);
    3. a write that fails with ENOSPC anyway becomes the same clear ``NoSpaceError`` (the partial
       ``.tmp-`` directory is removed; the previous checkpoints are untouched).
    """
    group = engine.mesh.reduce_group
    bad = torch.tensor(float(local_nonfinite(list(engine.module.parameters()))))
    if all_reduce_max(bad, group).item():
        raise DivergenceError(
            f"not saving step {step}: the model's weights hold NaN or inf. The last good checkpoint is "
            f"{last_good or 'none (none was saved yet)'}. {HINT}",
            step=step,
            bad_steps=0,
        )
    need = checkpoint_bytes(engine, save_dtype=save_kw.get("save_dtype"))
    free = shutil.disk_usage(output_dir).free
    short = f"no space left on {output_dir}: need ~{_mib(need)} for checkpoint {step}, have {_mib(free)}"
    error = f"{short}; free space or choose another --output-dir" if need > free else None
    raise_if_any_rank_failed(error if torch.distributed.get_rank() == 0 else None, group, NoSpaceError)
    try:
        return ckpt.save_checkpoint(engine, output_dir, step, **save_kw)
    # torch.distributed.checkpoint reports its ranks' write errors as a CheckpointException, which is
    # a BaseException (not an Exception); torch.save and safetensors say "full disk" in their own words
    except (Exception, CheckpointException) as e:
        # torch.save says only "unexpected pos ..." / "iostream error": an (almost) full file system
        # right after the failure is the evidence
        full = shutil.disk_usage(output_dir).free < max(4 * 2**20, need // 100)
        causes = [e, *_rank_errors(e).values()]
        if not (
            any(getattr(c, "errno", None) == errno.ENOSPC or "No space left" in str(c) for c in causes)
            or full
        ):
            raise
        shutil.rmtree(os.path.join(output_dir, f"{ckpt.TMP_PREFIX}{step}"), ignore_errors=True)
        free = shutil.disk_usage(output_dir).free
        raise NoSpaceError(
            f"no space left on {output_dir}: need ~{_mib(need)} for checkpoint {step}, have {_mib(free)} "
            f"(the write failed: {_write_failure(e)}); free space or choose another --output-dir"
        ) from None


def _rank_errors(e: BaseException) -> dict[int, BaseException]:
    """A ``CheckpointException``'s per-rank errors (its ``failures`` hold ``(exception, stack)``)."""
    failures = getattr(e, "failures", None) or {}
    return {r: f[0] if isinstance(f, tuple) else f for r, f in failures.items()}


def _write_failure(e: BaseException) -> str:
    """One line for a failed write: each rank's error type and first line, never the writers'
    tracebacks (a ``CheckpointException`` carries every rank's)."""
    errors = _rank_errors(e) or {None: e}
    parts = []
    for rank, err in sorted(errors.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        text = (str(err).strip().splitlines() or [""])[0]
        where = "" if rank is None else f"rank {rank}: "
        parts.append(f"{where}{type(err).__name__}: {text}")
    return "; ".join(parts)
