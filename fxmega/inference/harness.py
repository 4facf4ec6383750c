"""EleutherAI's lm-evaluation-harness on a checkpoint: ``run.py eval --tasks T1,T2 --load CKPT``.

The harness (``pip install -e '.[eval]'``, imported only when ``--tasks`` is given) owns the
tasks: their prompts, few-shot examples, metrics and tables. fxmega answers its three kinds of
request with the checkpoint's model, on one device or on its mesh:

- ``loglikelihood``: the continuation's summed token log-probabilities and whether greedy
  decoding would give it (``fxmega.inference.scoring``); the harness's ``TemplateLM`` splits
  context and continuation into tokens as it does for its own ``hf`` model;
- ``loglikelihood_rolling``: a whole text in the harness's own disjoint rolling windows of the
  model's context, each token scored once (perplexity tasks such as wikitext);
- ``generate_until``: greedy (or sampled, where the task asks) cached generation, cut at the
  task's stop strings; requests with the same settings batched, longest first.

On a mesh every rank runs the same harness over the same requests (each is the harness's rank 0
of 1) and computes the same answers; rank 0 prints the table and writes the results.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fxmega.core.errors import ConfigError
from fxmega.inference.generate_parallel import generate_on_mesh
from fxmega.inference.model_loader import LoadedModel
from fxmega.inference.scoring import continuation_logprobs, decoder_for
from fxmega.inference.stops import cut_at_stop, stop_token_ids

INSTALL = "pip install -e '.[eval]'"


def _lm_eval() -> Any:
    try:
        import lm_eval
        import lm_eval.api.model
        import lm_eval.tasks
        import lm_eval.utils
    except ImportError:
        raise ConfigError(f"run.py eval --tasks runs EleutherAI's lm-evaluation-harness, which is not installed: "
                          f"{INSTALL}") from None
    return lm_eval


def harness_model(run: LoadedModel, batch_size: int) -> Any:
    """``run``'s model as an ``lm_eval.api.model.LM`` scoring ``batch_size`` requests per
    forward."""
    lm_eval = _lm_eval()
    get_rolling_token_windows, make_disjoint_window = (lm_eval.utils.get_rolling_token_windows,
                                                       lm_eval.utils.make_disjoint_window)

    class FxmegaLM(lm_eval.api.model.TemplateLM):
        def __init__(self) -> None:
            super().__init__()
            self.run, self.tok, self.decoder = run, run.tokenizer, decoder_for(run)
            self.context = run.cfg.model.max_seq_len

        @property
        def eot_token_id(self) -> int:
            if self.tok.eod is None:
                raise ConfigError(f"the {self.tok.name} tokenizer has no end-of-text token, which the harness "
                                  f"puts before a text scored from its start (loglikelihood_rolling, or an empty "
                                  f"context): evaluate a model trained with a tokenizer that has one (e.g. gpt2)")
            return self.tok.eod

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
            return self.tok.encode(string)

        def _score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[float, bool]]:
            return continuation_logprobs(self.decoder, self.run.cfg.model, pairs, batch_size)

        def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                                  **kwargs: Any) -> list[tuple[float, bool]]:
            answers = self._score([(context, continuation) for _, context, continuation in requests])
            for (key, _, _), answer in zip(requests, answers):
                self.cache_hook.add_partial("loglikelihood", key, answer)
            return answers

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
            windows, owner = [], []
            for i, request in enumerate(requests):
                tokens = self.tok_encode(request.args[0])
                for window in get_rolling_token_windows(tokens, self.eot_token_id, self.context, 1):
                    windows.append(make_disjoint_window(window))
                    owner.append(i)
            totals = [0.0] * len(requests)
            for i, (logprob, _) in zip(owner, self._score(windows)):
                totals[i] += logprob
            for request, total in zip(requests, totals):
                self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), total)
            return totals

        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
            """Requests with the same settings generated together, longest prompts first,
            ``batch_size`` at a time (each row decodes as it would alone)."""
            settings = [self._settings(dict(request.args[1])) for request in requests]
            prompts = [self.tok_encode(request.args[0])[-(self.context - new):] or [self.eot_token_id]
                       for request, (_, new, _) in zip(requests, settings)]
            groups: dict[tuple[tuple[str, ...], int, float], list[int]] = {}
            for i, setting in enumerate(settings):
                groups.setdefault(setting, []).append(i)
            out = [""] * len(requests)
            for (until, new, temperature), members in groups.items():
                members.sort(key=lambda i: -len(prompts[i]))
                for first in range(0, len(members), batch_size):
                    rows = members[first:first + batch_size]
                    generated = generate_on_mesh(self.run, [prompts[i] for i in rows], new, temperature=temperature,
                                                 stop_tokens=stop_token_ids(self.tok, until))
                    for i, ids in zip(rows, generated):
                        out[i] = cut_at_stop(self.tok.decode(ids), until)[0]
            for request, text in zip(requests, out):
                self.cache_hook.add_partial("generate_until", request.args, text)
            return out

        def _settings(self, options: dict[str, Any]) -> tuple[tuple[str, ...], int, float]:
            """A request's (stop strings, max new tokens, temperature): greedy unless it samples."""
            until = options.pop("until", None) or []
            until = (until,) if isinstance(until, str) else tuple(until)
            new = int(options.pop("max_gen_toks", 256))
            sample = bool(options.pop("do_sample", False))
            temperature = float(options.pop("temperature", 1.0)) if sample else 0.0
            if new >= self.context:
                raise ConfigError(f"a task asks for max_gen_toks={new}, which leaves no room for its prompt in the "
                                  f"model's context of {self.context} tokens (model.max_seq_len)")
            return until, new, temperature

    return FxmegaLM()


def task_manager(include_path: str | None) -> Any:
    """The harness's task index, with the YAML tasks under ``include_path`` added."""
    lm_eval = _lm_eval()
    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"--include-path {include_path}: not a directory (a folder of task YAML files)")
    return lm_eval.tasks.TaskManager(include_path=include_path)


def check_tasks(manager: Any, tasks: list[str], include_path: str | None) -> None:
    """Refuse, before a model is loaded, task names the index does not know."""
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        where = f" or under --include-path {include_path}" if include_path else " (--include-path DIR adds YAML tasks)"
        raise ConfigError(f"--tasks: {', '.join(unknown)} not among the harness's tasks{where}; `lm_eval ls tasks` "
                          f"lists them")


def evaluate_tasks(run: LoadedModel, manager: Any, tasks: list[str], limit: float | None = None,
                   num_fewshot: int | None = None, batch_size: int = 8, log_samples: bool = False) -> dict[str, Any]:
    """The harness's results for ``tasks`` (names or groups ``manager``, a ``task_manager``,
    knows) on ``run``'s model: its ``results`` per task, ``configs``, versions and n-shot, as its
    own CLI writes them (with ``log_samples``, each request and answer under ``samples``)."""
    return _lm_eval().simple_evaluate(model=harness_model(run, batch_size), tasks=tasks, task_manager=manager,
                                      limit=limit, num_fewshot=num_fewshot, bootstrap_iters=0,
                                      log_samples=log_samples)


def report(results: dict[str, Any]) -> str:
    """The harness's own tables of ``results``: tasks, then groups where there are any."""
    make_table = _lm_eval().utils.make_table
    tables = [make_table(results)]
    if results.get("groups"):
        tables.append(make_table(results, "groups"))
    return "\n".join(tables)


def write_results(results: dict[str, Any], path: str) -> None:
    """``results`` as JSON at ``path``, as the harness's CLI writes them."""
    handle = _lm_eval().utils.handle_non_serializable
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=2, default=handle, ensure_ascii=False) + "\n")
