"""umix_switch_transformer_lm (issue 3 item 4, paper §4.1): mean of N members' logits, one model."""

import re
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from fairseq.models import ARCH_CONFIG_REGISTRY
from lm_fixtures import run, tool
from omegaconf import OmegaConf
from test_switch_lm import FakeTask  # a dictionary of VOCAB symbols, as task.target_dictionary

from fairseq_alma.criterions.switch_cross_entropy import SwitchCrossEntropyCriterion
from fairseq_alma.errors import CheckpointError
from fairseq_alma.models.switch_transformer_lm import (
    SwitchTransformerLanguageModel,
    SwitchTransformerLMConfig,
)
from fairseq_alma.models.umix_switch_transformer_lm import (
    UMixSwitchLMConfig,
    UMixSwitchTransformerLanguageModel,
)

REPO = Path(__file__).resolve().parent.parent
USER_DIR = str(REPO / "fairseq_alma")
VOCAB = 40


def build(umix_members=None, arch="switch_transformer_lm_tiny", **overrides):
    """A UMix model with ``umix_members`` members, or a plain member model when it is None."""
    args = Namespace(**{"moe_experts": 2, "dropout": 0.0, **overrides})
    if umix_members is None:
        ARCH_CONFIG_REGISTRY[arch](args)
        cfg, model_cls = (
            OmegaConf.structured(SwitchTransformerLMConfig(tokens_per_sample=24)),
            SwitchTransformerLanguageModel,
        )
    else:
        ARCH_CONFIG_REGISTRY["umix_" + arch](args)
        cfg = OmegaConf.structured(
            UMixSwitchLMConfig(tokens_per_sample=24, umix_members=umix_members)
        )
        model_cls = UMixSwitchTransformerLanguageModel
    for key, value in vars(args).items():
        setattr(cfg, key, value)
    return model_cls.build_model(cfg, FakeTask(VOCAB))


def member_model(umix, index, **overrides):
    """A stand-alone switch_transformer_lm carrying member ``index``'s weights from the UMix state dict."""
    prefix = f"decoder.members.{index}."
    state = {
        "decoder." + k[len(prefix) :]: v
        for k, v in umix.state_dict().items()
        if k.startswith(prefix)
    }
    model = build(None, **overrides)
    model.load_state_dict(state, strict=True)
    return model


def tokens(batch=3, length=9, seed=0):
    return torch.randint(4, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_logits_are_the_mean_of_the_members_logits():
    torch.manual_seed(0)
    umix = build(3).eval()
    x = tokens()
    logits, extra = umix(x)
    assert logits.shape == (3, 9, VOCAB)
    members = [member_model(umix, i).eval() for i in range(3)]
    member_logits = [m(x)[0] for m in members]
    assert torch.allclose(logits, torch.stack(member_logits).mean(0), atol=1e-6)
    # independently initialised: no two members predict alike
    assert not torch.allclose(member_logits[0], member_logits[1], atol=1e-3)
    assert not torch.equal(
        umix.decoder.members[0].embed_tokens.weight, umix.decoder.members[1].embed_tokens.weight
    )
    # a single model's normalisation and length limit
    assert torch.allclose(
        umix.get_normalized_probs((logits, extra), log_probs=True), torch.log_softmax(logits, -1)
    )
    assert umix.max_positions() == members[0].max_positions() == 24


def test_gradients_reach_every_member():
    torch.manual_seed(0)
    umix = build(2).train()
    x = tokens()
    sample = {
        "net_input": {"src_tokens": x, "src_lengths": torch.full((3,), 9)},
        "target": torch.roll(x, -1, 1),
        "ntokens": 27,
    }
    loss, _, _ = SwitchCrossEntropyCriterion(FakeTask(VOCAB), False, 0.01, "sum", 0.0)(umix, sample)
    loss.backward()
    for member in umix.decoder.members:
        assert member.embed_tokens.weight.grad.abs().sum() > 0
        assert member.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
        assert (
            member.moe_layers()[0].router.weight.grad.abs().sum() > 0
        )  # balance loss + routing gates


def test_one_member_equals_the_plain_model_in_outputs_and_gradients():
    torch.manual_seed(0)
    umix = build(1).train()
    plain = member_model(umix, 0).train()
    x = tokens()
    out_umix, out_plain = umix(x), plain(x)
    assert torch.equal(out_umix[0], out_plain[0])
    balance = [aux.balance_loss for aux in out_umix[1]["moe_aux"]]
    assert torch.equal(
        torch.stack(balance), torch.stack([aux.balance_loss for aux in out_plain[1]["moe_aux"]])
    )
    (out_umix[0].square().mean() + sum(balance)).backward()
    (
        out_plain[0].square().mean() + sum(aux.balance_loss for aux in out_plain[1]["moe_aux"])
    ).backward()
    grads_plain = {name: p.grad for name, p in plain.named_parameters()}
    for name, p in umix.named_parameters():
        plain_name = name.replace("decoder.members.0.", "decoder.")
        assert (p.grad is None) == (grads_plain[plain_name] is None), name
        assert p.grad is None or torch.equal(p.grad, grads_plain[plain_name]), name


def test_aux_outputs_moe_layers_and_parameter_counts_cover_every_member():
    torch.manual_seed(0)
    umix = build(3, decoder_layers=4, moe_freq=2, moe_experts=2, moe_max_experts=5)
    member = build(None, decoder_layers=4, moe_freq=2, moe_experts=2, moe_max_experts=5)
    assert len(umix(tokens())[1]["moe_aux"]) == 3 * 2  # N members x 2 Switch blocks each
    assert len(umix.moe_layers()) == 6
    assert {id(layer) for layer in umix.moe_layers()} == {
        id(m.ffn) for decoder in umix.decoder.members for m in decoder.layers if m.is_moe
    }
    counts, one = umix.parameter_counts(), member.parameter_counts()
    for key in ("shared", "per_expert", "active", "allocated"):
        assert counts[key] == 3 * one[key], key
    assert counts["experts"] == 2 and counts["members"] == 3
    assert counts["allocated"] == sum(p.numel() for p in umix.parameters())
    router_row = sum(layer.router.weight.shape[1] for layer in member.moe_layers())  # per slot
    assert counts["allocated"] - counts["active"] == 3 * (5 - 2) * (one["per_expert"] + router_row)


def test_incremental_decoding_matches_the_full_forward():
    torch.manual_seed(0)
    umix = build(2).eval()
    x = tokens(batch=2, length=7)
    full = umix(x)[0]
    state: dict = {}
    steps = [
        umix.decoder(x[:, : i + 1], incremental_state=state)[0] for i in range(7)
    ]  # each (B, 1, V)
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)
    assert len(state) == 2 * 2  # one cache per attention module: 2 members x 2 blocks


def test_features_only_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="no single feature vector"):
        build(2).decoder(tokens(), features_only=True)


def test_checkpoint_without_version_entries_loads_strictly_and_newer_is_refused():
    """UMix records its own format version and each member's; checkpoints from before that
    (no ``version`` entries) load with strict=True through fairseq's upgrade path."""
    torch.manual_seed(0)
    umix = build(2).eval()
    versions = sorted(k for k in umix.state_dict() if k.endswith(".version"))
    assert versions == ["decoder.members.0.version", "decoder.members.1.version", "decoder.version"]
    legacy = {k: v.clone() for k, v in umix.state_dict().items() if k not in versions}
    clone = build(2).eval()
    clone.load_state_dict(legacy, strict=True, model_cfg=OmegaConf.structured(UMixSwitchLMConfig()))
    assert torch.equal(umix(tokens())[0], clone(tokens())[0])
    newer = umix.state_dict()
    newer["decoder.members.1.version"] = torch.tensor([99])
    with pytest.raises(CheckpointError, match=r"decoder\.members\.1\.version has format version 99"):
        clone.load_state_dict(newer, strict=True)


def train_cmd(data: Path, save_dir: Path, *extra: str) -> list[str]:
    return [
        tool("fairseq-train"),
        str(data),
        "--user-dir",
        USER_DIR,
        "--task",
        "language_modeling",
        "--arch",
        "umix_switch_transformer_lm_tiny",
        "--umix-members",
        "2",
        "--criterion",
        "switch_cross_entropy",
        "--moe-experts",
        "4",
        "--optimizer",
        "adam",
        "--lr",
        "0.005",
        "--lr-scheduler",
        "inverse_sqrt",
        "--warmup-updates",
        "5",
        "--tokens-per-sample",
        "32",
        "--batch-size",
        "16",
        "--cpu",
        "--save-dir",
        str(save_dir),
        "--log-format",
        "simple",
        "--log-interval",
        "5",
        "--seed",
        "1",
        "--dropout",
        "0.0",
        "--num-workers",
        "0",
        *extra,
    ]


@pytest.mark.slow
def test_fairseq_train_then_eval_lm(tiny_lm_bin, tmp_path):
    proc = run(train_cmd(tiny_lm_bin, tmp_path / "ckpt", "--max-update", "10"))
    out = proc.stdout + proc.stderr
    assert re.search(
        r"umix_switch_transformer_lm: 2 members x \([0-9.]+M shared \+ [0-9.]+M per expert x 4 experts\)",
        out,
    )
    losses = [float(x) for x in re.findall(r"\| train_inner \|.*?loss=([0-9.]+)", out)]
    assert len(losses) == 2 and losses[1] < losses[0], losses
    assert "moe_balance=" in out
    ckpt = tmp_path / "ckpt" / "checkpoint_last.pt"
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert state["cfg"]["model"]["umix_members"] == 2
    assert any(k.startswith("decoder.members.1.") for k in state["model"])

    valid_loss = float(re.findall(r"\| valid \|.*?\| loss ([0-9.]+)", out)[-1])
    ev = run(
        [
            tool("fairseq-eval-lm"),
            str(tiny_lm_bin),
            "--user-dir",
            USER_DIR,
            "--path",
            str(ckpt),
            "--gen-subset",
            "valid",
            "--tokens-per-sample",
            "32",
            "--batch-size",
            "16",
            "--cpu",
        ]
    )
    m = re.search(r"Loss \(base 2\): ([0-9.]+), Perplexity: ([0-9.]+)", ev.stdout + ev.stderr)
    assert m, ev.stderr[-2000:]
    assert float(m.group(1)) == pytest.approx(valid_loss, abs=0.01)  # same averaged model in both


@pytest.mark.slow
def test_zero_members_is_a_one_line_error(tiny_lm_bin, tmp_path):
    proc = run(
        train_cmd(tiny_lm_bin, tmp_path / "ckpt", "--max-update", "1", "--umix-members", "0"),
        check=False,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fairseq-alma: error:")]
    assert errors == ["fairseq-alma: error: --umix-members must be an integer >= 1 (got 0)"], (
        proc.stderr[-2000:]
    )
    assert "Traceback" not in proc.stderr
