"""The kept launch plans' bookkeeping (`cupysparse.layer_plans`), without a GPU: which calls share a
plan, and when a layer selects again."""

import types

import numpy as np
import pytest

from cupysparse import layer_plans, tuner
from cupysparse.algorithm_modes import ENVIRONMENT_VARIABLES, parse_algorithm_filter
from cupysparse.algorithms import CONV


@pytest.fixture(autouse=True)
def no_kept_plans(monkeypatch):
    for variable in ENVIRONMENT_VARIABLES.values():
        monkeypatch.delenv(variable, raising=False)
    layer_plans.forget_plans()
    yield
    layer_plans.forget_plans()


def _map(num_in: int, num_out: int | None = None, stride=(1, 1, 1)):
    return types.SimpleNamespace(kernel_volume=27, stride=stride, transposed=False, generative=False, num_in=num_in,
                                 num_out=num_in if num_out is None else num_out)


def _key(kernel_map, argument: str = "", phase: str = "forward", channels=(32, 32)) -> tuple:
    return layer_plans.map_plan_key(phase, np.dtype(np.float16), (27, *channels), 0, argument, kernel_map)


def _kept(key: tuple, selected: list):
    def select():
        selected.append(key)
        return f"plan {len(selected)}"

    return layer_plans.kept_plan(key, select)


@pytest.mark.parametrize(("algo", "argument"), [
    (None, ""), ("auto", "auto"), ("ALL", "all"), ("wmma_implicit_gemm", "[wmma_implicit_gemm]"),
    (["mma_implicit_gemm", "wmma_implicit_gemm"], "[mma_implicit_gemm,wmma_implicit_gemm]"),
    ("[mma_implicit_gemm, wmma_implicit_gemm]", "[mma_implicit_gemm,wmma_implicit_gemm]"),
])
def test_an_algorithm_argument_has_one_canonical_string_which_parses_back_to_it(algo, argument):
    assert layer_plans.algorithm_argument(algo, CONV, "forward") == argument
    assert layer_plans.algorithm_filter(argument, CONV, "forward") == parse_algorithm_filter(algo, CONV, "forward")


@pytest.mark.parametrize("algo", ["not_an_algorithm", [], ["auto", "nope"]])
def test_a_bad_algorithm_argument_raises_before_any_plan_is_looked_up(algo):
    with pytest.raises(ValueError, match="algorithm"):
        layer_plans.algorithm_argument(algo, CONV, "forward")


def test_a_signature_selects_once_for_every_map_of_its_sizes():
    selected = []
    first = _kept(_key(_map(1500)), selected)
    assert _kept(_key(_map(2000)), selected) == first  # 1500 and 2000 rows: one size bucket
    assert _kept(_key(_map(2100)), selected) != first  # the next bucket
    assert _kept(_key(_map(1500), phase="backward"), selected) != first
    assert _kept(_key(_map(1500), channels=(32, 64)), selected) != first
    assert _kept(_key(_map(1500, stride=(2, 2, 2))), selected) != first
    assert len(selected) == 5


def test_a_layer_selects_again_when_the_tuners_choices_or_the_environment_change(monkeypatch):
    selected = []
    kernel_map = _map(1500)
    _kept(_key(kernel_map), selected)
    tuner.default_tuner().forget_choices()
    _kept(_key(kernel_map), selected)
    monkeypatch.setenv(ENVIRONMENT_VARIABLES[(CONV, "forward")], "wmma_implicit_gemm")
    _kept(_key(kernel_map), selected)
    _kept(_key(kernel_map, "auto"), selected)
    monkeypatch.setenv(ENVIRONMENT_VARIABLES[(CONV, "forward")], "mma_implicit_gemm")
    _kept(_key(kernel_map, "auto"), selected)  # an explicit argument does not read the variable
    monkeypatch.setenv("CUPYSPARSE_AUTOTUNE", "0")
    _kept(_key(kernel_map, "auto"), selected)
    assert len(selected) == 5 and len(set(selected)) == 5


def test_a_selection_that_raises_keeps_nothing():
    key = _key(_map(1500))

    def failing():
        raise ValueError("no algorithm can run this problem")

    with pytest.raises(ValueError):
        layer_plans.kept_plan(key, failing)
    selected = []
    assert _kept(key, selected) == "plan 1" and selected == [key]


def test_a_recalled_plan_is_kept_unless_one_already_is():
    key = _key(_map(1500))
    layer_plans.keep_plan(key, "recalled")
    layer_plans.keep_plan(key, "later")
    assert _kept(key, []) == "recalled"


def test_the_host_overhead_benchmark_says_it_needs_a_gpu(capsys):
    from cupysparse.backend import gpu_available
    from cupysparse.scripts import benchmark_host_overhead

    if gpu_available():
        pytest.skip("checks the message on machines without a GPU")
    assert benchmark_host_overhead.main(["--repeats", "3"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
