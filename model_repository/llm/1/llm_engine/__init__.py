"""A continuous-batching LLM generation engine for Triton's Python backend."""
