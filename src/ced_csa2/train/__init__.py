"""Gradient training of the maps: the trainers, the projector recipe, the online objectives.

No imports here: importing one module must not pull in its siblings (a stage's
dvc.yaml deps are its import closure).
"""
