"""moerun: fast inference for sparse Mixture-of-Experts language models.

Nothing heavy happens at import time; `load()` pulls in torch and the model code.
"""

__version__ = "0.1.0"


def load(path=None, dtype="auto", **options):
    """Load a Hugging Face model directory or a GGUF file (the bundled demo model when `path`
    is None).

    Returns an `LLM` with `forward(input_ids)` and `generate(prompt_or_messages, ...)`.
    """
    from .engine.llm import LLM

    return LLM.load(path, dtype=dtype, **options)


__all__ = ["load", "__version__"]
