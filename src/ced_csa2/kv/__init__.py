"""Stored-KV formats and their cost: FP4 quantisation, rotations, bytes per token.

No imports here: importing one module must not pull in its siblings (a stage's
dvc.yaml deps are its import closure).
"""
