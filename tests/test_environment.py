"""`environment.variable` against `os.environ`: every change Python makes reaches it, and between
changes it does not read `os.environ` again."""

import os
import subprocess
import sys

from cupysparse import environment
from cupysparse.environment import variable

NAME = "CUPYSPARSE_TEST_ENVIRONMENT_VARIABLE"


def test_a_variable_follows_every_way_python_changes_the_environment(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert variable(NAME, "default") == "default"
    monkeypatch.setenv(NAME, "set by monkeypatch")
    assert variable(NAME, "default") == "set by monkeypatch"
    os.environ[NAME] = "assigned"
    assert variable(NAME) == "assigned"
    del os.environ[NAME]
    assert variable(NAME, "default") == "default"
    os.environ.update({NAME: "updated"})
    assert variable(NAME) == "updated"
    assert os.environ.pop(NAME) == "updated"
    assert variable(NAME) == ""
    monkeypatch.setenv(NAME, "naïve ünïcode")
    assert variable(NAME) == "naïve ünïcode"


def test_a_name_is_read_from_os_environ_once_and_changes_arrive_through_the_hook(monkeypatch):
    monkeypatch.setenv(NAME, "before")
    other = NAME + "_NEVER_SET"
    monkeypatch.delenv(other, raising=False)
    environment._values.pop(other, None)
    reads = []
    get = os.environ.get

    def counted(name, default=None):
        if name in (NAME, other):
            reads.append(name)
        return get(name, default)

    monkeypatch.setattr(os.environ, "get", counted)
    try:
        assert [variable(other, "unset") for _ in range(3)] == ["unset"] * 3
        assert [variable(NAME) for _ in range(3)] == ["before"] * 3
        assert reads == [other]  # NAME's value came with its change
        os.environ[other] = "now set"
        assert variable(other, "unset") == "now set"
        assert reads == [other]
    finally:
        os.environ.pop(other, None)


def test_the_count_of_changes_moves_with_every_change_and_only_then(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    before = environment.changes()
    assert environment.changes() == before
    variable(NAME)  # a read is no change
    assert environment.changes() == before
    monkeypatch.setenv(NAME, "one")
    after_setting = environment.changes()
    assert after_setting != before
    os.unsetenv(NAME)  # directly, past os.environ
    assert environment.changes() not in (before, after_setting)


def test_without_the_hook_every_read_goes_to_os_environ():
    """An audit hook that refuses new hooks keeps this one out: `variable` then reads `os.environ`."""
    script = f"""
import os, sys

def refuse_new_hooks(event, arguments):
    if event == "sys.addaudithook":
        raise RuntimeError("no further audit hooks")

sys.addaudithook(refuse_new_hooks)
from cupysparse import environment
assert not environment._hooked
os.environ[{NAME!r}] = "first"
assert environment.variable({NAME!r}) == "first"
os.environ[{NAME!r}] = "second"
assert environment.variable({NAME!r}) == "second"
assert environment.changes() != environment.changes()  # no change can be seen: every check says changed
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
