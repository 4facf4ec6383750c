"""The training loop on one device: data → step → metrics → eval → checkpoint → sample.

Everything that is computed lives elsewhere (model, step, optimizer, data); this file wires
them together. ``Run`` holds a run's state and does one step at a time (tests and
benchmarks drive it directly); ``train`` adds the progress bar, logs, evaluation,
checkpoints and the closing sample.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from fxmega.config import RunConfig, to_dict
from fxmega.core import precision, tree
from fxmega.core.device import pick_device, set_deterministic
from fxmega.core.errors import ConfigError, NonFiniteError
from fxmega.core.kernel_dump import dump_kernels
from fxmega.core.memory import peak_bytes, reset_peak
from fxmega.data.sources import build_data
from fxmega.inference.generate import sample_text
from fxmega.inference.generate_parallel import generate_on_mesh
from fxmega.models import family_name, loss_by_pieces, model_for
from fxmega.ops import kernels, recompute
from fxmega.ops.init import count_params, init_params
from fxmega.ops.objectives import global_count
from fxmega.sharding.runtime import Parallel
from fxmega.storage import checkpoint, run_state
from fxmega.training import faults, tracking
from fxmega.training.evaluate import mean_loss, micro_sums, my_micro_batches, one_device_loss_sum
from fxmega.training.heartbeat import Heartbeat
from fxmega.training.logs import RunLog
from fxmega.training.metrics import Throughput, device_peak, model_flops_per_token
from fxmega.training.optim import AdamWHyper, adamw_init, decay_mask
from fxmega.training.pipeline_step import PipelineStep
from fxmega.training.schedules import lr_at
from fxmega.training.step import EvalStep, TrainStep, trainable


def check_compute(cfg: RunConfig, parallel: Parallel | None, device: torch.device) -> None:
    """Refuse, before anything is built, the ``compute`` options this model and mesh cannot
    honour (no silent fallback)."""
    c = cfg.compute
    kernels.check_available(c.kernels, device)
    model = model_for(cfg.model)
    if c.loss_chunk and not (hasattr(model, "final_hidden") and hasattr(model, "output_weight")):
        raise ConfigError(f"compute.loss_chunk={c.loss_chunk}: the {family_name(cfg.model)} head is not a final norm "
                          f"and one output projection (final_hidden, output_weight), which the chunked loss "
                          f"needs: set compute.loss_chunk=0")
    if not c.loss_chunk or parallel is None:
        return
    if parallel.groups.tp > 1:
        raise ConfigError(f"compute.loss_chunk={c.loss_chunk} works on an unsplit vocabulary; with "
                          f"tp={parallel.groups.tp} "
                          f"the logits are already split over the vocabulary (vocab-parallel cross-entropy): set "
                          f"compute.loss_chunk=0")
    if parallel.plan.pipeline is not None:
        raise ConfigError("compute.loss_chunk is not supported with pipeline parallelism yet (the last stage "
                          "computes the loss from whole logits): set compute.loss_chunk=0")


class Run:
    """A run's model, parameters, optimizer state, steps and data — on one device, or, with
    ``parallel`` (a ``fxmega.sharding.runtime.Parallel``), this rank's shards of them."""

    def __init__(self, cfg: RunConfig, parallel: Parallel | None = None, device: torch.device | None = None) -> None:
        self.parallel = parallel
        data_size = parallel.groups.data_size if parallel is not None else 1
        self.cfg = cfg.validate(data_size)
        t = cfg.train
        if t.deterministic:
            set_deterministic()
        self.device = device or pick_device(t.device)
        check_compute(cfg, parallel, self.device)
        self.compute_dtype = precision.compute_dtype(cfg.compute.precision)
        self.scaler = precision.scaler_for(cfg.compute)  # fp16 only
        self.model = model_for(cfg.model)
        self.specs = self.model.param_specs(cfg.model)
        # the parameters this process holds: all of them, or its pipeline stages' (global paths)
        self.local_specs = self.specs if parallel is None else parallel.specs
        self.pipelined = parallel is not None and parallel.plan.pipeline is not None
        hyper = AdamWHyper(cfg.optim.beta1, cfg.optim.beta2, cfg.optim.eps, cfg.optim.weight_decay)
        decay = decay_mask(self.local_specs, cfg.optim.decay_embeddings)
        if parallel is None:
            self.params = trainable(init_params(self.specs, t.seed, self.device))
            self.opt_state = adamw_init(tree.leaves(self.params))
            loss_sum = one_device_loss_sum(self.specs, cfg.model, cfg.compute)
        else:
            self.params = parallel.shards.init_params(t.seed, self.device)
            self.opt_state = parallel.shards.init_opt_state(self.device)
            loss_sum = parallel.loss_sum_fn(loss_by_pieces(cfg.model, parallel.compute))
        self.step = 0  # optimizer steps taken
        self.skipped_steps = 0  # of them, steps whose update was dropped (non-finite)
        self._checkpointer: checkpoint.Checkpointer | None = None
        zero3_regather = parallel is not None and parallel.gathers_params and parallel.regather
        options = recompute.inductor_options(cfg.compute.recompute != "none" or zero3_regather)
        if self.pipelined:

            # PipelineStage registers the stage's parameters as nn.Parameters (same storage)
            self.params = tree.map_leaves(lambda p: torch.nn.Parameter(p.detach(), requires_grad=True), self.params)
            self.train_step = PipelineStep(parallel, cfg.model, self.model, self.model.objective(cfg.model),
                                           self.params, decay, hyper,
                                           cfg.optim.clip_grad, cfg.grad_accum_steps(data_size), t.compile,
                                           self.device, backend=t.compile_backend, options=options)
            self.eval_step = None
        else:
            self.loss_sum = loss_sum  # (flat params, batch) -> summed loss: what the steps differentiate
            self.train_step = TrainStep(loss_sum, decay, hyper, cfg.optim.clip_grad, compile=t.compile,
                                        parallel=parallel, backend=t.compile_backend, options=options)
            self.eval_step = EvalStep(loss_sum, compile=t.compile, backend=t.compile_backend)
        self.data = build_data(cfg, self.model.objective(cfg.model).name)
        self.train_data, self.valid_data, self.tokenizer = self.data.train, self.data.valid, self.data.tokenizer

    def _my_micro_batches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        return my_micro_batches(batch, self.cfg.train.micro_batch_size, self.parallel, self.device)

    def do_step(self) -> dict[str, float]:
        """One optimizer step on the next global batch; returns loss, lr and grad norm."""
        t = self.cfg.train
        batch = self.train_data.global_batch(self.step, t.global_batch_size)
        n_tokens = global_count([batch])  # of the whole global batch, whatever this rank's share
        n_tokens = faults.maybe_poison(self.step + 1, n_tokens)
        lr = lr_at(self.step, self.cfg.optim, t.steps)
        scale = self.scaler.scale if self.scaler is not None else None
        with kernels.use(self.cfg.compute.kernels):
            self.params, self.opt_state, metrics = self.train_step(self.params, self.opt_state,
                                                                   self._my_micro_batches(batch), lr, n_tokens,
                                                                   loss_scale=scale)
        self.step += 1
        out = {"loss": float(metrics["loss"]), "lr": lr, "grad_norm": float(metrics["grad_norm"])}
        finite = bool(metrics["finite"])
        if self.scaler is not None:
            self.scaler.update(finite)
            out["loss_scale"] = scale
            if not finite:  # fp16: an overflow, expected now and then; not a stop
                self.skipped_steps += 1
                out["skipped"] = True
                if self.parallel is None or self.parallel.rank == 0:
                    print(f"step {self.step}: fp16 gradients overflowed at loss scale {scale:g}: the update was "
                          f"skipped; loss scale now {self.scaler.scale:g} ({self.skipped_steps} skipped so far)",
                          flush=True)
                return out
        if not finite:  # the compiled step did not apply the update
            self._nonfinite(metrics)
            out["skipped"] = True
        return out

    def _nonfinite(self, metrics: dict) -> None:
        """A step with a non-finite loss or gradient (every rank sees it: the norm is global).
        Policy ``skip``: the update was dropped; say so and go on. ``stop``: write what went
        wrong where, and stop with an error."""
        t = self.cfg.train
        report = faults.nonfinite_report(self, metrics, self.step)
        self.skipped_steps += 1
        main = self.parallel is None or self.parallel.rank == 0
        if t.nonfinite == "skip":
            if main:
                print(f"warning: step {self.step}: non-finite loss or gradient (loss {report['loss']}); the update "
                      f"was skipped ({self.skipped_steps} skipped so far; train.nonfinite=skip)", flush=True)
            return
        out = Path(t.diagnostics_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"nonfinite_step{self.step:08d}_rank{report['rank']}.json"
        path.write_text(json.dumps(report, indent=1))
        bad = report["nonfinite_gradients"]
        raise NonFiniteError(f"step {self.step}: non-finite loss or gradient (loss {report['loss']}, gradient norm "
                             f"{report['grad_norm']}); {len(bad)} gradients on rank {report['rank']} are not finite, "
                             f"first {bad[:3]}; the update was not applied. Diagnostics: {path}. Resume from the "
                             f"last checkpoint with a lower --lr, or set train.nonfinite=skip to drop such steps")

    def evaluate(self) -> float:
        """Mean validation loss over ``train.eval_iters`` fixed global batches (the same
        sequences whatever the mesh)."""
        if self.pipelined:  # already summed over the pipeline and the data ranks
            return mean_loss(self.cfg, self.valid_data, self.train_step.eval_sum, self.parallel, self.device, True)
        return mean_loss(self.cfg, self.valid_data, micro_sums(self.eval_step, self.params, self.device),
                         self.parallel, self.device)

    def full_params(self) -> dict:
        """The whole model's parameters as full, unsharded tensors on every rank (every rank
        takes part). Pipeline stages are exchanged with an all_gather_object over pp: for
        checking small models, not for 70B."""
        if self.parallel is None:
            return self.params
        return self.parallel.shards.full_params(self.params, self.specs)

    def save(self, root: str) -> str:
        """Save a checkpoint of this step under ``root`` (asynchronously with
        ``train.async_save``: it is finished by the next save or ``finish_saves``)."""
        t = self.cfg.train
        if self._checkpointer is None or self._checkpointer.root != Path(root):
            self._checkpointer = checkpoint.Checkpointer(root, t.keep_last, t.async_save)
        spec, files = run_state.tokenizer_files(self)
        meta = run_state.meta(self) | {"tokenizer": spec}
        return str(self._checkpointer.save(self.step, run_state.tensors(self), meta, files))

    def finish_saves(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.wait()

    def resume(self, path: str, params_only: bool = False) -> bool:
        """Load a checkpoint (a root's latest, or a step directory) into this rank's shards,
        from whatever mesh saved it. False if the root holds none yet."""
        found = checkpoint.resolve(path)
        if found is None:
            return False
        info = run_state.load_into(self, found, params_only)
        if self.parallel is None or self.parallel.rank == 0:
            if info.get("params_only") or params_only:
                print(f"initialised the parameters from {found} (optimizer and step start fresh)")
            else:
                print(f"resumed from {found} at step {self.step}")
                if info.get("data") != self.data.description:  # said, not silently continued
                    print(f"warning: the checkpoint was trained on {info.get('data')}; this run reads "
                          f"{self.data.description}, from sample {self.step * self.cfg.train.global_batch_size:,}")
        return True

    def sample(self, n_tokens: int, prompt: str, seed: int) -> str:
        """Generated text, decoded on the run's mesh where its parameters are (every rank
        must call, and every rank gets the same text)."""
        if self.tokenizer is None:
            return ""
        return sample_text(functools.partial(generate_on_mesh, self), self.cfg.model, self.tokenizer, prompt, n_tokens,
                           temperature=0.8, top_k=40, seed=seed)


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
    say = print if main else (lambda *a, **k: None)
    t = cfg.train
    if t.load_dir and not run.resume(t.load_dir, params_only=t.finetune):
        say(f"no checkpoint under {t.load_dir} yet: starting from step 0")
    flops = model_flops_per_token(run.specs, cfg.model, t.seq_len)
    peak = device_peak(run.device, run.compute_dtype, t.peak_flops)
    say(f"model: {family_name(cfg.model)}, {count_params(run.specs):,} parameters, {flops / 1e6:,.1f} MFLOPs/token; "
        f"device {run.device} x {world}; MFU against {peak.flops / 1e12:.3f} TFLOP/s per device ({peak.source})")
    dp = 1 if parallel is None else parallel.groups.data_size
    say(f"batch: {t.global_batch_size} x {t.seq_len} tokens = micro batch {t.micro_batch_size} x "
        f"{cfg.grad_accum_steps(dp)} accumulation steps x {dp} data-parallel ranks; {t.steps} steps; "
        f"compile={t.compile_backend if t.compile else 'off'}")
    c = cfg.compute
    say(f"compute: {c.precision} (fp32 master weights and AdamW state"
        f"{', dynamic loss scaling' if c.precision == 'fp16' and not c.loss_scale else ''}), gradient reductions in "
        f"{c.grad_reduce}, recompute {c.recompute}"
        f"{f' (first {c.recompute_layers} blocks)' if c.recompute != 'none' and c.recompute_layers else ''}, "
        f"{c.kernels} kernels, cross-entropy {f'in chunks of {c.loss_chunk} tokens' if c.loss_chunk else 'whole'}")
    say(f"data: {run.data.description}")
    log = RunLog(t.log_jsonl, t.tensorboard_dir, tracking.sinks(cfg, to_dict(cfg))) if main else RunLog()
    result = RunResult(run=run)
    meter = Throughput(flops, peak, world)
    tokens_per_step = t.global_batch_size * t.seq_len
    bar = tqdm(total=t.steps, initial=run.step, desc="train", unit="step", disable=not (progress and main),
               dynamic_ncols=True)
    echo = bar.write if main else (lambda *a, **k: None)
    first_step = run.step
    spikes = faults.SpikeDetector(t.spike_z)
    rank = 0 if parallel is None else parallel.rank
    mesh = parallel.groups.mesh if parallel is not None else None
    beats = None if mesh is None else Heartbeat(rank, world, mesh.coords, mesh.names)
    reset_peak(run.device)
    while run.step < t.steps:
        faults.maybe_stall(rank, run.step + 1)
        if beats is not None:
            beats.start(run.step + 1)
        t0 = time.perf_counter()
        try:
            if t.dump_kernels and run.step == first_step:  # the first step compiles: dump what it becomes

                with dump_kernels(t.dump_kernels, rank, parallel.groups.labels if parallel is not None else None):
                    m = run.do_step()
                echo(f"wrote {t.dump_kernels}/rank{rank}/index.md: compiled graphs, generated code, kernels and "
                     f"collectives")
            else:
                m = run.do_step()  # float() of the loss waits for the step to finish
        except RuntimeError as e:  # a collective that gave up waiting explains who it waited for
            if beats is None:
                raise
            raise beats.explain(e, run.step + 1) from e
        seconds = time.perf_counter() - t0
        step = run.step
        if beats is not None:
            beats.done(step)
        faults.maybe_kill(rank, step)
        first = step == first_step + 1
        rates = meter.step(0 if first else tokens_per_step, seconds)  # compilation is not throughput
        record = {"step": step, **m, "step_time_s": seconds, **rates}
        if not m.get("skipped") and (z := spikes.score(m["loss"])) is not None:
            record["loss_spike_z"] = z
            echo(f"warning: step {step}: loss {m['loss']:.4f} is {z:.1f} standard deviations above the mean of the "
                 f"last {len(spikes.history) - 1} steps (a loss spike)")
        result.losses.append(m["loss"])
        if (t.eval_interval and step % t.eval_interval == 0) or step == t.steps:
            record["valid_loss"] = result.valid_losses[step] = run.evaluate()
            echo(f"step {step}: validation loss {record['valid_loss']:.4f}")
        log_line = not first and (step % t.log_interval == 0 or step == t.steps)
        straggler = ""
        slow = beats.stragglers(step) if log_line and beats is not None and main else None
        if slow is not None and slow[1] > max(0.05, 0.1 * seconds):  # noticeably late, not clock noise
            late_rank, late_s = slow
            straggler = f" | straggler: rank {late_rank} began the step {late_s * 1e3:.0f} ms after the first"
            record |= {"straggler_rank": late_rank, "straggler_late_s": late_s}
        if log_line:
            record["peak_memory_bytes"] = peak_bytes(run.device)  # the high-water mark since the last log line
            reset_peak(run.device)
        log.write(record)
        bar.set_postfix(loss=f"{m['loss']:.3f}", lr=f"{m['lr']:.2e}", gnorm=f"{m['grad_norm']:.2f}",
                        tok_s=f"{rates['tokens_per_s']:,.0f}", refresh=False)
        bar.update(1)
        if first:
            echo(f"step {step}: first step took {seconds:.1f} s" + (" (includes compilation)" if t.compile else ""))
            meter.interval()
        elif log_line:
            avg = meter.interval()
            peak_mem = record["peak_memory_bytes"]
            echo(f"step {step:>6} | loss {m['loss']:.4f} | lr {m['lr']:.3e} | grad norm {m['grad_norm']:.3f} | "
                 f"{avg['tokens_per_s']:,.0f} tokens/s | MFU {100 * avg['mfu']:.2f}% | "
                 f"peak mem {peak_mem / 2**30:.2f} GiB{straggler}")
        if t.save_dir and ((t.save_interval and step % t.save_interval == 0) or step == t.steps):
            result.checkpoint = run.save(t.save_dir)
            echo(f"step {step}: saved checkpoint {result.checkpoint}")
    bar.close()
    run.finish_saves()
    log.close()
    if t.sample_tokens and run.tokenizer is not None:
        result.sample = run.sample(t.sample_tokens, t.sample_prompt, t.seed)
        say("-" * 30 + " sample " + "-" * 30 + f"\n{result.sample}\n" + "-" * 68)
    return result
