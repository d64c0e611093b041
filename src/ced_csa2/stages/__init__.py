"""The pipeline's stage entry points, one module per ``dvc.yaml`` stage.

Each is run as ``python -m ced_csa2.stages.<stage>`` and imports only library modules of
``ced_csa2`` -- never another stage (``tests/test_graph.py`` keeps it so).
"""
