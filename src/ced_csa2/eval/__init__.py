"""Scoring: shared-trunk NLL/KL/top-1, perplexity, GSM8K (lm-eval), intervals, the Mode A LM.

No imports here: importing one module must not pull in its siblings (a stage's
dvc.yaml deps are its import closure).
"""
