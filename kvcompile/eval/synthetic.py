"""Offline RULER-style long-context tasks, split into a context and a question so compression never sees the question.

Every task is a ``build(rng, n) -> Sample`` over a haystack of ``n`` units (filler lines, prose sentences,
distractor needles, listed words); ``make_sample`` draws the sample's content once from a seeded RNG, then
searches the largest ``n`` whose prompt plus ``max_new_tokens`` fits the requested length in the model's own
tokens. Haystacks come from Python's bundled ``pydoc_data`` topics and generated words: nothing is downloaded.
Task definitions follow RULER (https://arxiv.org/abs/2404.06654, NVIDIA/RULER ``scripts/data/synthetic``);
the scores are RULER's ``string_match_all`` (fraction of reference strings found in the answer).
"""

from __future__ import annotations

import functools
import random
import re
import string
import uuid
from collections.abc import Callable

from .samples import Sample, Task
from .step_tasks import STEP_TASKS

SEPARATOR = "\x1e"  # in a task prompt: the context before it is compressed before the question after it is read
_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


# ---------------------------------------------------------------------------------------------- text sources
@functools.lru_cache(maxsize=1)
def _prose() -> list[str]:
    """Sentences of Python's reference manual (``pydoc_data.topics``, bundled with CPython)."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    text = re.sub(r"\s+", " ", re.sub(r"[*`|>]+", " ", text))
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z])", text)
    return [s for s in sentences if 20 <= len(s) <= 400]


@functools.lru_cache(maxsize=1)
def _words() -> list[str]:
    """Plain English words of 4..10 letters from the same text, sorted: the pool for keys and word lists."""
    words = set(re.findall(r"\b[a-z]{4,10}\b", " ".join(_prose())))
    return sorted(words)


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _word_key(rng: random.Random) -> str:
    return "-".join(rng.sample(_words(), 2))


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


# ---------------------------------------------------------------------------------------------- needle tasks
def _niah(haystack: str, key: Callable, value: Callable, num_keys: int = 1, num_values: int = 1, num_queries: int = 1):
    """RULER's needle-in-a-haystack: ``max(num_keys, num_queries)`` keys with ``num_values`` values each, hidden in
    ``haystack`` ("noise" filler lines, "essay" prose or "needle" distractors); the question asks for every value
    of ``num_queries`` keys."""
    kind = "numbers" if value is _number else "uuids"

    def build(rng: random.Random, n: int) -> Sample:
        n_keys = max(num_keys, num_queries)
        keys = []
        while len(keys) < n_keys:
            k = key(rng)
            keys.append(k) if k not in keys else None
        values = [[value(rng) for _ in range(num_values)] for _ in keys]
        queried = rng.sample(range(n_keys), num_queries)
        single = num_values * num_queries == 1
        noun = kind[:-1] if single else kind
        needles = [f"One of the special magic {kind} for {k} is: {v}." for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        depths = [rng.random() for _ in needles]
        start, sub_seed = rng.randrange(1 << 30), rng.getrandbits(32)
        if haystack == "noise":
            units = [_FILLER] * n
        elif haystack == "essay":
            prose = _prose()
            units = [prose[(start + i) % len(prose)] for i in range(n)]
        else:  # distractor needles with their own keys; a sub-RNG keeps the first n the same for every n
            sub = random.Random(sub_seed)
            units = []
            while len(units) < n:
                k = key(sub)
                if k not in keys:
                    units.append(f"One of the special magic {kind} for {k} is: {value(sub)}.")
        for needle, depth in sorted(zip(needles, depths), key=lambda p: p[1], reverse=True):
            units.insert(round(depth * len(units)), needle)
        q_keys = _join([keys[i] for i in queried])
        intro = (f"{'A' if single else 'Some'} special magic {noun} {'is' if single else 'are'} hidden within the "
                 f"following text. Make sure to memorize {'it' if single else 'them'}. I will quiz you about the "
                 f"{noun} afterwards.\n")
        question = (f"\nWhat {'is the' if single else 'are all the'} special magic {noun} for {q_keys} mentioned in "
                    "the provided text?")
        prefix = f"The special magic {noun} for {q_keys} mentioned in the provided text {'is' if single else 'are'}"
        answers = tuple(v for i in queried for v in values[i])
        return Sample(intro + " ".join(units), question, answers, prefix)

    return build


def _passkey(rng: random.Random, n: int, depth: float | None = None) -> Sample:
    """A 5-digit pass key at ``depth`` (random if None) in ``n`` filler lines (the Landmark-Attention pass-key test)."""
    key = str(rng.randint(10000, 99999))
    drawn = rng.random()
    at = round((drawn if depth is None else depth) * n)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    intro = "There is important information hidden in a lot of irrelevant text. Find it and memorize it.\n"
    context = intro + " ".join([_FILLER] * at + [needle] + [_FILLER] * (n - at))
    # "5-digit number only": without it SmolLM2-135M loops on "the pass key is the pass key..." (0.65 -> 1.0)
    question = "\nWhat is the pass key? Answer with the 5-digit number only."
    return Sample(context, question, (key,), answer_prefix="The pass key is")


def _credential(rng: random.Random, n: int) -> Sample:
    """A ``password: <8 characters>`` line at a random depth of an ``n``-line service log: a dormant credential
    behind an anchor (Transactional Attention's case, docs/methods_scorers.md#ta-fast), asked for after the log."""
    secret, depth, start = "".join(rng.choices(string.ascii_letters + string.digits, k=8)), rng.random(), rng.random()
    words, at = _words(), round(depth * n)
    lines = [f"[{i:05d}] service {words[round(start * len(words) + 7 * i) % len(words)]} ok" for i in range(n)]
    lines.insert(at, f"[{at:05d}] login admin password: {secret}")
    return Sample("A server log follows.\n" + "\n".join(lines), "\nWhat is the admin password in the log?", (secret,),
                  answer_prefix="The admin password is")


# ---------------------------------------------------------------------------------------------- aggregation tasks
def _variable_tracking(rng: random.Random, n: int, hops: int = 4) -> Sample:
    """RULER VT: a chain ``VAR A = 12345, VAR B = VAR A, ...`` of ``hops`` assignments in ``n`` filler lines;
    the answer is every variable that ends up holding the value."""
    names = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        names.append(name) if name not in names else None
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    depths = sorted(rng.random() for _ in chain)
    units = [_FILLER] * n
    for stmt, depth in reversed(list(zip(chain, depths))):
        units.insert(round(depth * n), stmt)
    context = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
               + " ".join(units))
    question = f"\nQuestion: Find all variables that are assigned the value {value} in the text above."
    prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} variables "
              f"are assigned the value {value}, they are:")
    return Sample(context, question, tuple(names), prefix)


def _common_words(rng: random.Random, n: int, num_common: int = 10, freq_common: int = 6, freq_rare: int = 1):
    """RULER CWE: ``num_common`` words ``freq_common`` times each among ``n`` rarer words (``freq_rare`` times
    each), shuffled into a numbered list; the answer is the common words. (RULER's <4k frequencies.)"""
    pool = rng.sample(_words(), num_common + 2000)
    common, rare = pool[:num_common], pool[num_common:]
    rare = (rare * (n // len(rare) + 1))[:n]
    order = random.Random(rng.getrandbits(32))
    words = common * freq_common + rare * freq_rare
    order.shuffle(words)
    listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
    context = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
               f"ones that appear most often.\n{listing}")
    question = f"\nQuestion: What are the {num_common} most common words in the above list?"
    prefix = f"Answer: The top {num_common} words that appear most often in the list are:"
    return Sample(context, question, tuple(common), prefix)


def _frequent_words(rng: random.Random, n: int, alpha: float = 2.0, vocab: int = 40) -> Sample:
    """RULER FWE: ``n`` coded words drawn with Zipf(``alpha``) counts over ``vocab`` random 6-letter words (the
    most frequent one is the noise "...."); the answer is the three most frequent real words."""
    coded = []
    while len(coded) < vocab:
        w = "".join(rng.choices(string.ascii_lowercase, k=6))
        coded.append(w) if w not in coded else None
    coded[0] = "...."
    weights = [k ** -alpha for k in range(1, vocab + 1)]
    total = sum(weights)
    counts = [max(1, round(n * w / total)) for w in weights]
    words = [w for w, c in zip(coded, counts) for _ in range(c)]
    random.Random(rng.getrandbits(32)).shuffle(words)
    context = ("Read the following coded text and track the frequency of each coded word. Find the three most "
               "frequently appeared coded words. " + " ".join(words))
    question = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text?")
    prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
    return Sample(context, question, tuple(coded[1:4]), prefix)


TASKS: dict[str, Task] = {t.name: t for t in [
    Task("niah_single_1", _niah("noise", _word_key, _number), 24),
    Task("niah_single_2", _niah("essay", _word_key, _number), 24),
    Task("niah_single_3", _niah("essay", _word_key, _uuid), 48),
    Task("niah_multikey_1", _niah("essay", _word_key, _number, num_keys=4), 24),
    Task("niah_multikey_2", _niah("needle", _word_key, _number), 24),
    Task("niah_multikey_3", _niah("needle", _uuid, _uuid), 48),
    Task("niah_multivalue", _niah("essay", _word_key, _number, num_values=4), 64),
    Task("niah_multiquery", _niah("essay", _word_key, _number, num_queries=4), 64),
    Task("vt", _variable_tracking, 30),
    Task("cwe", _common_words, 96),
    Task("fwe", _frequent_words, 32),
    Task("passkey", _passkey, 12),
    Task("credential", _credential, 16),
]}
TASKS.update(STEP_TASKS)


# ---------------------------------------------------------------------------------------------- fitting
def _count(tokenizer, sample: Sample) -> int:
    return sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in sample.prompt(tokenizer))


def make_sample(task: str | Task, tokenizer, length: int, seed: int = 0, index: int = 0) -> Sample:
    """Sample ``index`` of ``task`` whose prompt plus ``max_new_tokens`` fits ``length`` tokens of ``tokenizer``.

    Deterministic for (task, length, seed, index); the haystack is the largest that fits (binary search).
    """
    task = get_task(task)
    if not isinstance(length, int) or length < 128:
        raise ValueError(f"length must be an int >= 128 tokens, got {length!r}")
    state = random.Random(f"{task.name}:{seed}:{index}").getstate()

    def build(n: int) -> Sample:
        rng = random.Random()
        rng.setstate(state)
        return task.build(rng, n)

    target = length - task.max_new_tokens
    lo, hi = 0, 1
    while _count(tokenizer, build(hi)) <= target:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _count(tokenizer, build(mid)) <= target else (lo, mid)
    if lo == 0:
        raise ValueError(f"task {task.name!r} does not fit in {length} tokens even with a one-unit haystack")
    return build(lo)


def get_task(task: str | Task) -> Task:
    if isinstance(task, Task):
        return task
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[task]


def passkey(tokenizer, n_tokens: int, seed: int = 0, depth: float | None = None) -> Sample:
    """The ``passkey`` task's sample for ``seed``, fitted to ``n_tokens`` of ``tokenizer``, with the key at ``depth``
    (0 = start, 1 = end; random if None)."""
    task = TASKS["passkey"] if depth is None else Task("passkey", functools.partial(_passkey, depth=depth), 12)
    return make_sample(task, tokenizer, n_tokens, seed=seed)
