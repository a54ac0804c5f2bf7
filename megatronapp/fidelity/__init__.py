"""The simulator's fidelity: prediction, calibration against measured runs."""
