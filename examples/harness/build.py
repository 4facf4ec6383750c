"""Two lm-evaluation-harness tasks over the Shakespeare corpus that ``make run`` trains on,
written as local JSONL files and task YAMLs, for ``run.py eval --tasks`` where the Hugging Face
hub is out of reach:

- ``shakespeare_cloze`` (multiple choice, accuracy): a line without its last word, and four
  words to end it: the true one and three last words of other lines;
- ``shakespeare_lines`` (generation, exact match): the first half of a line, to be completed
  up to the end of the line.

    python examples/harness/build.py                     # writes data/harness/
    python run.py eval --load runs/shakespeare_gpt/checkpoints \\
        --tasks shakespeare_cloze,shakespeare_lines --include-path data/harness --limit 100

Lines are drawn from the corpus' last 5%, the part ``make run`` holds out for validation.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from fxmega.data.corpus import ensure_shakespeare  # noqa: E402

CLOZE = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{text}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

LINES = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prefix}}}}"
doc_to_target: "{{{{rest}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 32
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def candidate_lines(text: str) -> list[str]:
    """Verse and prose lines of the held-out part with at least four words (no speaker names,
    no stage directions)."""
    held_out = text[int(len(text) * 0.95):]
    return [line.strip() for line in held_out.splitlines()
            if len(line.split()) >= 4 and not line.isupper() and not line.strip().startswith("[")]


def build(text: str, out: Path, n: int = 200, seed: int = 0) -> list[Path]:
    """The two tasks' JSONL files and YAMLs under ``out`` (``n`` documents each); their paths."""
    rng = random.Random(seed)
    lines = candidate_lines(text)
    picked = rng.sample(lines, min(n, len(lines)))
    endings = sorted({line.split()[-1] for line in lines})
    cloze, halves = [], []
    for line in picked:
        words = line.split()
        wrong = rng.sample([w for w in endings if w != words[-1]], 3)
        choices = [words[-1], *wrong]
        rng.shuffle(choices)
        cloze.append({"text": " ".join(words[:-1]), "choices": choices, "answer": choices.index(words[-1])})
        cut = len(words) // 2
        halves.append({"prefix": " ".join(words[:cut]) + " ", "rest": " ".join(words[cut:])})
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, docs, template in (("shakespeare_cloze", cloze, CLOZE), ("shakespeare_lines", halves, LINES)):
        data = out / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (out / f"{name}.yaml").write_text(template.format(name=name, data=data.resolve()))
        written += [data, out / f"{name}.yaml"]
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data/harness", help="where the task files go")
    parser.add_argument("--data-dir", default="data", help="where the Shakespeare corpus is (fetched if missing)")
    parser.add_argument("-n", type=int, default=200, help="documents per task")
    args = parser.parse_args()
    for path in build(ensure_shakespeare(args.data_dir).read_text(), Path(args.out), args.n):
        print(path)


if __name__ == "__main__":
    main()
