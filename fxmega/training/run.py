"""A run, assembled: the config validated, the model and its specs, the parameters and
optimizer state (``TrainState``), the compiled train and eval steps (plain or pipelined),
the data, and the checkpointer — on one device or as one rank of a mesh. ``Run.do_step``
advances the state by one optimizer step; tests and benchmarks drive it directly, and
``fxmega.training.train.train`` is the loop around it.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from fxmega.compiler import overlap
from fxmega.config import RunConfig
from fxmega.core import precision, tree
from fxmega.core.device import pick_device, set_deterministic
from fxmega.core.log import get_logger
from fxmega.data.prefetch import Prefetcher
from fxmega.data.sources import Data, build_data
from fxmega.inference.generate import sample_text
from fxmega.inference.generate_parallel import generate_on_mesh
from fxmega.inference.seq2seq import WithModelSpecials, ended, generate_seq2seq, is_encoder_decoder
from fxmega.models import loss_by_pieces, model_for
from fxmega.models.family import ModelFamily
from fxmega.models.weight_uses import fp8_gathered
from fxmega.ops import aux_loss, fp8, kernels, matmul, recompute, tied_embedding_grad
from fxmega.ops.init import init_params
from fxmega.ops.objectives import Objective
from fxmega.optim.optimizer import init_state, optimizer_for
from fxmega.parallel.runtime import Parallel
from fxmega.storage import checkpoint, run_state
from fxmega.training import faults
from fxmega.training.checks import check_reference, check_run
from fxmega.training.evaluate import mean_loss, micro_sums, my_step_input, one_device_loss_sum, to_device
from fxmega.training.optim import param_roles
from fxmega.training.outcome import Pending, settle
from fxmega.training.pipeline_step import PipelineStep
from fxmega.training.reference import load_reference
from fxmega.training.schedules import lr_at
from fxmega.training.state import TrainState
from fxmega.training.step import EvalStep, TrainStep, trainable

log = get_logger(__name__)


class _StateField:
    """A ``TrainState`` field, read and written through the ``Run`` that holds the state."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, run: Run | None, owner: type | None = None) -> object:
        return self if run is None else getattr(run.state, self.name)

    def __set__(self, run: Run, value: object) -> None:
        setattr(run.state, self.name, value)


class Run:
    """What a run is built of — the config, the model and its specs, the compiled steps, the
    data, the checkpointer — around its ``state`` (a ``TrainState``: parameters, optimizer
    state, counters, loss scaler), on one device or, with ``parallel``, this rank's shards.
    ``do_step`` advances the state by one optimizer step; the loop is ``train.train``.

    ``model`` and ``data`` default to the config's family and its objective's token data;
    fine-tuning (``training.finetune``) passes a classifier and labelled rows instead, and
    trains through the same steps. ``objective`` defaults to the family's; one that
    ``reads_reference`` reads the outputs of ``reference``, a checkpoint loaded as a frozen
    second tree under the same plan (``training.reference``)."""

    def __init__(self, cfg: RunConfig, parallel: Parallel | None = None, device: torch.device | None = None,
                 model: ModelFamily | None = None, data: Data | None = None, objective: Objective | None = None,
                 reference: str | None = None) -> None:
        self.parallel = parallel
        data_size = parallel.groups.data_size if parallel is not None else 1
        t = cfg.train
        self.device = device or pick_device(t.device)
        self.model = model if model is not None else model_for(cfg.model)
        self.cfg = check_run(cfg, None if parallel is None else parallel.plan, self.device, self.model)
        self.objective = objective if objective is not None else self.model.objective(cfg.model)
        check_reference(cfg, None if parallel is None else parallel.plan, self.objective, reference)
        if t.deterministic:
            set_deterministic()
        self.compute_dtype = precision.compute_dtype(cfg.compute.precision)
        self.matmul_recipe = fp8.recipe_for(cfg.compute.fp8, self.device)  # plain unless compute.fp8
        if cfg.compute.fp8_gather:  # which weights ZeRO-3 gathers in fp8: those the recipe's matmuls cast
            parallel.gather_in_fp8(fp8_gathered(cfg.model, parallel.plan.tp_shapes(), self.model, self.objective))
        self.specs = self.model.param_specs(cfg.model)
        # the parameters this process holds: all of them, or its pipeline stages' (global paths)
        self.local_specs = self.specs if parallel is None else parallel.specs
        self.pipelined = parallel is not None and parallel.plan.pipeline is not None
        self.optimizer = optimizer = optimizer_for(cfg.optim)
        roles = param_roles(self.local_specs, cfg.optim.decay_embeddings)
        if parallel is not None:  # Muon on a mesh that slices a matrix: how its pieces are gathered
            roles = parallel.optimizer_roles(roles, optimizer)
        sign_rates = tuple(s.sign_rate for s in tree.leaves(self.local_specs))  # MoE expert biases: see Update
        if parallel is None:
            params = trainable(init_params(self.specs, t.seed, self.device))
            leaves = tree.leaves(params)
            opt_state = init_state(optimizer, lambda dtype: [torch.zeros_like(p, dtype=dtype) for p in leaves],
                                   self.device)
        else:
            params = parallel.shards.init_params(t.seed, self.device)
            opt_state = parallel.init_opt_state(optimizer, self.device)
        # the frozen second tree (None without one): this rank's shards, laid out as ``params``
        self.reference = None if reference is None else \
            load_reference(reference, params, self.specs, self.local_specs, parallel)
        if parallel is None:
            loss_sum = one_device_loss_sum(self.specs, cfg.model, cfg.compute, self.model, self.objective,
                                           self.reference)
        else:
            loss_sum = parallel.loss_sum_fn(loss_by_pieces(cfg.model, parallel.compute, self.model, self.objective,
                                                           self.reference))
        if self.pipelined:  # PipelineStage registers the stage's parameters as nn.Parameters (same storage)
            params = tree.map_leaves(lambda p: torch.nn.Parameter(p.detach(), requires_grad=True), params)
        self.state = TrainState(params, opt_state, scaler=precision.scaler_for(cfg.compute, self.device))
        # parallel.overlap_param_gather: after a step only this rank's optimizer shards are current
        # in its parameters until the next step (or ``params``) gathers them
        self._params_stale = False
        self._checkpointer: checkpoint.Checkpointer | None = None
        self._prefetcher: Prefetcher | None = None  # ``prefetch``: the next steps' input, built ahead
        zero3_regather = parallel is not None and parallel.gathers_params and parallel.regather
        options = {**tied_embedding_grad.inductor_options(),
                   **(recompute.inductor_options(cfg.compute.recompute != "none" or zero3_regather) or {})}
        if cfg.parallel.overlap_comm or cfg.parallel.async_tp:
            options |= overlap.inductor_options(cfg.parallel)
        if t.cuda_graphs:  # the state lives at fixed addresses, so the captured graphs update it in place
            options["triton.cudagraphs"] = True
            for tensor in [*tree.leaves(params), *tree.leaves(opt_state)]:
                torch._dynamo.mark_static_address(tensor)
        # what the layers report through the step (aux_loss.measure): routers' statistics, MTP's depth losses
        self.meter_names = self.model.meter_stats(cfg.model)
        under_cp = parallel is not None and parallel.plan.mesh.size("cp") > 1
        if under_cp and aux_loss.ROUTER_STATS[0] in self.meter_names:
            # per-sequence and per-micro-batch measures (balancing, load max/min) of which each cp
            # rank sees a part: said, and left out rather than reported per part
            self.meter_names = tuple(n for n in self.meter_names if n not in aux_loss.ROUTER_STATS)
            if parallel.rank == 0:
                log.info("note: under cp the routers' statistics (balancing loss, load max/min, dropped pairs) are "
                         "not collected: each is a per-sequence measure of which a cp rank sees only its chunks "
                         "(the selection bias still moves by the whole load, summed over cp)")
        if self.pipelined:
            self.train_step = PipelineStep(parallel, cfg.model, self.model, self.objective,
                                           self.params, roles, optimizer,
                                           cfg.optim.clip_grad, cfg.grad_accum_steps(data_size), t.compile,
                                           self.device, backend=t.compile_backend, options=options,
                                           sign_rates=sign_rates, meter_names=self.meter_names)
            self.eval_step = None
        else:
            self.loss_sum = loss_sum  # (flat params, batch) -> summed loss: what the steps differentiate
            self.train_step = TrainStep(loss_sum, roles, optimizer, cfg.optim.clip_grad, compile=t.compile,
                                        parallel=parallel, backend=t.compile_backend, options=options,
                                        sign_rates=sign_rates, meter_names=self.meter_names,
                                        gather_params_first=cfg.parallel.overlap_param_gather)
            self.eval_step = EvalStep(loss_sum, compile=t.compile, backend=t.compile_backend)
        self._local_paths = tree.paths(self.local_specs)  # what a non-finite report names
        self._rank = 0 if parallel is None else parallel.rank
        self._say = log.info if self._rank == 0 else (lambda text: None)
        self.data = data if data is not None else build_data(cfg, self.model.objective(cfg.model).name)
        self.train_data, self.valid_data, self.tokenizer = self.data.train, self.data.valid, self.data.tokenizer

    # the state's fields, read and written through the run (checkpoints, generation, tests)
    opt_state, step = _StateField(), _StateField()
    skipped_steps, scaler = _StateField(), _StateField()

    @property
    def params(self) -> tree.Tree:
        """This rank's parameters, whole. Under ``parallel.overlap_param_gather`` the last
        step's updated shards are gathered into every replica first (eagerly: what the next
        step's graph would have done), so evaluation, checkpoints and samples read current values."""
        if self._params_stale:
            self.train_step.gather_params(tree.leaves(self.state.params))
            self._params_stale = False
        return self.state.params

    @params.setter
    def params(self, value: tree.Tree) -> None:
        self.state.params = value
        self._params_stale = False

    def host_batch(self, step: int) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
        """Step ``step``'s input on the host: this rank's micro batches (pinned on CUDA, for
        asynchronous copies) and the loss-token count of the whole global batch."""
        t = self.cfg.train
        micros, n_tokens = my_step_input(self.train_data, step, t.global_batch_size, t.micro_batch_size, self.parallel)
        if self.device.type == "cuda":
            micros = [{k: v.pin_memory() for k, v in b.items()} for b in micros]
        return micros, n_tokens  # the count: of the whole global batch, whatever this rank's share

    def prefetch(self, depth: int) -> None:
        """Build the next ``depth`` steps' input in a background thread from now on
        (``stop_prefetch`` ends it); the batches are the same as without."""
        self.stop_prefetch()
        self._prefetcher = Prefetcher(self.host_batch, self.step, self.cfg.train.steps, depth)

    def stop_prefetch(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None

    def launch_step(self) -> Pending:
        """One optimizer step on the next global batch, launched without waiting for it:
        nothing is read back from the device (the fp16 scaler decides the next scale there).
        ``settle`` reads its outcome."""
        t = self.cfg.train
        micros, n_tokens = self._prefetcher.get(self.step) if self._prefetcher is not None else \
            self.host_batch(self.step)
        n_tokens = faults.maybe_poison(self.step + 1, n_tokens)
        lr = lr_at(self.step, self.cfg.optim, t.steps)
        scale = self.scaler.scale_tensor if self.scaler is not None else None
        s = self.state
        with kernels.use(self.cfg.compute.kernels), matmul.use(self.matmul_recipe):
            s.params, s.opt_state, metrics = self.train_step(s.params, s.opt_state, to_device(micros, self.device), lr,
                                                             n_tokens, loss_scale=scale)
        self._params_stale = self.cfg.parallel.overlap_param_gather
        if self.scaler is not None:
            self.scaler.update(metrics["finite"])
        s.step += 1
        return Pending(s.step, lr, metrics, scale, self.scaler.scale_tensor if self.scaler is not None else None)

    def settle(self, pending: list[Pending]) -> list[dict[str, float]]:
        """The outcomes of launched steps (loss, lr, grad norm, ...), read from the device
        in one go; applies the non-finite policy (``train.nonfinite``) to them, in order."""
        t = self.cfg.train
        return settle(self.state, pending, policy=t.nonfinite, diagnostics_dir=t.diagnostics_dir,
                      local_paths=self._local_paths, rank=self._rank, say=self._say, meter_names=self.meter_names)

    def do_step(self) -> dict[str, float]:
        """One optimizer step, waited for: loss, lr and grad norm (a host sync; the training
        loop launches steps and settles them at log steps instead)."""
        return self.settle([self.launch_step()])[0]

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

    def full_opt_state(self, name: str) -> dict:
        """The optimizer state ``name`` (AdamW: ``exp_avg`` or ``exp_avg_sq``) as full tensors
        in the parameter tree, on every rank (every rank takes part). After the first step
        ``exp_avg`` is (1 - beta1) times the clipped global gradient: what the parity tests
        compare parameter by parameter."""
        if self.parallel is None:
            return tree.unflatten_like(self.local_specs, self.opt_state[name])
        local = tree.unflatten_like(self.local_specs, self.parallel.grads.moments_by_param(self.opt_state[name]))
        return self.parallel.shards.full_params(local, self.specs, kind="opt")

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
                log.info(f"initialised the parameters from {found} (optimizer and step start fresh)")
            else:
                log.info(f"resumed from {found} at step {self.step}")
                if info.get("data") != self.data.description:  # said, not silently continued
                    sample = self.step * self.cfg.train.global_batch_size
                    log.warning(f"the checkpoint was trained on {info.get('data')}; this run reads "
                                f"{self.data.description}, from sample {sample:,}")
        return True

    def sample(self, n_tokens: int, prompt: str, seed: int) -> str:
        """Generated text, decoded on the run's mesh where its parameters are (every rank
        must call, and every rank gets the same text)."""
        if self.tokenizer is None:
            return ""
        if is_encoder_decoder(self.model):  # the prompt is a source; its target follows it
            if self.parallel is not None:
                log.info(f"no sample: the {self.cfg.name} encoder-decoder generates on one device "
                         f"(run.py generate --load the checkpoint)")
                return ""
            tok = WithModelSpecials(self.tokenizer, self.cfg.model)  # the prompt may hold sentinels
            source = ended([tok.encode(prompt)], self.cfg.model.eos_id)
            ids = generate_seq2seq(self.model, self.params, self.cfg.model, source, n_tokens, temperature=0.8,
                                   top_k=40, seed=seed)[0]
            return f"{prompt}\n=> {tok.decode(ids)}"
        return sample_text(functools.partial(generate_on_mesh, self), self.cfg.model, self.tokenizer, prompt, n_tokens,
                           temperature=0.8, top_k=40, seed=seed)
