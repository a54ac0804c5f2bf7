"""megatronapp: a simulation-first testbed for managing distributed LLM training."""
__version__ = "0.1.0"
