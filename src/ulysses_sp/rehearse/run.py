"""``train --rehearse``: the run's own step rehearsed at its real shapes, beside the planner's prediction.

``rehearse_run(cfg, gpus=N, device="cuda")`` takes the ``RunConfig`` a ``train`` command line makes,
builds the model from its ``config.json`` alone (or the preset's config; no weights are read), draws
one micro-batch of the run's sequence length (synthetic tokens, plain causal or packed documents as
``--packing`` would give), cuts this rank's shard exactly as the data adapter does
(``data.shard.prepare_batch`` / ``shard_batch``) and rehearses one step (``rehearse.step``) as rank 0
and as the last rank of the first SP group of ``N`` ranks. The verdict compares the device peak
with ``--gpu-memory`` (less the planner's reserve for what a rehearsal cannot see: CUDA context and
kernel workspaces, NCCL buffers, allocator fragmentation) and the host bytes of a node with
``--host-memory``.

Where it sits: a command of its own, above ``run`` (it builds what ``run.loop`` builds); no real
process group, no real tensors.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from ulysses_sp.plan.hardware import DEVICES, GB, parse_bytes
from ulysses_sp.plan.inputs import ModelShape
from ulysses_sp.rehearse.fake import RehearsalDevice, rehearsal_device
from ulysses_sp.rehearse.step import StepResult, quiet, rehearse_step
from ulysses_sp.run.config import RunConfig

logger = logging.getLogger(__name__)

DEFAULT_HOST_MEMORY = 2 * 1024 * GB
"""A DGX H100-class node's host memory (2 TB = 2,048 GB: 1.86 TiB), which a single GPU may use whole."""


@dataclass
class Rehearsal:
    """A rehearsed ``train`` step: per rank what it measured, the planner's prediction, the verdict."""

    device: str
    gpus: int
    seq_len: int
    ranks: list[StepResult]
    predicted: dict[str, Any]
    """The planner's ``Prediction`` for the same run (``as_dict``)."""
    gpu_memory: int
    reserve: int
    host_memory: int
    gpus_per_node: int
    notes: list[str] = field(default_factory=list)
    time: dict[str, Any] = field(default_factory=dict)
    """The slowest rank's step time projected on the device table's entry (``rehearse.timing``)."""

    @property
    def device_peak(self) -> int:
        return max(r.device_peak for r in self.ranks)

    @property
    def host_per_node(self) -> int:
        """Host bytes of one node: each of its ranks' host peak (offloaded activations and K/V, model
        states under CPU offload, pinned copies)."""
        return max(r.host_peak for r in self.ranks) * min(self.gpus, self.gpus_per_node)

    @property
    def fits(self) -> bool:
        return self.device_peak + self.reserve <= self.gpu_memory and self.host_per_node <= self.host_memory

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(device_peak=self.device_peak, host_per_node=self.host_per_node, fits=self.fits)
        return out


def _model_config(cfg: RunConfig) -> Any:
    from ulysses_sp import tasks

    if tasks.is_preset(cfg.model):
        return tasks.preset_config(cfg.model, vocab_size=tasks.VOCAB_SIZE)
    from ulysses_sp.state.model_dir import load_config

    return load_config(cfg.model)  # config.json alone: no weights, no tokenizer needed


def synthetic_batch(cfg: RunConfig, vocab_size: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """``[B, S]`` tokens of the run's length; with ``--packing`` documents of S/8 tokens each
    (position ids restarting at 0), else one causal sequence per row."""
    g = torch.Generator().manual_seed(seed)
    b, s = cfg.micro_batch_size, cfg.seq_len
    ids = torch.randint(0, vocab_size, (b, s), generator=g)
    pos = torch.arange(s).repeat(b, 1)
    if getattr(cfg, "packing", None) not in (None, "none"):
        pos = pos % max(s // 8, 1)
    return {"input_ids": ids, "position_ids": pos}


def rehearse_run(
    cfg: RunConfig,
    *,
    gpus: int,
    device: str = "cuda",
    gpu_memory: str | int | None = None,
    host_memory: str | int | None = None,
    ranks: tuple[int, ...] | None = None,
    reserve: int | None = None,
    progress: Any = None,
    images: int | None = None,
    image_size: tuple[int, int] | None = None,
) -> Rehearsal:
    """Rehearse ``cfg``'s step on ``gpus`` ranks (see the module docstring); ``reserve``: bytes kept
    back from ``gpu_memory`` (default: the device table's); ``progress``: called with a line per
    rehearsed phase (``None``: quiet). Raises ``ValueError`` for a bad layout or
    option, ``rehearse.fake.HostReadError`` when the step reads a device value. A Qwen-VL model is
    rehearsed with ``images`` images of ``image_size`` pixels per row (``rehearse.vlm``), and the rank
    whose tower encodes the most patches is rehearsed too."""
    from ulysses_sp.checks import check_seq_len_divisible, positive_int
    from ulysses_sp.run.preflight import planned_shape, prediction

    positive_int("--gpus", gpus)
    if gpus % cfg.sp:
        raise ValueError(f"--gpus ({gpus}) must be a multiple of --sp ({cfg.sp}): dp = gpus / sp")
    check_seq_len_divisible(cfg.seq_len, cfg.sp, 1, fix="use --seq-len")
    if cfg.zero_stage < 2:
        raise ValueError(
            f"--rehearse needs --zero-stage 2 or 3 (FSDP2), got {cfg.zero_stage}: stages 0-1 wrap the model in "
            "DDP, whose C++ reducer reads parameter memory that fake tensors do not have"
        )
    where = rehearsal_device(device)
    hw = DEVICES["cpu" if device == "cpu" else "h100"]
    budget = parse_bytes(gpu_memory, what="--gpu-memory") if gpu_memory is not None else hw.memory_bytes
    host = parse_bytes(host_memory, what="--host-memory") if host_memory is not None else DEFAULT_HOST_MEMORY
    config = _model_config(cfg)
    vocab = config.get_text_config().vocab_size
    batch, patches, busiest, extra = synthetic_batch(cfg, vocab, seed=cfg.seed), 0, 0, []
    if _is_vlm(config):  # images through train's per-shard merge (rehearse.vlm)
        batch, patches, busiest, extra = _vlm_batch(cfg, config, images, image_size)
    ranks = ranks if ranks is not None else tuple(sorted({0, busiest, cfg.sp - 1}))
    shape = planned_shape(config)  # the exact parameter count (experts, a VLM's tower included), the layer kinds
    slow = chunk_loop_note(config, cfg.seq_len, len(ranks), shape=shape)
    if slow and progress:
        progress(slow)
    results = []
    with quiet():
        for rank in ranks:
            results.append(_rehearse_rank(cfg, config, batch, gpus=gpus, rank=rank, where=where, progress=progress))
    pred = prediction(cfg, gpus, config, torch.device("cpu" if device == "cpu" else "cuda"), vision_patches=patches)
    notes = [f"device: {where.describe()}",
             "not seen by a rehearsal: CUDA context, kernel workspaces (cuBLAS, flash/sdpa), NCCL buffers, allocator "
             f"fragmentation, pinned staging; the planner keeps {hw.reserve_bytes / GB:.0f} GB for them", *extra]  # fmt: skip
    return Rehearsal(device=where.describe(), gpus=gpus, seq_len=cfg.seq_len, ranks=results, predicted=pred.as_dict(),
                     gpu_memory=budget, reserve=hw.reserve_bytes if reserve is None else reserve, host_memory=host, gpus_per_node=hw.gpus_per_node,
                     notes=notes, time=_projected(cfg, shape.params, results, hw, gpus))  # fmt: skip


LOOP_SECONDS = 0.05
"""CPU seconds a rehearsal spends per chunk and layer in a Python chunk loop (forward, recompute and
backward; Qwen3-Next's gated delta-net at 128-wide heads, measured on a 2-core CPU)."""


def chunk_loop_note(config: Any, seq_len: int, ranks: int = 1, *, shape: ModelShape | None = None) -> str | None:
    """A warning when the model's sequence mixers scan in a Python loop over ``S / c`` chunks
    (transformers' torch fallbacks of gated delta-net, KDA and lightning attention): fake tensors run
    each chunk's ops one by one, so the rehearsal's time grows with ``S / c`` x layers. ``None``: no such
    layer (Mamba-2's chunked scan is vectorized). ``shape``: the config's ``run.preflight.planned_shape``
    when the caller has it (else built here)."""
    from ulysses_sp.run.preflight import planned_shape

    shape = shape if shape is not None else planned_shape(config)
    loops = [k.mixer for k in shape.kinds()
             if k.mixer is not None and k.mixer.kind in ("gated_delta_net", "kimi_delta_attention", "lightning_attention")]  # fmt: skip
    if not loops:
        return None
    chunks = -(-seq_len // loops[0].chunk)
    minutes = LOOP_SECONDS * chunks * len(loops) * ranks / 60
    return (f"note: {len(loops)} {loops[0].kind} layers scan {chunks:,} chunks each in a Python loop (transformers' "
            f"torch fallback), which fake tensors run op by op: expect about {minutes:,.0f} CPU minutes "
            f"({LOOP_SECONDS} s per chunk and layer on a 2-core CPU); a shorter --seq-len or fewer layers rehearses "
            "the same per-layer shapes sooner")  # fmt: skip


def _projected(cfg: RunConfig, params: int, results: list[StepResult], hw: Any, gpus: int) -> dict[str, Any]:
    """The slowest rehearsed rank's step time on ``hw`` (``rehearse.timing.project``) for a model of ``params``
    parameters (the optimizer step on the host with ``--cpu-offload``)."""
    from ulysses_sp.rehearse.timing import project

    shard = gpus if cfg.partition_for(gpus) == "all" else gpus // cfg.sp
    host_opt = 16 * params // shard if cfg.cpu_offload else 0
    times = [project(r, hw, dtype=cfg.dtype, sp=cfg.sp, shard_group=shard, host_optimizer_bytes=host_opt,
                     tokens=cfg.micro_batch_size * cfg.seq_len // cfg.sp, head_groups=cfg.head_chunks,
                     head_overlap=cfg.head_chunk_overlap and cfg.sp > 1 and not cfg.offload_attention,
                     checkpointed=cfg.activation_checkpointing) for r in results]  # fmt: skip
    return max(times, key=lambda t: t.step_s).as_dict() | {"device": hw.name, "mfu": hw.mfu}


def _rehearse_rank(cfg: RunConfig, config: Any, batch: dict[str, torch.Tensor], *, gpus: int, rank: int,
                   where: RehearsalDevice, progress: Any = None) -> StepResult:  # fmt: skip
    from ulysses_sp.data.shard import prepare_batch, shard_batch
    from ulysses_sp.parallel.doc_layout import host_layout
    from ulysses_sp.run.loop import micro_step

    sp_rank = rank % cfg.sp
    if _is_vlm(config):  # as VLMDataLoaderAdapter yields it: the whole sample, its host layout
        from ulysses_sp.rehearse.vlm import meta_model, rank_batch

        local = rank_batch(cfg, meta_model(config, cfg.attn), batch, sp_rank)
    else:
        prepared = prepare_batch(batch, cfg.sp)
        local = shard_batch(prepared, sp_rank, cfg.sp)
        local["_layout"] = host_layout(prepared["position_ids"])  # as the adapter ships it (attached in the step)

    def build():
        from ulysses_sp.parallel.mesh import init_mesh
        from ulysses_sp.parallel.mesh_shape import head_counts, resolve_ring_size_for_layers
        from ulysses_sp.state.loading import empty_model_from_config

        ring = resolve_ring_size_for_layers(cfg.sp, head_counts(config), cfg.ring_size) if cfg.sp > 1 else 1
        mesh = init_mesh(sp_size=cfg.sp, ring_size=ring, device_type=where.tensor_device)
        return empty_model_from_config(config, attn_implementation=cfg.attn), mesh

    def make_engine(model, mesh):
        from ulysses_sp.engine import initialize
        from ulysses_sp.run.loop import register_attention
        from ulysses_sp.run.model_checks import apply_techniques
        from ulysses_sp.run.vlm import vlm_shard

        _, loss_fn = apply_techniques(cfg, model)
        mpu = register_attention(cfg, model, config, mesh)  # train's own registration (--exchange included)
        vlm_shard(cfg, model, mesh)  # --split-images off / packed rows at sp 1: as train installs it
        engine, _, _, _ = initialize(model, cfg.training_config(gpus), mpu=mpu or mesh.mpu, loss_fn=loss_fn)
        return engine

    return rehearse_step(build, make_engine, local, gpus=gpus, rank=rank, device=where,
                         micro_step=micro_step, host_states=cfg.cpu_offload, progress=progress)  # fmt: skip


def _is_vlm(config: Any) -> bool:
    from ulysses_sp.run.vlm import is_vlm_config

    return is_vlm_config(config)


def _vlm_batch(cfg: RunConfig, config: Any, images: int | None, image_size: Any) -> tuple[Any, int, int, list[str]]:
    """A VLM run's synthetic batch (``rehearse.vlm``), the most patches a rank's tower encodes, the busiest
    rank, the report's note on them."""
    from ulysses_sp.rehearse.vlm import busiest_rank, describe, synthetic_vlm_batch, vision_patches
    from ulysses_sp.run.vlm import check_vlm_options

    check_vlm_options(replace(cfg, data=None))  # the options train refuses for a VLM, refused alike
    batch = synthetic_vlm_batch(cfg, config, images=images, image_size=image_size, seed=cfg.seed)
    return batch, vision_patches(cfg, batch), busiest_rank(cfg, batch), [describe(cfg, config, batch)]
