"""UMix for the Switch Transformer LM: N member networks whose logits are averaged (ALMA paper §4.1).

The paper's UMix "train[s] a model whose prediction is the average (in logit space) of the
predictions produced by N networks"; unlike an ensemble (Ens, probabilities averaged at scoring
time over independently trained runs), both training and evaluation use that same averaged
model, so the members are trained jointly through one loss on the mean logits.

Each member is a complete ``SwitchTransformerDecoder`` (its own embeddings, blocks and experts,
initialised independently because they are built one after another from the same RNG stream).
The members' auxiliary outputs are concatenated in ``extra["moe_aux"]``, so
``switch_cross_entropy`` applies the balance loss to every member's routers.  Sizes come from
the member presets (``switch_transformer_lm_{tiny,base,large}``) and ``--umix-members``.
"""

import logging
from dataclasses import dataclass, field
from typing import Any

from fairseq.models import (
    FairseqIncrementalDecoder,
    FairseqLanguageModel,
    register_model,
    register_model_architecture,
)
from torch import Tensor, nn

from ..errors import require
from ..fairseq_glue.expert_parallel import prepare_expert_parallel
from ..modules.switch_ffn import SwitchFFN
from .checkpoint_format import (
    UMIX_DECODER_UPGRADES,
    UMIX_DECODER_VERSION,
    register_version,
    upgrade_state_dict,
)
from .switch_transformer_lm import (
    DEFAULT_MAX_TARGET_POSITIONS,
    SwitchTransformerDecoder,
    SwitchTransformerLanguageModel,
    SwitchTransformerLMConfig,
    switch_transformer_lm_base,
    switch_transformer_lm_large,
    switch_transformer_lm_tiny,
    validate_config,
)

logger = logging.getLogger(__name__)


@dataclass
class UMixSwitchLMConfig(SwitchTransformerLMConfig):
    umix_members: int = field(
        default=2,
        metadata={
            "help": "N member networks whose logits are averaged in training and evaluation "
            "(paper §4.1 uses N = 5 in vision; each member has the full --arch size)"
        },
    )


def validate_umix_config(cfg: UMixSwitchLMConfig) -> None:
    """The member's checks (sizes, experts, criterion) plus the member count, as one-line errors."""
    require(
        cfg.umix_members >= 1, f"--umix-members must be an integer >= 1 (got {cfg.umix_members})"
    )
    validate_config(cfg)


class UMixSwitchDecoder(FairseqIncrementalDecoder):
    """N member decoders run on the same tokens; the output is the mean of their logits."""

    def __init__(self, cfg: UMixSwitchLMConfig, dictionary: Any) -> None:
        super().__init__(dictionary)
        self.members = nn.ModuleList(
            SwitchTransformerDecoder(cfg, dictionary) for _ in range(cfg.umix_members)
        )
        # checkpoint format of the member arrangement; each member records its own as well
        register_version(self, UMIX_DECODER_VERSION)

    def upgrade_state_dict_named(self, state_dict: dict[str, Tensor], name: str) -> dict[str, Tensor]:
        """Called by fairseq before every load (the members' entries are upgraded by the members)."""
        upgrade_state_dict(
            state_dict, name, UMIX_DECODER_VERSION, UMIX_DECODER_UPGRADES, "umix_switch_transformer_lm"
        )
        return state_dict

    def moe_layers(self) -> list[SwitchFFN]:
        """Every member's Switch layers, member by member (growth acts on each of them)."""
        return [layer for member in self.members for layer in member.moe_layers()]

    def forward(
        self,
        prev_output_tokens: Tensor,
        encoder_out: dict[str, list[Tensor]] | None = None,
        incremental_state: dict[str, dict[str, Tensor | None]] | None = None,
        features_only: bool = False,
        src_lengths: Any | None = None,
        **unused: Any,
    ) -> tuple[Tensor, dict[str, Any]]:
        """Mean of the members' logits, (B, T, V), and all members' MoE auxiliary outputs.

        One ``incremental_state`` dict serves every member: fairseq keys each attention module's
        cached keys/values by that module's own id, so members never read each other's state.
        The logits are summed as they come rather than stacked, so at most two (B, T, V) tensors
        are alive besides the one a member is producing (V is 50k for the paper's LM).
        """
        if features_only:
            raise ValueError(
                "umix_switch_transformer_lm has no single feature vector (each member has its own); "
                "call decoder.members[i] for one member's features"
            )
        logits_sum: Tensor | None = None
        moe_aux: list[Any] = []
        for member in self.members:
            logits, extra = member(
                prev_output_tokens, incremental_state=incremental_state
            )  # (B, T, V)
            logits_sum = logits if logits_sum is None else logits_sum + logits  # (B, T, V)
            moe_aux.extend(extra["moe_aux"])
        assert logits_sum is not None  # members >= 1 is validated at build time
        return logits_sum / len(self.members), {"attn": [None], "moe_aux": moe_aux}  # (B, T, V)

    def max_positions(self) -> int:
        return self.members[0].max_positions()


@register_model("umix_switch_transformer_lm", dataclass=UMixSwitchLMConfig)
class UMixSwitchTransformerLanguageModel(FairseqLanguageModel):
    """UMix of N Switch Transformer LMs: one model, trained and evaluated on averaged logits."""

    @classmethod
    def build_model(
        cls, cfg: UMixSwitchLMConfig, task: Any
    ) -> "UMixSwitchTransformerLanguageModel":
        validate_umix_config(cfg)
        if cfg.max_target_positions is None:
            cfg.max_target_positions = getattr(
                cfg, "tokens_per_sample", DEFAULT_MAX_TARGET_POSITIONS
            )
        model = cls(UMixSwitchDecoder(cfg, task.target_dictionary))
        # torch DDP must skip the expert shards (each rank holds others): without this it
        # broadcast rank 0's shards over the others' and averaged different experts' gradients
        prepare_expert_parallel(model)
        model.log_parameter_counts()
        return model

    def moe_layers(self) -> list[SwitchFFN]:
        return self.decoder.moe_layers()

    def member_parameter_counts(self) -> list[dict[str, int]]:
        """One member model's counts per member (a member model's parameters are its decoder's).

        ``SwitchTransformerLanguageModel.parameter_counts`` only uses ``parameters()`` and
        ``moe_layers()``, which a member decoder has, so the member's own formula is reused.
        """
        return [
            SwitchTransformerLanguageModel.parameter_counts(member)
            for member in self.decoder.members
        ]

    def parameter_counts(self) -> dict[str, int]:
        """Member counts summed over members (|θ| of UMix is N members' active parameters).

        ``experts`` stays the per-member expert count (the largest, should growth ever leave
        members unequal) and ``members`` is N, so reports can print "experts@N" as the paper does.
        """
        per_member = self.member_parameter_counts()
        counts = {
            key: sum(c[key] for c in per_member)
            for key in ("shared", "per_expert", "active", "allocated")
        }
        counts["experts"] = max(c["experts"] for c in per_member)
        counts["members"] = len(per_member)
        return counts

    def log_parameter_counts(self) -> None:
        """One line at build time, like the member model's, with the member sizes spelled out."""
        member, total = self.member_parameter_counts()[0], self.parameter_counts()
        logger.info(
            "umix_switch_transformer_lm: %d members x (%.2fM shared + %.2fM per expert x %d experts) "
            "= %.2fM active parameters (%.2fM allocated)",
            total["members"],
            member["shared"] / 1e6,
            member["per_expert"] / 1e6,
            member["experts"],
            total["active"] / 1e6,
            total["allocated"] / 1e6,
        )


@register_model_architecture("umix_switch_transformer_lm", "umix_switch_transformer_lm_base")
def umix_switch_transformer_lm_base(cfg: Any) -> None:
    """Members of ``switch_transformer_lm_base`` size (paper §5 base)."""
    switch_transformer_lm_base(cfg)


@register_model_architecture("umix_switch_transformer_lm", "umix_switch_transformer_lm_large")
def umix_switch_transformer_lm_large(cfg: Any) -> None:
    """Members of ``switch_transformer_lm_large`` size (paper §5 large)."""
    switch_transformer_lm_large(cfg)


@register_model_architecture("umix_switch_transformer_lm", "umix_switch_transformer_lm_tiny")
def umix_switch_transformer_lm_tiny(cfg: Any) -> None:
    """Members of ``switch_transformer_lm_tiny`` size (CPU tests and the demo)."""
    switch_transformer_lm_tiny(cfg)
