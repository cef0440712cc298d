"""The ``logprobe`` command line: ``score``, ``perplexity`` and ``logprobs`` (entry point ``cli.main.main``).

Nothing is imported here on purpose: ``python -m logprobe.cli.main`` must find the submodule
unimported (runpy warns otherwise), and ``logprobe.cli.main`` must stay the module, not the function.
"""
