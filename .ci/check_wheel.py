"""Check a built cupysparse wheel: the mapped folders live under `cupysparse/`, never at top level,
and every shipped tuning cache of the source tree next to this script is in it.

Usage: python .ci/check_wheel.py WHEEL
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path, PurePosixPath

SOURCE_ROOT = Path(__file__).resolve().parent.parent


def shipped_caches(root: Path) -> list[str]:
    """The wheel paths of the source tree's shipped tuning caches (package data)."""
    folder = root / "cupysparse" / "tuning" / "shipped_caches"
    return sorted(f"cupysparse/tuning/shipped_caches/{path.name}" for path in folder.glob("*.msgpack"))


def problems(names: list[str], shipped: list[str] = ()) -> list[str]:
    paths = [PurePosixPath(name) for name in names]
    found = []
    missing = [name for name in shipped if name not in names]
    if missing:
        found.append(f"shipped tuning caches missing: {', '.join(missing)}")
    if not any(path.parent == PurePosixPath("cupysparse/raw_kernels") and path.suffix == ".cu" for path in paths):
        found.append("no cupysparse/raw_kernels/*.cu")
    if "cupysparse/adapters/__init__.py" not in names:
        found.append("no cupysparse/adapters/__init__.py")
    if not any(name.startswith("cupysparse/scripts/") for name in names):
        found.append("no cupysparse/scripts/")
    # Only the package and its metadata may be installed: a top-level `adapters` would clash with PyPI's.
    top_level = {path.parts[0] for path in paths}
    stray = sorted(name for name in top_level if name != "cupysparse" and not name.endswith(".dist-info"))
    if stray:
        found.append(f"top-level entries besides cupysparse/: {', '.join(stray)}")
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    with zipfile.ZipFile(argv[0]) as wheel:
        names = wheel.namelist()
    found = problems(names, shipped_caches(SOURCE_ROOT))
    for problem in found:
        print(f"check_wheel: {argv[0]}: {problem}", file=sys.stderr)
    if not found:
        print(f"check_wheel: {argv[0]}: ok ({len(names)} files)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
