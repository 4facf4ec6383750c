"""The training loop: data → step → metrics → eval → checkpoint → sample, around a ``Run``
(``fxmega.training.run``), with the progress bar, logs, heartbeats and fault seams.

Everything that is computed lives elsewhere (model, step, optimizer, data); this file wires
them together.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from fxmega.compiler.kernel_dump import dump_kernels
from fxmega.config import RunConfig, to_dict
from fxmega.core.log import get_logger
from fxmega.core.memory import peak_bytes, reset_peak
from fxmega.models import family_name
from fxmega.models.weight_uses import fp8_matmul_count
from fxmega.ops import fp8
from fxmega.ops.init import count_params
from fxmega.parallel.runtime import Parallel
from fxmega.training import faults, tracking
from fxmega.training.heartbeat import Heartbeat
from fxmega.training.interrupt import Interrupted, StopOnSignal, resume_command
from fxmega.training.logs import RunLog
from fxmega.training.metrics import Throughput, device_peak, model_flops_per_token
from fxmega.training.outcome import Pending
from fxmega.training.run import Run

log = get_logger(__name__)


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)
    valid_losses: dict[int, float] = field(default_factory=dict)
    sample: str = ""
    checkpoint: str = ""
    run: Run | None = None


def train(cfg: RunConfig, progress: bool = True, parallel: Parallel | None = None,
          device: torch.device | None = None) -> RunResult:
    """Train ``cfg``; with ``parallel`` this process is one rank of a sharded run and only
    rank 0 prints and writes logs (the JSONL has the same fields as a single-device run)."""
    run = Run(cfg, parallel, device)
    main = parallel is None or parallel.rank == 0
    world = 1 if parallel is None else parallel.groups.mesh.world_size
    t = cfg.train
    if t.load_dir and not run.resume(t.load_dir, params_only=t.finetune):
        log.info(f"no checkpoint under {t.load_dir} yet: starting from step 0")
    flops = model_flops_per_token(run.specs, cfg.model, t.seq_len)
    peak = device_peak(run.device, run.compute_dtype, t.peak_flops)
    log.info(f"model: {family_name(cfg.model)}, {count_params(run.specs):,} parameters, "
             f"{flops / 1e6:,.1f} MFLOPs/token; device {run.device} x {world}; "
             f"MFU against {peak.flops / 1e12:.3f} TFLOP/s per device ({peak.source})")
    dp = 1 if parallel is None else parallel.groups.data_size
    log.info(f"batch: {t.global_batch_size} x {t.seq_len} tokens = micro batch {t.micro_batch_size} x "
             f"{cfg.grad_accum_steps(dp)} accumulation steps x {dp} data-parallel ranks; {t.steps} steps; "
             f"compile={t.compile_backend if t.compile else 'off'}")
    c = cfg.compute
    fp8_line = "" if c.fp8 == "off" else "; " + fp8.describe(c.fp8, run.device, fp8_matmul_count(
        cfg.model, parallel.plan.tp_shapes() if parallel is not None else None, run.model, run.objective))
    log.info(f"compute: {c.precision} (fp32 master weights and AdamW state"
             f"{', dynamic loss scaling' if c.precision == 'fp16' and not c.loss_scale else ''}), gradient "
             f"reductions in {c.grad_reduce}, recompute {c.recompute}"
             f"{f' (first {c.recompute_layers} blocks)' if c.recompute != 'none' and c.recompute_layers else ''}, "
             f"{c.kernels} kernels, cross-entropy {f'in chunks of {c.loss_chunk} tokens' if c.loss_chunk else 'whole'}"
             f"{fp8_line}"
             f"{f'; {len(parallel.fp8_gathered)} weights all-gathered in fp8' if c.fp8_gather else ''}")
    log.info(f"data: {run.data.description}")
    run_log = RunLog(t.log_jsonl, t.tensorboard_dir, tracking.sinks(cfg, to_dict(cfg))) if main else RunLog()
    result = RunResult(run=run)
    meter = Throughput(flops, peak, world)
    tokens_per_step = t.global_batch_size * t.seq_len
    bar = None
    first_step = run.step
    spikes = faults.SpikeDetector(t.spike_z)
    rank = 0 if parallel is None else parallel.rank
    mesh = parallel.groups.mesh if parallel is not None else None
    beats = None if mesh is None else Heartbeat(rank, world, mesh.coords, mesh.names)
    if t.prefetch:  # the next batches are built while the device runs this step
        run.prefetch(t.prefetch)
    stop = StopOnSignal(parallel is not None, cfg.parallel.timeout_s)
    signum = 0  # the signal the ranks agreed to stop on, after the step that saw it
    bar_since = 0.0  # when the first step ended: the bar's token rate leaves compilation out
    try:
        stop.listen()
        pending: list[Pending] = []  # steps launched since the last report, their metrics still on the device
        since = time.perf_counter()  # when the steps in ``pending`` began
        reset_peak(run.device)
        while run.step < t.steps:
            faults.maybe_stall(rank, run.step + 1)
            if beats is not None:
                beats.start(run.step + 1)
            step = run.step + 1
            first = step == first_step + 1
            log_line = not first and (step % t.log_interval == 0 or step == t.steps)
            evaluate = (t.eval_interval and step % t.eval_interval == 0) or step == t.steps
            save = t.save_dir and ((t.save_interval and step % t.save_interval == 0) or step == t.steps)
            report = first or log_line or evaluate or save  # the steps that read the device; no others wait for it
            try:
                if t.dump_kernels and first:  # the first step compiles: dump what it becomes
                    with dump_kernels(t.dump_kernels, rank, parallel.groups.labels if parallel is not None else None):
                        pending.append(run.launch_step())
                    log.info(f"wrote {t.dump_kernels}/rank{rank}/index.md: compiled graphs, generated code, kernels "
                             f"and collectives")
                else:
                    pending.append(run.launch_step())
                signum = stop.agreed()
                report = report or bool(signum)
                outcomes = run.settle(pending) if report else []  # one read for the interval: waits for the device
            except RuntimeError as e:  # a collective that gave up waiting explains who it waited for
                if beats is None:
                    raise
                raise beats.explain(e, step) from e
            if beats is not None:
                beats.done(step)
            faults.maybe_kill(rank, step)
            if bar is None:  # made once the first step is done, so that its rate and ETA leave compilation out
                bar = tqdm(total=t.steps, initial=step, desc="train", unit="step", disable=not (progress and main),
                           dynamic_ncols=True)
                bar_since = time.perf_counter()
            else:
                bar.update(1)
                # the host's rate, every step; the loss and its step change only where a step is read
                bar.postfix = _postfix(bar.postfix, tokens_per_step * (step - first_step - 1)
                                       / max(time.perf_counter() - bar_since, 1e-9))
            if not report:
                continue
            seconds = time.perf_counter() - since  # every step of the interval, finished (the read waited)
            steps, pending, since = pending, [], time.perf_counter()
            rates = meter.step(0 if first else tokens_per_step * len(steps), seconds)  # compilation is not throughput
            for p, m in zip(steps, outcomes):
                # each step of the interval gets the interval's mean time: the host did not wait for the single steps
                record = {"step": p.step, **m, "step_time_s": seconds / len(steps), **rates}
                if not m.get("skipped") and (z := spikes.score(m["loss"])) is not None:
                    record["loss_spike_z"] = z
                    log.warning(f"step {p.step}: loss {m['loss']:.4f} is {z:.1f} standard deviations above the mean of "
                                f"the last {len(spikes.history) - 1} steps (a loss spike)")
                result.losses.append(m["loss"])
                if p.step == step:
                    record |= _report(run, step, evaluate, log_line, seconds, beats if main else None, result)
                run_log.write(record)
            m = outcomes[-1]
            bar.set_postfix({f"loss@{step}": f"{m['loss']:.3f}", "lr": f"{m['lr']:.2e}",
                             "gnorm": f"{m['grad_norm']:.2f}"}, refresh=False)
            if not first:
                bar.postfix = _postfix(bar.postfix, tokens_per_step * (step - first_step - 1)
                                       / max(time.perf_counter() - bar_since, 1e-9))
            if first:
                log.info(f"step {step}: first step took {seconds:.1f} s"
                         + (" (includes compilation)" if t.compile else ""))
                meter.interval()
            elif log_line:
                avg = meter.interval()
                straggler = "" if "straggler_rank" not in record else (
                    f" | straggler: rank {record['straggler_rank']} began the step "
                    f"{record['straggler_late_s'] * 1e3:.0f} ms after the first")
                log.info(f"step {step:>6} | loss {m['loss']:.4f} | lr {m['lr']:.3e} | grad norm {m['grad_norm']:.3f} | "
                         f"{avg['tokens_per_s']:,.0f} tokens/s | MFU {100 * avg['mfu']:.2f}% | "
                         f"peak mem {record['peak_memory_bytes'] / 2**30:.2f} GiB{straggler}{router_line(m)}"
                         f"{mtp_line(m)}")
            if save or signum:  # the checkpointer says when it is committed
                result.checkpoint = run.save(t.save_dir or _default_save_dir(cfg))
            if signum:
                break
    finally:
        stop.restore()
        run.stop_prefetch()
    if bar is not None:
        bar.close()
    run.finish_saves()
    run_log.close()
    if signum:
        raise _interrupted(cfg, signum, run.step, result.checkpoint, main)
    if t.sample_tokens and run.tokenizer is not None:
        result.sample = run.sample(t.sample_tokens, t.sample_prompt, t.seed)
        if main:  # the sample is the command's output, not a message
            print("-" * 30 + " sample " + "-" * 30 + f"\n{result.sample}\n" + "-" * 68, flush=True)
    return result


def _default_save_dir(cfg: RunConfig) -> str:
    """Where a run without a save directory saves when a signal stops it."""
    return f"runs/{cfg.name}/checkpoints"


def _interrupted(cfg: RunConfig, signum: int, step: int, saved: str, main: bool) -> Interrupted:
    """The one line a signal ends the run with (said by rank 0), as the error that ends it."""
    root = cfg.train.save_dir or _default_save_dir(cfg)
    where = "" if cfg.train.save_dir else " (the run had no --save: its default directory)"
    text = (f"{signal.Signals(signum).name}: stopped after step {step} and saved {saved}{where}; resume with: "
            f"{resume_command(root, not cfg.train.save_dir)}")
    if main:
        log.warning(text)
    return Interrupted(text, signum)


def _postfix(postfix: str | None, tokens_per_s: float) -> str:
    """The bar's postfix with its token rate replaced."""
    kept = [part for part in (postfix or "").split(", ") if part and not part.startswith("tok_s=")]
    return ", ".join([*kept, f"tok_s={tokens_per_s:,.0f}"])


def _report(run: Run, step: int, evaluate: bool, log_line: bool, seconds: float, beats: Heartbeat | None,
            result: RunResult) -> dict:
    """What a reported step's record adds: the validation loss, a straggler, the memory peak."""
    record: dict = {}
    if evaluate:
        record["valid_loss"] = result.valid_losses[step] = run.evaluate()
        log.info(f"step {step}: validation loss {record['valid_loss']:.4f}")
    slow = beats.stragglers(step) if log_line and beats is not None else None
    if slow is not None and slow[1] > max(0.05, 0.1 * seconds):  # noticeably late, not clock noise
        record |= {"straggler_rank": slow[0], "straggler_late_s": slow[1]}
    if log_line:
        record["peak_memory_bytes"] = peak_bytes(run.device)  # the high-water mark since the last log line
        reset_peak(run.device)
    return record


def router_line(m: dict) -> str:
    """A mixture of experts' router statistics for the log line (this step's), or nothing."""
    if "moe_load_max" not in m:
        return ""
    return (f" | experts: load max/min {m['moe_load_max']:.2f}/{m['moe_load_min']:.2f} of mean, dropped "
            f"{100 * m['moe_dropped_fraction']:.1f}%, balancing {m['moe_balancing_loss']:.3f}, z {m['moe_z_loss']:.3f}")


def mtp_line(m: dict) -> str:
    """Multi-token prediction's per-depth losses for the log line (this step's), or nothing."""
    depths = [v for k, v in m.items() if k.startswith("mtp_loss_")]
    return f" | MTP loss {', '.join(f'{v:.4f}' for v in depths)}" if depths else ""
