"""Registered criterions (fairseq does not auto-import a user dir's criterions/ folder)."""

from . import switch_cross_entropy  # noqa: F401  (registration)
