"""Facts a user can tell a model and later ask about: the recall task and the retention test draw from these.

Several kinds, each with several values, so a model cannot score by always answering one lucky string.
"""

from __future__ import annotations

import random
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
    """The index-th fact of a sequence: kinds in turn, the value drawn at random."""
    template, question, values = KINDS[index % len(KINDS)]
    answer = rng.choice(values)
    return Fact(template.format(answer), question, answer, tuple(v for v in values if v != answer))
