"""MegaScope: capture, compression and perturbation of model internals."""
