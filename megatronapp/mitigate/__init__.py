"""Everything about the closed loop lives here: acting on on-line MegaScan's
verdicts (drop the slow node or swap in a spare, re-plan onto what is left,
restart from the last checkpoint) and what it saves (goodput)."""

__all__ = ["loop", "plan"]
