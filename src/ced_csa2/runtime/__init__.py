"""Serving the maps inside the model: shared KV, the group registry, layer modes, sparse attention.

No imports here: importing one module must not pull in its siblings (a stage's
dvc.yaml deps are its import closure).
"""
