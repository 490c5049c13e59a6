"""Evaluation prompts kept out of training: a prompt that equals or nearly equals an MT-bench question is dropped.

"Nearly" is measured on words, not characters: half of a question's word 5-grams found in one user turn (a question
re-typed with a few words changed, quoted inside a longer request, or with another greeting), or the same words after
case and punctuation are dropped. Both turns of every question count: a second turn is a prompt too.
"""
import re

from common.sources import mtbench_questions

NGRAM = 5
SHARE = 0.5  # of a question's 5-grams inside one user turn


def _words(text):
    return re.findall(r"[a-z0-9]+", text.lower())


def _grams(words):
    return {tuple(words[i:i + NGRAM]) for i in range(len(words) - NGRAM + 1)}


class EvalPrompts:
    """The evaluation questions' word 5-grams, indexed: `overlaps(text)` -> the id of the question `text` repeats
    (or None) in a few set look-ups, so 17,000 conversations are checked in about a second."""

    def __init__(self, questions=None):
        questions = questions if questions is not None else \
            [(f"{qid}/turn{t + 1}", text) for qid, turns, _ in mtbench_questions() for t, text in enumerate(turns)]
        self.exact, self.grams, self.index = {}, {}, {}
        for qid, text in questions:
            words = _words(text)
            self.exact[" ".join(words)] = qid
            self.grams[qid] = _grams(words)
            for g in self.grams[qid]:
                self.index.setdefault(g, set()).add(qid)

    def overlaps(self, text):
        words = _words(text)
        if " ".join(words) in self.exact:
            return self.exact[" ".join(words)]
        hits = {}
        for g in _grams(words):
            for qid in self.index.get(g, ()):
                hits[qid] = hits.get(qid, 0) + 1
        for qid, n in hits.items():
            if n >= SHARE * len(self.grams[qid]):
                return qid
        return None

    def conversation_overlaps(self, messages):
        """-> the question id that any user turn of `messages` repeats, or None."""
        for m in messages:
            if m["role"] == "user":
                hit = self.overlaps(m["content"])
                if hit:
                    return hit
        return None
