"""The array helpers of `cupysparse.cuda.backend`: whole-mask truth tests, on NumPy and on CuPy, against
Python's own `all` and `any` over the elements."""

import numpy as np
import pytest

from cupysparse.cuda.backend import all_true, any_true, cupy_module

MASKS = {
    "empty": np.zeros(0, dtype=bool),
    "all true": np.ones(1000, dtype=bool),
    "all false": np.zeros(1000, dtype=bool),
    "last false": np.concatenate([np.ones(999, dtype=bool), [False]]),
    "first true": np.concatenate([[True], np.zeros(999, dtype=bool)]),
    "random": np.random.default_rng(0).random(4097) < 0.5,
    "strided, true at the even positions": np.arange(1000) % 2 == 0,
    "matrix": np.random.default_rng(1).random((37, 53)) < 0.99,
}
# Views that are not contiguous: every other element of the strided mask (all True), a matrix column.
VIEWS = {"every other element": lambda mask: mask[::2], "a column": lambda mask: mask[:, 3]}


def cases():
    for name, mask in MASKS.items():
        yield name, mask
    yield "every other element", VIEWS["every other element"](MASKS["strided, true at the even positions"])
    yield "a column", VIEWS["a column"](MASKS["matrix"])


@pytest.mark.parametrize("name, mask", list(cases()), ids=[name for name, _ in cases()])
def test_all_true_and_any_true_on_numpy_are_pythons_all_and_any(name, mask):
    assert all_true(mask) is all(mask.ravel().tolist())
    assert any_true(mask) is any(mask.ravel().tolist())


@pytest.mark.gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name, mask", list(cases()), ids=[name for name, _ in cases()])
def test_all_true_and_any_true_on_cupy_are_pythons_all_and_any(name, mask):
    cupy = cupy_module()
    on_gpu = cupy.asarray(np.ascontiguousarray(mask))
    if name in VIEWS:  # the view taken on the GPU, so that it is strided there too
        base = MASKS["strided, true at the even positions"] if name == "every other element" else MASKS["matrix"]
        on_gpu = VIEWS[name](cupy.asarray(base))
        assert not on_gpu.flags.c_contiguous
    assert all_true(on_gpu) is all(mask.ravel().tolist())
    assert any_true(on_gpu) is any(mask.ravel().tolist())
