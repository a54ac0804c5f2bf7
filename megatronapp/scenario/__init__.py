"""Everything a scenario says lives here: its schema and overrides (config), MegaScope's
observation spec (scope_spec), seeds, the training text (data) and model checkpoints."""

__all__ = ["checkpoint", "config", "data", "scope_spec", "seeds"]
