"""HumanEval pass@k of a checkpoint's completions: every problem's prompt completed, each
completion run against the problem's tests (a fresh process, a scratch directory, time and
memory limits, no network), pass@k by the unbiased estimator.

    python examples/code/evaluate.py --load ckpt/gpt_code                        # greedy: pass@1
    python examples/code/evaluate.py --load ckpt/gpt_code --samples 10 --temperature 0.8 --k 1 10
    python examples/code/evaluate.py --canonical         # the harness on HumanEval's reference solutions
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from fxmega.inference.code_eval import completions, evaluate_code  # noqa: E402
from fxmega.inference.code_exec import read_problems  # noqa: E402
from fxmega.inference.generation_cli import load_recorded_generator  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--load", help="the checkpoint (a root or a step directory)")
    which.add_argument("--canonical", action="store_true", help="score HumanEval's reference solutions instead")
    parser.add_argument("--samples", type=int, default=1, help="completions per problem")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--k", type=int, nargs="+", default=[1], help="pass@k for each k <= samples")
    parser.add_argument("--max-new-tokens", type=int, default=384, help="per completion")
    parser.add_argument("--limit", type=int, default=0, help="only the first N problems (0: all 164)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per candidate")
    parser.add_argument("--no-isolate", action="store_true", help="run candidates with network access")
    parser.add_argument("--show", type=int, default=2, help="print this many completions")
    args = parser.parse_args(argv)
    problems = read_problems()
    tasks = list(problems)[:args.limit or None]
    start = time.perf_counter()
    if args.canonical:
        candidates = {t: [problems[t]["canonical_solution"]] * args.samples for t in tasks}
    else:
        run = load_recorded_generator(args.load)
        made = completions(run, [problems[t]["prompt"] for t in tasks], args.max_new_tokens, args.samples,
                           args.temperature)
        candidates = dict(zip(tasks, made))
    generated = time.perf_counter()
    result = evaluate_code(candidates, problems, args.k, args.timeout, not args.no_isolate)
    for task in tasks[:args.show]:
        print(f"{task}: {result['outcomes'][task][0].result}\n{problems[task]['prompt']}{candidates[task][0]}\n")
    report = {k: v for k, v in result.items() if k != "outcomes"}
    report |= {"generate_s": round(generated - start, 1), "execute_s": round(time.perf_counter() - generated, 1)}
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in report.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
