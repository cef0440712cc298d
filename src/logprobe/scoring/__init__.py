"""Scoring: the chunked log-prob head, the prompt/continuation contract, perplexity windows."""
