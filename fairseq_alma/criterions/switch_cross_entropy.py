"""Cross-entropy + Switch load-balancing loss (ALMA App. B.2: balance weight fixed to 0.01).

The loss that is back-propagated is ``nll + w * balance (+ z_w * z_loss)``, with ``balance`` the
sum (default, as the Switch reference implementation adds one auxiliary loss per MoE layer) or
the mean over MoE layers.  The auxiliary terms are per-token averages, so they are multiplied by
the sample size to sit on the same scale as fairseq's summed NLL before fairseq divides by it.

The logged ``loss``/``ppl`` are the cross-entropy alone (base 2, like fairseq's
``cross_entropy``), so they compare with dense models and with ``fairseq-eval-lm``.  The routing
diagnostics go through fairseq ``metrics``: they appear in the progress log and in tensorboard.
"""


from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.logging import metrics
from omegaconf import II

from ..errors import require
from ..modules.switch_routing import moe_losses, summed_diagnostics


@dataclass
class SwitchCrossEntropyConfig(FairseqDataclass):
    sentence_avg: bool = II("optimization.sentence_avg")
    moe_balance_loss_weight: float = field(
        default=0.01, metadata={"help": "weight of the Switch load-balancing loss (paper: 0.01)"}
    )
    moe_balance_reduction: ChoiceEnum(["sum", "mean"]) = field(
        default="sum",
        metadata={"help": "combine the MoE layers' balance losses by sum (Switch reference) or mean (depth-independent)"},
    )
    moe_z_loss_weight: float = field(
        default=0.0, metadata={"help": "weight of the ST-MoE router z-loss (0 = off; ST-MoE uses 0.001)"}
    )


def moe_terms(aux_list: List[Any]) -> Tuple[torch.Tensor, Optional[torch.Tensor], Dict[str, torch.Tensor]]:
    """(balance losses (L,), z-losses (L,) or None, summed diagnostics) of a model's MoE blocks,
    formed from the fused router's sums (``switch_routing.moe_losses``/``summed_diagnostics``):
    blocks of the same shape (all of one model's) in one batch of small ops, not per block."""
    groups: Dict[Tuple[Any, ...], List[int]] = {}
    for i, aux in enumerate(aux_list):
        groups.setdefault((aux.counts.numel(), aux.capacity, tuple(aux.probs.shape)), []).append(i)
    balance: List[Any] = [None] * len(aux_list)
    z: List[Any] = [None] * len(aux_list)
    with_z = all(aux.lse_square_sum is not None for aux in aux_list)
    diagnostics: Dict[str, torch.Tensor] = {}
    for (_, capacity, _), members in groups.items():
        group = [aux_list[i] for i in members]
        counts = torch.stack([aux.counts for aux in group])
        lse_sums = torch.stack([aux.lse_square_sum for aux in group]) if with_z else counts.new_zeros(len(group))
        balances, zs = moe_losses(counts, torch.stack([aux.prob_sums for aux in group]), lse_sums)
        entropy = torch.special.entr(torch.stack([aux.probs for aux in group])).sum((1, 2))
        for key, value in summed_diagnostics(counts, entropy, capacity).items():
            diagnostics[key] = value if key not in diagnostics else diagnostics[key] + value
        if len(groups) == 1:
            return balances, zs if with_z else None, diagnostics
        for j, i in enumerate(members):
            balance[i], z[i] = balances[j], zs[j]
    return torch.stack(balance), torch.stack(z) if with_z else None, diagnostics


@register_criterion("switch_cross_entropy", dataclass=SwitchCrossEntropyConfig)
class SwitchCrossEntropyCriterion(CrossEntropyCriterion):
    """Token cross-entropy plus the MoE auxiliary losses carried in ``extra["moe_aux"]``."""

    def __init__(
        self,
        task: Any,
        sentence_avg: bool,
        moe_balance_loss_weight: float,
        moe_balance_reduction: str,
        moe_z_loss_weight: float,
    ) -> None:
        super().__init__(task, sentence_avg)
        require(moe_balance_loss_weight >= 0, f"--moe-balance-loss-weight must be >= 0 (got {moe_balance_loss_weight})")
        require(moe_z_loss_weight >= 0, f"--moe-z-loss-weight must be >= 0 (got {moe_z_loss_weight})")
        self.balance_weight = moe_balance_loss_weight
        self.balance_reduction = str(moe_balance_reduction)
        self.z_weight = moe_z_loss_weight

    def forward(self, model: Any, sample: Dict[str, Any], reduce: bool = True) -> Tuple[torch.Tensor, int, Dict[str, Any]]:
        net_output = model(**sample["net_input"])
        nll, _ = self.compute_loss(model, net_output, sample, reduce=reduce)
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        aux_list = net_output[1].get("moe_aux", []) if isinstance(net_output[1], dict) else []
        loss = nll
        logging_output: Dict[str, Any] = {
            "loss": nll.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        if aux_list:
            balances, z_losses, diagnostics = moe_terms(aux_list)
            balance = balances.sum() if self.balance_reduction == "sum" else balances.mean()
            loss = loss + self.balance_weight * balance * sample_size
            if self.z_weight > 0 and z_losses is not None:
                loss = loss + self.z_weight * z_losses.sum() * sample_size
            logging_output["moe_layers"] = len(aux_list)
            logging_output["moe_balance_sum"] = balances.detach().sum()
            for key, value in diagnostics.items():
                logging_output[f"moe_{key}"] = value
        return loss, sample_size, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs: List[Dict[str, Any]]) -> None:
        CrossEntropyCriterion.reduce_metrics(logging_outputs)
        calls = sum(log.get("moe_layers", 0) for log in logging_outputs)
        if calls == 0:
            return

        def total(key: str) -> torch.Tensor:  # a tensor: no host read here (fairseq reads at logging)
            value = sum(log.get(key, 0) for log in logging_outputs)
            return value if torch.is_tensor(value) else torch.tensor(float(value))

        # averaging weights must be host numbers (fairseq's meter tests ``n > 0``): the tokens
        # routed per block are the step's non-padding tokens, ntokens, in every block
        token_weight = max(sum(log.get("ntokens", 0) for log in logging_outputs) * calls, 1)
        tokens = total("moe_tokens").clamp(min=1)
        metrics.log_scalar("moe_balance", total("moe_balance_sum") / calls, calls, round=4)
        metrics.log_scalar("moe_dropped_pct", 100.0 * total("moe_dropped") / tokens, token_weight, round=2)
        metrics.log_scalar("moe_entropy", total("moe_entropy_sum") / tokens, token_weight, round=3)
        metrics.log_scalar("moe_load_max", total("moe_load_max") / calls, calls, round=3)
        metrics.log_scalar("moe_load_min", total("moe_load_min") / calls, calls, round=3)
        metrics.log_scalar("moe_unused", total("moe_unused") / calls, calls, round=2)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True


