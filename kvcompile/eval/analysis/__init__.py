"""Analysis tools of the field (issue 20), read-only over a prefilled cache: ``ceiling`` (METHODS.md §48: top-mass
against the exact best subset, the balancing selector and the certificate; ``ceiling_report`` runs it on a model)."""
