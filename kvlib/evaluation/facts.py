"""Facts a user can tell a model and later ask about: the recall task and the retention test draw from these.

Several kinds, each with several values, so a model cannot score by always answering one lucky string.
"""

from __future__ import annotations

import random
import re
import unicodedata
from dataclasses import dataclass


@dataclass(frozen=True)
class Fact:
    statement: str  # told to the model
    question: str  # asked later
    answer: str  # what a correct answer contains
    alternatives: tuple[str, ...]  # other values of the same kind (distractors)


KINDS = [
    ("My dog's name is {}.", "What is my dog's name?",
     ["Barkley", "Biscuit", "Rufus", "Pepper", "Maple", "Ziggy", "Waffles", "Copper"]),
    ("My sister lives in {}.", "In which city does my sister live?",
     ["Lisbon", "Osaka", "Denver", "Nairobi", "Oslo", "Lima", "Krakow", "Hanoi"]),
    ("The code of the garage door is {}.", "What is the code of the garage door?",
     ["4729", "1836", "5902", "3417", "7265", "9051", "2683", "8140"]),
    ("My favourite fruit is the {}.", "What is my favourite fruit?",
     ["mango", "apricot", "kiwi", "plum", "papaya", "lychee", "fig", "guava"]),
    ("Our project is called {}.", "What is our project called?",
     ["Nightingale", "Copperfield", "Bluebird", "Ironwood", "Starling", "Juniper", "Marigold", "Falcon"]),
    ("My manager is named {}.", "What is my manager's name?",
     ["Margaret", "Tobias", "Ingrid", "Ravi", "Esther", "Lucas", "Priya", "Anselm"]),
]


def draw(rng: random.Random, index: int) -> Fact:
    """The index-th fact of a sequence: kinds in turn, the value drawn at random. Callers number facts within each
    bucket or length (index 0 in every one), so every bucket holds the same kinds: kind never stands in for length."""
    template, question, values = KINDS[index % len(KINDS)]
    answer = rng.choice(values)
    return Fact(template.format(answer), question, answer, tuple(v for v in values if v != answer))


def words(text: str) -> list[str]:
    """Lower-case words, accents folded and punctuation dropped: "Kraków." and "krakow" read alike, and "config" is
    one word, not a "fig" within it."""
    folded = unicodedata.normalize("NFKD", text.casefold())
    plain = "".join(c for c in folded if not unicodedata.combining(c))
    return re.findall(r"[^\W_]+", plain)


def answered(expected: str, answer: str) -> bool:
    """Whether an answer states the expected value as whole words (case and punctuation aside): "fig" is answered by
    "It is the fig." and not by "config"; "4729" not by "47291"."""
    want, said = words(expected), words(answer)
    if not want:
        return False
    return any(said[i:i + len(want)] == want for i in range(len(said) - len(want) + 1))


# Tokens allowed beyond the longest statement of a fact: an answer may open with a word or two ("Sure, ...").
ANSWER_MARGIN = 6


def answer_cap(tokenizer, margin: int = ANSWER_MARGIN) -> int:
    """How many tokens an answer may take: the longest statement of any fact in full (a model that answers "The code
    of the garage door is 4729." must reach the code), plus a margin. Measured with the model's own tokenizer."""
    longest = max(len(tokenizer.encode(template.format(value), add_special_tokens=False))
                  for template, _, values in KINDS for value in values)
    return longest + margin
