"""The judgement: what the trace says about each suspect, and the verdict."""
