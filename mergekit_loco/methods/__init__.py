"""Merge methods: one module each; :func:`get_method` is the way in."""

from mergekit_loco.methods.base import MergeMethod
from mergekit_loco.methods.registry import METHODS, get_method, list_methods, parse_options

__all__ = ["METHODS", "MergeMethod", "get_method", "list_methods", "parse_options"]
