"""Cross-entropy + Switch load-balancing loss (ALMA App. B.2: balance weight fixed to 0.01).

The loss that is back-propagated is ``nll + w * balance (+ z_w * z_loss)``, with ``balance`` the
sum (default, as the Switch reference implementation adds one auxiliary loss per MoE layer) or
the mean over MoE layers.  The auxiliary terms are per-token averages, so they are multiplied by
the sample size to sit on the same scale as fairseq's summed NLL before fairseq divides by it.

The logged ``loss``/``ppl`` are the cross-entropy alone (base 2, like fairseq's
``cross_entropy``), so they compare with dense models and with ``fairseq-eval-lm``.  The routing
diagnostics go through fairseq ``metrics``: they appear in the progress log and in tensorboard.
They travel as one tensor of sums (``moe_stats``: one entry in fairseq's all-reduce, one meter
update per step) and are divided only when a log line is printed (``log_derived``): on a GPU each
tensor meter update is a kernel launch every step, and the step is bound by launches.
"""


from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from fairseq.criterions import register_criterion
from fairseq.criterions.cross_entropy import CrossEntropyCriterion
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.logging import metrics
from fairseq.logging.meters import MetersDict
from omegaconf import II

from ..errors import require
from ..modules.switch_routing import DIAGNOSTIC_KEYS, diagnostic_sums, moe_losses


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


STATS = ("balance_sum",) + DIAGNOSTIC_KEYS  # the entries of a logging output's "moe_stats"
_STAT = {name: i for i, name in enumerate(STATS)}
# logged name: (numerator, denominator: "calls" = MoE block calls, else a STATS entry), scale, digits
LOGGED = {
    "moe_balance": ("balance_sum", "calls", 1.0, 4),
    "moe_dropped_pct": ("dropped", "tokens", 100.0, 2),
    "moe_entropy": ("entropy_sum", "tokens", 1.0, 3),
    "moe_load_max": ("load_max", "calls", 1.0, 3),
    "moe_load_min": ("load_min", "calls", 1.0, 3),
    "moe_unused": ("unused", "calls", 1.0, 2),
}


def moe_terms(aux_list: List[Any]) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """(balance losses (L,), z-losses (L,) or None, summed diagnostics (6,) in ``DIAGNOSTIC_KEYS``
    order) of a model's MoE blocks, formed from the fused router's sums
    (``switch_routing.moe_losses``/``diagnostic_sums``): blocks of the same shape (all of one
    model's) in one batch of small ops, not per block."""
    groups: Dict[Tuple[Any, ...], List[int]] = {}
    for i, aux in enumerate(aux_list):
        groups.setdefault((aux.counts.numel(), aux.capacity, tuple(aux.probs.shape)), []).append(i)
    balance: List[Any] = [None] * len(aux_list)
    z: List[Any] = [None] * len(aux_list)
    with_z = all(aux.lse_square_sum is not None for aux in aux_list)
    diagnostics: Optional[torch.Tensor] = None
    for (_, capacity, _), members in groups.items():
        group = [aux_list[i] for i in members]
        counts = torch.stack([aux.counts for aux in group])
        lse_sums = torch.stack([aux.lse_square_sum for aux in group]) if with_z else counts.new_zeros(len(group))
        balances, zs = moe_losses(counts, torch.stack([aux.prob_sums for aux in group]), lse_sums)
        entropy = torch.special.entr(torch.stack([aux.probs for aux in group])).sum((1, 2))
        sums = diagnostic_sums(counts, entropy, capacity)
        diagnostics = sums if diagnostics is None else diagnostics + sums
        if len(groups) == 1:
            return balances, zs if with_z else None, diagnostics
        for j, i in enumerate(members):
            balance[i], z[i] = balances[j], zs[j]
    assert diagnostics is not None  # aux_list is not empty
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
            logging_output["moe_stats"] = torch.cat((balances.detach().sum(0, keepdim=True), diagnostics))
        return loss, sample_size, logging_output

    @staticmethod
    def reduce_metrics(logging_outputs: List[Dict[str, Any]]) -> None:
        """Sums now, ratios at print time: each logged value is its sums over the log window
        divided, e.g. moe_dropped_pct = 100 * tokens dropped / tokens routed, which is the
        token-weighted mean of the steps' percentages; per-block values are per MoE block call.
        No host read here (fairseq reads when it prints)."""
        CrossEntropyCriterion.reduce_metrics(logging_outputs)
        calls = sum(log.get("moe_layers", 0) for log in logging_outputs)
        if calls == 0:
            return
        metrics.log_scalar_sum("_moe_stats", sum(log["moe_stats"] for log in logging_outputs if "moe_stats" in log))
        metrics.log_scalar_sum("_moe_calls", calls)
        for name, (numerator, denominator, scale, digits) in LOGGED.items():
            for meters in metrics.get_active_aggregators():
                meter = meters.get(name)
                if meter is None:
                    meters.add_meter(name, MetersDict._DerivedMeter(_ratio(numerator, denominator, scale, digits)), 20)
                elif not isinstance(meter, MetersDict._DerivedMeter):
                    # an average restored from a checkpoint written before the sums: nothing
                    # updates it any more, so it would print a stale value; the derived one
                    # takes its place (and its print position)
                    OrderedDict.__setitem__(meters, name, MetersDict._DerivedMeter(
                        _ratio(numerator, denominator, scale, digits)))

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True


def _ratio(numerator: str, denominator: str, scale: float, digits: int) -> Any:
    """A ``log_derived`` function: ``scale`` * the window's sum of ``numerator`` / that of
    ``denominator`` (at least 1, so a window with no routed token logs 0, not NaN)."""

    def value(meters: Any) -> float:
        sums = meters["_moe_stats"].sum
        stats = sums.tolist() if torch.is_tensor(sums) else sums  # one read, then host arithmetic
        below = float(meters["_moe_calls"].sum) if denominator == "calls" else stats[_STAT[denominator]]
        return round(scale * stats[_STAT[numerator]] / max(below, 1.0), digits)

    return value
