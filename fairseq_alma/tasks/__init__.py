"""Registered tasks."""

from . import alma_stream  # noqa: F401
