"""Exact match and token F1 of a chat-tuned model's answers to held-out questions, against the
majority baseline (every question answered with the training split's most frequent answer).

    python examples/qa/evaluate.py --load ckpt/gpt_qa [--questions data/qa/stdlib-docs.test.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from fxmega.inference.chat import chat_answerer  # noqa: E402
from fxmega.inference.generation_cli import load_recorded_generator  # noqa: E402
from fxmega.inference.qa_eval import evaluate_qa  # noqa: E402


def read_questions(path: str) -> list[tuple[str, str]]:
    """``(prompt, response)`` of each ``{"prompt", "response"}`` line."""
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return [(r["prompt"], r["response"]) for r in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", required=True, help="the checkpoint (a root or a step directory)")
    parser.add_argument("--questions", default="data/qa/stdlib-docs.test.jsonl", help="held-out question lines")
    parser.add_argument("--train", default="data/qa/stdlib-docs.train.jsonl", help="for the majority baseline")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="per answer")
    parser.add_argument("--show", type=int, default=5, help="print this many answers")
    args = parser.parse_args(argv)
    run = load_recorded_generator(args.load)
    pairs = read_questions(args.questions)
    result = evaluate_qa(chat_answerer(run, args.max_new_tokens), pairs, [a for _, a in read_questions(args.train)])
    for (question, reference), answer in list(zip(pairs, result["predictions"]))[:args.show]:
        print(f"question:  {question}\nreference: {reference}\nanswer:    {answer}\n")
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()
                      if k != "predictions"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
