"""Tables for docs/testing.md from one profiled suite run:

    FXMEGA_SUITE_PROFILE=prof.jsonl pytest -q --durations=0 tests > log.txt
    python tests/suite_profile/report.py prof.jsonl log.txt

Wall time per file and per test comes from pytest's --durations table (setup, call and
teardown added up); where the time went from the profile's lines: each process the suite
started (gloo ranks, run.py and the ranks it launched) and each test's share of the pytest
process. A launcher (a process that started others) is left out of the sums: it only waits."""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict

PHASE = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(.+)$")


def durations(log: str) -> dict[str, float]:
    """Test id -> seconds, from pytest's --durations lines."""
    total: dict[str, float] = defaultdict(float)
    for line in open(log):
        m = PHASE.match(line.strip())
        if m:
            total[m.group(3)] += float(m.group(1))
    return dict(total)


def profile(path: str) -> dict[str, dict[str, float]]:
    """Test id -> summed seconds by kind over the processes it started, and cache counts."""
    records = [json.loads(line) for line in open(path)]
    launchers = {r.get("ppid") for r in records if r.get("rank") is not None}
    by_test: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in records:
        test = r["test"].rsplit(" (", 1)[0]
        row = by_test[test]
        if r.get("in_pytest"):
            row["pytest_compile_s"] += r["compile"].get("total_wall_time", 0.0)
            counters = r["counters"]
            # a test that clears dynamo's counters itself leaves a negative difference: none counted
            row["graphs_built"] += max(0, counters.get("inductor.fxgraph_cache_miss", 0))
            row["graphs_found"] += max(0, counters.get("inductor.fxgraph_cache_hit", 0))
            row["aot_built"] += max(0, counters.get("aot_autograd.autograd_cache_miss", 0))
            row["aot_found"] += max(0, counters.get("aot_autograd.autograd_cache_hit", 0))
            continue
        if r["argv"][:1] == ["-c"] or (r["pid"] in launchers and r.get("rank") is None):
            continue  # a helper a library started, or a launcher waiting on its ranks
        row["processes"] += 1
        row["alive_s"] += r["alive_s"]
        row["import_s"] += r.get("torch_imported_s", 0.0)
        row["process_group_s"] += r.get("process_group_s", 0.0)
        row["compile_s"] += r.get("compile", {}).get("total_wall_time", 0.0)
        counters = r.get("counters", {})
        row["graphs_built"] += counters.get("inductor", {}).get("fxgraph_cache_miss", 0)
        row["graphs_found"] += counters.get("inductor", {}).get("fxgraph_cache_hit", 0)
        row["aot_built"] += counters.get("aot_autograd", {}).get("autograd_cache_miss", 0)
        row["aot_found"] += counters.get("aot_autograd", {}).get("autograd_cache_hit", 0)
    return by_test


def main(profile_path: str, log: str) -> None:
    wall = durations(log)
    prof = profile(profile_path)
    files: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for test, seconds in wall.items():
        f = files[test.split("::")[0]]
        f["tests"] += 1
        f["wall_s"] += seconds
        for k, v in prof.get(test, {}).items():
            f[k] += v
    total = sum(wall.values())
    print(f"tests: {len(wall)}, seconds in tests: {total:.0f}\n")
    kinds = ("processes", "alive_s", "import_s", "process_group_s", "compile_s", "pytest_compile_s",
             "graphs_built", "graphs_found", "aot_built", "aot_found")
    sums = {k: sum(f[k] for f in files.values()) for k in kinds}
    print("| kind | seconds | share |\n| --- | --- | --- |")
    child = sums["alive_s"] or 1.0
    for k in ("import_s", "process_group_s", "compile_s"):
        print(f"| {k} (of processes' {child:.0f} s alive) | {sums[k]:.0f} | {100 * sums[k] / child:.0f}% |")
    share = 100 * sums["pytest_compile_s"] / total
    print(f"| compile in the pytest process | {sums['pytest_compile_s']:.0f} | {share:.0f}% of wall |")
    print(f"\nprocesses started: {sums['processes']:.0f}; inductor graphs built {sums['graphs_built']:.0f}, "
          f"found in the cache {sums['graphs_found']:.0f}; AOTAutograd built {sums['aot_built']:.0f}, "
          f"found {sums['aot_found']:.0f}\n")
    print("| file | tests | wall s | processes | process-s alive | import | pg setup | compile | pytest compile "
          "| graphs built/found |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, f in sorted(files.items(), key=lambda kv: -kv[1]["wall_s"]):
        print(f"| {name} | {f['tests']:.0f} | {f['wall_s']:.0f} | {f['processes']:.0f} | {f['alive_s']:.0f} "
              f"| {f['import_s']:.0f} | {f['process_group_s']:.0f} | {f['compile_s']:.0f} "
              f"| {f['pytest_compile_s']:.0f} "
              f"| {f['graphs_built']:.0f}/{f['graphs_found']:.0f} |")
    print("\n| test | wall s | processes | compile (process-s) | graphs built/found |\n| --- | --- | --- | --- | --- |")
    for test, seconds in sorted(wall.items(), key=lambda kv: -kv[1])[:40]:
        p = prof.get(test, {})
        print(f"| {test} | {seconds:.0f} | {p.get('processes', 0):.0f} "
              f"| {p.get('compile_s', 0) + p.get('pytest_compile_s', 0):.0f} "
              f"| {p.get('graphs_built', 0):.0f}/{p.get('graphs_found', 0):.0f} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
