"""Sweeps: many scenarios from one spec, run anywhere, one result table."""
