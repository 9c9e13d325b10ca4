"""Structured output: constrain sampling to a JSON schema, a regex, a choice or a grammar."""

from .params import StructuredOutputs

__all__ = ["StructuredOutputs"]
