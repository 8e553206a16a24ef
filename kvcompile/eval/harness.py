"""An lm-eval model ("kvcompile") whose every score goes through the compressed cache.

Stock lm-eval scores log-likelihoods in one uncompressed forward pass and compresses prompts together with
their question; this model does neither:

- ``loglikelihood``: prefill the context (all but its last token; with a separator, the part before it),
  compress, then score the rest of the context plus the continuation over the compressed cache, at the original
  positions. Choices that share a context share one compressed prefill (``CompressedModel.fork``).
- ``generate_until``: compress the context, then read the question and decode greedily. The boundary is
  ``SEPARATOR`` in the prompt (the kvcompile tasks put it there; the character itself is never fed to the model).
  Without it the whole prompt is compressed after prefill: query-aware, and the results say so. A task's
  ``generation_kwargs: {segments: blank-lines}`` (or ``tool-calls``) segments the context for step-level recipes.
- ``loglikelihood_rolling``: streaming with eviction: the document is read ``rolling_chunk`` tokens at a time,
  compressing after each chunk, so the cache holds about the budget plus one chunk while perplexity is measured.

``get_model_info`` (merged into ``results["config"]`` by lm-eval) carries the recipe, budget, bytes held per
request (mean and max), the scorer's mean UOR over them and how many requests were query-aware; ``requests``
keeps each compressed prefill's accounting, which ``lm_eval_store`` turns into results-store rows. Entry points:
docs/eval.md ("lm-eval model").
"""

from __future__ import annotations

import time

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

import kvcompile

from ..model import CompressedModel
from .decoding import greedy, ids_tensor, read_question, streamed_log_likelihood
from .ranks import DataParallel
from .synthetic import SEPARATOR
from .uor import compress_measuring_uor


@register_model("kvcompile")
class KVCompileLM(DataParallel, TemplateLM):
    """lm-eval model over a ``CompressedModel`` (batch size 1, greedy generation); data-parallel when launched by
    torchrun (``DataParallel``).

    Parameters
    ----------
    pretrained: a ``CompressedModel`` (then ``tokenizer`` is required) or a name for ``kvcompile.load_model``.
    recipe, budget: re-target the model (``kvcompile.apply``); ``None`` keeps a given model's, or "full" / 1.0.
    rolling_chunk: tokens read between compressions in ``loglikelihood_rolling``.
    max_length: longest sequence scored (default: the model's positions).
    """

    def __init__(
        self,
        pretrained: str | CompressedModel = "smollm2-135m",
        tokenizer=None,
        recipe: str | None = None,
        budget: float | int | str | None = None,
        page_size: int = 16,
        prefill_chunk: int | None = None,
        rolling_chunk: int = 256,
        max_length: int | None = None,
        batch_size: int | str = 1,
        device: str | None = None,
        max_batch_size: int | None = None,  # passed by lm-eval's runner; batches are always 1 here
    ):
        super().__init__()
        if str(batch_size) not in ("1", "auto"):
            raise ValueError(f"the kvcompile model evaluates one request at a time; got batch_size={batch_size!r}")
        if not isinstance(rolling_chunk, int) or rolling_chunk < 1:
            raise ValueError(f"rolling_chunk must be a positive int, got {rolling_chunk!r}")
        device = self.join_ranks(device)
        if isinstance(pretrained, CompressedModel):
            if tokenizer is None:
                raise ValueError("pass tokenizer= together with a CompressedModel")
            cm = pretrained
            if recipe is not None or budget is not None:
                cm = kvcompile.apply(cm, budget=cm.budget if budget is None else budget,
                                     recipe=recipe or cm.recipe, page_size=page_size, prefill_chunk=prefill_chunk)
        elif isinstance(pretrained, str):
            model, loaded_tok = kvcompile.load_model(pretrained)
            if device and (not str(device).startswith("cuda") or torch.cuda.is_available()):
                model = model.to(device)  # lm-eval's CLI passes device=cuda by default; without CUDA stay on CPU
            tokenizer = tokenizer or loaded_tok
            cm = kvcompile.apply(model, budget=1.0 if budget is None else budget, recipe=recipe or "full",
                                 page_size=page_size, prefill_chunk=prefill_chunk)
        else:
            raise TypeError(f"pretrained must be a CompressedModel or a model name, got {type(pretrained).__name__}")
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.cm, self.tokenizer, self.rolling_chunk, self._max_length = cm, tokenizer, rolling_chunk, max_length
        self.model_name = pretrained if isinstance(pretrained, str) else tokenizer.name_or_path  # the store's model
        self.requests: list[dict] = []  # per compressed prefill: its cache accounting (see get_model_info, _record)

    # ------------------------------------------------------------------ lm-eval plumbing
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length or self.cm.spec.max_positions or 2048

    max_gen_toks = 256  # a generation task's answer length when it names none

    @property
    def device(self):
        return self.cm.device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Like HFLM: the tokenizer's own special tokens unless told otherwise or the string starts with BOS."""
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos is not None and string.startswith(bos):
            add_special_tokens = False
        extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **extra)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def get_model_info(self) -> dict:
        """What the cache held: recipe, budget, bytes held after compressing each request's context (mean, max), over
        this process's requests (rank 0's under torchrun; the results store has every sample's)."""
        held = [r["bytes_held"] for r in self.requests] or [0]
        full = [r["bytes_full"] for r in self.requests] or [0]
        aware = sum(r["query_aware"] for r in self.requests)
        uors = [r["uor"] for r in self.requests if r["uor"] is not None]
        return {"kvcompile": {
            "recipe": self.cm.recipe.tag,
            "budget": str(self.cm.budget),
            "requests": len(self.requests),
            "bytes_held_mean": sum(held) / len(held),
            "bytes_held_max": max(held),
            "bytes_full_mean": sum(full) / len(full),
            "query_aware_requests": aware,
            "uor_mean": sum(uors) / len(uors) if uors else None,
            "query_aware": bool(aware) or self.cm.recipe.query_aware,
            "world_size": self.world_size,
        }}

    def _record(self, contexts: list[str], query_aware: bool, t0: float, stats: dict | None = None,
                uor: float | None = None) -> None:
        """Account one compressed prefill, begun at ``t0``, for requests whose first argument is in ``contexts``;
        ``stats``: the cache's, taken once the context was compressed (default: now); ``uor``: its scorer's UOR."""
        stats = stats or self.cm.cache_stats()
        self.requests.append({"contexts": contexts, "query_aware": query_aware, "wall_s": time.perf_counter() - t0,
                              "uor": uor,
                              **{k: stats[k] for k in ("bytes_held", "bytes_allocated", "bytes_full",
                                                       "peak_bytes_held")}})

    def _split(self, text: str) -> tuple[str, str | None]:
        """(context, rest) at the first ``SEPARATOR``; rest is None when there is none (query-aware)."""
        if SEPARATOR not in text:
            return text, None
        context, rest = text.split(SEPARATOR, 1)
        return context, rest.replace(SEPARATOR, "")

    # ------------------------------------------------------------------ loglikelihood
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """Requests with a ``SEPARATOR`` in the context compress only what precedes it; others go through
        ``TemplateLM`` (tokenized like HFLM; all of the context but its last token is compressed)."""
        plain = [i for i, r in enumerate(requests) if SEPARATOR not in r.args[0]]
        split = [i for i, r in enumerate(requests) if SEPARATOR in r.args[0]]
        out: list = [None] * len(requests)
        for i, res in zip(plain, super().loglikelihood([requests[i] for i in plain], disable_tqdm=disable_tqdm)):
            out[i] = res
        entries = []
        for i in split:
            context, continuation = requests[i].args
            head, rest = self._split(context)
            head_ids = self.tok_encode(head)
            rest_ids, cont_ids = self._encode_rest(rest, continuation)
            entries.append((i, requests[i].args, head_ids + rest_ids, cont_ids, len(head_ids), False))
        for (i, *_), res in zip(entries, self._score(entries, disable_tqdm)):
            out[i] = res
        return out

    def _encode_rest(self, rest: str, continuation: str) -> tuple[list[int], list[int]]:
        """(rest, continuation) token ids after the separator, no special tokens; trailing spaces of ``rest`` move
        to the continuation as in ``TemplateLM._encode_pair``."""
        n_spaces = len(rest) - len(rest.rstrip())
        if n_spaces:
            rest, continuation = rest[:-n_spaces], rest[-n_spaces:] + continuation
        rest_ids = self.tok_encode(rest, add_special_tokens=False) if rest else []
        whole = self.tok_encode(rest + continuation, add_special_tokens=False)
        return rest_ids, whole[len(rest_ids):]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        entries = [(i, key, ctx, cont, len(ctx) - 1, True) for i, (key, ctx, cont) in enumerate(requests)]
        return self._score(entries, disable_tqdm)

    def _score(self, entries, disable_tqdm: bool) -> list[tuple[float, bool]]:
        """entries: (index, cache key, context ids, continuation ids, boundary, query-aware); ``context[:boundary]``
        is compressed (at most all but its last token), the rest of the context and the continuation are scored
        over it. Shared contexts are prefilled once."""
        results: list = [None] * len(entries)
        groups: dict[tuple, list[int]] = {}
        for n, (_, _, ctx, cont, boundary, aware) in enumerate(entries):
            ctx, cont, boundary = self._truncate(ctx, cont, min(boundary, len(ctx) - 1))
            groups.setdefault((tuple(ctx), boundary, aware), []).append(n)
        bar = tqdm(total=len(entries), disable=disable_tqdm, desc="kvcompile loglikelihood")
        for (ctx, boundary, aware), members in groups.items():
            t0, uor = time.perf_counter(), None
            self.cm.reset()
            if boundary > 0:
                uor = compress_measuring_uor(self.cm, ids_tensor(list(ctx[:boundary]), self.device))[1]
            for n in members:
                cont = entries[n][3]
                model = self.cm.fork() if boundary > 0 and len(members) > 1 else self.cm
                if boundary == 0:
                    model.reset()
                inp = list(ctx[boundary:]) + cont[:-1]
                with torch.no_grad():
                    logits = model.prefill(ids_tensor(inp, self.device), compress=False, logits="all")
                logp = torch.log_softmax(logits[0, -len(cont):].float(), -1)
                target = torch.tensor(cont, device=logp.device)
                ans = (float(logp.gather(-1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all()))
                results[n] = ans
                self.cache_hook.add_partial("loglikelihood", entries[n][1], ans)
                bar.update(1)
            self._record([entries[n][1][0] for n in members], aware, t0, uor=uor)
        bar.close()
        return results

    def _truncate(self, ctx, cont, boundary):
        """Left-truncate context + continuation to ``max_length + 1`` tokens, as HFLM does."""
        over = len(ctx) + len(cont) - (self.max_length + 1)
        if over <= 0:
            return ctx, cont, boundary
        return ctx[over:], cont, max(0, boundary - over)

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        eos_text = self.tokenizer.decode([self.eot_token_id])
        for req in tqdm(requests, disable=disable_tqdm, desc="kvcompile generate_until"):
            text, gen_kwargs = req.args
            segments = gen_kwargs.get("segments")  # a task's rule for step-level recipes (kvcompile.segments)
            kwargs = normalize_gen_kwargs({k: v for k, v in gen_kwargs.items() if k != "segments"}, self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ValueError("the kvcompile lm-eval model decodes greedily; set do_sample=false for this task")
            until = handle_stop_sequences(kwargs.get("until"), eos=eos_text)
            budget = kwargs["max_gen_toks"]
            context, question = self._split(text)
            ctx_ids = self.tok_encode(context)
            q_ids = self.tok_encode(question, add_special_tokens=False) if question else []
            room = self.max_length - budget - len(q_ids)
            if room < 1:
                raise ValueError(f"question plus {budget} new tokens exceed max_length={self.max_length}")
            ctx_ids = ctx_ids[-room:]
            t0 = time.perf_counter()
            self.cm.reset()
            with torch.no_grad():
                logits, uor = compress_measuring_uor(self.cm, ids_tensor(ctx_ids, self.device), segments=segments,
                                                     tokenizer=self.tokenizer)
                logits = logits[0, -1]
            compressed = self.cm.cache_stats()
            if q_ids:
                logits = read_question(self.cm, q_ids)
            stop = (lambda toks: any(s in self.tokenizer.decode(toks) for s in until)) if until else None
            tokens = greedy(self.cm, logits, budget, eos_ids={self.eot_token_id}, stop=stop)
            self._record([text], question is None, t0, compressed, uor)  # the answer's time counts, its tokens not
            answer = postprocess_generated_text(self.tokenizer.decode(tokens, skip_special_tokens=True), until, None)
            out.append(answer)
            self.cache_hook.add_partial("generate_until", (text, gen_kwargs), answer)
        return out

    # ------------------------------------------------------------------ perplexity
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Streaming with eviction: windows of ``max_length`` predicted tokens, each read ``rolling_chunk`` tokens at
        a time with compression after every chunk; the sum of log-probabilities of every token."""
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="kvcompile loglikelihood_rolling"):
            tokens = [self.prefix_token_id] + self.tok_encode(req.args[0], add_special_tokens=False)
            total = 0.0
            for start in range(0, len(tokens) - 1, self.max_length):
                window = tokens[start : start + self.max_length + 1]
                t0 = time.perf_counter()
                total += streamed_log_likelihood(self.cm, ids_tensor(window, self.device), self.rolling_chunk)
                self._record([req.args[0]], False, t0)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out
