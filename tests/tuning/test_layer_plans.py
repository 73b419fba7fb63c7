"""The kept launch plans' bookkeeping (`cupysparse.tuning.plans`), without a GPU: which calls share a
plan, and when a layer selects again."""

import types

import numpy as np
import pytest

from cupysparse import settings
from cupysparse.tuning import plans as layer_plans
from cupysparse.cuda import precision
from cupysparse.tuning import tuner
from cupysparse.settings import ALGORITHM_MODES
from cupysparse.tuning.search_space import parse_algorithm_filter
from cupysparse.algorithms import CONV


@pytest.fixture(autouse=True)
def no_kept_plans(monkeypatch):
    for variable in (mode.name for mode in ALGORITHM_MODES.values()):
        monkeypatch.delenv(variable, raising=False)
    layer_plans.forget_plans()
    yield
    layer_plans.forget_plans()


def _map(num_in: int, num_out: int | None = None, stride=(1, 1, 1)):
    return types.SimpleNamespace(kernel_volume=27, stride=stride, transposed=False, generative=False, num_in=num_in,
                                 num_out=num_in if num_out is None else num_out, layer_plans={})


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
    monkeypatch.setenv(ALGORITHM_MODES[(CONV, "forward")].name, "wmma_implicit_gemm")
    _kept(_key(kernel_map), selected)
    _kept(_key(kernel_map, "auto"), selected)
    monkeypatch.setenv(ALGORITHM_MODES[(CONV, "forward")].name, "mma_implicit_gemm")
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


def _remembered(kernel_map, selected: list, argument: str = "", call: tuple = ("forward", (27, 32, 32))):
    """`map_layer_plan` of `call` (the caller's signature) over `kernel_map`, selecting through the kept
    plans as the functional API does; `selected` gains a key per selection made."""
    def select():
        return _kept(_key(kernel_map, argument), selected)

    return layer_plans.map_layer_plan(kernel_map, (*call, argument), select)


def test_a_map_remembers_its_layers_plans_until_the_settings_they_were_selected_under_change(monkeypatch):
    selected = []
    kernel_map = _map(1500)
    first = _remembered(kernel_map, selected)
    assert _remembered(kernel_map, selected) == first and len(kernel_map.layer_plans) == 1
    assert _remembered(kernel_map, selected, "auto") == "plan 2"  # another signature on the same map
    tuner.default_tuner().forget_choices()
    assert _remembered(kernel_map, selected) == "plan 3"
    monkeypatch.setenv(ALGORITHM_MODES[(CONV, "forward")].name, "wmma_implicit_gemm")
    assert _remembered(kernel_map, selected) == "plan 4"
    assert _remembered(kernel_map, selected, "auto") == "plan 5"  # the tuner's generation moved on
    monkeypatch.setenv(ALGORITHM_MODES[(CONV, "forward")].name, "mma_implicit_gemm")
    assert _remembered(kernel_map, selected, "auto") == "plan 5"  # an explicit argument does not read it
    monkeypatch.setenv("CUPYSPARSE_AUTOTUNE", "0")
    assert _remembered(kernel_map, selected, "auto") == "plan 6"
    layer_plans.forget_plans()
    assert _remembered(kernel_map, selected, "auto") == "plan 7"
    assert len(selected) == 7


def test_a_remembered_plan_is_checked_without_reading_a_setting_and_looked_up_again_after_a_change(monkeypatch):
    """Between changes a call parses no setting; a change no selection depends on looks nothing up
    again; a change of a selection variable looks the plan up again, under the settings' values, and
    finds the kept one; another fp32 precision selects anew."""
    selected, lookups = [], []
    kernel_map = _map(1500)

    def select():
        lookups.append(kernel_map)
        return _kept(_key(kernel_map), selected)

    first = layer_plans.map_layer_plan(kernel_map, ("forward", ""), select)
    with monkeypatch.context() as patches:
        def unread(*arguments):
            raise AssertionError("a setting was parsed")

        for reader in ("autotune", "fp32_precision", "algorithm_mode"):
            patches.setattr(settings, reader, unread)
        assert [layer_plans.map_layer_plan(kernel_map, ("forward", ""), select) for _ in range(3)] == [first] * 3
        monkeypatch.setenv("CUPYSPARSE_TEST_UNRELATED_VARIABLE", "changed")
        assert layer_plans.map_layer_plan(kernel_map, ("forward", ""), select) == first
    assert len(lookups) == 1
    monkeypatch.setenv(settings.AUTOTUNE.name, "1")
    assert layer_plans.map_layer_plan(kernel_map, ("forward", ""), select) == first
    assert len(lookups) == 2 and len(selected) == 1
    with precision.fp32_precision("tf32"):
        assert layer_plans.map_layer_plan(kernel_map, ("forward", ""), select) == "plan 2"
    assert len(lookups) == 3


def test_a_new_map_of_a_kept_signature_reuses_the_plan_and_remembers_it_itself():
    selected = []
    first, second = _map(1500), _map(2000)
    assert _remembered(first, selected) == _remembered(second, selected) == "plan 1" and len(selected) == 1
    assert second.layer_plans == first.layer_plans


def test_a_map_remembers_nothing_from_a_selection_that_raises():
    kernel_map = _map(1500)

    def failing():
        raise ValueError("no algorithm can run this problem")

    with pytest.raises(ValueError):
        layer_plans.map_layer_plan(kernel_map, ("forward",), failing)
    assert kernel_map.layer_plans == {}
    assert layer_plans.map_layer_plan(kernel_map, ("forward",), lambda: None) is None
    assert layer_plans.map_layer_plan(kernel_map, ("forward",), lambda: "a plan") is None


def test_the_host_overhead_benchmark_says_it_needs_a_gpu(capsys):
    from cupysparse.cuda.backend import gpu_available
    from cupysparse.scripts import benchmark_host_overhead

    if gpu_available():
        pytest.skip("checks the message on machines without a GPU")
    assert benchmark_host_overhead.main(["--repeats", "3"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
