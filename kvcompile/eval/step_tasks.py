"""Multi-step tasks: a reasoning chain and an agent trace, whose answer needs specific earlier steps.

Each sample's context is a list of steps (``Sample.steps``, separated by blank lines) and the indices of the steps
the answer needs (``Sample.needed``), so retention can be scored directly (the share of the needed steps' tokens a
compression held: ``needed_retention``) as well as by the answer. Like ``synthetic``'s tasks they are generated
offline, deterministic for a seed, and fitted to a length in the model's tokens (``synthetic.make_sample``: ``n``
distractor steps, drawn from a sub-RNG so the first ``n`` are the same for every ``n``).

* ``steps_chain``: numbered reasoning steps; one states a code, a later one says another thing uses the same code;
  the question asks for the second thing's code (needs both). Distractors: other codes and links, steps that move
  on, and reflection steps ("Wait, let me re-check..."). SmolLM2-135M's full cache answered 1 of 10 at 1024 tokens,
  too few for accuracy to rank compressions.
* ``steps_chain1``: the one-hop chain: the question asks for a stated code (the answer needs that one step) and a
  tenth of the distractors state other codes (``steps_chain``: 35%); SmolLM2-135M's full cache answered most
  samples (bench/results/steps.md).
* ``steps_agent``: a tool-call trace (``Action: tool(args)`` then ``Observation: ...``) after a system prompt with
  the tool schemas; the question asks for what one observation returned (needs that step).
"""

from __future__ import annotations

import functools
import random
import string

from torch import Tensor

from .samples import Sample, Task

COLORS = ("red", "blue", "green", "yellow", "black", "white", "silver", "orange", "purple", "brown")
THINGS = ("box", "door", "safe", "locker", "gate", "crate", "cabinet", "drawer", "chest", "vault")
CITIES = ("Oslo", "Lima", "Cairo", "Quito", "Perth", "Dakar", "Hanoi", "Porto", "Tunis", "Riga", "Accra", "Kyiv")
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea")
DEPTS = ("sales", "billing", "support", "research", "legal", "shipping")
SKIES = ("cloudy", "sunny", "rainy", "windy", "foggy")
MOVE_ON = ("Nothing else depends on this, so we move on.", "This does not change the earlier steps.",
           "We keep this in mind and continue.", "So far every step is consistent.")
REFLECT = ("Wait, let me re-check the previous step. It is correct.", "Hmm, let me double-check that. Yes, it holds.",
           "Actually, let me verify the list again. Nothing is missing.")


def _code(rng: random.Random) -> str:
    return str(rng.randint(10000, 99999))


def _place(rng: random.Random, units: list[str], needed: list[str]) -> tuple[list[str], tuple[int, ...]]:
    """``needed`` inserted in order at random depths of ``units``; the steps and the needed steps' indices."""
    depths = sorted(rng.random() for _ in needed)
    steps, marks = list(units), []
    for text, depth in reversed(list(zip(needed, depths))):
        steps.insert(round(depth * len(units)), text)
    for text in needed:
        marks.append(steps.index(text))
    return steps, tuple(marks)


def _chain(rng: random.Random, n: int, links: int = 1, decoys: float = 0.35) -> Sample:
    """A code stated once, then ``links`` steps that pass it on ("the B uses the same code as the A"); the question
    asks for the last thing's code, so the answer needs ``links + 1`` steps (``links=0``: the code itself). A share
    ``decoys`` of the distractor steps state other things' codes; the rest link other things, move on or reflect."""
    objects = [f"{c} {t}" for c in COLORS for t in THINGS]
    rng.shuffle(objects)
    chain, value, h = objects[: links + 1], _code(rng), links + 1
    sub = random.Random(rng.getrandbits(32))
    units = []
    for i in range(n):
        kind = sub.random()
        other = objects[h + i % (len(objects) - h)]
        rest = (kind - decoys) / (1 - decoys)  # where a non-decoy falls among the other kinds
        if kind < decoys:
            units.append(f"The code of the {other} is {_code(sub)}.")
        elif rest < 0.2 / 0.65:
            units.append(f"The {other} uses the same code as the {sub.choice(objects[h:])}.")
        elif rest < 0.45 / 0.65:
            units.append(sub.choice(MOVE_ON))
        else:
            units.append(sub.choice(REFLECT))
    needed = [f"The code of the {chain[0]} is {value}."]
    needed += [f"The {b} uses the same code as the {a}." for a, b in zip(chain, chain[1:])]
    steps, marks = _place(rng, units, needed)
    steps = tuple(f"Step {i + 1}: {s}" for i, s in enumerate(steps))
    context = "Solve the puzzle step by step. Each step may depend on earlier steps.\n\n" + "\n\n".join(steps)
    return Sample(context, f"\n\nQuestion: What is the code of the {chain[-1]}?", (value,),
                  f"Answer: The code of the {chain[-1]} is", steps, marks)


TOOLS = "lookup_order(id), weather(city), get_user(name)"


def _agent(rng: random.Random, n: int) -> Sample:
    order, code = str(rng.randint(10000, 99999)), "".join(rng.choices(string.ascii_uppercase + string.digits, k=6))
    sub = random.Random(rng.getrandbits(32))
    units = []
    for _ in range(n):
        kind = sub.random()
        if kind < 0.2:
            other = str(sub.randint(10000, 99999))
            while other == order:
                other = str(sub.randint(10000, 99999))
            units.append(f"Action: lookup_order({other})\nObservation: Order {other} ships to {sub.choice(CITIES)}; "
                         f"tracking code {''.join(sub.choices(string.ascii_uppercase + string.digits, k=6))}.")
        elif kind < 0.6:
            city = sub.choice(CITIES)
            units.append(f"Action: weather({city})\nObservation: {city}: {sub.randint(-5, 35)} degrees, "
                         f"{sub.choice(SKIES)}.")
        else:
            name = sub.choice(NAMES)
            units.append(f"Action: get_user({name})\nObservation: {name} works in {sub.choice(DEPTS)}, extension "
                         f"{sub.randint(1000, 9999)}.")
    needed = [f"Action: lookup_order({order})\nObservation: Order {order} ships to {rng.choice(CITIES)}; tracking "
              f"code {code}."]
    steps, marks = _place(rng, units, needed)
    context = (f"You are a support agent. Tools: {TOOLS}. Each action is followed by its observation.\n\n"
               + "\n\n".join(steps))
    return Sample(context, f"\n\nQuestion: What tracking code did the lookup of order {order} return?", (code,),
                  "Answer: The tracking code is", tuple(steps), marks)


STEP_TASKS = {t.name: t for t in [
    Task("steps_chain", _chain, 12, segments="steps"),
    Task("steps_chain1", functools.partial(_chain, links=0, decoys=0.1), 12, segments="steps"),
    Task("steps_agent", _agent, 12, segments="steps"),
]}


def step_spans(tokenizer, context: str, steps: tuple[str, ...]) -> list[tuple[int, int]]:
    """The token span (start, end) of every step within ``context``'s tokens (``tokenizer(context,
    add_special_tokens=False)``): the tokens that start inside the step's characters."""
    offsets = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    spans, at = [], 0
    for step in steps:
        c0 = context.index(step, at)
        c1 = at = c0 + len(step)
        inside = [t for t, (a, _) in enumerate(offsets) if c0 <= a < c1]
        spans.append((inside[0], inside[-1] + 1))
    return spans


def needed_retention(held: Tensor, spans: list[tuple[int, int]], needed: tuple[int, ...]) -> float:
    """The share of the needed steps' tokens held, over every (layer, KV head): ``held`` [L, B, Hkv, S] is
    ``CompressedModel.held_positions()`` (row 0 is read)."""
    wanted = [p for i in needed for p in range(*spans[i])]
    pos = held[:, 0]
    hit = sum(int((pos == p).any(-1).sum()) for p in wanted)
    return hit / (len(wanted) * pos.shape[0] * pos.shape[1])


def task_segments(task: Task, sample: Sample, tokenizer, context: str):
    """What ``prefill(segments=...)`` gets for ``task``'s ``context`` text: the sample's step spans
    (``task.segments == "steps"``), a rule name, or None."""
    if task.segments == "steps":
        return step_spans(tokenizer, context, sample.steps)
    return task.segments
