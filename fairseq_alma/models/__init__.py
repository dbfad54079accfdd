"""Registered models: the Switch Transformer LM (and, later, ensemble wrappers)."""

from . import switch_transformer_lm  # noqa: F401
from . import umix_switch_transformer_lm  # noqa: F401
