"""SCROLLS' metrics on hand-worked cases: SQuAD normalisation, token F1 and exact match with the best reference,
ROUGE without stemming, each ROUGE type's own maximum over references, the geometric mean, and SCROLLS' own
documented example."""

from __future__ import annotations

import pytest

import tapelm.scrolls
from tapelm.scrolls.metrics import exact_match_score, f1_score, normalize_answer, rouge_scores, score


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The  Cat's hat!", "cats hat"),
        ("an apple a day", "apple day"),
        ("Theater, then theme", "theater then theme"),  # articles only as whole words
        ("A.B", "ab"),  # punctuation removed, not replaced: the letters join
        ("  \n\tYes.\n", "yes"),
        ("the", ""),
        ("Ünïcode – dash", "ünïcode – dash"),  # non-ASCII punctuation is not in string.punctuation
    ],
)
def test_normalisation_as_squad(text, expected):
    assert normalize_answer(text) == expected


def test_token_f1_and_exact_match_by_hand():
    # pred tokens {cat, sat}; ref tokens {cat, sat, down}: precision 1, recall 2/3, F1 0.8
    assert f1_score("the cat sat", "A cat sat down.") == pytest.approx(0.8)
    assert f1_score("cat cat", "cat") == pytest.approx(2 * 0.5 * 1 / 1.5)  # counts are a multiset
    assert f1_score("", "cat") == 0.0
    assert f1_score("", "") == 0.0  # SQuAD v1.1's rule, kept by SCROLLS: no common token scores 0
    assert f1_score("the", "a") == 0.0
    assert exact_match_score("The Answer!", "answer") == 1.0
    assert exact_match_score("answers", "answer") == 0.0


def test_best_reference_is_taken_and_examples_are_averaged():
    predictions = {"q1": "Paris", "q2": "blue whale", "q3": ""}
    references = {"q1": ["London", "paris."], "q2": ["the whale", "a green whale"], "q3": ["anything"]}
    em = score("contract_nli", predictions, references)
    assert em["exact_match"] == pytest.approx(round(100 / 3, 4))
    f1 = score("qasper", predictions, references)
    # q1: 1.0; q2: max(F1 vs "whale" = 2/3, F1 vs "green whale" = 0.5) = 2/3; q3 (empty prediction): 0
    assert f1["f1"] == pytest.approx(round(100 * (1 + 2 / 3 + 0) / 3, 4))
    assert f1["scrolls_score"] == f1["f1"]
    assert f1["num_predicted"] == 3
    assert f1["mean_prediction_length_characters"] == pytest.approx(round((5 + 10 + 0) / 3, 4))


def test_rouge_by_hand_without_stemming():
    scores = rouge_scores(["the cat sat on the mat"], [["the cat is on the mat"]])
    # unigrams: 5 of 6 shared; bigrams: the-cat, on-the, the-mat = 3 of 5; LCS "the cat on the mat" = 5 of 6
    assert scores["rouge1"] == pytest.approx(500 / 6)
    assert scores["rouge2"] == pytest.approx(60.0)
    assert scores["rougeL"] == pytest.approx(500 / 6)
    assert scores["geometric_mean"] == pytest.approx((500 / 6 * 60 * 500 / 6) ** (1 / 3))
    unstemmed = rouge_scores(["running dogs"], [["run dog"]])
    assert unstemmed["rouge1"] == 0.0  # with stemming these would match: SCROLLS does not stem


def test_each_rouge_type_takes_its_own_best_reference():
    # ref A "d c b a": rouge1 1.0, rouge2 0, rougeL 0.25; ref B "a b x y": rouge1 0.5, rouge2 1/3, rougeL 0.5
    scores = score("gov_report", ["a b c d"], [["d c b a", "a b x y"]])
    assert scores["rouge/rouge1"] == pytest.approx(100.0)
    assert scores["rouge/rouge2"] == pytest.approx(33.3333)
    assert scores["rouge/rougeL"] == pytest.approx(50.0)
    assert scores["rouge/geometric_mean"] == pytest.approx(round((100 * 100 / 3 * 50) ** (1 / 3), 4))
    assert scores["scrolls_score"] == scores["rouge/geometric_mean"]


def test_geometric_mean_is_zero_when_one_rouge_is_zero_and_empty_prediction_scores_zero():
    scores = score("qmsum", ["mat the on"], [["the mat on"]])  # every unigram shared, no bigram
    assert scores["rouge/rouge1"] == pytest.approx(100.0)
    assert scores["rouge/rouge2"] == 0.0
    assert scores["rouge/geometric_mean"] == 0.0
    empty = score("summ_screen_fd", [""], [["a summary"]])
    assert empty["rouge/rouge1"] == empty["rouge/geometric_mean"] == 0.0


def test_newlines_do_not_change_rouge_1_2_l():
    flat = rouge_scores(["First point. Second point here."], [["First point. Another point here."]])
    lined = rouge_scores(["First point.\nSecond point here."], [["First point.\nAnother point here."]])
    for kind in ("rouge1", "rouge2", "rougeL", "geometric_mean"):
        assert flat[kind] == pytest.approx(lined[kind])


def test_scrolls_documented_example():
    """The example in SCROLLS' metric script (metrics/scrolls.py of the tau/scrolls dataset repository)."""
    predictions = ["exact match example", "hello there", "general kenobi"]
    references = [["exact match example"], ["hello", "hi there"], ["commander kenobi"]]
    rouge = tapelm.scrolls.score("gov_report", predictions, references)
    assert (rouge["rouge/rouge1"], rouge["rouge/rouge2"], rouge["rouge/rougeL"]) == (72.2222, 33.3333, 72.2222)
    assert rouge["rouge/geometric_mean"] == 55.8136
    assert rouge["mean_prediction_length_characters"] == 14.6667
    assert tapelm.scrolls.score("contract_nli", predictions, references)["exact_match"] == 33.3333
    assert tapelm.scrolls.score("narrative_qa", predictions, references)["f1"] == 72.2222


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="task='squad' is not allowed; choose one of: qasper"):
        score("squad", ["a"], [["a"]])
    with pytest.raises(ValueError, match="1 missing"):
        score("qasper", {"a": "x"}, {"a": ["x"], "b": ["y"]})
    with pytest.raises(ValueError, match="1 redundant"):
        score("qasper", {"a": "x", "c": "z"}, {"a": ["x"]})
    with pytest.raises(ValueError, match="at least one reference"):
        score("qasper", {"a": "x"}, {"a": []})
    with pytest.raises(ValueError, match="average_score"):
        tapelm.scrolls.average_score({})
    assert tapelm.scrolls.average_score({"a": {"scrolls_score": 10.0}, "b": {"scrolls_score": 20.0}}) == 15.0


def test_rouge_lsum_is_reported_on_sentences_when_a_splitter_is_installed(monkeypatch):
    """With nltk's punkt data SCROLLS puts one sentence per line, which rougeLsum scores sentence by sentence; a
    stand-in splitter replaces punkt (absent offline) to check that wiring."""
    from tapelm.scrolls import metrics

    monkeypatch.setattr(metrics, "_sentence_splitter", lambda: lambda text: [s for s in text.split(". ") if s])
    scores = score("gov_report", ["a b. c d."], [["c d. a b."]])
    assert scores["rouge/rougeL"] == pytest.approx(50.0)  # one sequence: the longest common subsequence is 2 of 4
    assert scores["rouge/rougeLsum"] == pytest.approx(100.0)  # each reference sentence is matched whole
    assert scores["rouge/rouge2"] == pytest.approx(66.6667)  # bigrams a-b and c-d of a-b, b-c, c-d
    # rougeLsum stays out of the geometric mean
    assert scores["rouge/geometric_mean"] == pytest.approx(round((100 * 200 / 3 * 50) ** (1 / 3), 4))
