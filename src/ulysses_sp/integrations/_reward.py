"""TRL's ``RewardTrainer`` under sequence parallelism: the score of each sequence's last real token, routed.

``RewardTrainer.compute_loss`` calls ``model(input_ids, attention_mask)`` on the concatenated ``[2B, S]``
chosen + rejected batch of a sequence-classification model (``GenericForSequenceClassification``: the
backbone, ``score`` on every token's hidden state, then the score of each row's rightmost non-pad token) and
builds its Bradley-Terry loss, margin and centring terms and every metric from those ``[2B, C]`` scores.
Under SP the last real token of a row lives on one rank only — the last shard for the longest rows, any
shard for a shorter one. The SP forward (``RewardHeadPatch``, in place of the model's ``forward``):

1. every rank of the group holds the whole batch (``_preference.PreferenceDataLoader``); rank ``k`` runs
   the backbone on tokens ``[k*S_l, (k+1)*S_l)`` (padded to a multiple of ``P``) with the full-sequence
   ``position_ids``, and ``score`` on its hidden states: ``[2B, S_l, C]``, a few bytes per token;
2. those are gathered along the sequence (``objectives.gather_sequence``: ``[2B, S, C]`` on every rank;
   its backward hands each rank its own slice of the gradient), and the row's score is taken at the
   index transformers takes (the rightmost token that is not ``pad_token_id``) from the full ``input_ids``;
3. TRL's loss runs unchanged on every rank of the group; ``SPPreferenceMixin.compute_loss`` scales its
   gradient by ``P``, so the Trainer's average over ``dp * sp`` ranks is the sum over SP: the gradient
   reaches the backbone only on the rank that holds each row's last token (and, through attention, the
   ranks before it), exactly as without SP.

Shape legend: ``B`` pairs per batch, ``S`` sequence, ``S_l = S/P``, ``C`` score labels (1), ``P`` sp size.
"""

from __future__ import annotations

import math
import types
from typing import Any

import torch
import torch.nn.functional as F

from ulysses_sp.objectives.logps import gather_sequence
from ulysses_sp.parallel.doc_layout import HostLayout, attach_layout
from ulysses_sp.parallel.mesh import SPMesh


def is_reward_trainer(trainer: Any) -> bool:
    """Whether ``trainer`` is (a subclass of) TRL's ``RewardTrainer``."""
    return any(c.__name__ == "RewardTrainer" and c.__module__.startswith("trl.") for c in type(trainer).__mro__)


def reward_model(trainer: Any) -> torch.nn.Module:
    """The transformers sequence-classification model under the trainer's (PEFT) wrapper; refused
    (``ValueError``) unless it is transformers' generic one (backbone, ``score``, last-non-pad pooling)."""
    from transformers.modeling_layers import GenericForSequenceClassification

    model = trainer.model
    model = model.get_base_model() if hasattr(model, "peft_config") else model
    if not isinstance(model, GenericForSequenceClassification):
        raise ValueError(
            f"{type(trainer).__name__} with a {type(model).__name__} is not supported under sequence parallelism: "
            "the SP path reproduces transformers' generic sequence classification (AutoModelForSequenceClassification "
            "of a decoder: backbone, score head, the last non-pad token's score)"
        )
    if model.config.get_text_config().pad_token_id is None:
        raise ValueError("the reward model's config has no pad_token_id (transformers needs it to find each row's "
                         "last token); set model.config.pad_token_id")  # fmt: skip
    return model


def _sp_reward_forward(mesh: SPMesh, pad_token_id: int) -> Any:
    """The sequence-classification ``forward`` under SP (module docstring) for this rank of ``mesh``."""
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast

    def forward(self: Any, input_ids: torch.Tensor | None = None, attention_mask: Any = None, **kwargs: Any) -> Any:
        extra = sorted(k for k, v in kwargs.items() if v is not None and k not in ("use_cache", "return_dict"))
        if input_ids is None or extra:
            raise ValueError(f"under sequence parallelism the reward model takes input_ids and attention_mask only "
                             f"(given: {extra or ['no input_ids']})")  # fmt: skip
        b, s = input_ids.shape
        p, k = mesh.sp_size, mesh.sp_rank
        padded = math.ceil(s / p) * p
        s_l = padded // p
        ids = F.pad(input_ids, (0, padded - s), value=pad_token_id)  # [2B, S] -> [2B, S_pad]
        pos = torch.arange(k * s_l, (k + 1) * s_l, device=ids.device).repeat(b, 1)  # [2B, S_l] full-sequence ids
        layout = HostLayout(padded, tuple(((0, 0),) for _ in range(b)), pos.dtype)  # one document per row
        # right padding (checked by the loader): causal attention without the mask is exact on real tokens
        hidden = getattr(self, self.base_model_prefix)(input_ids=ids[:, k * s_l : (k + 1) * s_l], use_cache=False,
                                                       position_ids=attach_layout(pos, layout)).last_hidden_state
        scores = gather_sequence(self.score(hidden), mesh.sp_group)[:, :s]  # [2B, S_l, C] -> [2B, S, C]
        # transformers' rule, on the full sequence: the rightmost token that is not the pad token
        real = (input_ids != self.config.get_text_config().pad_token_id).to(scores.device, torch.int32)  # [2B, S]
        last = (torch.arange(s, device=scores.device, dtype=torch.int32) * real).argmax(-1)  # [2B]
        return SequenceClassifierOutputWithPast(logits=scores[torch.arange(b, device=scores.device), last])

    return forward


class RewardHeadPatch:
    """The SP ``forward`` on the reward model (``reward_model``); ``remove()`` restores its class's own."""

    def __init__(self, model: torch.nn.Module, mesh: SPMesh, *, pad_token_id: int) -> None:
        self._model, self._saved = model, vars(model).get("forward")
        model.forward = types.MethodType(_sp_reward_forward(mesh, pad_token_id), model)

    def remove(self) -> None:
        if self._saved is None:
            del self._model.forward
        else:
            self._model.forward = self._saved
