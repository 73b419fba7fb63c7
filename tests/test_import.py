"""`import cupysparse` works, and convolves on the CPU, without CuPy; and with an unusable CuPy cache directory."""

from __future__ import annotations

import os
import subprocess
import sys

# Makes CuPy look uninstalled inside the subprocess, whatever the environment has.
BLOCK_CUPY = """
import sys

class _BlockCuPy:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"cupy", "cupyx", "cupy_backends"}:
            raise ImportError(f"{name} is blocked by the test")
        return None

sys.meta_path.insert(0, _BlockCuPy())
"""


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_import_and_info_without_cupy():
    result = run_python(
        BLOCK_CUPY
        + """
import numpy as np

import cupysparse
import cupysparse.cuda.backend
import cupysparse.scripts.info

assert not cupysparse.cuda.backend.gpu_available()
tensor = cupysparse.SparseTensor(np.array([[0, 0, 0, 0], [0, 0, 0, 1]], np.int32), np.ones((2, 2)))
out = cupysparse.spatially_sparse_conv(tensor, np.ones((27, 2, 3)), 3)
assert out.features.tolist() == [[4.0] * 3, [4.0] * 3]
assert cupysparse.cuda.backend.cupy_module() is None
cupysparse.scripts.info.main()
"""
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.split() == ["backend:", "numpy", "(CuPy", "not", "installed)"] for line in lines), result.stdout
    assert any(line.startswith("cupy:") and "not found (CuPy not installed)" in line for line in lines), result.stdout


def test_import_with_unwritable_cupy_cache_dir(tmp_path):
    regular_file = tmp_path / "not-a-directory"
    regular_file.write_text("")
    # A directory under a regular file cannot be created, even by root; `import cupy` alone would crash.
    env = {**os.environ, "CUPY_CACHE_DIR": str(regular_file / "kernel_cache"), "TMPDIR": str(tmp_path)}
    result = run_python(
        """
import importlib.util
import cupysparse.cuda.backend as backend

backend.gpu_available()
if importlib.util.find_spec("cupy") is not None:
    assert backend.cupy_module() is not None, "CuPy failed to import"
""",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "RuntimeWarning" in result.stderr and "not writable" in result.stderr, result.stderr
