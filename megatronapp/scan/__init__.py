"""MegaScan: trace loading, dependency reconstruction, clock alignment, slow-node detection."""
