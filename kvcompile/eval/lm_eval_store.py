"""lm-eval's per-sample results as results-store rows (``kvcompile lm-eval ... --store PATH``).

One row per (task, document), keyed as the sweep keys its cells (``store.cell_keys``): the lm-eval task name is
the task, the document index the sample, the task's ``length`` and ``seed`` metadata (0 where it has none) the
length and seed. The score is the task's first metric. Bytes and time are those of the compressed prefills that
served the document's requests (the most bytes over them, their time summed, their scorer's mean UOR), matched by
the requests' first argument (the prompt) against ``KVCompileLM.requests`` gathered from every rank. A document
lm-eval answered from its own response cache (``--use_cache``) was never prefilled: its bytes and time are NULL."""

from __future__ import annotations

from .store import cell_keys

_BYTES = ("bytes_held", "bytes_allocated", "bytes_full")


def rows(results: dict, lm, requests: list[dict]) -> list[dict]:
    """The store rows of ``results`` (``simple_evaluate``'s, with ``samples``) for the kvcompile model ``lm``,
    whose prefills (every rank's ``lm.requests``, concatenated) are ``requests``."""
    if "samples" not in results:
        raise ValueError("store rows need lm-eval's per-sample results: run simple_evaluate with log_samples=True")
    served: dict[str, list[dict]] = {}
    for r in requests:
        for context in r["contexts"]:
            served.setdefault(context, []).append(r)
    dtype = str(lm.cm.cache.k_pages.dtype).removeprefix("torch.")
    cell = [(lm.cm.recipe, lm.cm.budget)]
    out = []
    for task, samples in results["samples"].items():
        meta = results["configs"].get(task, {}).get("metadata") or {}
        length, seed = int(meta.get("length", 0)), int(meta.get("seed", 0))
        seen = set()
        for s in samples:  # one entry per (document, filter): the first filter's is the document's
            if s["doc_id"] in seen:
                continue
            seen.add(s["doc_id"])
            prefills = list({id(r): r for a in s["arguments"] for r in served.get(a[0], [])}.values())
            key = cell_keys(cell, lm.model_name, task, int(s["doc_id"]), length, seed, dtype)[0]
            out.append({**key, "score": float(s[s["metrics"][0]]),
                        "query_aware": any(r["query_aware"] for r in prefills) if prefills else None,
                        "wall_s": sum(r["wall_s"] for r in prefills) if prefills else None,
                        "uor": sum(u) / len(u) if (u := [r["uor"] for r in prefills if r["uor"] is not None]) else None,
                        **{b: max(r[b] for r in prefills) if prefills else None for b in _BYTES}})
    return out
