"""The model states one rank holds (``plan.model`` adds the step's activations to them).

Per rank: parameters (sharded over ``shard`` ranks in stage 3, one layer unsharded at
a time), gradients (sharded from stage 2), AdamW state ``2 x fp32`` (+ fp32 master weights with a
16-bit dtype; sharded from stage 1), or on the host with ``offload_states`` (FSDP2's CPU offload: 12
bytes a parameter through the step, + 8 at the optimizer step: the fp32 gradients and foreach AdamW's
temporary; the host's peak is the larger of that and the offloaded activations). Communication buffers:
DDP's gradient buckets (``1 x`` gradients, stages 0-1), FSDP2's unsharded layer (stages 2-3).
"""

from __future__ import annotations

from ulysses_sp.plan.inputs import DTYPE_BYTES, ModelShape, Settings


def model_states(m: ModelShape, s: Settings) -> tuple[dict[str, int], int, int, int]:
    """One rank's model states under ``s``: ``(device bytes by component, host bytes held through the step,
    the optimizer step's workspace bytes, host bytes added at the optimizer step)``."""
    e = DTYPE_BYTES[s.dtype]
    n, shard = m.params, s.shard
    mixed = e < 4
    params = n * e // shard if s.zero_stage == 3 else n * e
    grads = n * e // shard if s.zero_stage >= 2 else n * e
    opt = n * (8 + (4 if mixed else 0))  # AdamW exp_avg + exp_avg_sq, + fp32 master weights when mixed
    opt = opt // shard if s.zero_stage >= 1 else opt
    host = host_step = 0
    if s.offload_states:  # ZeRO-Offload/Infinity style: all states on the host, one layer in flight
        # fp32 parameter shards + AdamW's moments; at the step fp32 gradients + foreach's temporary (docstring)
        host, host_step = opt + (0 if mixed else params), 2 * 4 * n // shard
        opt, grads = 0, m.layer_params * e
        params = 2 * m.layer_params * e + (1 if m.tied else 2) * m.vocab * m.hidden * e  # + the root's, unsharded
    if s.device_type == "cpu":  # single-tensor AdamW: a few temporaries of the largest tensor
        workspace = 2 * 4 * max(m.vocab * m.hidden, m.hidden * m.intermediate)
    else:  # foreach AdamW: one fp32 temporary list the size of the local shard
        workspace = 0 if s.offload_states else 4 * n // (shard if s.zero_stage >= 1 else 1)
    if s.offload_states:
        buffers = 2 * m.layer_params * e  # one layer's gradients on their way to the host
    elif s.zero_stage <= 1:
        buffers = n * e  # DDP's gradient buckets
    elif s.zero_stage == 2:
        buffers = 0  # parameters stay unsharded through the step: counted in params
        params = n * e
    else:  # one layer unsharded + the next prefetched; FSDP2 keeps the root module (embedding, output matrix)
        # unsharded from its forward to the end of the backward (read off rehearsals: Llama-3-8B at sp 8)
        buffers = 2 * m.layer_params * e + (1 if m.tied else 2) * m.vocab * m.hidden * e
    states = {"parameters": params, "gradients": grads, "optimizer_state": opt, "comm_buffers": buffers}
    return states, host, workspace, host_step
