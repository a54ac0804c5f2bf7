"""Everything about reading input and writing output lives here: text and YAML input with
limits (text), the one writer of output directories (outdirs), progress lines, did-you-mean
suggestions for names, and stopping on signals (interrupts)."""

__all__ = ["interrupts", "outdirs", "progress", "suggest", "text"]
