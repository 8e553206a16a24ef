"""Loaders and scorer of the kvcompile lm-eval tasks (reached through ``custom_dataset: !function utils.load``).

Task metadata (``--metadata`` JSON or ``TaskManager(metadata=...)``): ``tokenizer`` (name or folder; defaults to
the model's ``pretrained`` name), ``length`` (prompt plus answer tokens, default 1024), ``num_samples`` (default
50), ``seed`` (default 0). Each prompt is ``context + SEPARATOR + question``: the kvcompile model compresses the
context before reading the question.
"""

from __future__ import annotations

import functools

from kvcompile.eval.samples import string_match_all
from kvcompile.eval.synthetic import SEPARATOR, make_sample


@functools.lru_cache(maxsize=4)
def _tokenizer(name: str):
    from pathlib import Path

    if Path(name).is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    import kvcompile

    return kvcompile.load_model(name)[1]


def load(kvc_task: str, tokenizer: str | None = None, pretrained: str | None = None, length: int = 1024,
         num_samples: int = 50, seed: int = 0, **_metadata):
    import datasets

    name = tokenizer or pretrained
    if not isinstance(name, str):
        raise ValueError("the kvcompile tasks need metadata 'tokenizer' (a tokenizer name or folder) to fit lengths")
    tok = _tokenizer(name)
    rows = []
    for index in range(int(num_samples)):
        sample = make_sample(kvc_task, tok, int(length), seed=int(seed), index=index)
        context, question = sample.prompt(tok)
        rows.append({"prompt": context + SEPARATOR + question, "answers": list(sample.answers), "index": index})
    return {"test": datasets.Dataset.from_list(rows)}


def process_results(doc, results):
    return {"score": string_match_all(doc["answers"], results[0])}
