"""memory.py: the CPU tracker against allocation patterns whose peak is known exactly.

Every expected number below is computed by hand from the allocation sequence; the tracker must
match it to the byte (it is deterministic). The CUDA path is checked only where CUDA exists.
"""

from __future__ import annotations

import gc

import pytest
import torch

from ulysses_sp.memory.meter import host_allocations, track_peak_memory

KB = 1024


def _bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def test_allocate_free_allocate_peak_is_exact():
    with track_peak_memory("cpu") as m:
        a = _bytes(100 * KB)  # live 100
        b = _bytes(50 * KB)  # live 150  <- peak so far
        del a  # live 50
        c = _bytes(80 * KB)  # live 130
        d = _bytes(30 * KB)  # live 160  <- peak
        del b, c  # live 30
        e = _bytes(120 * KB)  # live 150
        assert m.current_bytes == 150 * KB
    assert (m.baseline_bytes, m.peak_bytes, m.extra_bytes) == (0, 160 * KB, 160 * KB)
    assert m.current_bytes == 150 * KB  # d and e are still alive at exit
    del d, e


def test_views_inplace_and_dtype_sizes():
    with track_peak_memory("cpu") as m:
        x = torch.zeros(1000, dtype=torch.float32)  # 4000 bytes
        v = x.view(10, 100).t()  # a view: same storage, no new bytes
        x.add_(1)  # in place: no new bytes
        y = v.contiguous()  # a copy: 4000
        z = torch.ones(10, dtype=torch.float64)  # 80
        assert m.current_bytes == 8080
        del x, y
        assert m.current_bytes == 4080  # x's storage is still held by the view v
        del v
        assert m.current_bytes == 80
    assert m.peak_bytes == 8080
    del z


def test_autograd_forward_and_backward_are_counted():
    x = torch.randn(256, 64, requires_grad=True)  # 65536 bytes, outside the region
    elem = 256 * 64 * 4
    with track_peak_memory("cpu") as m:
        e = x.exp()  # saved for backward: 1 elem
        y = (e * 3).sum()  # e*3: 1 elem (freed after sum), y: 4 bytes
        assert m.current_bytes == elem + 4
        y.backward()
    # e + y + the seed gradient (4) + d(loss)/d(e) + d(loss)/d(x), before d/d(e) is dropped
    assert m.peak_bytes == 3 * elem + 8
    assert m.current_bytes == elem + 4 + elem  # e, y and x.grad (kept by x) remain
    del e, y


def test_include_counts_existing_tensors_and_their_freeing():
    w = torch.empty(1000, dtype=torch.uint8)
    u = torch.empty(500, dtype=torch.uint8)
    with track_peak_memory("cpu", include=[w, u]) as m:
        assert m.baseline_bytes == 1500
        del w  # the included storage is freed inside the region: subtracted
        a = _bytes(700)
    assert (m.baseline_bytes, m.peak_bytes, m.current_bytes) == (1500, 1500, 1200)
    del u, a


def test_host_allocations_are_counted_apart():
    with track_peak_memory("cpu") as m:
        d = _bytes(1000)
        with host_allocations():
            h = _bytes(4000)
            h2 = d.clone()  # 1000 on the "host" side
        d2 = h.clone()  # back on the device side: 4000
        del h
    assert (m.peak_bytes, m.current_bytes) == (5000, 5000)
    assert (m.host_peak_bytes, m.host_current_bytes) == (5000, 1000)
    del d, d2, h2


def test_finished_measurement_is_frozen_and_nested_trackers_agree():
    with track_peak_memory("cpu") as outer:
        a = _bytes(300)
        with track_peak_memory("cpu") as inner:
            b = _bytes(200)
        keep = b
    del a, b, keep
    gc.collect()
    assert (inner.peak_bytes, inner.current_bytes) == (200, 200)  # frees after exit not seen
    assert (outer.peak_bytes, outer.current_bytes) == (500, 500)


def test_as_dict_and_default_device():
    with track_peak_memory() as m:
        _bytes(10)
    d = m.as_dict()
    expect_mech = "allocator" if torch.cuda.is_available() else "dispatch"
    assert d["mechanism"] == expect_mech and set(d) >= {"peak_bytes", "extra_bytes", "baseline_bytes"}


def test_unknown_accelerator_type_is_a_clear_error():
    with pytest.raises(ValueError, match="no allocator statistics for device type 'meta'"):
        with track_peak_memory("meta"):
            pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_allocator_peak():
    dev = torch.device("cuda")
    with track_peak_memory(dev) as m:
        a = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
        del a
        b = torch.empty(1 << 19, dtype=torch.uint8, device=dev)
    assert m.extra_bytes == 1 << 20
    del b


def _fsdp2_step_peak() -> tuple[int, int, int, int]:
    """One rank: two 256x256 FSDP2 layers, a warm-up step (FSDP2's all-gather buffers exist, resized
    to 0), then the measured step. Returns (parameter bytes, baseline, peak, current at exit)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256, bias=False) for _ in range(2)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    x = torch.randn(4, 256)
    model(x).sum().backward()
    for p in model.parameters():
        p.grad = None
    with track_peak_memory("cpu", include=model.parameters()) as m:
        model(x).sum().backward()
    return sum(p.numel() * 4 for p in model.parameters()), m.baseline_bytes, m.peak_bytes, m.current_bytes


def test_fsdp2_unsharded_parameters_are_followed_through_resize(pool):
    """FSDP2 allocates and frees its unsharded parameters with ``UntypedStorage.resize_`` on buffers made
    in an earlier step: the meter counts them while they are allocated (the peak holds the parameters,
    their gradients and two unsharded layers of backward) and not after (exit: parameters + gradients)."""
    ((params, baseline, peak, current),) = pool.run(_fsdp2_step_peak, 1)
    assert baseline == params and current == 2 * params  # the unsharded copies freed again by resize_(0)
    assert peak >= 3 * params  # without following resize_ the peak was 2.5x the parameters
