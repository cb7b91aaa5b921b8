"""The layers' sparse-dense product on CPU ranks (``hpcgnn.codecs.native.spmm``, the C kernel):
against a float64 product written here with numpy (each row's sum taken in CSR order, as the
kernel documents), the same bits for any thread count, rows with 0 to 9 non-zeros (the
kernel's unrolled and remainder paths), empty matrices, the gradient of ``SpMM``, and row and
column offsets past 2^31 rows."""
import numpy as np
import pytest
import scipy.sparse as sp
import torch

from hpcgnn.codecs import native
from hpcgnn.nn.graph import SparseOp

pytestmark = pytest.mark.skipif(native.lib() is None, reason="no C compiler: the torch path runs")


def _csr(n: int, m: int, seed: int, max_deg: int = 9) -> sp.csr_matrix:
    """Rows with 0..max_deg non-zeros (every count the unrolling by 4 can meet)."""
    rng = np.random.default_rng(seed)
    deg = rng.integers(0, max_deg + 1, size=n)
    deg[:max_deg + 1] = np.arange(max_deg + 1)
    rows = np.repeat(np.arange(n), deg)
    cols = np.concatenate([rng.choice(m, size=d, replace=False) for d in deg]) if m else rows[:0]
    vals = rng.standard_normal(rows.size).astype(np.float32)
    a = sp.csr_matrix((vals, (rows, cols)), shape=(n, m))
    a.sort_indices()
    return a


def _torch_csr(a: sp.csr_matrix) -> torch.Tensor:
    return torch.sparse_csr_tensor(torch.from_numpy(a.indptr.astype(np.int64)),
                                   torch.from_numpy(a.indices.astype(np.int64)),
                                   torch.from_numpy(a.data.astype(np.float32)), size=a.shape)


def _reference(a: sp.csr_matrix, x: np.ndarray) -> np.ndarray:
    """``a @ x`` in float32 with each row's terms added in CSR order, one at a time."""
    out = np.zeros((a.shape[0], x.shape[1]), dtype=np.float32)
    for r in range(a.shape[0]):
        acc = np.zeros(x.shape[1], dtype=np.float32)
        for e in range(a.indptr[r], a.indptr[r + 1]):
            acc = acc + np.float32(a.data[e]) * x[a.indices[e]]
        out[r] = acc
    return out


@pytest.mark.parametrize("width", [1, 3, 8, 17, 64, 130])
def test_spmm_equals_the_sequential_sum(width):
    a = _csr(300, 120, seed=width)
    x = np.random.default_rng(1).standard_normal((120, width)).astype(np.float32)
    got = native.spmm(_torch_csr(a), torch.from_numpy(x)).numpy()
    want = _reference(a, x)
    assert np.array_equal(got, want)            # the order is documented, so the bits are
    exact = a.astype(np.float64) @ x.astype(np.float64)
    assert np.allclose(got, exact, rtol=1e-5, atol=1e-5)


def test_spmm_same_bits_for_any_thread_count(monkeypatch):
    a = _csr(5000, 4000, seed=3, max_deg=40)    # above the size where the rows are split
    x = torch.randn(4000, 64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.spmm(_torch_csr(a), x)
        for threads in (2, 3, 5):
            torch.set_num_threads(threads)
            monkeypatch.setattr(native, "_SPMM_SPLIT", 1)
            assert torch.equal(native.spmm(_torch_csr(a), x), one), threads
    finally:
        torch.set_num_threads(before)


def test_spmm_empty_shapes():
    for n, m in ((0, 5), (5, 0), (4, 4)):
        a = sp.csr_matrix((n, m), dtype=np.float32)
        got = native.spmm(_torch_csr(a), torch.randn(m, 6))
        assert got.shape == (n, 6) and not got.any()


def test_spmm_gradient_is_the_transpose_product():
    a = _csr(200, 150, seed=7)
    op = SparseOp.from_scipy(a, torch.device("cpu"))
    x = torch.randn(150, 12, requires_grad=True)
    g = torch.randn(200, 12)
    (op @ x).backward(g)
    want = a.T.astype(np.float64) @ g.double().numpy()
    assert np.allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(x.grad, native.spmm(op.mat_t, g))


def test_spmm_csr_takes_int32_indices_as_cagnet_blocks_carry_them():
    a = _csr(120, 90, seed=11)
    x = torch.randn(90, 33)
    want = native.spmm(_torch_csr(a), x)
    got = native.spmm_csr(torch.from_numpy(a.indptr.astype(np.int32)),
                          torch.from_numpy(a.indices.astype(np.int32)),
                          torch.from_numpy(a.data), a.shape[0], x)
    assert torch.equal(got, want)
    from hpcgnn.comm.cagnet_wire import SparseBlock
    block = SparseBlock.from_scipy(a, torch.int32, "cpu")
    assert torch.equal(block @ x, want)


def test_c_kernels_take_row_and_column_offsets_past_2_31_in_64_bits():
    """A graph past 2^31 rows (or a row times the width past 2^31 elements) is addressed in
    int64: ``x + indices[e] * w``, ``out + r * w`` and ``x + index[j] * width`` in the C kernels.
    Without allocating 8 GiB: the arrays are passed as seen from a base ``FAR`` rows before
    their memory, so only offsets computed in 64 bits land in them (an int product wraps to
    another address)."""
    lib, far, w = native.lib(), 1 << 31, 3
    x = torch.arange(1, 4 * w + 1, dtype=torch.float32).reshape(4, w)
    x_far = x.data_ptr() - far * w * 4                   # row FAR + i of x_far is x[i]
    indptr = torch.tensor([0, 2, 3], dtype=torch.int64)
    indices = torch.tensor([far + 1, far + 3, far], dtype=torch.int64)
    values = torch.tensor([0.5, 2.0, -1.0])
    want = torch.stack([0.5 * x[1] + 2.0 * x[3], -1.0 * x[0]])
    out = torch.full((2, w), float("nan"))
    lib.hpcgnn_spmm(indptr.data_ptr(), indices.data_ptr(), values.data_ptr(), 0, 2, x_far, w,
                    out.data_ptr())
    assert torch.equal(out, want)
    # output rows FAR and FAR + 1: indptr and out seen from FAR rows before them as well
    out = torch.full((2, w), float("nan"))
    lib.hpcgnn_spmm(indptr.data_ptr() - far * 8, indices.data_ptr(), values.data_ptr(), far,
                    far + 2, x_far, w, out.data_ptr() - far * w * 4)
    assert torch.equal(out, want)
    got = torch.full((3, w), float("nan"))
    index = torch.tensor([far + 2, far, far + 3], dtype=torch.int64)
    assert lib.hpcgnn_gather_rows(x_far, far + 4, index.data_ptr(), None, 3, w, got.data_ptr()) == 0
    assert torch.equal(got, x[[2, 0, 3]])
