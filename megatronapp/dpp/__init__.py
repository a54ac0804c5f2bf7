"""MegaDPP: dynamic depth-first / breadth-first pipeline scheduling."""
