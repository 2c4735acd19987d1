"""Vision-language models under sequence parallelism: each rank embeds and merges its own shard.

Where it sits in the step (DESIGN.md): a VLM's own forward encodes the images and video frames
with its vision tower, scatters the visual embeddings into the token sequence and only then calls
its language model. Under SP every rank of a group receives the **whole** sample's metadata and
pixels (token ids, grids), and the 3-D multimodal rotary positions (mrope: temporal, height, width)
are computed from them over the full sequence before any sharding (``positions``). The model's
forward is then replaced (``merge``): rank ``k`` embeds only its ``S_l`` tokens, gets only the
visual rows its placeholders take — the tower's frames split over the group by patch count and
one all-to-all sending each merged row to the rank that holds its token (``split``) — and runs the
language model on ``[B, S_l, Hd]`` with the Ulysses attention exactly as for text. No rank builds
the sample's ``[B, S, Hd]`` embeddings. Gradients reach the vision tower through the rows and the
inverse exchange; summed over the SP group (as every gradient is) they are the full-sequence ones.

One concern per module:

- ``families``: which VLM families this path is exact for (closed world) and the refusal of the rest;
- ``positions``: ``vlm_position_ids``, full-sequence ``[4, B, S]`` positions (text row + mrope rows),
  packed documents restarting at 0;
- ``shard``: ``shard_vlm``, installs the per-shard forward (and the vision tower's own attention);
- ``merge``: that forward: this rank's embeddings, visual rows, deepstack inputs and positions;
- ``scatter`` / ``phi4mm``: the LLaVA-style and Phi-4-multimodal forwards (every image, or clip, on each rank);
- ``split``: the tower's frames for a rank (split over the group, or those its shard touches) and
  the exchange of merged rows;
- ``batch``: ``prepare_vlm_batch``, one rank's model inputs from a full-sequence VLM batch;
- ``adapter``: ``VLMDataLoaderAdapter``, the SP group's round over whole VLM batches;
- ``data``: chat JSONL with local images and videos through the model directory's tokenizer and processors;
- ``media``: a chat's image and video parts, their files checked, images read (PIL);
- ``video``: video files decoded (transformers' ``load_video``, PyAV) and sampled as the model's video processor does.

Shape legend: ``B`` batch, ``S`` global (padded) sequence, ``S_l = S/P`` local sequence, ``P`` sp
size, ``Hd`` hidden size, ``N_v`` visual tokens of the batch.

May import: ``checks``, ``parallel``, ``data`` (the text batch logic), ``attention`` (the registered core).
"""

from __future__ import annotations

from ulysses_sp.vlm.adapter import VLMDataLoaderAdapter, vlm_round
from ulysses_sp.vlm.batch import prepare_vlm_batch
from ulysses_sp.vlm.families import SUPPORTED_VLMS, multimodal_refusal, vlm_parts
from ulysses_sp.vlm.positions import vlm_position_ids
from ulysses_sp.vlm.shard import VLMShardHandle, shard_vlm

__all__ = [
    "SUPPORTED_VLMS",
    "VLMDataLoaderAdapter",
    "VLMShardHandle",
    "multimodal_refusal",
    "prepare_vlm_batch",
    "shard_vlm",
    "vlm_parts",
    "vlm_position_ids",
    "vlm_round",
]
