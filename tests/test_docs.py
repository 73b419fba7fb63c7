"""The documentation cannot drift from the code:

- every ```python block of README.md and docs/**/*.md runs as written, the blocks of a page in order in
  one namespace (a later block may use an earlier one's names), in a fresh working directory with its
  own tuning cache. A block whose first line is `# needs: gpu` runs only in the GPU suite
  (`pytest -m gpu`), after the page's other blocks; a block that imports PyTorch or JAX skips the rest
  of its page where that framework is not installed;
- every results page under docs/results/ is exactly what the last command of its "Reproduce" block
  writes from the data files committed beside it.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RESULTS = ROOT / "docs" / "results"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
NEEDS_GPU = "# needs: gpu"
# An import of a framework, directly or through its adapter.
FRAMEWORK_IMPORT = re.compile(r"^\s*(?:import|from)\s+(torch|jax)\b|cupysparse\.adapters(?:\.|\s+import\s+)(torch|jax)\b",
                              re.MULTILINE)


def python_blocks(page: Path) -> list[str]:
    return PYTHON_BLOCK.findall(page.read_text())


def needs_gpu(block: str) -> bool:
    return block.split("\n", 1)[0].strip() == NEEDS_GPU


def page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def pages_with(predicate) -> list:
    return [pytest.param(page, id=page_id(page)) for page in PAGES if any(map(predicate, python_blocks(page)))]


def run_blocks(page: Path, blocks: list[str], tmp_path: Path, monkeypatch) -> None:
    """`blocks` of `page` in order in one namespace, in `tmp_path` with a tuning cache of its own."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path / "tuning-cache"))
    namespace: dict = {"__name__": "__doc_block__"}
    for index, block in enumerate(blocks):
        for match in FRAMEWORK_IMPORT.finditer(block):
            framework = match.group(1) or match.group(2)
            if importlib.util.find_spec(framework) is None:
                pytest.skip(f"{page_id(page)}, block {index + 1}: {framework} is not installed")
        exec(compile(block, f"{page_id(page)} (python block {index + 1})", "exec"), namespace)


@pytest.mark.parametrize("page", pages_with(lambda block: not needs_gpu(block)))
def test_python_blocks_run_on_the_cpu(page, tmp_path, monkeypatch):
    run_blocks(page, [block for block in python_blocks(page) if not needs_gpu(block)], tmp_path, monkeypatch)


@pytest.mark.gpu  # tests/conftest.py skips it without a GPU
@pytest.mark.parametrize("page", pages_with(needs_gpu))
def test_python_blocks_run_on_the_gpu(page, tmp_path, monkeypatch):
    run_blocks(page, python_blocks(page), tmp_path, monkeypatch)


def reproduce_command(page: Path) -> list[str]:
    """The last command of the page's bash block: the one that writes the page from its data."""
    block = BASH_BLOCK.findall(page.read_text())[-1]
    commands = [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return shlex.split(commands[-1])


def console_script(name: str):
    (script,) = entry_points(group="console_scripts", name=name)
    return script


@pytest.mark.parametrize("page", [pytest.param(page, id=page_id(page)) for page in sorted(RESULTS.glob("*.md"))])
def test_results_pages_are_what_their_data_gives(page, tmp_path, monkeypatch):
    command, *arguments = reproduce_command(page)
    script = console_script(command)
    if script.module.endswith("benchmark_network"):
        pytest.importorskip("torch")  # the network benchmark's module imports it
    copy = tmp_path / RESULTS.relative_to(ROOT)
    copy.mkdir(parents=True)
    for data in RESULTS.iterdir():
        if data.suffix in (".csv", ".json"):
            shutil.copy(data, copy)
    monkeypatch.chdir(tmp_path)
    assert script.load()(arguments) == 0
    written = tmp_path / page.relative_to(ROOT)
    assert written.read_text() == page.read_text(), (
        f"{page_id(page)} differs from what `{shlex.join([command, *arguments])}` writes from its data: "
        "regenerate it with that command"
    )
