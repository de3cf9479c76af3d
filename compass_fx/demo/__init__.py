"""A small Llama-style model and its tensor-parallel plan, for the demo, the CLI and the tests."""
from .model import ModelArgs, Transformer
from .parallelize import parallelize

__all__ = ["ModelArgs", "Transformer", "parallelize"]
