"""Registered models: the Switch Transformer LM, its UMix ensemble, and the vision learner's flags
(``alma_vision``)."""

from . import alma_vision, switch_transformer_lm, umix_switch_transformer_lm  # noqa: F401
