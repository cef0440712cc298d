"""Adapters to other frameworks, one small module each, each importing its framework itself.

Nothing here is imported by ``logprobe`` itself: ``import logprobe.integrations.lm_eval`` is what
needs lm-evaluation-harness installed.
"""
