"""TRL's ``GRPOTrainer`` and ``RLOOTrainer`` under sequence parallelism: each rank is what it is without SP,
except that its SP group computes the ranks' per-token log-probabilities together.

Both trainers build every loss (each ``loss_type``), advantage, importance ratio and metric from one
method's output, ``_get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep)``:
the log-probability (and entropy) of each completion token under the policy (the training pass, the
old log-probs of ``num_iterations > 1`` / ``steps_per_generation``) or the reference model. The SP path
replaces that method and wraps generation; nothing else (no SP data loader, no SP loss):

1. **Generation and rewards, without SP.** TRL's ``RepeatSampler`` draws one index order on every
   process (same seed) and accelerate's loader gives rank ``r`` of a ``W``-process run its contiguous
   slice of each generation batch; sampling is seeded per process (``set_seed(seed,
   device_specific=True)``); rewards are gathered over all ``W`` processes to normalise advantages. None
   of that depends on SP, so every rank generates and scores exactly the completions it does in the
   same run without SP — each prompt once, the generation spread over all ``W`` ranks, not ``P`` copies
   of a group's work. ``_generate`` runs the policy on its core attention (the attention mask and KV
   cache as transformers runs them), with the SP guard off.
2. **Per-token log-probs, with SP** (DESIGN.md steps 3-5). The ``P`` ranks of a group exchange their
   batches (token ids and each row's padding spans, host values, one ``all_gather_object``) and lay the
   group's ``N`` rows side by side: each row's real tokens first (TRL left-pads prompts and right-pads
   completions), its position ids those of the run without SP (``arange(T)``: the left padding's offset
   kept), padded to a multiple of ``P``. Rank ``k`` runs TRL's fused LM head (``add_fused_lm_head``: no
   ``[B, S, V]`` logits) on tokens ``[k*S_l, (k+1)*S_l)`` of every row with pre-shifted ``shift_labels``;
   the per-token fields are gathered (``gather_sequence``) and each rank keeps its own rows in TRL's
   ``[B, logits_to_keep]`` layout (zeros off the completion, as TRL's labels ``-100`` give).
3. **Loss and gradients.** TRL's ``_compute_loss`` runs unchanged on each rank for its own batch: its
   value and every logged metric (reward, KL, entropy, clip ratios, completion lengths and their
   collectives over ``W`` processes) are those of the run without SP. A rank's loss reads only its own
   rows, so the gather's backward sums the group's gradients before each rank takes its token slice
   (``sum_grads``): the gradients summed over the group are those of the sum of its ranks' losses, and
   the Trainer's DDP/FSDP average over ``W`` is the run without SP's — no scaling.

The oracle is the same trainer on the same ``W`` processes without SP (one process without SP samples
other completions: its seed and its slice of the generation batch differ).

Memory: the group's ``N = P * B`` rows go through one forward, ``[P * B, S/P]`` per rank — the ``B * T``
tokens a rank holds without SP. Exact, but not yet the ``1/P`` per-rank activations SP is for; that needs
the rows taken one source rank at a time with a backward in between (TRL's loss on no-grad values first,
then a recomputed forward/backward per source rank under ``no_sync``).

Shape legend: ``B`` rows of one rank's chunk, ``T`` its prompt + completion length, ``C`` its
``logits_to_keep``, ``N`` the group's rows, ``S`` the longest real run padded to a multiple of ``P``,
``S_l = S/P``, ``F`` per-token fields, ``P`` sp size.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from ulysses_sp.objectives.logps import gather_sequence
from ulysses_sp.parallel.comm import all_gather_object
from ulysses_sp.parallel.doc_layout import HostLayout, attach_layout
from ulysses_sp.parallel.loss import IGNORE_INDEX
from ulysses_sp.parallel.mesh import SPMesh

RL_TRAINERS = ("GRPOTrainer", "RLOOTrainer")
"""TRL trainers whose SP path is this module's."""

OWN_METHODS = ("_get_per_token_logps_and_entropies", "_generate", "compute_loss", "_compute_loss")
"""What a subclass may not override: the SP path replaces the first two and reproduces TRL's loss only."""


def is_rl_trainer(trainer: Any) -> bool:
    """Whether ``trainer`` is (a subclass of) TRL's ``GRPOTrainer`` or ``RLOOTrainer``."""
    return any(c.__name__ in RL_TRAINERS and c.__module__.startswith("trl.") for c in type(trainer).__mro__)


def check_rl(trainer: Any, *, ring_size: int, tiled_loss: bool | int) -> None:
    """Refuse what the RL SP path does not reproduce exactly, naming it and the fix (``ValueError``)."""
    name, args = type(trainer).__name__, trainer.args
    if getattr(trainer, "aux_loss_enabled", False):
        raise ValueError(
            f"{name}: the MoE auxiliary (load-balancing) loss is not reproduced under sequence parallelism "
            "(each rank routes only its shard's tokens); set router_aux_loss_coef=0.0 in the config"
        )
    if getattr(trainer, "_is_vlm", False):
        raise ValueError(f"{name} with a vision-language model is not supported under sequence parallelism")
    if ring_size > 1:
        raise ValueError(
            f"{name} under a ring (ring_size={ring_size}) is not supported: the shards are in zigzag order; "
            "choose an sp_size the attention heads split over (ring_size=1)"
        )
    if tiled_loss is not False:
        raise ValueError(
            f"tiled_loss does not apply to {name}: TRL's fused LM head already computes the log-probabilities "
            "in tiles (no [B, S_l, V] logits); pass tiled_loss=False"
        )
    if getattr(args, "use_vllm", False) and getattr(args, "vllm_mode", None) == "colocate":
        raise ValueError(
            f"{name} with use_vllm=True, vllm_mode='colocate' is not supported under sequence parallelism (a vLLM "
            "engine inside every training process, untested with the SP groups); run a vLLM server "
            "(vllm_mode='server': generation outside the training processes) or generate with transformers"
        )
    if getattr(args, "use_transformers_continuous_batching", False):
        raise ValueError(
            f"{name} with use_transformers_continuous_batching=True is not supported under sequence parallelism "
            "(its paged attention is not the core attention the SP path restores for generation); set it to False"
        )
    peft_config = getattr(trainer.model, "peft_config", None) or {}
    if any(getattr(c, "is_prompt_learning", False) for c in peft_config.values()):
        raise ValueError(
            f"{name} with a prompt-learning PEFT adapter (virtual tokens before the sequence) is not "
            "supported under sequence parallelism; use LoRA or another adapter on the weights"
        )
    for cls in type(trainer).__mro__:
        if cls.__name__ in RL_TRAINERS:
            break
        own = [m for m in OWN_METHODS if m in vars(cls)]
        if own:
            raise ValueError(
                f"{name} (through {cls.__module__}.{cls.__name__}) overrides {own}: the SP path replaces TRL's "
                "per-token log-probabilities and wraps its generation, and reproduces TRL's own loss only"
            )


def reference_model(trainer: Any) -> torch.nn.Module | None:
    """A separate reference model (``beta > 0`` without PEFT), unwrapped; ``None`` otherwise."""
    ref = getattr(trainer, "ref_model", None)
    return None if ref is None else trainer.accelerator.unwrap_model(ref)


# ---------------------------------------------------------------------------------------------- layout
def _spans(mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """Per row: ``a`` padding tokens, then ``b`` real ones, then padding only (raises otherwise)."""
    real = mask.detach().cpu() != 0  # [B, T]
    b = real.sum(dim=1)  # [B]
    a = torch.where(b > 0, real.int().argmax(dim=1), 0)  # [B]: the first real token
    idx = torch.arange(real.shape[1])
    inside = (idx >= a[:, None]) & (idx < (a + b)[:, None])  # [B, T]
    bad = (inside != real).any(dim=1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"attention_mask rows {bad} have padding between real tokens; under sequence parallelism each row "
            "must be left padding, real tokens, right padding (TRL's prompt + completion layout)"
        )
    return a.tolist(), b.tolist()


def _lay_out(group: list[tuple[torch.Tensor, list[int], list[int], int]], p: int,
             pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:  # fmt: skip
    """The group's rows as the SP forward takes them: ``tokens``, ``shift_labels`` ``[N, S]`` (each row's
    real tokens first; the label at ``i`` is token ``i+1`` where TRL scores it, else ``-100``) and each
    row's first position id (its left padding: the real token ``j`` has position ``a + j`` without SP)."""
    n = sum(ids.shape[0] for ids, *_ in group)
    s = max(1, max(max(b, default=0) for _, _, b, _ in group))
    s = math.ceil(s / p) * p
    tokens = torch.full((n, s), pad_token_id, dtype=torch.long)  # [N, S]
    shift = torch.full((n, s), IGNORE_INDEX, dtype=torch.long)  # [N, S]
    starts, row = [], 0
    for ids, a_k, b_k, keep in group:
        for i, (a, b) in enumerate(zip(a_k, b_k)):
            tokens[row, :b] = ids[i, a : a + b]
            first = max(ids.shape[1] - keep - a, 1)  # the first scored token's index in the real run
            shift[row, first - 1 : b - 1] = ids[i, a + first : a + b]
            starts.append(a)
            row += 1
    return tokens, shift, starts


def group_logps(model: Any, ids: torch.Tensor, mask: torch.Tensor, keep: int, mesh: SPMesh, *, pad_token_id: int,
                entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """This rank's ``[B, keep]`` per-token log-probs (and entropies) of ``ids [B, T]``, computed with the
    rest of its SP group (module docstring, step 2): what TRL's ``_get_per_token_logps_and_entropies``
    returns for the chunk. A collective: every rank of the group calls it, with its own rows."""
    a_k, b_k = _spans(mask)
    group = all_gather_object((ids.detach().cpu(), a_k, b_k, keep), mesh.sp_group)  # [P] batches, SP-rank order
    tokens, shift, starts = _lay_out(group, mesh.sp_size, pad_token_id)
    s = tokens.shape[1]
    s_l, k, device = s // mesh.sp_size, mesh.sp_rank, ids.device
    cut = slice(k * s_l, (k + 1) * s_l)
    pos = torch.tensor(starts)[:, None] + torch.arange(k * s_l, (k + 1) * s_l)  # [N, S_l]: positions without SP
    layout = HostLayout(s, tuple(((0, a),) for a in starts))  # one document per row
    out = model(input_ids=tokens[:, cut].to(device), position_ids=attach_layout(pos.to(device), layout),
                shift_labels=shift[:, cut].to(device), fused_lm_head=True)  # fmt: skip
    names = ("log_probs", "entropy") if entropy else ("log_probs",)
    # one all-gather for every field: [N, S_l, F] -> [N, S, F]; backward: summed over the group, then sliced
    full = gather_sequence(torch.stack([getattr(out, n).float() for n in names], dim=-1), mesh.sp_group,
                           sum_grads=True)  # fmt: skip
    first = sum(len(g[1]) for g in group[:k])
    mine = full[first : first + ids.shape[0]]  # [B, S, F]
    # TRL's column j scores token T-C+j, predicted at the real-run index T-C+j-1-a
    idx = torch.arange(ids.shape[1] - keep - 1, ids.shape[1] - 1)[None] - torch.tensor(a_k)[:, None]  # [B, C]
    valid = ((idx >= 0) & (idx < s)).to(device)
    picked = mine.gather(1, idx.clamp(0, s - 1).to(device)[..., None].expand(-1, -1, len(names)))  # [B, C, F]
    picked = picked.masked_fill(~valid[..., None], 0.0)
    dtype = out.log_probs.dtype
    return picked[..., 0].to(dtype), picked[..., 1].to(dtype) if entropy else None


@contextlib.contextmanager
def unsharded(model: Any, attention: Any) -> Iterator[None]:
    """``model`` on its core attention and the SP guard off: generation without SP (each rank its own)."""
    prev_impl, prev_size = model.config._attn_implementation, attention.sp_size
    model.set_attn_implementation(attention.core)
    attention.sp_size = 1  # the registration's guard checks SP forwards only
    try:
        yield
    finally:
        attention.sp_size = prev_size
        model.set_attn_implementation(prev_impl)


# ---------------------------------------------------------------------------------------------- trainer
class SPRLMixin:
    """The SP overrides of TRL's ``GRPOTrainer`` / ``RLOOTrainer`` (module docstring); put in front of the
    trainer's class by ``integrations.transformers.prepare``, which sets ``_ulysses_sp``."""

    _ulysses_sp: Any  # integrations.transformers.SPTrainerHandle

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                           logits_to_keep: int, batch_size: int | None = None,
                                           compute_entropy: bool = False, compute_aux_loss: bool = False,
                                           **multimodal: Any) -> tuple[torch.Tensor, torch.Tensor | None, None]:  # fmt: skip
        """TRL's per-token log-probs and entropies of this rank's rows, computed by the SP group together,
        in chunks of ``batch_size`` rows per rank as TRL does."""
        given = sorted(k for k, v in multimodal.items() if v is not None)
        if given or compute_aux_loss:
            raise ValueError(f"under sequence parallelism the RL log-probs take token ids only (given: "
                             f"{given or ['compute_aux_loss']})")  # fmt: skip
        handle = self._ulysses_sp
        rows = batch_size or input_ids.size(0)
        starts = range(0, input_ids.size(0), rows)
        chunks = max(all_gather_object(len(starts), handle.mesh.sp_group))  # the group agrees on the calls
        logps, entropies = [], []
        for c in range(chunks):
            part = slice(c * rows, (c + 1) * rows)  # empty past this rank's rows
            with self.accelerator.autocast():  # type: ignore[attr-defined]
                lp, ent = group_logps(model, input_ids[part], attention_mask[part], logits_to_keep, handle.mesh,
                                      pad_token_id=handle.pad_token_id, entropy=compute_entropy)  # fmt: skip
            logps.append(lp)
            entropies.append(ent)
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    def _generate(self, prompts: list[Any]) -> Any:
        with unsharded(self.model, self._ulysses_sp.registration.attention):  # type: ignore[attr-defined]
            return super()._generate(prompts)  # type: ignore[misc]
