"""Question-answering quality on held-out questions: exact match and token F1 after SQuAD's
answer normalisation (lower case, punctuation and the articles a/an/the removed, whitespace
collapsed; the official SQuAD v1.1 evaluation's), averaged over questions, with one
reference answer each. Reported next to the majority baseline: every question answered with
the training split's most frequent answer (what a model must beat to have learned more than
the answers' distribution)."""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Sequence
from typing import Any

from fxmega.inference.chat import Answerer

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def token_f1(prediction: str, reference: str) -> float:
    """F1 of the normalised answers' tokens, counted with multiplicity (SQuAD's)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def qa_scores(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Exact match and token F1 in percent, averaged over the questions."""
    if len(predictions) != len(references) or not references:
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references: give one per question")
    n = len(references)
    return {"exact_match": 100 * sum(map(exact_match, predictions, references)) / n,
            "f1": 100 * sum(map(token_f1, predictions, references)) / n}


def majority_answer(answers: Sequence[str]) -> str:
    """The most frequent answer (after normalisation; the first seen of the most frequent)."""
    counts = collections.Counter(normalize_answer(a) for a in answers)
    best = max(counts.values())
    return next(a for a in answers if counts[normalize_answer(a)] == best)


def evaluate_qa(answer: Answerer, pairs: Sequence[tuple[str, str]], train_answers: Sequence[str]) -> dict[str, Any]:
    """Exact match and F1 of ``answer``'s answers to ``pairs``' questions, and of the majority
    baseline over ``train_answers``; with the answers themselves (``predictions``)."""
    questions, references = [q for q, _ in pairs], [a for _, a in pairs]
    predictions = [p.strip() for p in answer(questions)]
    baseline = qa_scores([majority_answer(train_answers)] * len(pairs), references)
    return {"questions": len(pairs), **qa_scores(predictions, references),
            "majority_exact_match": baseline["exact_match"], "majority_f1": baseline["f1"],
            "predictions": predictions}
