"""Environment variables read on every convolution call, kept until the environment changes.

A planned call checks the settings its plan was selected under (`layer_plans`): the algorithm mode
variable, CUPYSPARSE_AUTOTUNE and CUPYSPARSE_FP32_PRECISION, so that a change takes effect at the next
call. `os.environ.get` of a variable that is not set raises and catches a KeyError inside: 2 µs each on
an H100 machine's host, where the three came to 8 µs of a 100K-voxel forward's 25-35 µs of host time.

Python raises an audit event with every change to the process's environment (PEP 578: `os.putenv` with
the name and value, `os.unsetenv` with the name; `os.environ[name] = value`, `del os.environ[name]` and
pytest's `monkeypatch` all go through them). `variable` reads a name from `os.environ` once, and the
audit hook writes every later change of it, with its new value, as it happens. Where the hook was not
added (an earlier hook may refuse new ones), every read goes to `os.environ`.

`changes()` counts the changes, so that a caller keeping something derived from several variables
(a layer's plan) checks one number per call rather than reading each.
"""

from __future__ import annotations

import os
import sys
import threading

_PUTENV, _UNSETENV = "os.putenv", "os.unsetenv"
_PROBE = "cupysparse.environment.probe"
_UNSET = None
_UNREAD = object()

# name -> its value, or _UNSET: what `variable` read, with every change since (any name changed is here).
_values: dict[str, str | None] = {}
_lock = threading.Lock()  # orders a first read and a change of the same name
_hooked = False
_changes = 0  # changes to the environment the hook has seen


def _on_audit_event(event: str, arguments: tuple) -> None:
    # Called for every audit event of the process: cheap unless the environment changes.
    global _changes
    if event == _PUTENV:
        with _lock:
            _values[os.fsdecode(arguments[0])] = os.fsdecode(arguments[1])
            _changes += 1
    elif event == _UNSETENV:
        with _lock:
            _values[os.fsdecode(arguments[0])] = _UNSET
            _changes += 1
    elif event == _PROBE:
        global _hooked
        _hooked = True


sys.addaudithook(_on_audit_event)
sys.audit(_PROBE)  # sets `_hooked` only if the hook was added


def variable(name: str, default: str = "") -> str:
    """`os.environ.get(name, default)`, read from `os.environ` once, then kept up to date by the
    audit hook (which also sees `os.putenv` called directly, which `os.environ` does not)."""
    value = _values.get(name, _UNREAD)
    if value is _UNREAD:
        if not _hooked:
            return os.environ.get(name, default)
        with _lock:
            value = _values.setdefault(name, os.environ.get(name, _UNSET))
    return default if value is _UNSET else value


def changes() -> object:
    """A value that differs after every change to the environment: the count of changes, or without the
    hook, which cannot see them, a new object each call (equal to nothing before it)."""
    return _changes if _hooked else object()
