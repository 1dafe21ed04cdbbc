"""The project's own experiments (the lab), run from a checkout's root, never installed.

``python -m experiments.study`` runs the stall/reset study grids and writes their report
(docs/study.md). The package ``srtrain`` never imports this one.
"""
