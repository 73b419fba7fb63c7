"""ptxas's report of each kernel's resources through NVRTC (`cupysparse.cuda.resources`), against what probe
kernels are built to take, and on the GPU against the driver's attributes of the library's own kernels."""

import numpy as np
import pytest

from cupysparse.cuda import compile as kernel_compile
from cupysparse.cuda.backend import cupy_module
from cupysparse.cuda.resources import KernelResources, kernel_resources, max_resident_warps
from cupysparse.functional import training_norm
from cupysparse.networks import warmup
from cupysparse.scripts import warmup as warmup_command

PROBES = r"""
// A static shared buffer of exactly 4000 bytes.
__global__ void buffered(float* out) {
  __shared__ float buffer[1000];
  buffer[threadIdx.x] = threadIdx.x;
  __syncthreads();
  out[threadIdx.x] = buffer[999 - threadIdx.x];
}

// A local array written and read at indices known only at run time lives in the stack frame (256 bytes), not in
// registers.
__global__ void indexed(float* out, int stride) {
  float local[64];
  for (int i = 0; i < 64; ++i) local[(i * stride) & 63] = out[i];
  out[threadIdx.x] = local[threadIdx.x & 63];
}

// 48 sums live across a loop: 48 registers a thread at least, so bounded to two blocks of 1024 threads a
// multiprocessor (32 registers a thread) the sums spill.
template <int MIN_BLOCKS>
__global__ void __launch_bounds__(1024, MIN_BLOCKS) sums(const float* in, float* out, int rows) {
  float total[48];
#pragma unroll
  for (int j = 0; j < 48; ++j) total[j] = 0.0f;
  for (int row = 0; row < rows; ++row) {
    const float value = in[row * 1024 + threadIdx.x];
#pragma unroll
    for (int j = 0; j < 48; ++j) total[j] = fmaf(total[j], value, (float)j);
  }
#pragma unroll
  for (int j = 0; j < 48; ++j) out[j * 1024 + threadIdx.x] = total[j];
}
"""


@pytest.fixture
def probes(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_compile, "KERNEL_DIR", tmp_path)
    kernel_compile.load_source.cache_clear()
    (tmp_path / "probes.cu").write_text(PROBES)
    monkeypatch.setattr(kernel_compile, "_REGISTRY", [])
    yield kernel_compile.KernelSource("probes.cu", ("buffered", "indexed", "sums<1>", "sums<2>"))
    kernel_compile.load_source.cache_clear()


@pytest.mark.nvrtc
def test_the_report_gives_each_probe_what_it_is_built_to_take(probes):
    resources = kernel_resources(probes, "-arch=sm_90")
    assert set(resources) == set(probes.name_expressions)
    assert resources["buffered"].shared_bytes == 4000
    assert resources["indexed"].stack_bytes >= 64 * 4
    unbounded, bounded = resources["sums<1>"], resources["sums<2>"]
    assert unbounded.registers >= 48 and unbounded.spill_stores == unbounded.spill_loads == 0
    assert bounded.registers <= 32 and bounded.spill_stores > 0 and bounded.spill_loads > 0
    assert bounded.resident_warps(90) == 64  # two blocks of 32 warps
    assert all(0 < used.registers <= 255 for used in resources.values())
    assert resources["buffered"].stack_bytes == resources["buffered"].spill_stores == 0


@pytest.mark.nvrtc
def test_a_virtual_architecture_has_no_registers_to_report(probes):
    with pytest.raises(ValueError, match="real architecture"):
        kernel_resources(probes, "-arch=compute_90")


@pytest.mark.parametrize("registers, capability, warps", [
    (125, 90, 16),  # 4096 registers a warp: two blocks of 256 threads
    (64, 90, 32),
    (47, 90, 42),  # rounded up to 48 a thread, 1536 a warp
    (255, 90, 8),
    (24, 90, 64),  # as many as the multiprocessor holds at all
    (24, 86, 48),
    (1, 80, 64),
])
def test_resident_warps_count_a_warps_registers_in_units_of_256(registers, capability, warps):
    assert KernelResources(registers, 0, 0, 0, 0).resident_warps(capability) == warps


def test_an_ampere_consumer_part_holds_fewer_warps_than_a_data_center_one():
    assert (max_resident_warps(80), max_resident_warps(86), max_resident_warps(90)) == (64, 48, 64)


@pytest.mark.nvrtc
def test_warmup_prints_each_kernel_of_each_module_and_marks_spills(probes, monkeypatch, capsys):
    module = warmup.PlannedModule(probes, 90, "-arch=sm_90", ("probe",))
    monkeypatch.setattr(warmup_command, "plan", lambda *args: [module])
    assert warmup_command.main(["--arch", "sm_90", "--resources", "--networks", "minkunet18"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index(f"sm_90 {module.describe()}")
    reported = {line.split(" B stack")[1].split()[0]: line for line in lines[start + 1 : start + 5]}
    assert set(reported) == set(probes.name_expressions)
    assert "4000 B static shared" in reported["buffered"]
    assert "64/64 warps" in reported["sums<2>"] and "SPILLS" in reported["sums<2>"]
    assert "SPILLS" not in reported["sums<1>"]


@pytest.mark.gpu
def test_the_report_matches_the_drivers_attributes_of_the_training_norms_kernels():
    """The registers, static shared memory and local memory ptxas reports for the GPU's own architecture are what
    the driver says of the loaded kernels."""
    cupy = cupy_module()
    driver = cupy.cuda.driver
    capability = int(cupy.cuda.Device().compute_capability)
    source = training_norm._KERNELS[np.dtype(np.float16)]
    option = kernel_compile.source_option(source, capability)
    if not option.startswith("-arch=sm_"):
        pytest.skip(f"this NVRTC compiles PTX for sm_{capability}")
    for expression, used in kernel_resources(source, option).items():
        function = source.get(expression).ptr
        assert used.registers == driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_NUM_REGS, function), expression
        assert used.shared_bytes == driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, function)
        assert used.stack_bytes == driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, function)
