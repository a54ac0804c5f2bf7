"""The same judgement fed window by window while a job runs (``run --detect``, ``watch``)."""
