"""ReCo's early stop (docs/methods_scorers.md#reco, inferred): ``generate(early_stop=EarlyStop(tokenizer))`` finishes a
row once its answer is settled (a repeated step, or a step holding an end-of-answer marker), and changes no token
before."""

from __future__ import annotations

import pytest
import torch
from conftest import byte_tokenizer

import kvcompile
from kvcompile.early_stop import EarlyStop

N = 48  # max_new_tokens


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def prompts(rows: int = 1) -> torch.Tensor:
    return torch.cat([torch.randint(2, 250, (1, 40), generator=torch.Generator().manual_seed(s)) for s in range(rows)])


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text, settled", [
    ("The code is 5.\nSo the code is 5.\nThe code is 5.\n", True),  # a step restated
    ("Let me think.\nthe code is 5.\n", False),  # no repeat (case and spaces aside, the steps differ)
    ("Let me think.\nSo the answer is 5.\n", True),  # an end-of-answer marker
    ("The answer is 5", False),  # the step is not complete
    ("Step one.\n\n\n", False),  # blank steps neither repeat nor answer
    ("Step one.\n\nStep one.\n", True),
])
def test_a_row_settles_on_a_repeated_step_or_an_answer_step(tok, text, settled):
    assert EarlyStop(tok).settled(ids(tok, text)) is settled


def test_the_step_the_prompt_leaves_open_starts_the_first_step(tok):
    stop = EarlyStop(tok)
    head = stop.open_step(ids(tok, "Question: what is the code?\nAnswer: the code is"))
    assert head == "Answer: the code is"
    assert stop.settled(ids(tok, " 5.\n"), head) and not stop.settled(ids(tok, " 5.\n"))


def test_the_step_end_and_markers_are_options(tok):
    assert EarlyStop(tok, step_end=".").settled(ids(tok, "a b. a b."))
    assert not EarlyStop(tok, markers=("final:",)).settled(ids(tok, "the answer is 5\n"))
    assert EarlyStop(tok, markers=("final:",)).settled(ids(tok, "Final: 5\n"))


def first_settled(stop: EarlyStop, tokens: list[int], prompt: torch.Tensor) -> int | None:
    """The index of the token after which ``stop`` ends a row that generates ``tokens`` after ``prompt`` [T]
    (None: never)."""
    head = stop.open_step(prompt.tolist())
    return next((i for i in range(len(tokens)) if stop.settled(tokens[: i + 1], head)), None)


def firing_rule(tok, tokens: list[int]) -> EarlyStop:
    """A rule that fires inside ``tokens`` (a random model writes no lines): steps end at a character the row
    generated, and the marker is the text of the first step it completes."""
    text = [tok.decode([t]) for t in tokens]
    for i, c in enumerate(text[2:N - 8], start=2):
        step = tok.decode(tokens[:i]).split(c)[-1].strip()  # the step this character completes
        if c.strip() and step and c not in "".join(text[:i]):
            return EarlyStop(tok, markers=(step,), step_end=c)
    pytest.skip("the random model wrote no usable step")


def test_early_stop_ends_generation_at_the_settled_step_and_keeps_the_tokens_before(tok, byte_full):
    cm = kvcompile.apply(byte_full, budget=0.5, recipe="reco")
    plain = cm.generate(prompts(), max_new_tokens=N)[0, 40:].tolist()
    assert len(plain) == N  # the random model never writes its eos here
    stop = firing_rule(tok, plain)
    k = first_settled(stop, plain, prompts()[0])
    assert k is not None and k < N - 1
    out = cm.generate(prompts(), max_new_tokens=N, early_stop=stop)[0, 40:].tolist()
    assert out == plain[: k + 1]
    never = EarlyStop(tok, markers=("no such step",), step_end="\x07")  # a rule that never fires changes nothing
    assert cm.generate(prompts(), max_new_tokens=N, early_stop=never)[0, 40:].tolist() == plain


def test_a_settled_row_is_padded_while_the_other_rows_go_on(tok, byte_full):
    cm = kvcompile.apply(byte_full, budget=0.5, recipe="reco")
    plain = cm.generate(prompts(2), max_new_tokens=N)[:, 40:].tolist()
    stop = firing_rule(tok, plain[0])
    ends = [first_settled(stop, row, p) for row, p in zip(plain, prompts(2))]
    out = cm.generate(prompts(2), max_new_tokens=N, early_stop=stop, pad_token_id=0)[:, 40:].tolist()
    width = N if None in ends else max(ends) + 1
    assert len(out[0]) == width
    for row, got, end in zip(plain, out, ends):
        stop_at = N if end is None else end + 1
        assert got == (row[:stop_at] + [0] * width)[:width]


def test_bad_early_stop_is_refused_and_leaves_the_model_untouched(tok, byte_full):
    cm = kvcompile.apply(byte_full, budget=0.5, recipe="reco")
    draft = kvcompile.apply(byte_full, budget=0.25, recipe="snapkv")
    for bad, message in [("on", "must be a kvcompile.early_stop.EarlyStop"), (True, "EarlyStop")]:
        with pytest.raises(ValueError, match=message):
            cm.generate(prompts(), max_new_tokens=4, early_stop=bad)
    with pytest.raises(ValueError, match="not supported with a speculative draft"):
        cm.generate(prompts(), max_new_tokens=4, early_stop=EarlyStop(tok), draft=draft)
    assert cm.seen is None
    for args, message in [({"tokenizer": None}, "needs a tokenizer"), ({"step_end": ""}, "step_end"),
                          ({"markers": "answer"}, "tuple of non-blank strings")]:
        with pytest.raises(ValueError, match=message):
            EarlyStop(**({"tokenizer": tok} | args))
