"""Kinds of traffic: each rule fires on what it is for, and a real mixed corpus yields every kind."""

from collections import Counter

import pytest

from eyas.data.config import CorpusConfig
from eyas.data.corpora import read_corpus
from eyas.data.traffic import KINDS, traffic_kind


@pytest.mark.parametrize("request_text, kind", [
    ("Write a c# method to check if a string is a palindrome", "code"),
    ("I'm getting this error: app.py:8: DeprecationWarning: executable_path has been deprecated", "code"),
    ("import java.util.concurrent.Executors;\n\npublic class Tree {", "code"),
    ("Summarize this earnings report in 5 simple bullet points: Adobe drove record revenue", "summarization"),
    ("tl;dr of the following article please", "summarization"),
    ("Write a poem on the tragedy of a crypto exchange", "creative"),
    ("We're going to write a children's story about a little boy called Luka", "creative"),
    ("If a train leaves at 3 and travels 60 km/h, how many km after 2.5 hours?", "reasoning"),
    ("What is 17 * 23?", "reasoning"),
    ("Do astronauts get sick in space?", "chat"),
    ("list all the highlights of Rooibos tea", "chat"),
])
def test_each_kind_is_recognised(request_text, kind):
    assert traffic_kind(request_text) == kind


def test_category_auto_labels_a_real_corpus_with_every_kind_and_leaves_others_alone():
    records, _ = read_corpus(CorpusConfig(kind="sharegpt", max_records=600, category="auto"), 1)
    counts = Counter(r.category for r in records)
    assert set(counts) == set(KINDS) and counts["chat"] < len(records)
    records, _ = read_corpus(CorpusConfig(kind="sharegpt", max_records=50), 1)
    assert {r.category for r in records} == {"chat"}  # without "auto" the corpus keeps its one label
