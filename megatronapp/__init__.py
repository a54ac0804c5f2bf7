"""megatronapp: a simulation-first testbed for managing distributed LLM training.

The version is the installed package's (``megatronapp --version``).
"""
