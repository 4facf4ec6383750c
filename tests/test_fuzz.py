"""Bad input never surfaces as a deep traceback: fuzzed config overrides, command lines,
meshes, data files and checkpoint files are either accepted or rejected with fxmega's own
error type (one line naming the value), never an arbitrary exception."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fxmega.cli import config_from_args, parse_args
from fxmega.config import _all_keys, load
from fxmega.core.errors import FxmegaError
from fxmega.models import model_for
from fxmega.parallel.strategy import plan_from
from tests.conftest import FUZZING, ROOT

CONFIG = ROOT / "configs" / "tiny_gpt.py"
KEYS = _all_keys(load(CONFIG))
VALUES = st.one_of(
    st.integers(-10**6, 10**9).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", "true", "false", "x", "1e999", "-0", "2x2", "dp=2,tp=2", "pp=3", "gpipe", "skip", "stop",
                     "zero3", "megatron", "byte", "gpt2", "949,50,1", "1,,2", "auto", "cpu", "cuda", "nan"]),
    st.text(max_size=12),
)


def examples(n: int) -> int:
    """``n`` examples under ``make test``; twenty times as many under ``make fuzz``."""
    return n * 20 if FUZZING else n


FUZZ = settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check(argv: list[str]) -> None:
    """Parse, validate and plan what the command line asks for; only FxmegaError may escape."""
    try:
        args = parse_args(argv)
        cfg = config_from_args(args).validate(None)  # as run.py does
        model = model_for(cfg.model)
        plan = plan_from(model.param_specs(cfg.model), cfg.parallel, model)
        cfg.validate(plan.mesh.data_size)
    except FxmegaError as e:
        assert str(e).strip()  # a message, not an empty error
    except SystemExit:
        pass  # argparse's own usage error: one line naming the flag, exit code 2


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(KEYS), VALUES), min_size=1, max_size=4))
def test_fuzzed_overrides_are_accepted_or_rejected_cleanly(pairs):
    argv = ["--config", str(CONFIG)]
    for key, value in pairs:
        argv += ["--set", f"{key}={value}"]
    _check(argv)


@FUZZ
@given(st.text(alphabet="0123456789x=,dptpfsdcpe-+ ", max_size=16),
       st.sampled_from(["megatron", "zero1", "zero2", "zero3", "fsdp", "hsdp", "megatron-sp", "nope"]),
       st.integers(-2, 5), st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "x"]),
       st.integers(-1, 4), st.text(alphabet="Et*0123456789|L, ", max_size=12))
def test_fuzzed_meshes_and_parallel_flags(mesh, rules, zero, schedule, virtual, layout):
    _check(["--config", str(CONFIG), "--mesh", mesh, "--rules", rules, "--zero", str(zero), "--pipeline-schedule",
            schedule, "--virtual-stages", str(virtual), "--pipeline-layout", layout])


@FUZZ
@given(st.text(max_size=30), st.text(max_size=12))
def test_fuzzed_override_syntax(raw, flag_value):
    _check(["--config", str(CONFIG), "--set", raw, "--micro-batch-size", flag_value])


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=300), st.binary(max_size=64))
def test_fuzzed_indexed_dataset_files(tmp_path, idx, bin_):
    from fxmega.data.indexed import HEADER, IndexedDataset

    for i, head in enumerate((b"", HEADER + b"\x01" + bytes(7))):  # garbage, and garbage after a valid start
        prefix = tmp_path / f"f{i}"
        (tmp_path / f"f{i}.idx").write_bytes(head + idx)
        (tmp_path / f"f{i}.bin").write_bytes(bin_)
        try:
            ds = IndexedDataset(prefix)
            for j in range(len(ds)):
                np.asarray(ds[j])
        except FxmegaError:
            pass


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=400), st.sampled_from([".metadata", "meta.json", "manifest.json"]))
@example(b"0", "manifest.json")  # found by a random run: valid JSON, not an object (was a TypeError)
@example(b"[]", "manifest.json")
@example(b'{"files": 3}', "manifest.json")
@example(b"0", "meta.json")
@example(b"\x80\x04K\x00.", ".metadata")  # pickle of the int 0: allowed classes only, wrong type
def test_fuzzed_checkpoint_files(tmp_path, garbage, name):
    import torch

    from fxmega.storage import checkpoint

    root = tmp_path / "ckpt"
    if not (root / "latest").exists():
        checkpoint.save(root, 1, {"params.w": torch.ones(4)}, {"step": 1})
    step = checkpoint.latest(root)
    original = (step / name).read_bytes()
    (step / name).write_bytes(garbage)
    if name != "manifest.json":  # the attacker (or the disk) also rewrote the manifest
        from fxmega.storage.checkpoint_files import MANIFEST, digests, write_manifest

        files = json.loads((step / MANIFEST).read_text())["files"]
        write_manifest(step, digests(step, sorted(files)))
    try:
        checkpoint.check(step)
        checkpoint.load(step, {"params.w": torch.zeros(4)})
    except FxmegaError:
        pass
    finally:
        (step / name).write_bytes(original)
        if name != "manifest.json":
            write_manifest(step, digests(step, sorted(files)))
