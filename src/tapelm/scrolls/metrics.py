"""SCROLLS' metrics, computed as the benchmark's own metric script computes them (the `tau/scrolls` dataset
repository's metrics/scrolls.py with its f1.py, exact_match.py and rouge.py; the evaluator of tau-nlp/scrolls).

- Answers are normalised as in SQuAD v1.1: lower-cased, punctuation (`string.punctuation`) removed, the articles
  "a", "an", "the" removed as whole words, whitespace collapsed.
- `exact_match`: 100 x the mean over examples of the best (max over references) normalised string equality.
- `f1`: 100 x the mean over examples of the best token F1 (bag of normalised tokens); a pair with no common token
  scores 0, also when both sides normalise to nothing (SQuAD v1.1's rule, which SCROLLS keeps).
- ROUGE: `rouge-score`'s F-measures of rouge1, rouge2, rougeL and rougeLsum, without stemming (SCROLLS passes
  use_stemmer=False), on texts whose sentences are put on separate lines by nltk's `sent_tokenize` (this affects only
  rougeLsum; rouge-score's tokenizer treats newlines as spaces). Each ROUGE type takes, per example, its own maximum
  over the references (the max of rouge1 and the max of rouge2 may come from different references), then the mean
  over examples (x 100); `rouge/geometric_mean` is the cube root of the product of the mean rouge1, rouge2 and rougeL.
  nltk's sentence splitter needs its `punkt_tab` data (`python -m nltk.downloader punkt_tab`); without it
  `rouge/rougeLsum` is left out of the result (no other number changes), as no network may be reachable.
- Like SCROLLS, the result also has `num_predicted`, `mean_prediction_length_characters` and `scrolls_score` (the
  task's headline number); every value is rounded to 4 decimals. SCROLLS' display-only lists are not reproduced.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from functools import lru_cache

from .tasks import get_task

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD v1.1's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(char for char in text.lower() if char not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match_score(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


def f1_score(prediction: str, reference: str) -> float:
    """Token F1 of the normalised texts; 0 when they share no token (also when both are empty)."""
    predicted = normalize_answer(prediction).split()
    expected = normalize_answer(reference).split()
    same = sum((Counter(predicted) & Counter(expected)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(expected)
    return 2 * precision * recall / (precision + recall)


def _best_mean(metric, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """100 x the mean over examples of the best score over each example's references."""
    return 100.0 * sum(max(metric(p, r) for r in refs) for p, refs in zip(predictions, references)) / len(predictions)


@lru_cache(maxsize=1)
def _sentence_splitter():
    """nltk's sent_tokenize when its punkt data is installed, else None."""
    import nltk

    try:
        nltk.sent_tokenize("One. Two.")
    except LookupError:
        return None
    return nltk.sent_tokenize


def split_sentences(text: str) -> str | None:
    """`text` with one sentence per line (SCROLLS' preparation for rougeLsum); None without nltk's punkt data."""
    splitter = _sentence_splitter()
    return None if splitter is None else "\n".join(splitter(text))


def rouge_scores(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> dict[str, float]:
    """SCROLLS' ROUGE block: {"rouge1", "rouge2", "rougeL", ["rougeLsum",] "geometric_mean"}, each 0-100."""
    from rouge_score import rouge_scorer

    split = _sentence_splitter() is not None
    types = ROUGE_TYPES if split else ROUGE_TYPES[:3]
    scorer = rouge_scorer.RougeScorer(list(types), use_stemmer=False)
    prepare = split_sentences if split else (lambda text: text)
    totals = dict.fromkeys(types, 0.0)
    for prediction, refs in zip(predictions, references):
        predicted = prepare(prediction)
        scores = [scorer.score(prepare(reference), predicted) for reference in refs]
        for kind in types:
            totals[kind] += max(score[kind].fmeasure for score in scores)
    result = {kind: 100.0 * total / len(predictions) for kind, total in totals.items()}
    result["geometric_mean"] = (result["rouge1"] * result["rouge2"] * result["rougeL"]) ** (1.0 / 3.0)
    return result


def _aligned(predictions, references) -> tuple[list[str], list[list[str]]]:
    """Predictions and reference lists in one order, checked as SCROLLS' evaluator checks them."""
    if isinstance(predictions, Mapping) != isinstance(references, Mapping):
        raise ValueError("predictions and references must both be mappings id -> value or both be sequences")
    if isinstance(predictions, Mapping):
        missing = sorted(set(references) - set(predictions))
        extra = sorted(set(predictions) - set(references))
        if missing or extra:
            what = (
                f"{len(missing)} missing (e.g. {missing[0]!r})"
                if missing
                else f"{len(extra)} redundant (e.g. {extra[0]!r})"
            )
            raise ValueError(f"predictions do not match the references' ids: {what}; give one prediction per id")
        ids = list(references)
        predictions = [predictions[i] for i in ids]
        references = [references[i] for i in ids]
    predictions, references = list(predictions), [list(refs) for refs in references]
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} reference lists; give one each")
    if not predictions:
        raise ValueError("there is nothing to score: no predictions")
    if not all(isinstance(p, str) for p in predictions):
        raise ValueError("every prediction must be a string")
    if not all(refs and all(isinstance(r, str) for r in refs) for refs in references):
        raise ValueError(
            "every example needs at least one reference string (test splits have none: score the validation split)"
        )
    return predictions, references


def score(
    task: str,
    predictions: Mapping[str, str] | Sequence[str],
    references: Mapping[str, Sequence[str]] | Sequence[Sequence[str]],
) -> dict[str, float]:
    """SCROLLS' scores of one task, 0-100, under SCROLLS' own names (`f1`, `exact_match`, `rouge/rouge1`,
    `rouge/rouge2`, `rouge/rougeL`, `rouge/rougeLsum`, `rouge/geometric_mean`), plus `num_predicted`,
    `mean_prediction_length_characters` and `scrolls_score` (the task's headline metric).

    predictions: id -> text (then references: id -> list of reference texts, the same ids) or a list of texts
    aligned with a list of reference lists."""
    spec = get_task(task)
    predictions, references = _aligned(predictions, references)
    if spec.metric == "f1":
        metrics = {"f1": _best_mean(f1_score, predictions, references)}
    elif spec.metric == "exact_match":
        metrics = {"exact_match": _best_mean(exact_match_score, predictions, references)}
    else:
        metrics = {f"rouge/{k}": v for k, v in rouge_scores(predictions, references).items()}
    metrics["num_predicted"] = len(predictions)
    metrics["mean_prediction_length_characters"] = sum(map(len, predictions)) / len(predictions)
    metrics = {key: round(value, 4) for key, value in metrics.items()}
    metrics["scrolls_score"] = metrics[spec.metric]
    return metrics


def average_score(scores: Mapping[str, Mapping[str, float]]) -> float:
    """The mean of the tasks' headline scores (SCROLLS' overall score is this over its seven tasks)."""
    values = [task_scores["scrolls_score"] for task_scores in scores.values()]
    if not values or any(not isinstance(v, (int, float)) or math.isnan(v) for v in values):
        raise ValueError("average_score needs at least one task with a numeric scrolls_score")
    return round(sum(values) / len(values), 4)


__all__ = [
    "normalize_answer",
    "exact_match_score",
    "f1_score",
    "rouge_scores",
    "split_sentences",
    "score",
    "average_score",
    "ROUGE_TYPES",
]
