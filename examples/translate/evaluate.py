"""BLEU and chrF of a trained translator (a T5, or a decoder-only model tuned on the chat
template) on held-out pairs, against copying the source.

    python examples/translate/evaluate.py --load ckpt/t5_translate [--pairs data/translation/en-fr.test.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from fxmega.data.parallel_text import read_pairs  # noqa: E402
from fxmega.inference.generation_cli import load_recorded_generator  # noqa: E402
from fxmega.inference.translation_eval import evaluate_translation, translator_for  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", required=True, help="the checkpoint (a root or a step directory)")
    parser.add_argument("--pairs", default="data/translation/en-fr.test.jsonl", help="held-out {src, tgt} lines")
    parser.add_argument("--max-new-tokens", type=int, default=160, help="per translation")
    parser.add_argument("--show", type=int, default=5, help="print this many translations")
    args = parser.parse_args()
    run = load_recorded_generator(args.load)
    pairs = read_pairs(args.pairs)
    result = evaluate_translation(translator_for(run, args.max_new_tokens), pairs)
    for (src, ref), hyp in list(zip(pairs, result["hypotheses"]))[:args.show]:
        print(f"source:      {src}\nreference:   {ref}\ntranslation: {hyp}\n")
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()
                      if k != "hypotheses"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
