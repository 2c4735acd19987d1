"""Vision-language models under sequence parallelism: encode, merge, position, then shard.

Where it sits in the step (DESIGN.md): a VLM's own forward encodes the images and video frames
with its vision tower, scatters the visual embeddings into the token sequence and only then calls
its language model. Under SP every rank of a group holds the **whole** sample (token ids, pixels,
grids): the vision tower encodes all of the sample's images on every rank, the merge happens over
the full sequence, and the 3-D multimodal rotary positions (mrope: temporal, height, width) are
computed over the full sequence before any sharding. A forward pre-hook on the language model then
cuts rank ``k``'s tokens out of ``inputs_embeds``, the ``[4, B, S]`` position ids and the per-token
visual inputs (Qwen3-VL's deepstack features): the language model runs on ``S_l`` tokens with the
Ulysses attention exactly as for text. Gradients reach the vision tower through the slice; summed
over the SP group (as every gradient is) they are the full-sequence gradients.

One concern per module:

- ``families``: which VLM families this path is exact for (closed world) and the refusal of the rest;
- ``positions``: ``vlm_position_ids``, full-sequence ``[4, B, S]`` positions (text row + mrope rows),
  packed documents restarting at 0;
- ``shard``: ``shard_vlm``, the language model's pre-hook (and the vision tower's own attention);
- ``split``: optionally, the sample's images split over the SP group and their embeddings summed;
- ``batch``: ``prepare_vlm_batch``, one rank's model inputs from a full-sequence VLM batch;
- ``adapter``: ``VLMDataLoaderAdapter``, the SP group's round over whole VLM batches;
- ``data``: chat JSONL with local images through the model directory's tokenizer and image processor.

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
