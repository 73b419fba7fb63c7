"""The copy of rows that are not whole 16-byte vectors into rows that are (`RowPadding`,
raw_kernels/row_padding.cu), on the GPU (`pytest -m gpu`): every value where it was, zeros past the
channels, in each size of value, over more elements than one pass of its blocks covers."""

import numpy as np
import pytest

from cupysparse.algorithms.tensor_core.common import MAX_PAD_BLOCKS, PAD_THREADS, row_padding, row_width
from cupysparse.cuda.backend import cupy_module
from cupysparse.cuda.dtypes import BFLOAT16, FLOAT16, FLOAT32

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [FLOAT16, BFLOAT16, FLOAT32], ids=lambda dtype: dtype.name)
@pytest.mark.parametrize("channels", [1, 3, 4, 20, 47])
def test_rows_are_copied_bit_for_bit_with_zeros_past_the_channels(dtype, channels):
    cupy = cupy_module()
    padding = row_padding(dtype, channels)
    if padding is None:  # 4 fp32 values are one vector
        assert channels * dtype.itemsize % 16 == 0
        return
    width = row_width(dtype, channels)
    assert width > channels and width * dtype.itemsize % 16 == 0 and (width - channels) * dtype.itemsize < 16
    rows = MAX_PAD_BLOCKS * PAD_THREADS // width + 1001  # past one pass of the grid
    # The values as their bits: nonzero, so a zero in the copy is padding.
    bits_type = np.uint16 if dtype.itemsize == 2 else np.uint32
    source = np.random.default_rng(channels).integers(1, 2**15, size=(rows, channels)).astype(bits_type)
    padded = padding(cupy.asarray(source)).get()
    assert padded.shape == (rows, width) and padded.dtype == bits_type
    np.testing.assert_array_equal(padded[:, :channels], source)
    assert not padded[:, channels:].any()


def test_a_strided_view_is_copied_from_its_values():
    cupy = cupy_module()
    wide = cupy.arange(5000 * 6, dtype=cupy.float16).reshape(5000, 6)
    padded = row_padding(FLOAT16, 3)(wide[:, ::2])
    np.testing.assert_array_equal(padded[:, :3].get(), wide[:, ::2].get())
    assert not padded[:, 3:].any()
