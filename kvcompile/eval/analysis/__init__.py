"""Analysis tools of the field (issue 20): ``ceiling`` (top-mass against the exact best subset, the
balancing selector and the certificate; ``ceiling_report`` runs it on a model), ``queryleak`` (one method and budget
with the question visible, restricted to the document, or compressed before it), ``nominal`` (a per-head selection
as a mask over the full cache, ``masked``, vs ragged vs rectangular storage), ``diagnose`` (full-correct /
compressed-wrong rows: evidence coverage, likelihood drift, the evidence boost against a sham; inferred) and
``gap`` (answers against their supporting chain; inferred); ``commands``: their CLI."""
