"""The execution path's launch plans on the GPU (`pytest -m gpu`): a layer's calls over a map after its
first launch the plan its first call selected. They must give what the selected algorithm gives through
its own entry points (bitwise) and what the fp64 reference gives, over any map of the signature (a new
map selecting from the tuner's memory, measuring nothing), and arguments a plan cannot run must still take
the full path, with its errors."""

import numpy as np
import pytest

from cupysparse.functional import convolution as functional
from cupysparse.functional import execution
from cupysparse.settings import ALGORITHM_MODES
from cupysparse.algorithms import CONV, Algorithm, ConvProblem, get_algorithm
from cupysparse.cuda.backend import cupy_module
from cupysparse.cuda.dtypes import FLOAT32
from cupysparse.cuda.precision import fp32_precision
from cupysparse.tuning.search_space import algorithm_argument
from cupysparse.tuning.tuner import default_tuner, size_bucket
from gpu_cases import build_gpu_map, coordinates, gpu_map, inputs, reference_phase, supported
from tolerances import assert_close

pytestmark = pytest.mark.gpu


def _planned_cases():
    return [case for case in supported(CONV)
            if type(get_algorithm(case.values[0])).forward_plan is not Algorithm.forward_plan]


@pytest.fixture
def selections(monkeypatch):
    """The phases the execution path asks the tuner to select for, in order, starting with no plans kept
    on any map and no choices remembered."""
    default_tuner().forget_choices()
    selected = []
    select = execution.select_algorithm

    def recording(search_space, problem, run=None):
        selected.append(search_space.phase)
        return select(search_space, problem, run)

    monkeypatch.setattr(execution, "select_algorithm", recording)
    yield selected
    default_tuner().forget_choices()


def _on_gpu(*arrays):
    return tuple(cupy_module().asarray(array) for array in arrays)


def _planned_calls_match_the_algorithms_own(algorithm, kernel_map, x, w, dy) -> dict:
    """forward, dgrad and wgrad through `conv_forward` / `conv_backward` with `algo=algorithm.name`, each
    checked bitwise against the algorithm's own entry point with the selected parameters."""
    x_gpu, w_gpu, dy_gpu = _on_gpu(x, w, dy)
    out = functional.conv_forward(x_gpu, w_gpu, kernel_map, algorithm.name)
    grad_input, grad_weight = functional.conv_backward(dy_gpu, x_gpu, w_gpu, kernel_map, algorithm.name)
    forward = functional.select_forward(x_gpu, w_gpu, kernel_map, algorithm.name)
    backward = functional.select_backward(dy_gpu, x_gpu, w_gpu, kernel_map, algorithm.name)
    assert (forward.algorithm, backward.algorithm) == (algorithm, algorithm)
    own = {
        "forward": algorithm.forward(x_gpu, algorithm.prepare_weight(w_gpu), kernel_map, **forward.params),
        "dgrad": algorithm.dgrad(dy_gpu, algorithm.prepare_weight(w_gpu), kernel_map, **backward.params),
        "wgrad": algorithm.wgrad(x_gpu, dy_gpu, kernel_map, **backward.params),
    }
    results = {"forward": out.get(), "dgrad": grad_input.get(), "wgrad": grad_weight.get()}
    for phase, actual in results.items():
        np.testing.assert_array_equal(actual.view(np.uint8), own[phase].get().view(np.uint8))
    return results


@pytest.mark.parametrize("channels", ((64, 64), (24, 40), (3, 17)), ids=lambda c: f"{c[0]}to{c[1]}")
@pytest.mark.parametrize(("name", "dtype"), _planned_cases())
def test_a_planned_layer_gives_its_algorithms_results_over_every_map_of_its_signature(name, dtype, channels,
                                                                                      selections):
    """Two maps of one signature (the same size buckets): the first call of each phase selects and the
    rest launch the kept plan; every result is bitwise the selected algorithm's own and within the fp64
    reference's tolerance."""
    algorithm = get_algorithm(name)
    coords = coordinates(seed=3)
    maps = (build_gpu_map("submanifold", coords), build_gpu_map("submanifold", coords[: len(coords) - 40]))
    assert maps[0].num_in != maps[1].num_in and size_bucket(maps[0].num_in) == size_bucket(maps[1].num_in)
    measurements = []
    for seed, kernel_map in enumerate(maps):
        x, w, dy = inputs(kernel_map, *channels, dtype, seed=20 + seed)
        results = _planned_calls_match_the_algorithms_own(algorithm, kernel_map, x, w, dy)
        for phase, actual in results.items():
            expected, (terms, a, b) = reference_phase(phase, kernel_map, x, w, dy)
            assert_close(actual, expected, dtype, terms, a, b, f"{name} planned {phase} map {seed}")
        measurements.append(default_tuner().measurements)
    # The first map's calls selected; after that only the select_* calls above did, measuring nothing.
    assert selections == ["forward", "backward"] + ["forward", "backward"] * len(maps)
    assert measurements[1] == measurements[0]


@pytest.mark.parametrize("name", ["mma_implicit_gemm", "wgmma_implicit_gemm"])
def test_a_planned_tf32_layer_gives_its_algorithms_results(name, selections):
    """fp32 features in TF32, where wgmma's forward reads the weight transposed (K-major): the plan's
    weight is transposed and padded per call. The TF32 results themselves are checked in test_tf32_gpu."""
    algorithm = get_algorithm(name)
    kernel_map = gpu_map("strided")
    with fp32_precision("tf32"):
        problem = ConvProblem.over(kernel_map, 24, 40, FLOAT32, on_gpu=True)
        if not algorithm.supports(problem):
            pytest.skip(algorithm.unsupported_reason(problem))
        x, w, dy = inputs(kernel_map, 24, 40, FLOAT32, seed=61)
        _planned_calls_match_the_algorithms_own(algorithm, kernel_map, x, w, dy)
    assert selections == ["forward", "backward", "forward", "backward"]


@pytest.mark.parametrize(("name", "dtype"), _planned_cases())
def test_a_planned_layer_reads_its_weight_anew_at_every_call(name, dtype, selections):
    """A weight padded per call (24 -> 40 channels is no whole number of fragments) and one read in place
    (64 -> 64), each changed in place between two calls."""
    kernel_map = gpu_map("submanifold")
    for channels in ((24, 40), (64, 64)):
        x, w, dy = inputs(kernel_map, *channels, dtype, seed=31)
        x_gpu, w_gpu = _on_gpu(x, w)
        functional.conv_forward(x_gpu, w_gpu, kernel_map, name)
        doubled = (2 * w.astype(np.float64)).astype(dtype)
        w_gpu[...] = cupy_module().asarray(doubled)
        actual = functional.conv_forward(x_gpu, w_gpu, kernel_map, name).get()
        expected, (terms, a, b) = reference_phase("forward", kernel_map, x, doubled, dy)
        assert_close(actual, expected, dtype, terms, a, b, f"{name} {channels} after the weight changed")
    assert selections == ["forward", "forward"]  # once per signature: the second calls ran the kept plans


@pytest.mark.parametrize("channels", ((16, 32), (3, 20)), ids=lambda c: f"{c[0]}to{c[1]}")
@pytest.mark.parametrize(("name", "dtype"), _planned_cases())
def test_only_the_gradients_asked_for_are_computed(name, dtype, channels, selections):
    """Also where the plan copies the features and the gradient into rows of whole 16-byte vectors first
    (3 -> 20), which either gradient alone copies only what it reads."""
    kernel_map = gpu_map("strided")
    x, w, dy = inputs(kernel_map, *channels, dtype, seed=41)
    x_gpu, w_gpu, dy_gpu = _on_gpu(x, w, dy)
    both = functional.conv_backward(dy_gpu, x_gpu, w_gpu, kernel_map, name)
    grad_input, none = functional.conv_backward(dy_gpu, x_gpu, w_gpu, kernel_map, name, needs_weight_grad=False)
    none_too, grad_weight = functional.conv_backward(dy_gpu, x_gpu, w_gpu, kernel_map, name, needs_input_grad=False)
    assert none is None and none_too is None
    np.testing.assert_array_equal(grad_input.get(), both[0].get())
    np.testing.assert_array_equal(grad_weight.get(), both[1].get())
    assert selections == ["backward"]


@pytest.mark.parametrize(("name", "dtype"), _planned_cases())
def test_a_backward_over_shares_derived_beforehand_gives_the_same_gradients(name, dtype, selections):
    """`derive_backward_formats` on a fresh map of a kept signature derives its plan's wgrad shares (and selects
    nothing); the backward then reads them and gives, bitwise, what it gives deriving its own."""
    coords = coordinates(seed=5)
    first, fresh, again = (build_gpu_map("submanifold", coords) for _ in range(3))
    x, w, dy = inputs(first, 32, 32, dtype, seed=71)
    x_gpu, w_gpu, dy_gpu = _on_gpu(x, w, dy)
    functional.conv_backward(dy_gpu, x_gpu, w_gpu, first, name)  # selects and keeps the signature's plan
    argument = algorithm_argument(name, CONV, "backward")
    plan = execution.layer_plan(execution.core_arrays(), "backward", argument, x_gpu, w_gpu, first, dy_gpu)
    if plan is None or plan.wgrad_shares is None:
        pytest.skip(f"{name}'s backward plan derives no wgrad shares")
    execution.derive_backward_formats(execution.core_arrays(), [(x_gpu, w_gpu, fresh, argument)])
    assert plan.wgrad_shares(fresh) in fresh.__dict__["_wgrad_shares"]
    derived = functional.conv_backward(dy_gpu, x_gpu, w_gpu, fresh, name)
    own = functional.conv_backward(dy_gpu, x_gpu, w_gpu, again, name)
    for got, expected in zip(derived, own):
        np.testing.assert_array_equal(got.get().view(np.uint8), expected.get().view(np.uint8))
    assert selections == ["backward"]


def test_a_maps_later_calls_select_nothing_yet_follow_the_algorithm_variable(selections, monkeypatch):
    """The plan a signature keeps serves the layer's later calls without a selection; the variable behind
    `algo=None`, changed, switches the algorithm, the tuner answering from its memory (nothing is
    measured)."""
    names = sorted({case.values[0] for case in _planned_cases() if case.values[1] == np.float16})[:2]
    if len(names) < 2:
        pytest.skip("needs two planned algorithms for fp16 on this GPU")
    kernel_map = build_gpu_map("submanifold", coordinates(seed=52))  # a map of its own: no other test's plans on it
    x, w, _ = inputs(kernel_map, 32, 32, np.float16, seed=52)
    x_gpu, w_gpu = _on_gpu(x, w)
    own, plans = {}, {}
    problem = ConvProblem.of(x_gpu, kernel_map, 32)
    for name in names:
        algorithm = get_algorithm(name)
        selection = functional.select_forward(x_gpu, w_gpu, kernel_map, name)
        own[name] = algorithm.forward(x_gpu, algorithm.prepare_weight(w_gpu), kernel_map, **selection.params).get()
        plans[name] = algorithm.forward_plan(problem, selection.params)
    assert plans[names[0]] != plans[names[1]]
    selections.clear()
    measured = default_tuner().measurements
    for name in (names[0], names[1], names[0]):
        monkeypatch.setenv(ALGORITHM_MODES[(CONV, "forward")].name, name)
        for _ in range(3):
            out = functional.conv_forward(x_gpu, w_gpu, kernel_map)
            np.testing.assert_array_equal(out.get().view(np.uint16), own[name].view(np.uint16))
        assert selections == ["forward"]
        assert execution.layer_plan(execution.core_arrays(), "forward", "", x_gpu, w_gpu, kernel_map) == plans[name]
        selections.clear()
    assert default_tuner().measurements == measured


def test_arguments_a_plan_cannot_run_take_the_full_path_with_its_checks(selections):
    cupy = cupy_module()
    kernel_map = gpu_map("submanifold")
    x, w, dy = inputs(kernel_map, 32, 32, np.float16, seed=51)
    x_gpu, w_gpu, dy_gpu = _on_gpu(x, w, dy)
    planned = functional.conv_forward(x_gpu, w_gpu, kernel_map, "auto")
    assert selections == ["forward"]
    # Every other column of a wider array: not contiguous, so the full path (which selects) runs it.
    strided = cupy.zeros((kernel_map.num_in, 64), dtype=np.float16)
    strided[:, ::2] = x_gpu
    np.testing.assert_array_equal(functional.conv_forward(strided[:, ::2], w_gpu, kernel_map, "auto").get(),
                                  planned.get())
    assert selections == ["forward", "forward"]
    with pytest.raises(TypeError, match="dtype"):
        functional.conv_forward(x_gpu, w_gpu.astype(np.float32), kernel_map, "auto")
    with pytest.raises(ValueError, match="input channels"):
        functional.conv_forward(x_gpu[:, :16].copy(), w_gpu, kernel_map, "auto")
    with pytest.raises(ValueError, match="grad_output must have 32 channels"):
        functional.conv_backward(dy_gpu[:, :16].copy(), x_gpu, w_gpu, kernel_map, "auto")
    with pytest.raises(ValueError, match="not_an_algorithm"):
        functional.conv_forward(x_gpu, w_gpu, kernel_map, "not_an_algorithm")
