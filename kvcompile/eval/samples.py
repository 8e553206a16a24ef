"""A task sample (a context compressed before its question) and a task (how to build samples of a length), shared
by the generated task families (``synthetic``, ``step_tasks``)."""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Sample:
    """One prompt: ``context`` (compressed), then ``question`` + ``answer_prefix`` (read after compression)."""

    context: str
    question: str
    answers: tuple[str, ...]
    answer_prefix: str = ""
    steps: tuple[str, ...] = ()  # step tasks (``eval.step_tasks``): the context's steps, in order
    needed: tuple[int, ...] = ()  # ... and the ones the answer needs

    @property
    def answer(self) -> str:
        return ", ".join(self.answers)

    def prompt(self, tokenizer) -> tuple[str, str]:
        """(context text, question text) in the model's chat format when it has one; the context part ends where
        the question starts, so it can be compressed before the question is read."""
        if not getattr(tokenizer, "chat_template", None):
            return self.context, self.question + " " + self.answer_prefix
        marker = "\x00QUESTION\x00"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": self.context + marker}], tokenize=False, add_generation_prompt=True
        )
        context, rest = text.split(marker)
        return context, self.question + rest + self.answer_prefix

    def score(self, prediction: str) -> float:
        return string_match_all(self.answers, prediction)


def string_match_all(answers, prediction: str) -> float:
    """RULER's score: the fraction of reference strings found in ``prediction`` (case-insensitive)."""
    pred = re.sub(r"[\x00-\x1f]", " ", prediction).strip().lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


@dataclass(frozen=True)
class Task:
    """A task: ``build(rng, n)`` makes the sample with an ``n``-unit haystack; generation stops after
    ``max_new_tokens``. ``build`` must draw the same content for every ``n`` from the same ``rng`` state."""

    name: str
    build: Callable[[random.Random, int], Sample]
    max_new_tokens: int
    segments: str | None = None  # how the sweep segments the context: "steps" (the sample's), a rule, or None
