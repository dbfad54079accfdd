"""Registered tasks."""
