"""ReCo's early stop as a generation option: ``cm.generate(..., early_stop=EarlyStop(tokenizer))``.

ReCo is known from one line (generation stops early once its reward says the answer is settled). INFERRED (the paper was
not found; docs/methods_scorers.md#reco): no process reward model runs while generating, so the settled answer is read
off the tokens the row has generated. The text is cut into steps at ``step_end`` (a line, by default); when a token
completes a step, the row stops if that step repeats a step it generated before (the model restates itself: no progress,
the reward a repeated step would earn) or holds an end-of-answer marker (``markers``: "the answer is", "Answer:"; the
answer was given). The step the prompt leaves open counts as the first step's start, so an answer prefix in the prompt
("Answer: the code is") makes the first completed step an answer. The tokens before the stop are exactly those the row
generates without it; the check reads each token on the host (a sync per step, only when on).
"""

from __future__ import annotations

from dataclasses import dataclass

MARKERS = ("the answer is", "answer:")


@dataclass(frozen=True)
class EarlyStop:
    """Stop a row once its answer is settled (a repeated step, or a step holding one of ``markers``, matched
    case-insensitively); steps end at a token whose text holds ``step_end``."""

    tokenizer: object
    markers: tuple[str, ...] = MARKERS
    step_end: str = "\n"

    def __post_init__(self):
        if not callable(getattr(self.tokenizer, "decode", None)):
            raise ValueError(f"early stop needs a tokenizer (with decode), got {type(self.tokenizer).__name__}")
        if not isinstance(self.step_end, str) or not self.step_end:
            raise ValueError(f"early stop: step_end must be a non-empty string, got {self.step_end!r}")
        if isinstance(self.markers, str) or any(not isinstance(m, str) or not m.strip() for m in self.markers):
            raise ValueError(f"early stop: markers must be a tuple of non-blank strings, got {self.markers!r}")

    def open_step(self, prompt: list[int]) -> str:
        """The text of the step ``prompt`` leaves open (after its last ``step_end``): an answer prefix such as
        "Answer: the code is" makes the step the row completes an answer step."""
        return self.tokenizer.decode(prompt[-256:], skip_special_tokens=True).split(self.step_end)[-1]

    def heads(self, input_ids, mask) -> list[str]:
        """``open_step`` of each row of a prompt [B, T] (its real tokens: ``mask`` [B, T])."""
        return [self.open_step(ids[m.bool()].tolist()) for ids, m in zip(input_ids.cpu(), mask.cpu())]

    def settled(self, tokens: list[int], head: str = "") -> bool:
        """Whether a row that generated ``tokens`` after a prompt whose open step is ``head`` stops after the last
        one."""
        if not tokens or self.step_end not in self.tokenizer.decode(tokens[-1:]):
            return False
        text = head + self.tokenizer.decode(tokens, skip_special_tokens=True)
        steps = [s.strip().lower() for s in text.split(self.step_end)[:-1] if s.strip()]  # the completed steps
        if not steps:
            return False
        return steps[-1] in steps[:-1] or any(m.lower() in steps[-1] for m in self.markers)
