"""Starting a mesh's local ranks: every check first, in this process, then torch's elastic
launcher, then one report of what went wrong.

``python run.py --mesh 2x2 ...`` outside a launcher runs, before any rank exists:
  1. ``training.checks.preflight``, the checks every rank would make (config fields, mesh
     against model, batch arithmetic, compute options), and this rank 0's ``Parallel``
     built on a fake process group, as ``run.py plan`` builds it;
  2. ``planning.capacity``: whether this machine can hold the ranks (``--oversubscribe``
     skips it);
  3. torch.distributed.run, in this process, with ``--standalone``. A rank's fxmega error is
     written to torch elastic's error file instead of the rank's output, and this process
     prints the first one once, in place of torch's ``ChildFailedError`` report.

A bad mesh or config therefore ends in one line with exit status 2 and no process started.
Under torchrun or Slurm (``RANK`` set) none of this runs: each rank checks for itself.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing import ProcessFailure, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ErrorHandler

from fxmega.config import RunConfig
from fxmega.core.device import pick_device
from fxmega.core.errors import FxmegaError, LauncherLostError
from fxmega.core.log import get_logger
from fxmega.models.family import ModelFamily
from fxmega.parallel.distributed import rank_parallel
from fxmega.planning.capacity import Machine, check_capacity
from fxmega.planning.fake import fake_world
from fxmega.planning.report import estimate_plan
from fxmega.sharding.mesh import MeshSpec, build_device_mesh
from fxmega.training.checks import preflight
from fxmega.training.interrupt import SIGNALS

log = get_logger(__name__)

# set in the ranks this process starts: they leave reporting their fxmega errors to it
REPORTS_FOR_RANKS = "FXMEGA_LAUNCHER_REPORTS"
# torch elastic's own messages (the OMP_NUM_THREADS notice, each failed worker, the
# shutdown) would repeat what this module says in one line
_TORCH_LOGGERS = ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")


def check_launch(cfg: RunConfig, model: ModelFamily, oversubscribe: bool = False) -> None:
    """Every check the ranks of ``cfg``'s mesh would make, and whether this machine holds
    them, in this process; raises ``ConfigError`` before anything starts."""
    mesh = MeshSpec.parse(cfg.parallel.mesh)
    device = pick_device(cfg.train.device)
    plan = preflight(cfg, model, device)
    if plan is None:
        return
    with fake_world(mesh.world_size, 0):  # what the Parallel's own construction refuses
        rank_parallel(cfg, plan, build_device_mesh(mesh, "cpu"), 0, model)
    if not oversubscribe:
        check_capacity(mesh, cfg.parallel.mesh, device.type, estimate_plan(cfg, plan).peak, Machine.this())


def start_ranks(nproc: int, argv: list[str]) -> int:
    """Run ``run.py argv`` on ``nproc`` local processes with torch.distributed.run (in this
    process); returns the exit status: 0, 2 for a rank's fxmega error (printed here once),
    128 + the signal that stopped the job, or 1 for a rank that crashed (its own output
    says why)."""
    script = str(Path(sys.argv[0]).resolve())
    args = torchrun.parse_args(["--standalone", f"--nproc-per-node={nproc}", script, *argv])
    shown = os.path.relpath(script) if script.startswith(os.getcwd() + os.sep) else script
    log.info(f"starting {nproc} local processes: torchrun --standalone --nproc-per-node={nproc} "
             f"{' '.join([shown, *argv])}")
    # torch elastic's modules set their loggers' own levels, so each one is silenced, not a parent
    names = [n for n in logging.root.manager.loggerDict if n.startswith(_TORCH_LOGGERS)] + list(_TORCH_LOGGERS)
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for local ranks, without its notice
    # c10d's C++ warnings (a store that went away) come with a native stack trace each; the
    # ranks say what happened in one line (set TORCH_CPP_LOG_LEVEL=INFO to see them)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ[REPORTS_FOR_RANKS] = "1"
    try:
        torchrun.run(args)
        return 0
    except ChildFailedError as e:
        return _report(e.failures)
    except SignalException as e:
        return 128 + int(e.sigval)
    finally:
        os.environ.pop(REPORTS_FOR_RANKS, None)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _report(failures: dict[int, ProcessFailure]) -> int:
    """Print the first failure once: a rank's fxmega error as the rank wrote it, or which
    rank ended how (its own output above holds its traceback)."""
    recorded = sorted((f.timestamp, rank, _recorded_message(f)) for rank, f in failures.items())
    mine = [(rank, text) for _, rank, text in recorded if text is not None]
    if mine:
        log.error(mine[0][1])
        return 2
    stopped = {f.exitcode - 128 for f in failures.values()}
    if stopped and stopped <= set(SIGNALS):  # ranks a signal stopped cleanly; rank 0 said so
        return 128 + max(stopped)
    rank, failure = min(failures.items())
    how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit status {failure.exitcode}"
    log.error(f"rank {rank} ended with {how}; its output above says why")
    return 1


def _recorded_message(failure: ProcessFailure) -> str | None:
    """The fxmega error a rank recorded (``record_error``): torch elastic's error file holds
    ``"<type name>: <text>"``; the text of one of fxmega's error types, else None."""
    message = failure.message
    text = message.get("message") if isinstance(message, dict) else None
    name, _, rest = text.partition(": ") if isinstance(text, str) else ("", "", "")
    return rest if name in _error_types(FxmegaError) else None


def _error_types(cls: type) -> set[str]:
    return {cls.__name__}.union(*(_error_types(sub) for sub in cls.__subclasses__()))


def record_error(error: FxmegaError) -> None:
    """Say ``error`` once: in a rank this module started, in torch elastic's error file for
    the launching process to print; elsewhere (one device, or a rank under torchrun, whose
    summary reads the same file) on this process's output too."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        ErrorHandler().record_exception(error)
    if not os.environ.get(REPORTS_FOR_RANKS) or isinstance(error, LauncherLostError):  # no one else will
        log.error(str(error))
