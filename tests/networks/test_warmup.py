"""`python -m cupysparse warmup` without a GPU: the modules it derives from the networks, and the
kernel cache files it writes, which must be exactly those a GPU process of that architecture reads."""

import subprocess
import sys

import numpy as np
import pytest

from cupysparse.cuda import compile as kernel_compile
from cupysparse.networks import warmup
from cupysparse.scripts import warmup as warmup_command
from cupysparse.tuning.search_space import parse_algorithm_filter
from cupysparse.algorithms import CONV
from cupysparse.cuda.dtypes import BFLOAT16, FLOAT16, FLOAT32
from cupysparse.cuda.precision import fp32_precision
from cupysparse.tuning.search_space import candidates


MAP_SOURCES = ("coordinate_hash.cu", "kernel_map_formats.cu")


def convolution_source(source) -> bool:
    """Whether `source` holds convolution kernels: the implicit GEMMs, the tensor cores' wgrad sum and their
    copies of rows that are not whole 16-byte vectors."""
    return source.filename.endswith("implicit_gemm.cu") or source.filename in ("wgrad_sum.cu", "row_padding.cu")


def type_names(source):
    """The CUDA types the module's instantiations take."""
    found = set()
    for expression in source.name_expressions:
        for name in ("__half", "__nv_bfloat16", "float", "double"):
            if f"<{name}," in expression or f"<{name}>" in expression:
                found.add(name)
    return found


def needed(dtype_names, capability, network_names=("minkunet18",)):
    types = [warmup.FeatureType.parse(name) for name in dtype_names]
    return warmup.needed_sources(network_names, types, capability)


def test_fp16_on_hopper_needs_the_tensor_core_modules_of_fp16_and_the_map_kernels():
    sources = needed(["float16"], 90)
    conv = {s for s in sources if s.filename.endswith("implicit_gemm.cu")}
    wgmma = {"wgmma_implicit_gemm.cu"} if kernel_compile.nvrtc_knows("sm_90a") else set()
    assert {s.filename for s in conv} == {"wmma_implicit_gemm.cu", "mma_implicit_gemm.cu", *wgmma}
    assert all(s.architecture == "sm_90a" for s in conv if s.filename in wgmma)
    assert all(type_names(s) == {"__half"} for s in conv)
    assert set(MAP_SOURCES) <= {s.filename for s in sources}
    assert not any("__nv_bfloat16" in type_names(s) for s in sources)
    assert not any(s.filename == "depthwise.cu" for s in sources)  # no network has a depthwise layer


def test_the_plan_holds_the_modules_the_tuners_candidates_launch_and_no_other():
    types = [warmup.FeatureType.parse("float16")]
    sources = warmup.needed_sources(["minkunet18"], types, 90)
    launched = {source for problem in warmup.layer_problems(warmup.NETWORKS["minkunet18"](), types[0], 90)
                for phase in ("forward", "backward")
                for algorithm, params in candidates(parse_algorithm_filter(None, CONV, phase), problem)
                for source in algorithm.kernel_modules(phase, problem, params)}
    assert {s for s in sources if convolution_source(s)} == launched
    declared = {s for s in kernel_compile.registered_sources() if convolution_source(s)
                and type_names(s) == {"__half"}}
    assert len(launched) < len(declared)  # not the tiles, depths and block_k these channel counts never take


def test_before_sm80_fp16_has_no_mma_module_and_bf16_no_convolution_module():
    assert {s.filename for s in needed(["float16"], 75) if "gemm" in s.filename} == {"wmma_implicit_gemm.cu"}
    if BFLOAT16 is not None:
        assert not any("gemm" in s.filename for s in needed(["bfloat16"], 75))


def test_fp32_needs_simt_kernels_and_tf32_the_fp32_tensor_core_module():
    with fp32_precision("ieee"):
        exact = needed(["float32"], 90)
    assert {s.filename for s in exact if "gemm" in s.filename} == {"implicit_gemm.cu"}
    tf32 = needed(["tf32"], 90)
    mma = [s for s in tf32 if s.filename == "mma_implicit_gemm.cu"]
    assert mma and all(type_names(s) == {"float"} for s in mma)
    # mma_implicit_gemm's wgrad sums its fp32 partials with the tensor cores' wgrad-sum kernel.
    assert [s.name_expressions for s in tf32 if s.filename == "wgrad_sum.cu"] == [("wgrad_sum<float>",)]


def test_an_architecture_is_named_sm_xy():
    assert warmup.parse_architecture("sm_90") == warmup.parse_architecture("90") == 90
    for text in ("sm90a", "compute_90", "hopper"):
        with pytest.raises(ValueError, match="sm_XY"):
            warmup.parse_architecture(text)


def test_every_layer_problem_is_listed_once():
    problems = warmup.layer_problems(warmup.NETWORKS["minkunet18"](), warmup.FeatureType.parse("float16"), 90)
    assert len(problems) == len(set(problems))
    assert {(p.in_channels, p.out_channels) for p in problems} >= {(3, 32), (384, 256), (96, 96)}
    assert {(p.stride, p.transposed) for p in problems} == {((1, 1, 1), False), ((2, 2, 2), False),
                                                           ((2, 2, 2), True)}
    assert all(p.dtype == FLOAT16 and p.compute_capability == 90 for p in problems)


@pytest.fixture
def map_modules_only(monkeypatch, tmp_path):
    """Warm-up of the two small kernel-map modules only, into a kernel cache of this test's own."""
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "kernels"))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    sources = [s for s in kernel_compile.registered_sources() if s.filename in MAP_SOURCES]
    monkeypatch.setattr(warmup, "needed_sources", lambda *args: {s: {"test"} for s in sources})
    return tmp_path / "kernels", sources


@pytest.mark.nvrtc
def test_warmup_writes_what_a_gpu_process_of_the_architecture_reads_and_a_second_run_compiles_nothing(
        map_modules_only, monkeypatch, capsys):
    directory, sources = map_modules_only
    assert warmup_command.main(["--arch", "sm_90", "--jobs", "2"]) == 0
    first = capsys.readouterr().out
    option = kernel_compile.architecture_option(90)  # what a process on an sm_90 GPU compiles with
    expected = {kernel_compile.kernel_cache_file(source, option).name for source in sources}
    assert {path.name for path in directory.iterdir()} == expected
    module_lines = [line for line in first.splitlines() if line.startswith("[")]
    assert len(module_lines) == 2 and all("  compiled " in line for line in module_lines)
    assert "compiled 2 of 2 modules" in first

    monkeypatch.setattr(kernel_compile, "nvrtc_compile", lambda *args: pytest.fail("compiled again"))
    for source in sources:  # the call a GPU process's first launch makes
        compiled, compiled_now = kernel_compile.cached_or_compiled(source, option)
        assert not compiled_now and set(compiled.lowered_names) == set(source.name_expressions)
    assert warmup_command.main(["--arch", "sm_90", "--jobs", "1"]) == 0
    assert "compiled 0 of 2 modules (2 were cached, 0 failed)" in capsys.readouterr().out


def test_without_a_gpu_the_architecture_must_be_named(tmp_path):
    result = subprocess.run([sys.executable, "-m", "cupysparse", "warmup", "--list"], capture_output=True, text=True,
                            env={"CUPY_CACHE_DIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 2, result.stderr
    assert "--arch sm_90" in result.stderr


def test_list_names_each_module_and_its_cache_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    assert warmup_command.main(["--arch", "sm_90", "--networks", "minkunet18", "--dtypes", "float16", "--list"]) == 0
    out = capsys.readouterr().out
    for source in needed(["float16"], 90):
        assert str(kernel_compile.kernel_cache_file(source, kernel_compile.source_option(source, 90))) in out
    assert list(tmp_path.iterdir()) == []  # nothing compiled


def test_the_shared_feature_types_follow_the_fp32_precision():
    with fp32_precision("tf32"):
        assert warmup.FeatureType.parse("float32").tf32
    with fp32_precision("ieee"):
        assert not warmup.FeatureType.parse("float32").tf32
    assert warmup.FeatureType.parse("tf32") == warmup.FeatureType("tf32", FLOAT32, True)
    assert warmup.FeatureType.parse("float16").dtype == np.float16
