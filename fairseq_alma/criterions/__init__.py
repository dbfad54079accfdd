"""Registered criterions (fairseq does not auto-import a user dir's criterions/ folder)."""

from . import alma_vision_stage, switch_cross_entropy  # noqa: F401  (registration)
