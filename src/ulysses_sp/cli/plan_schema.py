"""The schema of ``ulysses-sp plan --json``: every key of the document ``cli.plan.candidates`` builds
(and ``--rehearse``'s addition), its JSON type and meaning.

The site's reference page (``docs``: "plan --json") is generated from ``SECTIONS``, and
tests/test_docs_reference.py checks real ``plan --json`` output against it both ways (every key
printed is documented, every documented key is printed by one of its runs, and the types agree),
so a key added to ``cli/plan.py`` without a line here fails a test. Types are JSON's: ``int``,
``float``, ``bool``, ``str``, ``list``, ``dict``, ``null``; ``A or B`` where either occurs.
"""

from __future__ import annotations

Schema = dict[str, tuple[str, str]]

DOCUMENT: Schema = {
    "model": ("str", "`--model` as given"),
    "gpus": ("int", "`--gpus` (per node)"),
    "nodes": ("int", "`--nodes`"),
    "device": ("str", "the device table's entry (`--device`: `h100`, `h200`, `a100`, `cpu`)"),
    "memory_bytes_per_rank": ("int", "device memory per rank the candidates must fit (`--gpu-memory`/`--memory`)"),
    "dtype": ("str", "`--dtype` (default: bf16 on a GPU, fp32 with `--device cpu`)"),
    "seq_len": ("int or null", "`--seq-len`; `null` with `--max` (the longest sequence per setting)"),
    "max_positions": ("int or null", "the model's positions limit (RoPE scaling included) that caps `seq_len`; `null`: none known"),
    "offload_states": ("str", "host-state candidates: `no`, `also` (`--offload-states`) or `auto` (nothing fit on the devices alone)"),
    "recommended": ("dict or null", "the first candidate if it fits (a candidate, below); `null` if none fits"),
    "command": ("list or null", "the recommended `train_args` made complete (`--data <your data>` for a model directory, `--lr`); `null` if none fits"),
    "candidates": ("list", "every setting evaluated (candidates, below), best first: the ones that fit, then the fastest (`--max`: the longest `seq_len`, then the fastest)"),
    "notes": ("list", "strings: how the recommendation was reached (host states, a capped `seq_len`, settings `train` refuses and why, the sequence-mixer layers)"),
    "layers": ("list", "hybrid models: one entry per decoder layer (below); empty for attention + MLP models"),
    "rehearsal": ("dict", "only with `--rehearse`: the rehearsal of the recommended command (below)"),
}  # fmt: skip

CANDIDATE: Schema = {
    "settings": ("dict", "the `ulysses-sp train` flags of this setting, underscored (below)"),
    "train_args": ("list", "the command line: `[\"ulysses-sp\", \"train\", \"--model\", ...]`"),
    "peak_bytes_per_rank": ("int", "predicted peak device memory of the busiest rank: the sum of `breakdown`"),
    "breakdown": ("dict", "bytes at the peak by part (below)"),
    "host_bytes_per_rank": ("int", "host memory the rank stages (offloaded checkpoints and model states)"),
    "fits": ("bool", "the peak fits the device memory and the host bytes fit `--host-memory`"),
    "max_seq_len": ("int", "the longest sequence (a multiple of `sp`) this setting fits in memory, not capped by the positions limit; 0 if none"),
    "tokens_per_s": ("float", "predicted training tokens/s of the whole job (a projection from the device table)"),
    "comm_share": ("float", "predicted (all-to-all + gradient reduction) / step time, no overlap assumed"),
}  # fmt: skip

SETTINGS: Schema = {
    "model": ("str", "`--model`"),
    "sp": ("int", "`--sp`"),
    "seq_len": ("int", "`--seq-len`"),
    "zero_stage": ("int", "`--zero-stage`"),
    "micro_batch_size": ("int", "`--micro-batch-size`"),
    "nproc": ("int", "`--nproc`, on one node only (several nodes: launch with torchrun)"),
    "zero_partition": ("str", "`--zero-partition all`; absent for `data_parallel`"),
    "ring_size": ("int", "`--ring-size`, only when a ring is needed (more sp ranks than the heads split over)"),
    "head_chunks": ("int", "`--head-chunks`, only where head groups reach a longer sequence (or fit `--seq-len`)"),
    "attn": ("str", "`--attn`, only when not `sdpa` (a model transformers cannot build with sdpa)"),
    "tiled_loss": ("bool", "`--tiled-loss`, only when on"),
    "tiled_mlp": ("bool", "`--tiled-mlp`, only when on"),
    "activation_checkpointing": ("bool", "`--activation-checkpointing`, only when on"),
    "offload_activations": ("bool", "`--offload-activations`, only when on"),
    "recompute_norms": ("bool", "`--recompute-norms`, only when on"),
    "dtype": ("str", "`--dtype`, only when not fp32"),
    "cpu_offload": ("bool", "`--cpu-offload` (model states on the host, ZeRO 3), only when on"),
}  # fmt: skip

BREAKDOWN: Schema = {
    "parameters": ("int", "parameters this rank holds (its shard at ZeRO 3; one layer in flight with host states)"),
    "gradients": ("int", "every gradient (sharded at ZeRO 2-3) when the peak is the optimizer step; else 0 (see `grads_in_flight`)"),
    "optimizer_state": ("int", "AdamW's two moments and, with a 16-bit dtype, the fp32 master weights (sharded at ZeRO 1-3)"),
    "comm_buffers": ("int", "DDP's gradient buckets (ZeRO 0-1), FSDP2's unsharded and prefetched layers (ZeRO 3), a layer's gradients on their way to the host (host states)"),
    "activations": ("int", "activations kept for backward at the peak"),
    "logits_loss": ("int", "the loss's fp32 workspace when the peak is at the loss; else 0"),
    "backward_workspace": ("int", "the worst layer's backward: its full activation set above what it keeps; 0 when the peak is elsewhere"),
    "grads_in_flight": ("int", "parameter gradients made so far when the peak is in the backward; else 0"),
    "vision_tower": ("int", "a vision-language model's tower activations kept through the step (its patches on this rank; `plan.vision`); 0 for a text model or when the peak is the step"),
    "optimizer_workspace": ("int", "the optimizer step's temporaries when the peak is the step; else 0"),
    "reserve": ("int", "the device table's reserve for what is not modelled (allocator fragmentation, kernel scratch; `--reserve`)"),
}  # fmt: skip

LAYER: Schema = {
    "attention": ("bool", "the layer has an attention block"),
    "mlp": ("bool", "the layer has an MLP block"),
    "mixer": ("str or null", "its sequence mixer: `mamba2`, `mamba1`, `gated_delta_net`, `short_conv`, `kimi_delta_attention`, `lightning_attention`; `null`: none"),
}  # fmt: skip

REHEARSAL: Schema = {
    "rehearsal": ("dict or null", "the rehearsed step (below); `null` when no length fits"),
    "probes": ("list", "`[seq_len, fits, device peak bytes]` per length tried"),
    "longest": ("int or null", "with `--max`: the longest length that fits by rehearsal; `null` with `--seq-len`"),
    "planned": ("int", "the planner's length, where the rehearsal started"),
}  # fmt: skip

REHEARSED: Schema = {
    "device": ("str", "`cuda` or `cpu`: the device the step was rehearsed for"),
    "gpus": ("int", "ranks of the rehearsed job"),
    "seq_len": ("int", "the rehearsed length"),
    "ranks": ("list", "per rehearsed rank: its measured step (`rehearse.step.StepResult`: peaks, timings)"),
    "predicted": ("dict", "the planner's prediction of the same run"),
    "gpu_memory": ("int", "device bytes per rank"),
    "reserve": ("int", "bytes reserved on the device"),
    "host_memory": ("int", "host bytes per node"),
    "gpus_per_node": ("int", "ranks per node"),
    "notes": ("list", "strings: what the rehearsal could not see"),
    "time": ("dict", "the slowest rank's step time projected on the device table (`rehearse.timing`)"),
    "device_peak": ("int", "the largest device peak over the ranks"),
    "host_per_node": ("int", "host bytes of one node"),
    "fits": ("bool", "device peak + reserve within the device memory, and the host bytes within the node's"),
}  # fmt: skip

SECTIONS: list[tuple[str, str, Schema]] = [
    ("The document", "The top level.", DOCUMENT),
    ("A candidate", "Each entry of `candidates` (and `recommended`).", CANDIDATE),
    ("`settings`", "A candidate's `train` flags; the keys marked *only when* are absent otherwise.", SETTINGS),
    ("`breakdown`", "A candidate's predicted bytes at the peak, per rank (`plan/model.py`): the peak is the forward's end, a layer's backward or the optimizer step, whichever is highest, and the terms of the other phases are 0.", BREAKDOWN),
    ("`layers`", "Each entry of `layers`.", LAYER),
    ("`rehearsal`", "With `--rehearse` (`cli/plan_rehearse.py`).", REHEARSAL),
    ("`rehearsal.rehearsal`", "The rehearsed step (`rehearse.run.Rehearsal.as_dict()`).", REHEARSED),
]
"""``(title, introduction, schema)`` in the order the reference page shows them."""
