"""Everything about rank programs lives here: building them from a scenario (ranks, layout),
compiling static ones into flat arrays (compiled), and the Backend protocol that runs them."""

__all__ = ["backend", "compiled", "layout", "ranks"]
