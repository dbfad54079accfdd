"""Building blocks: Switch routing (pure functions), the Switch FFN layer, decoder blocks."""

from .switch_ffn import SwitchAux, SwitchFFN
from .switch_ffn_config import SwitchFFNConfig

__all__ = ["SwitchAux", "SwitchFFN", "SwitchFFNConfig"]
