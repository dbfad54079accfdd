"""Registered LR schedulers (fairseq does not auto-import a user dir's optim/ folder)."""

from . import alma_stage_linear  # noqa: F401
