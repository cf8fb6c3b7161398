"""The weight prefetch's address math (tiles.prefetch_bounds, conv2d_fprop.krsc_range) under the interpreter, and
when a launch prefetches (plan.prefetch_meta). The prefetch itself is PTX, which only the GPU runs
(test_compiles_for_hopper.py checks it is in the kernels; BENCHMARKS.md, forty-second session, times it)."""
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings, strategies as st

from resfuse import kernels
from resfuse.kernels import plan
from resfuse.kernels.conv2d_fprop import krsc_range
from resfuse.kernels.tiles import prefetch_bounds


@pytest.fixture(autouse=True)
def _interpret():
    kernels.set_options(interpret=True)


@triton.jit
def _bounds(base, out_lo, out_size, row0, n_rows, row_stride, k0, k1, ROWS: tl.constexpr):
    lo, size = prefetch_bounds(base, row0, n_rows, row_stride, k0, k1, ROWS)
    tl.store(out_lo + tl.arange(0, ROWS), lo)
    tl.store(out_size + tl.arange(0, ROWS), size)


@settings(max_examples=40, deadline=None)
@given(st.data(), st.sampled_from([torch.float16, torch.float32]), st.integers(1, 40), st.integers(1, 90),
       st.integers(0, 7), st.sampled_from([8, 16]))
def test_each_rows_prefetch_covers_its_elements_within_16_byte_bounds(data, dtype, n_rows, width, pad, rows):
    """Every row below n_rows asks for an aligned byte range that holds elements [k0, k1) of that row and at most
    15 bytes either side; rows past n_rows, and an empty range, ask for nothing."""
    w = torch.empty(n_rows, width + pad, dtype=dtype)[:, pad:]  # rows not 16-byte aligned, a base offset
    row0 = data.draw(st.integers(0, n_rows))
    k0 = data.draw(st.integers(0, width))
    k1 = data.draw(st.integers(0, width))
    lo = torch.full((rows,), -1, dtype=torch.int64)
    size = torch.full((rows,), -1, dtype=torch.int32)
    _bounds[(1,)](w, lo, size, row0, n_rows, w.stride(0), k0, k1, ROWS=rows)
    e = w.element_size()
    for i in range(rows):
        r = row0 + i
        if r >= n_rows or k1 <= k0:
            assert size[i] == 0
            continue
        first = w.data_ptr() + (r * w.stride(0) + k0) * e
        end = first + (k1 - k0) * e
        a, n = int(lo[i]), int(size[i])
        assert a % 16 == 0 and n % 16 == 0
        assert a <= first < a + 16 and end <= a + n < end + 16


@triton.jit
def _krsc(out, C, R, S, BK: tl.constexpr, SPLIT_K: tl.constexpr):
    k0, k1 = krsc_range(tl.program_id(0), C, R, S, BK, SPLIT_K)
    tl.store(out + 2 * tl.program_id(0), k0)
    tl.store(out + 2 * tl.program_id(0) + 1, k1)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.sampled_from([1, 3, 5]), st.sampled_from([1, 3]), st.sampled_from([16, 32, 64]),
       st.sampled_from([1, 2, 3, 8]))
def test_a_splits_krsc_range_is_the_elements_its_blocks_read(c, r, s, bk, split):
    """The (r, s, BK channels) blocks of split p, as both conv mainloops walk them, read exactly the KRSC row's
    elements [k0, k1): the range the split prefetches."""
    got = torch.full((split, 2), -1, dtype=torch.int32)
    _krsc[(split,)](got, c, r, s, BK=bk, SPLIT_K=split)
    c_blocks = -(-c // bk)
    per = -(-(r * s * c_blocks) // split)
    for p in range(split):
        read = [rs * c + ch for t in range(p * per, min((p + 1) * per, r * s * c_blocks))
                for rs in [t // c_blocks] for ch in range((t % c_blocks) * bk, min((t % c_blocks + 1) * bk, c))]
        k0, k1 = got[p].tolist()
        if read:
            assert (k0, k1) == (min(read), max(read) + 1) and len(read) == k1 - k0
        else:
            assert k1 == k0


def test_only_a_launch_of_at_most_one_program_an_sm_prefetches(monkeypatch):
    monkeypatch.setitem(kernels._OPTIONS, "interpret", False)  # the switch the plans read, not Triton's mode
    monkeypatch.setattr(plan, "_bulk_prefetch", lambda device: True)
    monkeypatch.setattr(plan, "sm_count", lambda device: 132)
    gpu = torch.device("cuda", 0)
    assert plan.prefetch_meta(gpu, 132) == {"PREFETCH": True}
    assert plan.prefetch_meta(gpu, 133) == {"PREFETCH": False}  # a GEMM that fills the GPU: no prefetch
    monkeypatch.setitem(kernels._OPTIONS, "prefetch", False)
    assert plan.prefetch_meta(gpu, 1) == {"PREFETCH": False}
    monkeypatch.setitem(kernels._OPTIONS, "prefetch", True)
    monkeypatch.setitem(kernels._OPTIONS, "interpret", True)
    assert plan.prefetch_meta(gpu, 1) == {"PREFETCH": False}
