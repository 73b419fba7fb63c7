"""The execution path's bookkeeping without a GPU (`cupysparse.functional.execution`): the canonical
algorithm argument, which calls share a plan remembered on a kernel map, and when a layer selects again."""

import types

import numpy as np
import pytest

from cupysparse import settings
from cupysparse.algorithms import CONV
from cupysparse.cuda import precision
from cupysparse.functional import execution
from cupysparse.settings import ALGORITHM_MODES
from cupysparse.tuning import tuner
from cupysparse.tuning.search_space import algorithm_argument, algorithm_filter, parse_algorithm_filter


@pytest.fixture(autouse=True)
def no_algorithm_variables(monkeypatch):
    for variable in (mode.name for mode in ALGORITHM_MODES.values()):
        monkeypatch.delenv(variable, raising=False)


class PlannableArrays(execution.Arrays):
    """Arrays every plan takes, on GPU 0 (the selection itself is recorded, not made)."""

    def launch_device(self, features, weight, grad_output=None):
        return 0


@pytest.fixture
def selections(monkeypatch):
    """The plans `layer_plan` selects, in order: each selection returns a new "plan N"; no plan kept before."""
    selected = []

    def select(arrays, phase, argument, features, weight, kernel_map, grad_output):
        selected.append((phase, argument))
        return f"plan {len(selected)}"

    monkeypatch.setattr(execution, "_selected_plan", select)
    monkeypatch.setattr(execution, "_plans", {})
    return selected


class FakeMap:
    """What `layer_plan` reads of a kernel map."""

    def __init__(self, num_in: int = 1500, stride=(1, 1, 1)):
        self.kernel_volume, self.stride, self.transposed, self.generative = 27, stride, False, False
        self.num_in = self.num_out = num_in

    def derived(self, key, compute):
        return compute(self)


def _map(num_in: int = 1500, stride=(1, 1, 1)):
    return FakeMap(num_in, stride)


def _array(shape, dtype=np.float16):
    return types.SimpleNamespace(shape=shape, dtype=np.dtype(dtype))


def _plan(kernel_map, argument: str = "", phase: str = "forward", channels=(32, 32), dtype=np.float16):
    features, weight = _array((kernel_map.num_in, channels[0]), dtype), _array((27, *channels), dtype)
    grad_output = None if phase == "forward" else _array((kernel_map.num_out, channels[1]), dtype)
    return execution.layer_plan(PlannableArrays(), phase, argument, features, weight, kernel_map, grad_output)


@pytest.mark.parametrize(("algo", "argument"), [
    (None, ""), ("auto", "auto"), ("ALL", "all"), ("wmma_implicit_gemm", "[wmma_implicit_gemm]"),
    (["mma_implicit_gemm", "wmma_implicit_gemm"], "[mma_implicit_gemm,wmma_implicit_gemm]"),
    ("[mma_implicit_gemm, wmma_implicit_gemm]", "[mma_implicit_gemm,wmma_implicit_gemm]"),
])
def test_an_algorithm_argument_has_one_canonical_string_which_parses_back_to_it(algo, argument):
    assert algorithm_argument(algo, CONV, "forward") == argument
    assert algorithm_filter(argument, CONV, "forward") == parse_algorithm_filter(algo, CONV, "forward")


@pytest.mark.parametrize("algo", ["not_an_algorithm", [], ["auto", "nope"]])
def test_a_bad_algorithm_argument_raises_before_any_plan_is_looked_up(algo):
    with pytest.raises(ValueError, match="algorithm"):
        algorithm_argument(algo, CONV, "forward")


def test_a_signature_selects_once_for_every_map_of_its_sizes(selections):
    first = _plan(_map(1500))
    assert [_plan(_map(1500)) for _ in range(3)] == [first] * 3
    assert _plan(_map(2000)) == first  # 1500 and 2000 rows: one size bucket
    assert _plan(_map(2100)) == "plan 2"  # the next bucket
    assert _plan(_map(1500), "auto") == "plan 3"  # another algorithm argument
    assert _plan(_map(1500), phase="backward") == "plan 4"
    assert _plan(_map(1500), channels=(32, 64)) == "plan 5"
    assert _plan(_map(1500), dtype=np.float32) == "plan 6"
    assert _plan(_map(1500, stride=(2, 2, 2))) == "plan 7"
    assert len(selections) == 7


def test_shapes_that_do_not_fit_the_map_take_no_plan(selections):
    kernel_map = _map(1500)
    features, weight = _array((1500, 32)), _array((27, 32, 64))
    arrays = PlannableArrays()
    assert execution.layer_plan(arrays, "forward", "", features, weight, kernel_map) == "plan 1"
    for features_shape, weight_shape in (((1400, 32), (27, 32, 64)), ((1500, 32), (8, 32, 64)),
                                         ((1500, 16), (27, 32, 64)), ((1500, 32, 1), (27, 32, 64))):
        assert execution.layer_plan(arrays, "forward", "", _array(features_shape), _array(weight_shape),
                                    kernel_map) is None
    assert execution.layer_plan(arrays, "backward", "", features, weight, kernel_map, _array((1500, 64))) == "plan 2"
    assert execution.layer_plan(arrays, "backward", "", features, weight, kernel_map, _array((1500, 32))) is None
    assert len(selections) == 2


def test_a_rehearsals_selections_are_not_kept(selections):
    with tuner.rehearsal({}):
        assert _plan(_map(8)) == "plan 1"
        assert _plan(_map(8)) == "plan 2"
    assert _plan(_map(8)) == "plan 3"
    assert _plan(_map(8)) == "plan 3"


def test_a_layer_selects_again_after_a_change_a_selection_depends_on_and_only_then(selections, monkeypatch):
    kernel_map = _map()
    _plan(kernel_map)
    monkeypatch.setenv("CUPYSPARSE_TEST_UNRELATED_VARIABLE", "changed")
    monkeypatch.setenv(settings.PREFETCH.name, "0")
    _plan(kernel_map)
    assert len(selections) == 1
    tuner.default_tuner().forget_choices()
    _plan(kernel_map)
    monkeypatch.setenv(ALGORITHM_MODES[(CONV, "forward")].name, "wmma_implicit_gemm")
    _plan(kernel_map)
    monkeypatch.setenv(settings.AUTOTUNE.name, "0")
    _plan(kernel_map)
    with precision.fp32_precision("tf32"):
        _plan(kernel_map)
    _plan(kernel_map)
    assert len(selections) == 6


def test_a_remembered_plan_is_checked_without_parsing_a_setting(selections, monkeypatch):
    kernel_map = _map()
    first = _plan(kernel_map)

    def unread(*arguments):
        raise AssertionError("a setting was parsed")

    for reader in ("autotune", "fp32_precision", "algorithm_mode"):
        monkeypatch.setattr(settings, reader, unread)
    assert [_plan(kernel_map) for _ in range(3)] == [first] * 3


def test_a_selection_that_raises_keeps_nothing(monkeypatch):
    def failing(*arguments):
        raise ValueError("no algorithm can run this problem")

    monkeypatch.setattr(execution, "_plans", {})
    monkeypatch.setattr(execution, "_selected_plan", failing)
    with pytest.raises(ValueError):
        _plan(_map())
    assert execution._plans == {}


def test_no_plan_is_kept_too(monkeypatch):
    """An algorithm without plans: the layer's calls take the full path without selecting again."""
    calls = []
    monkeypatch.setattr(execution, "_plans", {})
    monkeypatch.setattr(execution, "_selected_plan", lambda *arguments: calls.append(1))
    kernel_map = _map()
    assert [_plan(kernel_map) for _ in range(3)] == [None] * 3 and len(calls) == 1


def test_arrays_no_plan_takes_select_nothing(selections):
    features, weight = np.zeros((1500, 32), np.float16), np.zeros((27, 32, 32), np.float16)
    assert execution.layer_plan(execution.core_arrays(), "forward", "", features, weight, _map()) is None
    assert selections == [] and execution._plans == {}


def test_backward_formats_are_derived_for_kept_plans_only_once_per_signature_and_select_nothing(selections,
                                                                                               monkeypatch):
    requested = []
    monkeypatch.setattr(execution, "derive_wgrad_shares", requested.extend)
    plan = types.SimpleNamespace(wgrad_shares=lambda kernel_map: (kernel_map.num_out // 100, False))
    monkeypatch.setattr(execution, "_selected_plan", lambda *arguments: selections.append("backward") or plan)
    kept_map, fresh_map, other_map = _map(1500), _map(1600), _map(40_000)
    channels = (32, 32)
    _plan(kept_map, phase="backward", channels=channels)  # selects and keeps the signature's plan
    calls = [(_array((kernel_map.num_in, 32)), _array((27, *channels)), kernel_map, "")
             for kernel_map in (fresh_map, fresh_map, other_map)]  # the last: another size bucket, no plan kept
    execution.derive_backward_formats(PlannableArrays(), calls)
    assert requested == [(fresh_map, 16, False)]
    assert selections == ["backward"]
