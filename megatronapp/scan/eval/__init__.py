"""Scoring against what was injected: trials, ground truth, baselines. The only part of MegaScan that may read a scenario's faults or ground_truth.json."""
