"""Everything about reading input and writing output lives here: the one gate every path a
command reads passes (gate), text and YAML input with limits (text), the one writer of output
directories (outdirs), progress lines, did-you-mean suggestions for names, and stopping on
signals (interrupts)."""

__all__ = ["gate", "interrupts", "outdirs", "progress", "suggest", "text"]
