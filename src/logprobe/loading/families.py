"""Every native family, registered: importing this module imports each family's loading module,
whose record (``registry.Family``, at the bottom of the module) registers itself. A new family adds
its module here (docs/architecture.md, "How to add a family"). The order does not matter: each
model_type, GGUF architecture and config class belongs to one family (``registry.register``).
"""

from . import deepseek, gemma, gemma4, glm4, gpt_oss, hybrid, llama, qwen3_vl, sigmoid_moe
from .registry import families

NATIVE = (deepseek, gemma, gemma4, glm4, gpt_oss, hybrid, llama, qwen3_vl, sigmoid_moe)  # the modules, each with FAMILY
__all__ = ["NATIVE", "families"]
