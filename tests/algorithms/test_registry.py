"""The registry without a GPU: one reference per kind, and what each algorithm says a call holds
besides its operands (`transient_bytes`)."""

from typing import ClassVar

import numpy as np
import pytest

from cupysparse.algorithms import CONV, DEPTHWISE, Algorithm, ConvProblem, get_algorithm, reference_algorithm
from cupysparse.algorithms import base as algorithms_base
from cupysparse.algorithms.tensor_core import common
from cupysparse.cuda.dtypes import FLOAT16, FLOAT32


def test_each_kind_has_one_reference_and_a_second_one_is_refused(monkeypatch):
    assert reference_algorithm(CONV) is get_algorithm("explicit_gemm")
    assert reference_algorithm(DEPTHWISE) is get_algorithm("explicit", DEPTHWISE)
    monkeypatch.setitem(algorithms_base._REGISTRY, CONV, dict(algorithms_base._REGISTRY[CONV]))

    class Rival(Algorithm):
        name = "rival"
        reference = True
        tuning_namespaces: ClassVar[dict[str, str]] = {}

    with pytest.raises(ValueError, match="'rival' cannot be the conv reference: 'explicit_gemm' is"):
        algorithms_base.register(Rival)
    monkeypatch.setitem(algorithms_base._REGISTRY, CONV, {})
    with pytest.raises(ValueError, match="no conv algorithm is registered as the reference"):
        reference_algorithm(CONV)


def _problem(dtype, device="cuda", num=100_000, channels=(64, 128), kernel_volume=27):
    return ConvProblem(num, num, *channels, kernel_volume, np.dtype(dtype), device, 90 if device == "cuda" else None)


def test_transient_bytes_follow_each_algorithms_temporaries(monkeypatch):
    monkeypatch.setattr(common, "multiprocessors", lambda device: 132)
    monkeypatch.setattr(common, "current_device", lambda: 0)
    problem, pairs = _problem(FLOAT16), 90_000
    # explicit_gemm forward on the GPU: the fp32 accumulator, the busiest offset's gathered rows and product
    # in fp16, and the fp16 features cast to fp32 (cuBLAS runs fp16 here, so no cast).
    assert get_algorithm("explicit_gemm").transient_bytes(problem, "forward", {}, pairs) == (
        100_000 * 128 * 4 + pairs * (64 + 128) * 2)
    # implicit_gemm: wgrad's split-K partials and their sum in fp32; nothing for forward.
    split = {"split_k_factor": 4}
    assert get_algorithm("implicit_gemm").transient_bytes(problem, "wgrad", split, pairs) == 5 * 27 * 64 * 128 * 4
    assert get_algorithm("implicit_gemm").transient_bytes(problem, "forward", split, pairs) == 0
    # The tensor cores: the padded weight, and for wgrad shares of fp32 partials (32 warps an SM over
    # 27 x 2 x 4 warp tiles: 20 shares).
    padded_weight = 27 * 64 * 128 * 2
    for name in ("wmma_implicit_gemm", "mma_implicit_gemm"):
        algorithm = get_algorithm(name)
        assert algorithm.transient_bytes(problem, "forward", {}, pairs) == padded_weight
        assert algorithm.transient_bytes(problem, "backward", {"wgrad_warps_per_sm": 32}, pairs) == (
            padded_weight + 20 * 27 * 64 * 128 * 4)
    assert get_algorithm("explicit", DEPTHWISE).transient_bytes(_problem(FLOAT32, "cpu"), "forward", {}, pairs) == 0
