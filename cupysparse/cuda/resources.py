"""What each kernel takes of a multiprocessor, from the compiler alone (no GPU): ptxas's report through NVRTC
of a kernel's registers a thread, static shared memory, stack and spilled bytes, and the warps a multiprocessor
holds at those registers.

A memory-bound kernel lives on its occupancy, which its registers bound: two passes of the training batch norm
joined into one kernel took 125 registers a thread where each alone took at most 64, and so two blocks of 256
threads a multiprocessor instead of four. No test sees that, and a GPU machine's time is too short to find it by
trial: `cupysparse-warmup --resources` reports every kernel a network loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cupysparse.cuda.compile import KernelSource, nvrtc_compile
from cupysparse.cuda.device import WARP_SIZE

REGISTERS_PER_MULTIPROCESSOR = 65536
REGISTER_UNIT = 256  # a warp's registers are allocated in units of this many
# The most warps a multiprocessor holds, by compute capability, where it is not 64 (the CUDA programming
# guide's table of compute capabilities).
_MAX_WARPS = {86: 48, 87: 48, 89: 48, 120: 48, 121: 48}

_ENTRY = re.compile(r"(?:Compiling entry function|Function properties for) '?([\w$.]+)'?")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SHARED = re.compile(r"(\d+) bytes smem")


def max_resident_warps(capability: int) -> int:
    """The most warps a multiprocessor of `capability` (e.g. 90) holds at once."""
    return _MAX_WARPS.get(capability, 64)


@dataclass(frozen=True)
class KernelResources:
    """One compiled kernel as ptxas reports it."""

    registers: int  # a thread's
    shared_bytes: int  # static shared memory of a block
    stack_bytes: int  # a thread's stack frame
    spill_stores: int  # bytes a thread spills to local memory
    spill_loads: int

    def resident_warps(self, capability: int) -> int:
        """The warps a multiprocessor of `capability` holds at these registers, before the block size, shared
        memory and the multiprocessor's block limit are counted."""
        per_warp = max(REGISTER_UNIT, -(-self.registers * WARP_SIZE // REGISTER_UNIT) * REGISTER_UNIT)
        return min(max_resident_warps(capability), REGISTERS_PER_MULTIPROCESSOR // per_warp)


def kernel_resources(source: KernelSource, architecture_option: str) -> dict[str, KernelResources]:
    """Each name expression of `source` compiled for `architecture_option` (`-arch=sm_XY`: ptxas runs only for a
    real architecture), as ptxas reports it."""
    if not architecture_option.startswith("-arch=sm_"):
        raise ValueError(f"registers are assigned only for a real architecture (-arch=sm_XY), got "
                         f"{architecture_option!r}: PTX is compiled by the driver when it is loaded")
    compiled = nvrtc_compile(source, architecture_option, ("-Xptxas=-v",))
    return parse_ptxas_report(compiled.log, compiled.lowered_names)


def parse_ptxas_report(log: str, lowered_names: dict[str, str]) -> dict[str, KernelResources]:
    """The resources of each name expression of `lowered_names` (expression → mangled name) in ptxas's verbose
    `log`; a kernel it does not mention is missing from the result."""
    found: dict[str, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if entry := _ENTRY.search(line):
            current = found.setdefault(entry.group(1), {})
        elif current is None:
            continue
        if frame := _FRAME.search(line):
            current.update(stack_bytes=int(frame.group(1)), spill_stores=int(frame.group(2)),
                           spill_loads=int(frame.group(3)))
        if used := _USED.search(line):
            shared = _SHARED.search(line)
            current.update(registers=int(used.group(1)), shared_bytes=int(shared.group(1)) if shared else 0)
    resources = {}
    for expression, mangled in lowered_names.items():
        values = found.get(mangled, {})
        if "registers" in values:
            resources[expression] = KernelResources(
                values["registers"], values["shared_bytes"], values.get("stack_bytes", 0),
                values.get("spill_stores", 0), values.get("spill_loads", 0))
    return resources
