"""Building blocks: Switch routing (pure functions), the Switch FFN layer, decoder blocks."""

from .switch_ffn import SwitchAux, SwitchFFN

__all__ = ["SwitchAux", "SwitchFFN"]
