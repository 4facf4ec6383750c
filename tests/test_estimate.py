"""The plan's estimates against what real gloo runs allocate: parameter, gradient and
optimizer bytes exactly; the compiled step's peak activation memory within 15%."""

import json
import os
import subprocess
import sys

import pytest

from tests.multirank import ROOT, run_ranks


@pytest.mark.parametrize("world,sets", [
    (4, ["parallel.mesh=dp=2,tp=2", "parallel.zero=2", "train.global_batch_size=32"]),
    (2, ["parallel.mesh=dp=2", "parallel.zero=3", "train.global_batch_size=32"]),
    (2, ["parallel.mesh=pp=2", "parallel.zero=0", "train.global_batch_size=16", "model.n_layers=4"]),
    (4, ["@tiny_llama", "parallel.mesh=dp=2,pp=2", "parallel.zero=1", "train.global_batch_size=32",
         "model.n_layers=4"]),
])
@pytest.mark.slow
def test_state_bytes_equal_what_ranks_allocate(world, sets):
    for r, got in enumerate(run_ranks(world, "tests.estimate_workers:state_bytes", sets)):
        pred = got["pred"]
        assert got["params"] == pred["params"] and got["opt"] == pred["opt"], (r, got)
        if got["grads"] is not None:  # gradient accumulation buffers (the pipeline keeps .grad instead)
            assert got["grads"] == pred["grads"], (r, got)


def _peaks(*args: str) -> list[dict]:
    # glibc returns freed blocks above 64 KiB at once (read when the process starts), so the
    # resident set follows the live tensors
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536",
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "tests.estimate_workers", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _within_15_percent(what: str, ranks: list[dict]) -> None:
    for r, rank in enumerate(ranks):
        ratio = rank["predicted"] / rank["measured"]
        print(f"{what}, rank {r}: measured {rank['measured'] / 2**20:.1f} MiB, predicted "
              f"{rank['predicted'] / 2**20:.1f} MiB ({ratio:.2f})")
        assert 0.85 <= ratio <= 1.15, rank


@pytest.mark.slow
def test_tp2_step_peak_within_15_percent():
    """Two gloo ranks, tp=2, a compiled (inductor) forward+backward whose activations
    dominate; each rank's peak above its resident set, against the estimate."""
    _within_15_percent("tp=2 step peak", _peaks("2", "parallel.mesh=tp=2", "train.seq_len=256",
                                                "model.max_seq_len=256", "model.n_layers=4",
                                                "train.micro_batch_size=8"))


@pytest.mark.slow
@pytest.mark.e2e  # make test keeps tp=2's (the suite's time); make e2e runs all
def test_cp2_ring_step_peak_within_15_percent():
    """Two gloo ranks, cp=2 with ring attention, the tiny Llama at 2,048 tokens: each rank
    holds its head-tail chunks and one key/value block at a time, so the estimate divides
    the block's activations by cp (measured 2026-12-03: 40.3 and 39.6 MiB, predicted 39.2,
    0.97x and 0.99x), against the compiled (inductor) forward+backward's peak."""
    _within_15_percent("cp=2 ring step peak", _peaks("2", "@tiny_llama", "parallel.mesh=cp=2",
                                                     "parallel.cp_attention=ring", "train.seq_len=2048",
                                                     "model.max_seq_len=2048", "model.n_layers=4",
                                                     "train.micro_batch_size=2", "train.global_batch_size=2"))


@pytest.mark.slow
@pytest.mark.e2e  # make test keeps tp=2's (the suite's time); make e2e runs all
def test_pp2_step_peak_within_15_percent():
    """Two gloo ranks, pp=2, 1F1B over 4 micro batches, compiled stages: the first stage
    keeps two micro batches' activations, the last one plus the head; the whole step's
    peak above the resident set (measured: 74 and 46 MiB, predicted 0.95x and 1.09x; with 8
    layers 139 and 77 MiB, 0.97x and 1.07x, at 1.5x the compile time), against the estimate."""
    _within_15_percent("pp=2 step peak", _peaks("--pipeline", "2", "parallel.mesh=pp=2", "train.seq_len=512",
                                                "model.max_seq_len=512", "model.n_layers=4",
                                                "train.micro_batch_size=8", "train.global_batch_size=32"))


@pytest.mark.slow
@pytest.mark.e2e  # make test keeps tp=2's (the suite's time); make e2e runs all
def test_ep2_moe_step_peak_within_15_percent():
    """Two gloo ranks, the tiny MoE dropless over ep=2: each expert's buffer holds a whole
    sequence (E rows per token: the buffers, the experts' SwiGLU and outputs on them, 6
    units of [rows, d] each), exchanged by all-to-all inside the compiled (inductor)
    forward+backward (measured 2026-12-03: 39.8 and 39.6 MiB, predicted 40.5, 1.02x; on one
    rank with capacity 1.0 and 2.0 and dropless 1.01x, 0.99x, 1.04x), against the estimate."""
    _within_15_percent("ep=2 MoE step peak", _peaks("2", "@tiny_moe", "parallel.mesh=dp=2,ep=2", "train.seq_len=256",
                                                    "model.max_seq_len=256", "model.n_layers=2",
                                                    "train.micro_batch_size=8", "train.global_batch_size=16"))
