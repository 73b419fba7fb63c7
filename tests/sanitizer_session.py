"""A pytest plugin for runs under compute-sanitizer, loaded by scripts/sanitizer_check.sh with
`-p sanitizer_session` (this folder on PYTHONPATH); ordinary test runs never load it.

- `--raw-allocations`: CuPy allocates every array with its own cudaMalloc (the memory pool off), so
  memcheck knows each array's bounds: a read past the end of an array inside a pooled block, or
  into its neighbour in the same block, would go unnoticed. (The script turns PyTorch's and JAX's
  pools off through their environment variables.)
- `--shard I/N`: run only the tests at positions I-1, I-1+N, I-1+2N, ... of the selection
  (interleaved, so every shard gets a share of every file and parametrisation).
- `--skip-first K`: leave out the shard's first K tests: resumes a run its time budget stopped.
- `--time-budget SECONDS`: start no test once this process has run that long; the tests left are
  counted, and the run report says where to resume.
- `--run-report PATH`: write `key=value` lines: selected, skipped_first, run, failed, not_run,
  resume_skip_first (what `--skip-first` resumes with), elapsed_s.
"""

from __future__ import annotations

import time

import pytest

PROGRESS_EVERY = 25  # tests between two progress lines


def pytest_addoption(parser):
    group = parser.getgroup("sanitizer_session", "runs under compute-sanitizer (scripts/sanitizer_check.sh)")
    group.addoption("--raw-allocations", action="store_true",
                    help="allocate every CuPy array with cudaMalloc (no memory pool)")
    group.addoption("--shard", default="1/1", help="I/N: every N-th test of the selection, from the I-th")
    group.addoption("--skip-first", type=int, default=0, help="leave out the shard's first K tests")
    group.addoption("--time-budget", type=float, default=None, help="start no test after this many seconds")
    group.addoption("--run-report", default=None, help="write the run's counts to this file")


def pytest_configure(config):
    config.pluginmanager.register(SanitizerSession(config), "sanitizer_session_state")


def parse_shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard takes I/N, got {text!r}") from None
    if not 1 <= index <= count:
        raise pytest.UsageError(f"--shard I/N needs 1 <= I <= N, got {text!r}")
    return index, count


class SanitizerSession:
    def __init__(self, config):
        self.config = config
        self.begin = time.monotonic()
        self.shard = parse_shard(config.getoption("shard"))
        self.skip_first = config.getoption("skip_first")
        self.budget = config.getoption("time_budget")
        self.selected = self.run = self.failed = 0
        self.failed_ids: set[str] = set()
        self.session = None
        if config.getoption("raw_allocations"):
            import cupy

            cupy.cuda.set_allocator(None)

    def pytest_sessionstart(self, session):
        self.session = session

    @pytest.hookimpl(trylast=True)  # after -m and -k have deselected
    def pytest_collection_modifyitems(self, config, items):
        index, count = self.shard
        in_shard = items[index - 1 :: count]
        kept = in_shard[self.skip_first :]
        kept_ids = {id(item) for item in kept}
        deselected = [item for item in items if id(item) not in kept_ids]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
        items[:] = kept
        self.selected = len(kept)

    def pytest_runtest_logreport(self, report):
        if report.failed and report.nodeid not in self.failed_ids:
            self.failed_ids.add(report.nodeid)
            self.failed += 1

    def pytest_runtest_logfinish(self, nodeid, location):
        self.run += 1
        elapsed = time.monotonic() - self.begin
        if self.run % PROGRESS_EVERY == 0 or self.run == self.selected:
            self.write_line(f"sanitizer session: {self.run}/{self.selected} tests, {self.failed} failed, "
                            f"{elapsed:.0f} s")
        if self.budget is not None and elapsed > self.budget and self.run < self.selected:
            self.session.shouldstop = (f"time budget of {self.budget:.0f} s spent after {self.run} of "
                                       f"{self.selected} tests; resume with --skip-first {self.resume_point()}")

    def resume_point(self) -> int:
        return self.skip_first + self.run

    def pytest_sessionfinish(self, session, exitstatus):
        path = self.config.getoption("run_report")
        if not path:
            return
        not_run = self.selected - self.run
        lines = {
            "selected": self.selected,
            "skipped_first": self.skip_first,
            "run": self.run,
            "failed": self.failed,
            "not_run": not_run,
            "resume_skip_first": self.resume_point() if not_run else "",
            "elapsed_s": round(time.monotonic() - self.begin),
        }
        with open(path, "w") as handle:
            handle.writelines(f"{key}={value}\n" for key, value in lines.items())

    def write_line(self, text: str) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(text)
