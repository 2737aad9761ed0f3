"""Reading and writing model files: Hugging Face safetensors directories (`hf`,
`safetensors`), moerun's quantized checkpoints (`quantized`, `quantized_write`) and GGUF
files (`gguf`, `gguf_write`)."""

from __future__ import annotations


def build(model_dir, dtype="auto", prepare=None, check_weights: bool = False):
    """(architecture module, args, net with weights loaded, dtype) of a model directory or a
    `.gguf` file; `prepare` and `check_weights` as `hf.build` takes them."""
    from .gguf import build as build_gguf, is_gguf
    from .hf import build as build_hf

    return (build_gguf if is_gguf(model_dir) else build_hf)(model_dir, dtype, prepare, check_weights)
