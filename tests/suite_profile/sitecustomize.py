"""Where a test's time goes, process by process (docs/testing.md). Imported by every Python
process the suite starts when ``FXMEGA_SUITE_PROFILE`` names a file: the test conftest puts
this folder on PYTHONPATH, so pytest itself, gloo ranks and ``run.py`` subprocesses (and the
ranks they launch) each append one JSON line when they end: the test that started them
(pytest's PYTEST_CURRENT_TEST, which children inherit), seconds alive, seconds until torch
was imported, in ``init_process_group`` and compiling, and the compile caches' hits and
misses. Off (nothing imported, nothing patched) when the variable is unset."""

import os

if os.environ.get("FXMEGA_SUITE_PROFILE"):
    import atexit
    import importlib.abc
    import importlib.util
    import json
    import sys
    import time

    _start = time.monotonic()
    _marks: dict[str, float] = {}
    _written = False

    def _time_process_group(dist) -> None:
        """Wraps init_process_group, where ranks wait for each other to start, to add up its time."""
        original = dist.distributed_c10d.init_process_group

        def timed(*args, **kwargs):
            t = time.monotonic()
            try:
                return original(*args, **kwargs)
            finally:
                _marks["process_group_s"] = _marks.get("process_group_s", 0.0) + time.monotonic() - t

        dist.init_process_group = dist.distributed_c10d.init_process_group = timed

    def _torch_imported(module) -> None:
        _marks["torch_imported_s"] = time.monotonic() - _start

    class _Watch(importlib.abc.MetaPathFinder):
        """Runs a function after a module has been imported: its loader is wrapped."""

        after = {"torch": _torch_imported, "torch.distributed": _time_process_group}

        def find_spec(self, name, path=None, target=None):
            if name not in self.after:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            run, then = spec.loader.exec_module, self.after[name]

            def exec_module(module):
                run(module)
                then(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Watch())

    def _dump() -> None:
        global _written
        if _written:
            return
        _written = True
        record = {"pid": os.getpid(), "ppid": os.getppid(), "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                  "argv": [os.path.basename(a) for a in sys.argv[:3]], "rank": os.environ.get("RANK"),
                  "alive_s": round(time.monotonic() - _start, 3), **{k: round(v, 3) for k, v in _marks.items()}}
        if "torch" in sys.modules:
            try:
                from torch._dynamo.utils import calculate_time_spent, counters

                record["compile"] = {k: round(v, 3) for k, v in calculate_time_spent().items()}
                record["counters"] = {group: dict(counters[group]) for group in ("inductor", "aot_autograd", "stats")
                                      if group in counters}
            except Exception as error:  # a profile line must never fail the process it describes
                record["error"] = repr(error)
        with open(os.environ["FXMEGA_SUITE_PROFILE"], "a") as out:
            out.write(json.dumps(record) + "\n")

    _exit = os._exit

    def _exit_with_profile(code):
        _dump()
        _exit(code)

    os._exit = _exit_with_profile
    atexit.register(_dump)
