"""Closed-form maps: ridge fits, their held-out metrics, the xKV low-rank baseline.

No imports here: importing one module must not pull in its siblings (a stage's
dvc.yaml deps are its import closure).
"""
