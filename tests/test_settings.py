"""`cupysparse.settings`: every variable defined there and read nowhere else, values parsed strictly,
and `selection_state()` moving with every change that may change a selection, and only then."""

import os
import re
from pathlib import Path

import pytest

from cupysparse import settings

PACKAGE = Path(settings.__file__).parent
SWITCHES = {
    settings.AUTOTUNE: settings.autotune,
    settings.SHIPPED_CACHE: settings.shipped_cache,
    settings.PREFETCH: settings.prefetch,
    settings.NVRTC_LINEINFO: settings.nvrtc_lineinfo,
}


def _sources():
    roots = [PACKAGE, PACKAGE.parent / "adapters", PACKAGE.parent / "scripts"]
    for root in roots:
        yield from (path for path in root.rglob("*.py") if path.resolve() != Path(settings.__file__).resolve())


def test_every_variable_the_code_names_is_defined_in_settings():
    defined = {variable.name for variable in settings.VARIABLES}
    named = {name for path in _sources() for name in re.findall(r"CUPYSPARSE_[A-Z0-9_]+", path.read_text())}
    assert named <= defined, f"named but not defined in cupysparse.settings: {sorted(named - defined)}"


def test_no_module_but_settings_reads_the_environment():
    reads = re.compile(r"os\.environ\.get|os\.getenv|os\.environ\[[^]]+\](?!\s*=)")
    readers = [f"{path.name}:{number}" for path in _sources() if "/scripts/" not in str(path)
               for number, line in enumerate(path.read_text().splitlines(), 1) if reads.search(line)]
    assert readers == []


@pytest.mark.parametrize("variable", list(SWITCHES), ids=lambda v: v.name)
def test_a_switch_takes_the_usual_words_in_any_case_and_blank_is_its_default(variable, monkeypatch):
    read = SWITCHES[variable]
    for value in ("1", "true", "ON", " Yes "):
        monkeypatch.setenv(variable.name, value)
        assert read() is True
    for value in ("0", "False", "off", "NO"):
        monkeypatch.setenv(variable.name, value)
        assert read() is False
    default = variable.default == "1"
    monkeypatch.setenv(variable.name, "  ")
    assert read() is default
    monkeypatch.delenv(variable.name)
    assert read() is default


@pytest.mark.parametrize("variable", list(SWITCHES), ids=lambda v: v.name)
def test_a_mistyped_switch_is_an_error_naming_it_and_its_valid_values(variable, monkeypatch):
    monkeypatch.setenv(variable.name, "flase")
    with pytest.raises(ValueError, match=rf"{variable.name}='flase'.*valid values: 1, true, on, yes, 0, false"):
        SWITCHES[variable]()


def test_fp32_precision_is_checked_on_every_device(monkeypatch):
    monkeypatch.delenv(settings.FP32_PRECISION.name, raising=False)
    assert settings.fp32_precision() == "ieee"
    monkeypatch.setenv(settings.FP32_PRECISION.name, " TF32 ")
    assert settings.fp32_precision() == "tf32"
    monkeypatch.setenv(settings.FP32_PRECISION.name, "tf16")
    with pytest.raises(ValueError, match="CUPYSPARSE_FP32_PRECISION='tf16'.*valid values: ieee, tf32"):
        settings.fp32_precision()


def test_the_cache_directory_expands_the_home_directory(monkeypatch):
    monkeypatch.delenv(settings.BENCHMARK_CACHE_DIR.name, raising=False)
    assert settings.benchmark_cache_dir() == os.path.expanduser("~/.cache/cupysparse")
    monkeypatch.setenv(settings.BENCHMARK_CACHE_DIR.name, "~/elsewhere")
    assert settings.benchmark_cache_dir() == os.path.expanduser("~/elsewhere")


def test_readers_see_every_way_python_changes_the_environment(monkeypatch):
    name = settings.AUTOTUNE.name
    monkeypatch.delenv(name, raising=False)
    assert settings.autotune()
    os.environ[name] = "0"
    assert not settings.autotune()
    del os.environ[name]
    assert settings.autotune()
    monkeypatch.setenv(name, "off")
    assert not settings.autotune()


def test_the_selection_state_moves_with_a_selection_variable_and_changed_and_only_then(monkeypatch):
    monkeypatch.delenv(settings.FWD_ALGO_MODE.name, raising=False)
    before = settings.selection_state()
    assert settings.selection_state() == before
    monkeypatch.setenv("CUPYSPARSE_TEST_UNRELATED_VARIABLE", "1")
    monkeypatch.setenv(settings.PREFETCH.name, "0")  # no selection depends on it
    assert settings.selection_state() == before
    monkeypatch.setenv(settings.FWD_ALGO_MODE.name, "implicit_gemm")
    after_setting = settings.selection_state()
    assert after_setting != before
    assert settings.selection_state() == after_setting
    monkeypatch.delenv(settings.FWD_ALGO_MODE.name)
    assert settings.selection_state() == before  # the values select as before
    settings.changed()
    assert settings.selection_state() not in (before, after_setting)
