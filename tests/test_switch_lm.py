"""switch_transformer_lm: presets, Table 2 parameter counts, criterion, save/load (issue #2)."""

import io
from argparse import Namespace

import pytest
import torch
from fairseq.data import Dictionary
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.models import ARCH_CONFIG_REGISTRY
from omegaconf import OmegaConf

from fairseq_alma.criterions.switch_cross_entropy import SwitchCrossEntropyCriterion
from fairseq_alma.models.switch_transformer_lm import SwitchTransformerLanguageModel, SwitchTransformerLMConfig


class FakeTask:
    def __init__(self, vocab: int):
        self.target_dictionary = Dictionary()
        for i in range(vocab - len(self.target_dictionary)):
            self.target_dictionary.add_symbol(f"w{i}")
        self.source_dictionary = self.target_dictionary


def build(arch: str, vocab: int, **overrides):
    args = Namespace(**overrides)
    ARCH_CONFIG_REGISTRY[arch](args)
    cfg = OmegaConf.structured(SwitchTransformerLMConfig(tokens_per_sample=512))
    for key, value in vars(args).items():
        setattr(cfg, key, value)
    return SwitchTransformerLanguageModel.build_model(cfg, FakeTask(vocab))


# Paper Table 2 (M parameters) and §5 (shared / per-expert sizes)
TABLE2 = [
    ("switch_transformer_lm_base", 4, 65e6),
    ("switch_transformer_lm_base", 8, 91e6),
    ("switch_transformer_lm_base", 12, 116e6),
    ("switch_transformer_lm_large", 4, 210e6),
    ("switch_transformer_lm_large", 8, 323e6),
    ("switch_transformer_lm_large", 12, 436e6),
]


@pytest.mark.parametrize("arch, experts, paper", TABLE2)
def test_parameter_counts_match_table2(arch, experts, paper):
    with torch.device("meta"):
        model = build(arch, 50000, moe_experts=experts)
    counts = model.parameter_counts()
    assert counts["active"] == sum(p.numel() for p in model.parameters())
    assert abs(counts["active"] - paper) / paper < 0.03, counts
    shared, per_expert = (40e6, 6e6) if "base" in arch else (96e6, 28e6)
    assert abs(counts["shared"] - shared) / shared < 0.05
    assert abs(counts["per_expert"] - per_expert) / per_expert < 0.10


def test_presets_and_explicit_flags_win():
    model = build("switch_transformer_lm_tiny", 100, moe_experts=2)
    assert len(model.decoder.layers) == 2 and model.decoder.layers[0].self_attn.embed_dim == 64
    assert [layer.is_moe for layer in model.decoder.layers] == [False, True]
    model = build("switch_transformer_lm_tiny", 100, moe_experts=2, decoder_layers=4, moe_freq=1)
    assert [layer.is_moe for layer in model.decoder.layers] == [True] * 4


def test_active_parameters_count_only_active_slots():
    model = build("switch_transformer_lm_tiny", 100, moe_experts=2, moe_max_experts=6)
    counts = model.parameter_counts()
    assert counts["allocated"] - counts["active"] == 4 * counts["per_expert"]


def test_criterion_reports_cross_entropy_and_adds_balance_loss():
    torch.manual_seed(0)
    task = FakeTask(50)
    model = build("switch_transformer_lm_tiny", 50, moe_experts=4, dropout=0.0)
    tokens = torch.randint(4, 50, (3, 12))
    sample = {"net_input": {"src_tokens": tokens, "src_lengths": torch.full((3,), 12)}, "target": torch.roll(tokens, -1, 1), "ntokens": 36}
    crit = SwitchCrossEntropyCriterion(task, False, 0.01, "sum", 0.0)
    loss, sample_size, log = crit(model, sample)
    net_output = model(tokens)
    lprobs = model.get_normalized_probs(net_output, log_probs=True).view(-1, 50)
    nll = torch.nn.functional.nll_loss(lprobs, sample["target"].view(-1), reduction="sum")
    balance = sum(aux.balance_loss for aux in net_output[1]["moe_aux"])
    assert log["loss"].item() == pytest.approx(nll.item(), rel=1e-5)
    assert loss.item() == pytest.approx(nll.item() + 0.01 * balance.item() * 36, rel=1e-5)
    assert log["moe_layers"] == 1 and log["moe_tokens"].item() == 36
    mean = SwitchCrossEntropyCriterion(task, False, 0.0, "mean", 0.0)(model, sample)[0]
    assert mean.item() == pytest.approx(nll.item(), rel=1e-5)


def test_state_dict_round_trip_is_exact():
    torch.manual_seed(0)
    model = build("switch_transformer_lm_tiny", 60, moe_experts=3, moe_max_experts=5, dropout=0.0).eval()
    model.moe_layers()[0].set_num_experts(4)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    clone = build("switch_transformer_lm_tiny", 60, moe_experts=3, moe_max_experts=5, dropout=0.0).eval()
    clone.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    assert clone.moe_layers()[0].num_experts == 4
    tokens = torch.randint(4, 60, (2, 10))
    assert torch.equal(model(tokens)[0], clone(tokens)[0])


def test_incremental_decoding_matches_full_forward():
    torch.manual_seed(0)
    model = build("switch_transformer_lm_tiny", 40, moe_experts=2, dropout=0.0).eval()
    tokens = torch.randint(4, 40, (2, 7))
    full = model(tokens)[0]
    state: dict = {}
    steps = [model.decoder(tokens[:, : i + 1], incremental_state=state)[0] for i in range(7)]
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)


def test_cli_namespace_conversion_keeps_defaults():
    cfg = convert_namespace_to_omegaconf(Namespace(_name="switch_transformer_lm", arch="switch_transformer_lm_tiny", task="language_modeling", criterion="switch_cross_entropy", no_progress_bar=True))
    assert cfg is not None
