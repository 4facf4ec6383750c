"""Which tier is running: ``make test`` (what CI runs, within its budget) or ``make e2e``
(``pytest --e2e``: everything). tests/conftest.py sets FXMEGA_E2E under --e2e, and gloo ranks
and ``run.py`` subprocesses inherit it.

Some tests prove numerics, graphs or collectives on a configuration that also happens to be
compiled with inductor. Under ``make test`` they trace with aot_eager — the same AOTAutograd
graph and collectives, run op by op — and their inductor build runs under ``make e2e``:
inductor's kernels for the same strategy are built in ``make test`` by the user-path matrix
(``run.py`` with the default compiler). docs/testing.md lists each such case."""

from __future__ import annotations

import os

E2E = os.environ.get("FXMEGA_E2E") == "1"
AOT_EAGER = ("train.compile_backend=aot_eager",)


def inductor_in_e2e() -> tuple[str, ...]:
    """Config overrides for a compiled run: inductor (the config's default) under make e2e,
    aot_eager under make test."""
    return () if E2E else AOT_EAGER
