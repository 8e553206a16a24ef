"""``CompressedModel.fork`` (mixed into it): a copy of the cache over the same programs, so one shared prefill
serves many (recipe, budget) cells."""

from __future__ import annotations

import copy

from . import checks
from .budget import Budget
from .recipes import Recipe, get_recipe


class Forking:
    """``fork``; the state it copies is ``CompressedModel``'s."""

    def fork(self, recipe: str | Recipe | None = None, budget: float | int | str | None = None, *,
             compile=None):
        """A copy of this model's cache and counters, retargeted to ``recipe`` / ``budget``, over the same programs:
        one ``prefill(context, compress=False)``, then ``fork(recipe, budget).compress()`` per cell. Only the cache
        is copied. ``compile``: the copy runs compiled (``True`` or a backend) or eager (``False``); None: as this
        model does. With a compression pending, the target may read at most the queries this cache kept."""
        recipe = self.recipe if recipe is None else get_recipe(recipe)
        checks.same_adapter(recipe, self.recipe)
        budget = self.budget if budget is None else Budget.parse(budget)
        programs = self.programs if compile is None else self.programs.compile(compile)
        chunk = recipe.prefill_chunk or self.prefill_chunk
        child = type(self)(programs, self.spec, recipe, budget, page_size=self.cache.page_size, prefill_chunk=chunk,
                           generation_config=self.generation_config, device=self.device, source=self.source,
                           latent_moments=self.latent_moments)
        if self.seen is None:
            return child
        checks.same_chunking(recipe.name, chunk, self.prefill_chunk)
        window, kept = child.observation_window, self.cache.ring.capacity
        if self._observing and window > kept and kept < int(self.seen.max()):
            raise ValueError(f"recipe {recipe.name!r} reads the last {window} queries of each layer but this cache "
                             f"kept {kept}; prefill the shared context with compress=False under the widest-window "
                             "recipe")
        if child.cache.keep_ids > self.cache.keep_ids:
            raise ValueError(f"recipe {recipe.name!r} reads the token ids of the context, which this cache did not log")
        weighted, basis, child.cache = child.cache.weighted, child.cache.fmt_basis, copy.deepcopy(self.cache)
        child.cache.set_format(recipe.format, basis if basis.shape[1] else None)
        child.cache.set_weighted(weighted)
        child.context_tokens, child._pending = self.context_tokens.clone(), list(self._pending)
        child.query_aware, child._observing = self.query_aware, self._observing
        if self.decoder is not None and (recipe, budget) == (self.recipe, self.budget):
            child.decoder = copy.deepcopy(self.decoder, memo={id(self.programs.layers): self.programs.layers})
        child.cache.observe(window)
        return child
