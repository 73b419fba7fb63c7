"""The benchmark-cache scripts on a hand-made cache: inspect's layout, limits and search; analyze's
statistics, margins and recommended candidate set, whose expected values are worked out by hand."""

import errno
import os
import pathlib
import sys
import warnings

import pytest
from cupysparse.scripts import analyze_autotune_cache as analyze
from cupysparse.scripts import inspect_benchmark_cache as inspect_cache

from cupysparse.cuda.compile import KERNEL_DIR, source_digest
from cupysparse.tuning import shipped
from cupysparse.tuning.cache_file import BenchmarkCache, cache_file_path

ISSUE_KEY = (
    ("log_num_in_coords", 21),
    ("log_num_out_coords", 21),
    ("in_channels", 3),
    ("out_channels", 32),
    ("kernel_volume", 27),
    ("in_dtype", "float16"),
)
ISSUE_RESULTS = [("implicit_gemm", {"fwd_block_size": 16}, 4.149), ("wmma_implicit_gemm", {}, 10.814)]
ISSUE_BLOCK = """\
----------------------------------------
Configuration 1:
----------------------------------------
Config Parameters:
  log_num_in_coords: 21
  log_num_out_coords: 21
  in_channels: 3
  out_channels: 32
  kernel_volume: 27
  in_dtype: float16

Results:
  [
    [
      "implicit_gemm"
      {
        fwd_block_size: 16
      }
      4.149
    ]
    ["wmma_implicit_gemm", {}, 10.814]
  ]
"""


def key(log_n, c_in, c_out, volume=27, dtype="float16"):
    return (
        ("log_num_in_coords", log_n),
        ("log_num_out_coords", log_n),
        ("in_channels", c_in),
        ("out_channels", c_out),
        ("kernel_volume", volume),
        ("in_dtype", dtype),
        ("compute_capability", "sm_90"),
    )


INSPECT_CACHE = {
    "sparse_conv_forward": [
        (ISSUE_KEY, ISSUE_RESULTS),
        (
            key(18, 32, 64),
            [  # stored out of order: shown best first all the same
                ("implicit_gemm", {"fwd_block_size": 32}, 1.5),
                ("wmma_implicit_gemm", {}, 1.0),
                ("explicit_gemm", {}, 2.25),
            ],
        ),
        (
            key(17, 64, 64, dtype="float32"),
            [("explicit_gemm", {}, 0.5), ("implicit_gemm", {"fwd_block_size": 16}, 0.75)],
        ),
    ],
    "sparse_conv_backward": [(key(18, 32, 64), [("explicit_gemm", {}, 3.0), ("implicit_gemm", {}, 3.5)])],
    "wmma_implicit_gemm_sm80": [
        (key(18, 32, 64), [("wmma_implicit_gemm", {"tile": 64}, 0.9)]),
        (key(20, 64, 128), [("wmma_implicit_gemm", {"tile": 128}, 2.0)]),
    ],
}


def write_cache(contents: dict) -> None:
    cache = BenchmarkCache(autosave=False)
    for namespace, configurations in contents.items():
        for config_key, results in configurations:
            cache.put(namespace, config_key, results)
    cache.save()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def inspect_cache_file(cache_dir):
    write_cache(INSPECT_CACHE)
    return cache_file_path()


def run_inspect(capsys, *argv):
    status = inspect_cache.main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def configuration_blocks(output: str) -> list[str]:
    """Each configuration block, from its opening rule to the closing bracket of its results."""
    rule = "-" * 40 + "\nConfiguration "
    end = "\n  ]\n"
    return [rule + part[: part.index(end) + len(end)] for part in output.split(rule)[1:]]


def test_inspect_namespace_reproduces_the_issue_layout(inspect_cache_file, capsys):
    status, out, _ = run_inspect(capsys, "namespace=sparse_conv_forward")
    assert status == 0
    assert out.startswith("Namespace: sparse_conv_forward (3 configurations)\n")
    blocks = configuration_blocks(out)
    assert len(blocks) == 3
    assert blocks[0] == ISSUE_BLOCK
    assert blocks[1].endswith(  # without parameters on one line, whatever the rank; with them spelled out
        "Results:\n"
        "  [\n"
        '    ["wmma_implicit_gemm", {}, 1.000]\n'
        "    [\n"
        '      "implicit_gemm"\n'
        "      {\n"
        "        fwd_block_size: 32\n"
        "      }\n"
        "      1.500\n"
        "    ]\n"
        '    ["explicit_gemm", {}, 2.250]\n'
        "  ]\n"
    )
    assert "  compute_capability: sm_90\n" in blocks[1]


def test_inspect_best_only_and_top_k_limit_the_results(inspect_cache_file, capsys):
    _, best_only, _ = run_inspect(capsys, "namespace=sparse_conv_forward", "--best-only")
    first = configuration_blocks(best_only)[0]
    assert first == ISSUE_BLOCK.replace('    ["wmma_implicit_gemm", {}, 10.814]\n', "")
    assert "10.814" not in best_only and "1.500" not in best_only and "0.750" not in best_only

    _, top_two, _ = run_inspect(capsys, "namespace=sparse_conv_forward", "--top-k", "2")
    second = configuration_blocks(top_two)[1]
    assert second.endswith('    ["wmma_implicit_gemm", {}, 1.000]\n    [\n      "implicit_gemm"\n      {\n'
                           "        fwd_block_size: 32\n      }\n      1.500\n    ]\n  ]\n")
    assert "2.250" not in top_two
    assert configuration_blocks(top_two)[0] == ISSUE_BLOCK

    with pytest.raises(SystemExit):
        inspect_cache.main(["namespace=sparse_conv_forward", "--top-k", "0"])


NAMESPACE_TREE = """\
============================================================
NAMESPACE TREE
============================================================
Total namespaces: 3

- sparse_conv_backward: 1 entry(ies)
- sparse_conv_forward: 3 entry(ies)
- wmma_implicit_gemm_sm80: 2 entry(ies)

"""


def test_inspect_summary_shows_location_size_and_the_namespace_tree(inspect_cache_file, capsys):
    status, out, _ = run_inspect(capsys)
    assert status == 0
    lines = out.splitlines()
    assert lines[0] == f"Cache file:    {inspect_cache_file}"
    assert lines[1].startswith(f"Size:          {inspect_cache_file.stat().st_size:,} bytes")
    assert lines[2].startswith("Last modified: 20") and lines[3] == ""
    assert out.split("\n", 4)[4].startswith(NAMESPACE_TREE)
    assert "Compute capabilities: sm_90 (5)" in lines  # the issue's key names no architecture


def test_inspect_search_words(inspect_cache_file, capsys):
    _, out, _ = run_inspect(capsys, "WMMA")
    assert "Namespaces matching: wmma_implicit_gemm_sm80 (2)" in out
    assert 'Namespace: sparse_conv_forward (2 of 3 configurations match "wmma")' in out
    assert 'Namespace: wmma_implicit_gemm_sm80 (2 of 2 configurations match "wmma")' in out
    assert "sparse_conv_backward" not in out  # neither its name nor its entry mentions wmma

    _, out, _ = run_inspect(capsys, "namespace=sparse_conv_forward", "float32")
    assert out.startswith('Namespace: sparse_conv_forward (1 of 3 configurations match "float32")\n')
    (block,) = configuration_blocks(out)
    assert "  in_dtype: float32\n" in block and '"explicit_gemm"' in block

    _, out, _ = run_inspect(capsys, "namespace=sparse_conv_forward", "wmma", "fwd_block_size")
    assert len(configuration_blocks(out)) == 2  # every word must match

    _, out, _ = run_inspect(capsys, "no-such-thing")
    assert 'Nothing in the cache matches "no-such-thing".' in out


def test_inspect_unknown_namespace_lists_the_known_ones(inspect_cache_file, capsys):
    status, _, err = run_inspect(capsys, "namespace=sparse_conv_sideways")
    assert status == 1
    assert "Unknown namespace 'sparse_conv_sideways'" in err
    assert "  sparse_conv_forward (3)" in err and "  wmma_implicit_gemm_sm80 (2)" in err


def test_inspect_another_file_and_a_missing_one(inspect_cache_file, cache_dir, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path / "elsewhere"))
    status, out, _ = run_inspect(capsys)
    assert status == 0 and f"No benchmark cache at {tmp_path / 'elsewhere'}" in out
    assert not (tmp_path / "elsewhere").exists()  # looking does not create anything

    status, out, _ = run_inspect(capsys, "--cache-file", str(inspect_cache_file), "namespace=sparse_conv_backward")
    assert status == 0 and '    ["implicit_gemm", {}, 3.500]' in out


@pytest.mark.parametrize("script", [inspect_cache, analyze])
def test_the_scripts_report_a_corrupt_cache_and_leave_it_in_place(script, cache_dir, capsys):
    cache_dir.mkdir()
    path = cache_file_path()
    path.write_bytes(b"\x92\x01\x02")  # valid msgpack, not a cache
    assert script.main([]) == 1
    assert f"Cannot read {path} is not a cupysparse benchmark cache" in capsys.readouterr().err
    assert path.read_bytes() == b"\x92\x01\x02" and [p.name for p in cache_dir.iterdir()] == [path.name]


@pytest.mark.parametrize("script", [inspect_cache, analyze])
def test_the_scripts_name_a_directory_at_the_cache_path_instead_of_calling_it_no_cache(script, cache_dir, capsys):
    cache_file_path().mkdir(parents=True)
    assert script.main([]) == 1
    captured = capsys.readouterr()
    assert "No benchmark cache" not in captured.out
    assert f"{cache_file_path()} is a directory, not a benchmark cache file." in captured.err
    assert "point CUPYSPARSE_BENCHMARK_CACHE_DIR at another directory" in captured.err

    elsewhere = cache_dir / "named.msgpack"
    os.mkfifo(elsewhere)
    assert script.main(["--cache-file", str(elsewhere)]) == 1
    captured = capsys.readouterr()
    assert captured.err == f"{elsewhere} is a named pipe, not a benchmark cache file.\n"  # not the user's cache


@pytest.mark.parametrize("script", [inspect_cache, analyze])
def test_the_scripts_report_a_cache_file_they_may_not_read(script, cache_dir, capsys, monkeypatch):
    cache_dir.mkdir()
    path = cache_file_path()
    path.write_bytes(b"\x92\x01\x02")
    real_read_bytes = pathlib.Path.read_bytes

    def read_bytes(self):  # another user's file, mode 0600, in a shared directory
        if self == path:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_read_bytes(self)

    monkeypatch.setattr(pathlib.Path, "read_bytes", read_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "kept in memory only": an inspection says what it cannot read
        assert script.main([]) == 1
    assert f"Cannot read {path}: [Errno 13] Permission denied: '{path}'" in capsys.readouterr().err


# ---- analyze ----
# Forward: five configurations (times in ms). I16/I32 = implicit_gemm with fwd_block_size 16/32,
# W = wmma_implicit_gemm, E = explicit_gemm.
#   C1  3->32   kv 27  2^20:  I16 1.00  I32 1.03  W 2.00  E 3.00
#   C2  32->64  kv 27  2^20:  W 1.00  I16 1.08  E 1.50  I32 1.60
#   C3  64->64  kv 27  2^21:  W 1.00  E 1.20  I16 1.30  I32 1.40
#   C4  64->64  kv 8   2^21:  E 1.00  W 1.04  I16 2.00             (I32 not measured)
#   C5 128->128 kv 27  2^22:  W 1.00  E 1.50  I16 3.00  I32 4.00
# Wins: W 3 (60%), implicit 1 (20%), explicit 1 (20%). Top 3: implicit 5/5, W 5/5, explicit 4/5.
# Runner-up ratios: 1.03 1.08 1.20 1.04 1.50 -> median 1.08, within 5%: 2/5, within 10%: 3/5.
# Other algorithm:  2.00 1.08 1.20 1.04 1.50 -> median 1.20, within 5%: 1/5, within 10%: 2/5.
# Within 10% of the best: W covers C2 C3 C4 C5, I16 covers C1 C2, I32 covers C1, E covers C4.
# Greedy for 95% (all 5): W (4 covered), then I16 and I32 both add C1; I16 covers more overall -> 5.


def results(*timings):
    names = {
        "I16": ("implicit_gemm", {"fwd_block_size": 16}),
        "I32": ("implicit_gemm", {"fwd_block_size": 32}),
        "W": ("wmma_implicit_gemm", {}),
        "E": ("explicit_gemm", {}),
    }
    return [(*names[name], time) for name, time in timings]


ANALYZE_CACHE = {
    "sparse_conv_forward": [
        (key(20, 3, 32), results(("I16", 1.0), ("I32", 1.03), ("W", 2.0), ("E", 3.0))),
        (key(20, 32, 64), results(("W", 1.0), ("I16", 1.08), ("E", 1.5), ("I32", 1.6))),
        (key(21, 64, 64), results(("W", 1.0), ("E", 1.2), ("I16", 1.3), ("I32", 1.4))),
        (key(21, 64, 64, volume=8), results(("E", 1.0), ("W", 1.04), ("I16", 2.0))),
        (key(22, 128, 128), results(("W", 1.0), ("E", 1.5), ("I16", 3.0), ("I32", 4.0))),
    ],
    "sparse_conv_backward": [
        (key(20, 3, 32), results(("W", 2.0), ("E", 2.5))),
        (key(20, 32, 64), results(("E", 1.0), ("W", 1.5))),
    ],
    "sparse_conv_depthwise_forward": [(key(20, 32, 32), [("implicit", {}, 0.5), ("explicit", {}, 0.6)])],
}


@pytest.fixture
def analyze_cache_file(cache_dir):
    write_cache(ANALYZE_CACHE)
    return cache_file_path()


def forward_entries():
    return analyze.measured_entries(BenchmarkCache(autosave=False), "sparse_conv_forward")


def test_analyze_win_and_top3_rates(analyze_cache_file):
    stats = analyze.algorithm_stats(forward_entries())
    assert list(stats) == ["wmma_implicit_gemm", "implicit_gemm", "explicit_gemm"]
    assert {name: (s.wins, s.top_k, s.measured) for name, s in stats.items()} == {
        "wmma_implicit_gemm": (3, 5, 5),
        "implicit_gemm": (1, 5, 5),
        "explicit_gemm": (1, 4, 5),
    }


def test_analyze_wins_by_group_in_numeric_order(analyze_cache_file):
    entries = forward_entries()
    by_pair = analyze.wins_by(entries, analyze.channel_pair)
    assert list(by_pair) == [(3, 32), (32, 64), (64, 64), (128, 128)]
    assert by_pair[(64, 64)] == {"wmma_implicit_gemm": 1, "explicit_gemm": 1}
    assert by_pair[(3, 32)] == {"implicit_gemm": 1}
    by_volume = analyze.wins_by(entries, analyze.kernel_volume)
    assert by_volume == {8: {"explicit_gemm": 1}, 27: {"wmma_implicit_gemm": 3, "implicit_gemm": 1}}
    by_size = analyze.wins_by(entries, analyze.size_bucket)
    assert list(by_size) == [20, 21, 22]
    assert by_size[20] == {"implicit_gemm": 1, "wmma_implicit_gemm": 1}


def test_analyze_margins(analyze_cache_file):
    any_runner_up, other_algorithm = analyze.runner_up_margins(forward_entries())
    assert sorted(any_runner_up.ratios) == pytest.approx([1.03, 1.04, 1.08, 1.2, 1.5])
    assert any_runner_up.median == pytest.approx(1.08)
    assert any_runner_up.share_within(0.05) == pytest.approx(0.4)
    assert any_runner_up.share_within(0.10) == pytest.approx(0.6)
    assert other_algorithm.median == pytest.approx(1.2)
    assert other_algorithm.share_within(0.05) == pytest.approx(0.2)
    assert other_algorithm.share_within(0.10) == pytest.approx(0.4)


def test_analyze_recommended_candidate_set(analyze_cache_file):
    entries = forward_entries()
    chosen = analyze.recommended_candidates(entries, tolerance=0.10, coverage=0.95)
    assert [(candidate.label, covered) for candidate, covered in chosen] == [
        ("wmma_implicit_gemm", 4),
        ("implicit_gemm(fwd_block_size=16)", 5),
    ]
    assert [c.label for c, _ in analyze.recommended_candidates(entries, tolerance=0.10, coverage=0.8)] == [
        "wmma_implicit_gemm"
    ]
    # Allowing 55%: W and E both cover C2..C5; the tie goes to the name first in order, then I16 adds C1.
    loose = analyze.recommended_candidates(entries, tolerance=0.55, coverage=1.0)
    assert [c.label for c, _ in loose] == ["explicit_gemm", "implicit_gemm(fwd_block_size=16)"]


def test_analyze_text_report(analyze_cache_file, capsys):
    assert analyze.main([]) == 0
    out = capsys.readouterr().out
    forward, backward = out.split("sparse_conv_forward (5 configurations)")[1].split(
        "sparse_conv_backward (2 configurations)"
    )
    assert "depthwise" not in out  # only forward and backward by default
    rows = [line.split() for line in forward.splitlines()]
    assert ["wmma_implicit_gemm", "3", "60.0%", "100.0%", "5"] in rows
    assert ["explicit_gemm", "1", "20.0%", "80.0%", "5"] in rows
    assert ["any", "runner-up", "5", "1.080", "40.0%", "60.0%"] in rows
    assert ["other", "algorithm", "5", "1.200", "20.0%", "40.0%"] in rows
    assert ["2", "implicit_gemm(fwd_block_size=16)", "5/5", "(100.0%)"] in rows
    backward_rows = [line.split() for line in backward.splitlines()]
    assert ["wmma_implicit_gemm", "1", "50.0%", "100.0%", "2"] in backward_rows


def test_analyze_markdown_file_and_namespace_choice(analyze_cache_file, tmp_path, capsys):
    output = tmp_path / "analysis.md"
    assert analyze.main(["--markdown", "--output", str(output), "--namespace", "sparse_conv_forward"]) == 0
    assert f"Wrote the analysis to {output}" in capsys.readouterr().out
    text = output.read_text()
    assert text.startswith("# Autotune cache analysis\n")
    assert "## sparse_conv_forward (5 configurations)" in text and "sparse_conv_backward" not in text
    assert "| algorithm | wins | win rate | top-3 rate | measured |\n| --- | ---: | ---: | ---: | ---: |\n" in text
    assert "| wmma_implicit_gemm | 3 | 60.0% | 100.0% | 5 |" in text
    assert "| C_in -> C_out | configs | wmma_implicit_gemm | implicit_gemm | explicit_gemm |" in text
    assert "| 64 -> 64 | 2 | 1 | 0 | 1 |" in text
    assert "| <= 2^22 | 1 | 1 | 0 | 0 |" in text
    assert "| 1 | wmma_implicit_gemm | 4/5 (80.0%) |" in text


def test_analyze_plot_without_matplotlib_says_so(analyze_cache_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    chart = tmp_path / "wins.png"
    assert analyze.main(["--plot", str(chart)]) == 0
    assert "--plot needs matplotlib" in capsys.readouterr().out
    assert not chart.exists()


def test_analyze_plot_writes_a_png(analyze_cache_file, tmp_path):
    pytest.importorskip("matplotlib")
    chart = tmp_path / "wins.png"
    assert analyze.main(["--plot", str(chart), "--output", str(tmp_path / "report.txt")]) == 0
    assert chart.read_bytes().startswith(b"\x89PNG")


def test_analyze_empty_and_missing_caches(cache_dir, capsys):
    assert analyze.main([]) == 0
    assert "No benchmark cache at" in capsys.readouterr().out
    write_cache({"sparse_conv_depthwise_forward": ANALYZE_CACHE["sparse_conv_depthwise_forward"]})
    assert analyze.main([]) == 0
    out = capsys.readouterr().out
    assert "no measured configurations in sparse_conv_forward, sparse_conv_backward" in out
    assert "Namespaces it has: sparse_conv_depthwise_forward (1)" in out


# ---- inspect: stale configurations, shipped files ----

KERNEL_FILE = sorted(path.name for path in KERNEL_DIR.glob("*.cu"))[0]


def write_with_sources(path, stale_keys):
    """INSPECT_CACHE's wmma entries, each measured with KERNEL_FILE: at another version of it for the keys
    named in `stale_keys` (by their in_channels), else at today's."""
    cache = BenchmarkCache(path, autosave=False)
    for config_key, results in INSPECT_CACHE["wmma_implicit_gemm_sm80"]:
        stale = dict(config_key)["in_channels"] in stale_keys
        cache.put("wmma_implicit_gemm_sm80", config_key, results,
                  [(KERNEL_FILE, "0" * 16 if stale else source_digest(KERNEL_FILE))])
    cache.put("sparse_conv_forward", key(18, 32, 64), INSPECT_CACHE["sparse_conv_forward"][1][1])
    cache.save()


@pytest.fixture
def shipped_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(shipped, "SHIPPED_CACHE_DIR", tmp_path / "shipped")
    (tmp_path / "shipped").mkdir()
    return tmp_path / "shipped"


def test_inspect_counts_and_marks_stale_configurations(cache_dir, shipped_dir, capsys):
    write_with_sources(cache_file_path(), stale_keys={64})
    _, out, _ = run_inspect(capsys)
    lines = out.splitlines()
    assert "Stale: 1 of 3 configurations (a kernel file they measured changed since; the library ignores them)" \
        in lines
    assert f"  changed: {KERNEL_FILE} (1)" in lines
    tree = [line for line in lines if line.startswith("- ")]
    assert tree == ["- sparse_conv_forward: 1 entry(ies)", "- wmma_implicit_gemm_sm80: 2 entry(ies) (1 stale)"]

    _, out, _ = run_inspect(capsys, "namespace=wmma_implicit_gemm_sm80")
    stale, fresh = sorted(configuration_blocks(out), key=lambda block: "stale" not in block)
    assert stale.splitlines()[1].endswith(f"(stale: {KERNEL_FILE} changed since measured; ignored):")
    assert "  in_channels: 64\n" in stale
    assert "stale" not in fresh and "  in_channels: 32\n" in fresh


def test_inspect_summarises_the_shipped_files_and_shows_one(cache_dir, shipped_dir, capsys):
    write_with_sources(shipped_dir / "benchmark_cache_sm_90.msgpack", stale_keys={32, 64})
    (shipped_dir / "benchmark_cache_sm_80.msgpack").write_bytes(b"\x92\x01\x02")
    write_cache(INSPECT_CACHE)
    _, out, _ = run_inspect(capsys)
    shipped_part = out[out.index("Shipped tuning files"):].splitlines()
    assert shipped_part[0] == "Shipped tuning files (used where this cache has no entry):"
    assert shipped_part[1].startswith("  sm_80  cannot be read: ")
    assert shipped_part[2] == f"  sm_90  3 configurations, 2 stale  {shipped_dir / 'benchmark_cache_sm_90.msgpack'}"

    status, out, _ = run_inspect(capsys, "--shipped", "sm_90")
    assert status == 0
    assert f"Cache file:    {shipped_dir / 'benchmark_cache_sm_90.msgpack'}" in out
    assert "Stale: 2 of 3 configurations" in out and "Shipped tuning files" not in out

    status, _, err = run_inspect(capsys, "--shipped", "sm_75")
    assert status == 1 and "ships no tuning file for sm_75 (it ships: sm_80, sm_90)" in err


def test_inspect_says_when_shipped_results_are_turned_off(cache_dir, shipped_dir, monkeypatch, capsys):
    write_with_sources(shipped_dir / "benchmark_cache_sm_90.msgpack", stale_keys=())
    monkeypatch.setenv("CUPYSPARSE_SHIPPED_CACHE", "0")
    _, out, _ = run_inspect(capsys)  # no cache of the user's yet
    assert "Shipped tuning files (used where this cache has no entry; turned off by CUPYSPARSE_SHIPPED_CACHE=0):" in out
    assert "  sm_90  3 configurations, 0 stale  " in out
