"""The experiments behind every table and figure of README and docs/.

One module per table or figure, run from the repository's root as
``python -m experiments.NAME``; each writes ``results/NAME.json`` through
``experiments.results.record`` (the data, and the command, commit, machine,
load and date that produced it). Tables in README and docs are rendered from
those files by ``python -m experiments.render`` and checked by
``tests/test_results_render.py``.
"""
