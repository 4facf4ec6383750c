"""A graph compiled on a mesh is found in the inductor cache by the next process that compiles
it: a resumed run, an evaluation or a generation on the same mesh does not compile again."""

from __future__ import annotations

import pytest

from tests.multirank import run_ranks


def _compile_twice(cache_base: str, stable: bool) -> dict:
    run_ranks(2, "tests.compile_cache_workers:compile_on_tp", cache_base, stable)
    return run_ranks(2, "tests.compile_cache_workers:compile_on_tp", cache_base, stable)[0]


@pytest.mark.slow
def test_the_second_process_on_a_mesh_hits_the_cache(tmp_path):
    again = _compile_twice(str(tmp_path / "stable"), stable=True)
    assert again.get("fxgraph_cache_miss", 0) == 0 and again.get("autograd_cache_miss", 0) == 0, again
    assert again.get("fxgraph_cache_hit", 0) + again.get("autograd_cache_hit", 0) > 0, again
