"""Offline synthetic retrieval prompts, split into a context and a question so compression never sees the question."""

from __future__ import annotations

import random
from dataclasses import dataclass

_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


@dataclass
class Sample:
    context: str
    question: str
    answer: str
    answer_prefix: str = ""

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


def passkey(tokenizer, n_tokens: int, seed: int = 0, depth: float | None = None) -> Sample:
    """A 5-digit pass key hidden at ``depth`` (0 = start, 1 = end; random if None) in ~``n_tokens`` of filler.

    The length is measured in the tokenizer's own tokens. Deterministic for a seed.
    """
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    depth = rng.random() if depth is None else depth
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    per_filler = len(tokenizer(_FILLER, add_special_tokens=False)["input_ids"])
    n_filler = max(1, (n_tokens - len(tokenizer(needle, add_special_tokens=False)["input_ids"])) // per_filler)
    at = round(depth * n_filler)
    intro = "There is important information hidden in a lot of irrelevant text. Find it and memorize it.\n"
    context = intro + _FILLER * at + needle + _FILLER * (n_filler - at)
    return Sample(context, "\nWhat is the pass key?", key, answer_prefix="The pass key is")
