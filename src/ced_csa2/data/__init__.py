"""Text and dumps: corpus sources, record sampling, the chunked HDF5 store and its loader.

No imports here: importing one module must not pull in its siblings (a stage's
dvc.yaml deps are its import closure).
"""
