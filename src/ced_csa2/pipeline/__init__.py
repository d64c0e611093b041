"""How a stage runs: entry point, paths, atomic files, checkpoints, timings, data parallelism.

No imports here: importing one module must not pull in its siblings (a stage's
dvc.yaml deps are its import closure).
"""
