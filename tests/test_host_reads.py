"""No host read of a tensor value inside the model during a step fed by the data adapter (issue 31).

The step must run under ``FakeTensorMode`` (the rehearsal) and keep the CUDA stream free of syncs
(DESIGN.md, "Scale without a GPU"): the document layout travels from ``UlyssesSPDataLoaderAdapter``
as host values (``parallel/doc_layout.py``), so between the first layer and the loss's backward
nothing reads a tensor's value on the host. ``HostReads`` counts every such read — ``.item()``,
``bool()``/``int()`` (``aten._local_scalar_dense``), ``.tolist()``/``.numpy()`` (a torch-function
read) and ops whose output shape depends on values (``nonzero``, ``unique``, ``repeat_interleave``
without ``output_size``) — around the engine's forward (tiled loss) and backward at sp 2, for packed
documents and plain causal, on the per-document, blockwise and dense (eager) paths. The pure
tests check that the host layout equals what the device fallback derives, value for value.
"""

from __future__ import annotations

import pytest
import torch
from models import tiny_model
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ulysses_sp.attention.blockwise import AttnStructure
from ulysses_sp.attention.masks import SeqLayout
from ulysses_sp.attention.positions import split_at_chunks
from ulysses_sp.attention.segments import segment_lengths
from ulysses_sp.parallel.doc_layout import HostLayout, attach_layout, host_layout, layout_of

aten = torch.ops.aten
READ_OPS = {aten._local_scalar_dense.default, aten.item.default, aten.equal.default, aten.is_nonzero.default,
            aten.nonzero.default, aten.unique_consecutive.default, aten._unique2.default,
            aten.masked_select.default}  # fmt: skip
READ_METHODS = {"tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__"}


class _Ops(TorchDispatchMode):
    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READ_OPS or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None):
            self.found.append(str(func))
        return func(*args, **kwargs)


class _Methods(TorchFunctionMode):
    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in READ_METHODS:
            self.found.append(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


class HostReads:
    """Collect the host reads of tensor values in a ``with`` block (``.found``: what read, in order)."""

    def __enter__(self) -> HostReads:
        self.found: list[str] = []
        self._modes = [_Methods(self.found), _Ops(self.found)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)


# ------------------------------------------------------------------------------------ pure layout

CASES = [
    [[0, 1, 2, 3, 4, 5, 6, 7]],  # plain causal
    [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]],  # packed, rows differ
    [[5, 6, 7, 0, 1, 2, 3, 9], [0, 0, 0, 1, 2, 3, 4, 5]],  # offsets, jumps, one-token documents
    [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 0, 1, 2, 3, 4, 5]],  # one row packed
]


@pytest.mark.parametrize("rows", CASES)
def test_host_layout_equals_what_the_device_fallback_derives(rows):
    pos = torch.tensor(rows)
    host = host_layout(pos)
    dev, hl = SeqLayout.from_positions(pos), SeqLayout.from_host(host, torch.device("cpu"))
    assert torch.equal(hl.positions, pos)
    assert (dev.doc_ids is None) == (hl.doc_ids is None) == (not host.packed)
    if dev.doc_ids is not None:
        assert torch.equal(hl.doc_ids, dev.doc_ids) and hl.doc_ids.dtype == dev.doc_ids.dtype
        assert host.doc_lengths() == segment_lengths(dev.doc_ids) == hl.doc_lengths()
    for chunk in (1, 3, 4):
        want, got = SeqLayout.from_positions(split_at_chunks(pos, chunk)), hl.split_at_chunks(chunk)
        assert torch.equal(got.positions, want.positions)
        assert got.doc_ids is None if want.doc_ids is None else torch.equal(got.doc_ids, want.doc_ids)


def _kind_from_ids(doc: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> str:
    """The block decision from device doc ids, as the blockwise core made it before host layouts."""
    if k0 > q1 - 1 or bool((doc[:, k1 - 1] < doc[:, q0]).all()):
        return "empty"
    full = k1 - 1 <= q0 and bool((doc[:, k0] == doc[:, q1 - 1]).all())
    return "full" if full else "partial"


@pytest.mark.parametrize("rows", CASES[1:])
def test_block_skipping_from_host_starts_equals_the_doc_id_decision(rows):
    pos = torch.tensor(rows)
    host = host_layout(pos)
    doc = SeqLayout.from_positions(pos).doc_ids
    for s in (AttnStructure.build(doc, None), AttnStructure.build(doc, None, host.doc_starts())):
        for q0, q1, k0, k1 in [(a, a + n, b, b + m) for n in (1, 2, 3) for m in (1, 2, 3)
                               for a in range(0, 9 - n) for b in range(0, 9 - m)]:  # fmt: skip
            assert s.block_kind(q0, q1, k0, k1) == _kind_from_ids(doc, q0, q1, k0, k1), (q0, q1, k0, k1)


@pytest.mark.parametrize("rows", CASES)
def test_mixer_document_spans_and_conv_windows_from_host_equal_the_fallback(rows):
    from ulysses_sp.mixers.documents import segments
    from ulysses_sp.mixers.linear_attn import _Sharded

    pos = torch.tensor(rows)
    dev, hl = SeqLayout.from_positions(pos), SeqLayout.from_host(host_layout(pos), torch.device("cpu"))
    b, s = pos.shape
    assert segments(hl, b, s) == segments(dev, b, s)
    for sp_size, width in [(2, 1), (2, 3), (4, 2), (4, 5)]:
        for rank in range(sp_size):
            want = _Sharded(None, sp_size, rank, dev)._window_docs(s // sp_size, width)
            assert _Sharded(None, sp_size, rank, hl)._window_docs(s // sp_size, width) == want


def test_an_attached_layout_is_dropped_when_the_ids_are_edited_in_place():
    pos = torch.arange(8)[None]
    attach_layout(pos, host_layout(pos))
    assert isinstance(layout_of(pos), HostLayout) and layout_of(pos.clone()) is None
    pos[0, 4] = 0
    assert layout_of(pos) is None  # stale: the attention gathers the ids instead


def test_a_layout_is_found_through_an_identical_view_of_the_ids():
    """Qwen3.5 hands its attention ``position_ids[None].expand(4, ...)[0]`` (its mrope layout): the same
    elements, so the same layout; a view of other elements, or the ids edited since, finds none."""
    pos = torch.arange(16)[None]
    layout = host_layout(pos)
    attach_layout(pos, layout)
    assert layout_of(pos[None].expand(4, *pos.shape)[0]) is layout
    assert layout_of(pos[:, 1:]) is None and layout_of(pos[:, ::2]) is None
    pos[0, 3] = 0
    assert layout_of(pos[None].expand(4, *pos.shape)[0]) is None


def test_the_counter_sees_every_kind_of_host_read():
    t = torch.tensor([0, 3, 0, 1])
    for read in (lambda: t.tolist(), lambda: bool(t[1]), lambda: t.sum().item(), lambda: int(t[1]),
                 lambda: t.nonzero(), lambda: torch.unique_consecutive(t), lambda: t.repeat_interleave(t)):  # fmt: skip
        with HostReads() as reads:
            read()
        assert reads.found, read
    host = host_layout(torch.tensor(CASES[1]))  # the data path reads the ids on the host ...
    with HostReads() as reads:  # ... what the model builds from its layout reads nothing
        SeqLayout.from_host(host, torch.device("cpu")).split_at_chunks(3).doc_lengths()
    assert reads.found == []


# ------------------------------------------------------------------------------------ the step

VOCAB = 64


def _packed_batch(rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s batch of 2 rows x 24 tokens: packed documents (boundaries inside and on the
    sp=2 shard edge at 12) or, for rank 1's second round, plain causal."""
    g = torch.Generator().manual_seed(7 + rank)
    docs = [(5, 7, 12), (12, 9, 3)] if rank == 0 else [(24,), (10, 14)]
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in docs])
    return {"input_ids": torch.randint(1, VOCAB, (2, 24), generator=g), "position_ids": pos}


def _plain_batch(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(70 + rank)
    return {"input_ids": torch.randint(1, VOCAB, (2, 24), generator=g)}


def _step_reads(core: str, attn_chunk: int | None) -> list[list[str]]:
    from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
    from ulysses_sp.data import UlyssesSPDataLoaderAdapter
    from ulysses_sp.engine import initialize
    from ulysses_sp.memory.tiling import TiledCausalLMLoss
    from ulysses_sp.parallel.mesh import init_mesh

    mesh = init_mesh((1, 2))
    model = tiny_model("llama", attn=core, vocab=VOCAB, kv_heads=2)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, core, 2, 2, mesh=mesh, attn_chunk=attn_chunk)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}  # fmt: skip
    engine, *_ = initialize(model, cfg, mpu=reg, loss_fn=TiledCausalLMLoss(num_shards=3))
    batches = [_packed_batch(mesh.sp_rank), _plain_batch(mesh.sp_rank)]
    loader = UlyssesSPDataLoaderAdapter(batches, mesh.sp_rank, mesh.sp_group, 2, engine.device)
    engine(**next(iter(loader)))  # once: the engine's one-time attention check may read what it likes
    found = []
    for batch in loader:
        with HostReads() as reads:
            loss = engine(**batch).loss
            engine.backward(loss)
        engine.step()
        found.append(reads.found)
    batch["position_ids"] = batch["position_ids"].clone()  # no layout attached: the gather fallback
    with HostReads() as reads:
        engine.backward(engine(**batch).loss)
    reg.remove()
    return found, bool(reads.found)


@pytest.mark.parametrize("core, attn_chunk", [("sdpa", None), ("sdpa", 4), ("eager", None)])
def test_a_step_from_the_adapter_reads_no_tensor_value_on_the_host(pool, core, attn_chunk):
    """Per document (sdpa), blockwise (``attn_chunk``) and dense (eager): 4 micro-steps, none reads;
    the same step without the adapter's layout (the gather fallback) does read."""
    for found, fallback_reads in pool.run(_step_reads, 2, core, attn_chunk):
        assert found == [[], [], [], []]
        assert fallback_reads
