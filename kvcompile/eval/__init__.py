"""Evaluation: synthetic long-context tasks (offline), and the pieces the lm-eval model and benches build on."""
