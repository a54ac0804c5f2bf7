"""The experiments behind every table and figure of README and docs/.

One module per table or figure, run from the repository's root as
``python -m experiments.NAME`` (``--help`` says what it takes). Every one
that measures or computes something writes ``results/NAME.json`` through
``experiments.results`` (the data, and the command, commit, machine, load and
date that produced it; ``--results-dir`` writes it elsewhere, for a trial
run): the rows it prints, as data, with its parameters. Those that draw
figures or screenshots record the files they wrote and their inputs. An
experiment with modes that measure different tables records each mode as a
part of its one file (``Run.record_part``). Those whose tables README and
docs show are rendered from their files by ``python -m experiments.render``
and checked by ``tests/test_results_render.py``. Only ``render`` (it writes
docs from the results files) and ``zoo_tuning`` (it records a set of traces
under ``--out``) write no results file; ``tests/test_experiments_record.py``
holds that list and fails on an experiment that neither records nor is in it.
Data experiments keep besides lives in ``experiments/data/``; other outputs
go under ``runs/``. Measurement history is in docs/journal/.
"""
