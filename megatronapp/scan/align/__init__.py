"""Clock alignment and the aligned, linked input every detector gets (``inputs.ScanInput``)."""
