"""``ulysses-sp eval`` on a vision-language model directory: what differs from a text model.

A Qwen2.5-VL / Qwen3-VL (``vlm.SUPPORTED_VLMS``) is scored through ``train``'s VLM forward: the
chat JSONL with images and videos read as ``train`` reads it (``run.vlm.vlm_dataset``: image tokens count toward
``--seq-len``, ``--loss-on``, ``--packing best-fit`` rows; every sample, since a VLM run holds none
out), every rank of an SP group given the group's batches whole (``VLMDataLoaderAdapter``), the
per-shard merge installed as ``train`` installs it (``initialize``'s ``shard_model`` at ``sp > 1``,
``run.vlm.vlm_shard`` for packed rows at ``sp 1``). Each rank's logits are its shard's ``[B, S_l, V]``;
``model_inputs`` gives the forward's inputs and the shard's text positions (position in its
document), by which ``eval`` bins the loss exactly as for text.

Shape legend: ``B`` batch, ``S`` global (padded) sequence, ``S_l`` this rank's tokens, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI imports this module before it needs torch (``--help``)
    import torch


def eval_run_config(cfg: Any, model_name: str, *, attn: str) -> Any:
    """The ``RunConfig`` whose forward ``eval`` runs for ``model_name`` (``cfg``: the ``EvalConfig``)."""
    from ulysses_sp.run.config import RunConfig

    return RunConfig(model=model_name, sp=cfg.sp, attn=attn, seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size,
                     data=cfg.data, loss_on=cfg.loss_on, packing=cfg.packing, data_format=cfg.data_format,
                     chat_template=cfg.chat_template, long_samples=cfg.long_samples, eval_split=cfg.eval_split)  # fmt: skip


def vlm_eval_dataset(cfg: Any, model_name: str, model_config: Any) -> list[dict[str, torch.Tensor]]:
    """Every sample (or packed row) of ``cfg.data`` for ``model_name``, as ``train`` reads them.

    Raises:
        ValueError: an option a VLM run refuses (named by flag), or a bad sample (named by line).
    """
    from ulysses_sp.run.vlm import check_vlm_options, vlm_dataset

    run = eval_run_config(cfg, model_name, attn=cfg.attn)
    check_vlm_options(run)
    return vlm_dataset(run, model_config)


def model_inputs(batch: dict[str, Any], mesh: Any, *, vlm: bool) -> tuple[dict[str, Any], torch.Tensor]:
    """``(forward kwargs, positions [B, S_l])`` of one adapter batch on this rank: for text the shard's
    ``input_ids``/``position_ids``; for a VLM the whole sample (ids, ``[4, B, S]`` positions, pixels,
    grids) and row 0 of its positions cut to this rank's tokens (``vlm.merge.shard_index``)."""
    if not vlm:
        return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}, batch["position_ids"]
    from ulysses_sp.vlm.layout import shard_index

    inputs = {k: v for k, v in batch.items() if k != "shift_labels"}
    pos = inputs["position_ids"]  # [4, B, S]: the text row, then mrope
    idx = shard_index(pos.shape[-1], mesh.sp_rank, mesh.sp_size, mesh.ring_size, pos.device)
    return inputs, pos[0].index_select(1, idx)  # [B, S] -> [B, S_l]
