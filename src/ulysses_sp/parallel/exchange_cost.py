"""Which attention exchange is faster: packed (one collective) or head by head — a latency/bandwidth model.

The Ulysses exchange (``parallel/headwise.py``) can move q/k/v (and the output) in two ways that send
the same bytes:

* **head by head**: ``n = B (H_l + 2 Hkv_l)`` collectives in (``B H_l`` out), each of one ``[P, S_l, D]``
  piece, straight into the output: no whole-tensor buffers (the capacity path);
* **packed**: one collective of all ``n`` pieces, packed into a send buffer and unpacked from a receive
  buffer: one copy more per byte than head by head, and a transient buffer the size of what is exchanged.

With ``alpha`` the fixed cost of one collective, ``beta`` its cost per byte and ``gamma`` the cost of one
memory copy per byte, head by head costs ``n alpha + n b (beta + c gamma)`` for pieces of ``b`` bytes and
packed ``alpha + n b (beta + (c + 1) gamma)``: the bytes term is the same, so packed is faster exactly when
``(n - 1) alpha > n b gamma``, i.e. below the **per-piece threshold** ``b* = alpha / gamma`` (times
``(n-1)/n``). Short sequences (small pieces) go packed, long ones head by head — where capacity matters.

The constants: gloo's were measured on this project's CPU machines (2 ranks over shared memory):
``all_to_all_single`` of 1 KB-256 KB took 170-270 us (alpha), of 16 MB 9.9 ms (beta); gamma is set so that
``alpha / gamma`` is the crossover measured with the attention exchange itself (q/k/v in and the output out,
forward + backward, 4 heads of D 16, fp32, 2 ranks; head-by-head time over packed, four runs under load 10-15
from other jobs): 1.12-1.77x at 128-256 KiB pieces, 1.00-1.38x at 512 KiB, 1.00-1.12x at 640 KiB, 0.84-1.18x
at 896 KiB (3 of 4 below 1), 0.56-0.82x at 2 MiB: 640 KiB. That is more than one plain copy (3.2 ms per
16 MB): packing, unpacking and first-touching two fresh buffers.
NCCL's are published figures (nccl-tests all-to-all small-message latency on DGX H100 over NVLink and
across nodes over 400 Gb/s InfiniBand; H100 HBM3 copy bandwidth), not measured here. The planner
(``plan/``) uses the same model for the time term and for the packed path's transient buffer; pure
arithmetic, no tensors (``headwise.packed_exchange`` applies it to a layer's q/k/v and group).

Shape legend: ``B`` batch, ``S_l`` local sequence, ``H_l``/``Hkv_l`` local query/kv heads after the
exchange, ``D`` head dim, ``P`` the Ulysses group size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

EXCHANGES = ("auto", "packed", "headwise")
"""``auto``: packed below the link's per-piece threshold, head by head above; or one of them always."""


@dataclass(frozen=True, kw_only=True)
class LinkCost:
    """The alpha/beta(/gamma) cost of one all-to-all on a backend and link."""

    name: str
    alpha_s: float
    """Fixed seconds of one collective (launch, synchronisation, the smallest message)."""
    beta_s_per_byte: float
    """Seconds per byte of the collective's buffer (1 / achieved bandwidth)."""
    gamma_s_per_byte: float
    """Seconds per byte of one memory copy (packing and unpacking)."""

    @property
    def threshold_bytes(self) -> int:
        """The per-piece size below which the packed exchange is faster (``alpha / gamma``)."""
        return int(self.alpha_s / self.gamma_s_per_byte)

    def seconds(self, nbytes: float, collectives: int, *, packed: bool) -> float:
        """Time of an exchange of ``nbytes`` in ``collectives`` head-by-head pieces (one when ``packed``);
        the copy both paths make (a strided side staged) is left out: the same either way."""
        if packed:
            return self.alpha_s + nbytes * (self.beta_s_per_byte + self.gamma_s_per_byte)
        return collectives * self.alpha_s + nbytes * self.beta_s_per_byte


GLOO_SHM = LinkCost(name="gloo", alpha_s=200e-6, beta_s_per_byte=0.58e-9, gamma_s_per_byte=200e-6 / (640 << 10))
"""gloo between processes of one CPU host (measured here: module docstring); threshold 640 KiB."""
NCCL_NVLINK = LinkCost(name="nccl-nvlink", alpha_s=20e-6, beta_s_per_byte=1 / 360e9, gamma_s_per_byte=1 / 1.5e12)
"""NCCL inside an H100 node: ~20 us per all-to-all, 360 GB/s achieved NVLink-4, a copy at ~1.5 TB/s
(read + write of 3.35 TB/s HBM3); threshold 30 MB."""
NCCL_IB = LinkCost(name="nccl-ib", alpha_s=40e-6, beta_s_per_byte=1 / 40e9, gamma_s_per_byte=1 / 1.5e12)
"""NCCL across nodes (400 Gb/s InfiniBand per GPU): ~40 us per all-to-all, 40 GB/s achieved; threshold 60 MB."""


_FAKE_STANDS_FOR: list[str] = []
"""The backend a rehearsal's fake process group stands for (``fake_backend_as``; innermost last)."""


@contextlib.contextmanager
def fake_backend_as(backend: str) -> Iterator[None]:
    """Within the block, a ``"fake"`` process group (``rehearse``) chooses its exchange as ``backend``'s would:
    a rehearsal of a gloo CPU run exchanges as gloo does (its packed/head-by-head threshold is 640 KiB, NCCL's 30 MB)."""
    _FAKE_STANDS_FOR.append(backend)
    try:
        yield
    finally:
        _FAKE_STANDS_FOR.pop()


def link_for_backend(backend: str) -> LinkCost:
    """The cost of a process group's backend: gloo's measured one, else NCCL over NVLink (a Ulysses group
    is laid out inside a node: its ranks are the mesh's innermost axis); a rehearsal's ``"fake"`` group
    costs as the backend it stands for (``fake_backend_as``; NCCL when none is named)."""
    if backend == "fake" and _FAKE_STANDS_FOR:
        backend = _FAKE_STANDS_FOR[-1]
    return GLOO_SHM if backend == "gloo" else NCCL_NVLINK


def check_exchange(exchange: str) -> str:
    """``exchange`` if it is one of ``EXCHANGES``, else ``ValueError`` naming them."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)}, got {exchange!r}")
    return exchange


def use_packed(exchange: str, piece_bytes: int, link: LinkCost) -> bool:
    """Whether an exchange of ``[P, S_l, D]`` pieces of ``piece_bytes`` goes packed (``exchange``: one of
    ``EXCHANGES``; ``auto``: at or below ``link``'s threshold)."""
    return check_exchange(exchange) == "packed" or (exchange == "auto" and piece_bytes <= link.threshold_bytes)

