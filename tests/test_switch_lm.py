"""switch_transformer_lm: presets, Table 2 parameter counts, criterion, save/load (issue #2)."""

import io
from argparse import Namespace

import pytest
import torch
from fairseq.data import Dictionary
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.models import ARCH_CONFIG_REGISTRY
from omegaconf import OmegaConf

from fairseq_alma.criterions.switch_cross_entropy import STATS, SwitchCrossEntropyCriterion
from fairseq_alma.errors import CheckpointError, UsageError
from fairseq_alma.models.checkpoint_format import SWITCH_DECODER_VERSION
from fairseq_alma.models.switch_transformer_lm import (
    SwitchTransformerLanguageModel,
    SwitchTransformerLMConfig,
    validate_config,
)


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


def test_batch_prioritized_routing_flag_reaches_every_switch_block():
    plain = build("switch_transformer_lm_tiny", 100, moe_experts=2, decoder_layers=4)
    assert [layer.cfg.batch_prioritized_routing for layer in plain.moe_layers()] == [False, False]
    model = build("switch_transformer_lm_tiny", 100, moe_experts=2, decoder_layers=4, moe_batch_prioritized_routing=True)
    assert [layer.cfg.batch_prioritized_routing for layer in model.moe_layers()] == [True, True]


def test_active_parameters_count_only_active_slots():
    """A model with slots pre-allocated for growth counts as the same model without them: its
    free slots' experts and router rows are allocated, not active."""
    model = build("switch_transformer_lm_tiny", 100, moe_experts=2, moe_max_experts=6)
    counts = model.parameter_counts()
    plain = build("switch_transformer_lm_tiny", 100, moe_experts=2).parameter_counts()
    assert counts["active"] == plain["active"] == plain["allocated"]
    assert counts["shared"] == plain["shared"] and counts["per_expert"] == plain["per_expert"]
    router_rows = 4 * model.moe_layers()[0].router.weight.shape[1]
    assert counts["allocated"] - counts["active"] == 4 * counts["per_expert"] + router_rows


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
    assert log["moe_layers"] == 1 and log["moe_stats"][STATS.index("tokens")].item() == 36
    mean = SwitchCrossEntropyCriterion(task, False, 0.0, "mean", 0.0)(model, sample)[0]
    assert mean.item() == pytest.approx(nll.item(), rel=1e-5)


def test_logged_diagnostics_are_the_log_windows_sums_divided_and_survive_a_two_rank_sum():
    """Two steps in one log window (one of them two ranks' logs, as fairseq sums them): each
    printed diagnostic is the window's sums divided (token-weighted for per-token ones, per
    block call for per-block ones); the sums themselves (``_moe_*``) are not printed."""
    from fairseq.logging import metrics

    def log(stats: list, layers: int, ntokens: int) -> dict:
        return {"loss": torch.tensor(1.0), "ntokens": ntokens, "nsentences": 1, "sample_size": ntokens,
                "moe_layers": layers, "moe_stats": torch.tensor(stats, dtype=torch.float32)}

    # balance_sum, tokens, dropped, entropy_sum, load_max, load_min, unused
    step1 = [log([2.0, 30.0, 3.0, 6.0, 2.5, 0.5, 1.0], 2, 15)]
    step2 = [log([1.0, 8.0, 0.0, 1.0, 1.5, 0.0, 2.0], 1, 8), log([1.5, 12.0, 3.0, 4.0, 1.0, 1.0, 0.0], 1, 12)]
    with metrics.aggregate(new_root=True) as window:
        SwitchCrossEntropyCriterion.reduce_metrics(step1)
        SwitchCrossEntropyCriterion.reduce_metrics(step2)
        shown = window.get_smoothed_values()
    assert shown["moe_balance"] == round(4.5 / 4, 4)
    assert shown["moe_dropped_pct"] == round(100 * 6 / 50, 2)
    assert shown["moe_entropy"] == round(11 / 50, 3)
    assert (shown["moe_load_max"], shown["moe_load_min"], shown["moe_unused"]) == (1.25, 0.375, 0.75)
    assert not [key for key in shown if key.startswith("_")]
    with metrics.aggregate(new_root=True) as window:  # resumed from a checkpoint written before the sums
        metrics.log_scalar("moe_balance", 7.0, 1, round=4)  # what such a checkpoint restores
        SwitchCrossEntropyCriterion.reduce_metrics(step1)
        assert window.get_smoothed_values()["moe_balance"] == 1.0  # not the stale 7
    with metrics.aggregate(new_root=True) as window:  # no MoE block: nothing MoE is logged
        SwitchCrossEntropyCriterion.reduce_metrics([{"loss": torch.tensor(1.0), "ntokens": 4, "nsentences": 1,
                                                     "sample_size": 4}])
        assert not [key for key in window.get_smoothed_values() if "moe" in key]


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


@pytest.mark.parametrize(
    "criterion, refused", [("cross_entropy", True), ("switch_cross_entropy", False), (None, False)]
)
def test_criterion_check_reads_the_full_config_and_skips_a_bare_model_config(criterion, refused):
    """As fairseq-train builds it (a node of the whole config), as a checkpoint's saved config
    reloads it (plain containers), and alone (tests): the check runs only where it can."""
    model_cfg = SwitchTransformerLMConfig(tokens_per_sample=64)
    validate_config(model_cfg)  # a bare dataclass: no criterion to check
    validate_config(OmegaConf.structured(model_cfg))  # a lone config node: nothing to check either
    sections = {} if criterion is None else {"criterion": {"_name": criterion}}
    saved = OmegaConf.create({"model": OmegaConf.to_container(OmegaConf.structured(model_cfg)), **sections})
    OmegaConf.set_struct(saved, True)  # as fairseq's load_checkpoint_to_cpu leaves it
    live = OmegaConf.create({"model": OmegaConf.structured(model_cfg), **sections})
    for cfg in (saved, live):
        if refused:
            with pytest.raises(UsageError, match=f"--criterion {criterion} ignores the Switch balance loss"):
                validate_config(cfg.model)
        else:
            validate_config(cfg.model)


def _without_version_entries(state: dict) -> dict:
    """The state dict exactly as checkpoints written before format versions were recorded hold it:
    every tensor of today's model except the ``version`` entries (SwitchFFN's keys are unchanged)."""
    return {key: value.clone() for key, value in state.items() if key.rsplit(".", 1)[-1] != "version"}


def test_checkpoint_without_version_entry_loads_strictly_through_fairseqs_path():
    torch.manual_seed(0)
    model = build("switch_transformer_lm_tiny", 60, moe_experts=3, moe_max_experts=5, dropout=0.0).eval()
    assert int(model.state_dict()["decoder.version"][0]) == SWITCH_DECODER_VERSION
    legacy = _without_version_entries(model.state_dict())
    assert set(model.state_dict()) - set(legacy) == {"decoder.version"}
    clone = build("switch_transformer_lm_tiny", 60, moe_experts=3, moe_max_experts=5, dropout=0.0).eval()
    model_cfg = OmegaConf.structured(SwitchTransformerLMConfig(tokens_per_sample=512))
    clone.load_state_dict(legacy, strict=True, model_cfg=model_cfg)  # what fairseq's loaders call
    assert int(clone.decoder.version[0]) == SWITCH_DECODER_VERSION
    tokens = torch.randint(4, 60, (2, 10))
    assert torch.equal(model(tokens)[0], clone(tokens)[0])


def test_checkpoint_from_a_newer_format_is_refused_in_one_line():
    model = build("switch_transformer_lm_tiny", 60, moe_experts=2)
    state = model.state_dict()
    state["decoder.version"] = torch.tensor([SWITCH_DECODER_VERSION + 1])
    with pytest.raises(CheckpointError) as err:
        model.load_state_dict(state, strict=True)
    message = str(err.value)
    assert "\n" not in message and "decoder.version" in message and f"version {SWITCH_DECODER_VERSION + 1}" in message


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


@pytest.mark.parametrize("arch", ["switch_transformer_lm_tiny", "umix_switch_transformer_lm_tiny"])
def test_checkpoint_activations_keeps_every_gradient_and_counts_the_balance_loss_once(arch):
    """--checkpoint-activations recomputes each block in backward (non-reentrant): every
    parameter's gradient, the router's included, equals the run without it, with dropout and
    router jitter on (their random draws are replayed), and one balance loss per MoE block."""
    import copy

    from fairseq_alma.models.umix_switch_transformer_lm import UMixSwitchLMConfig
    from fairseq_alma.models.umix_switch_transformer_lm import (
        UMixSwitchTransformerLanguageModel as UMixLM,
    )

    torch.manual_seed(0)
    overrides = dict(moe_experts=4, capacity_factor=1.0, dropout=0.2, moe_jitter_eps=0.1)
    if arch.startswith("umix"):
        cfg = OmegaConf.structured(UMixSwitchLMConfig(tokens_per_sample=512, umix_members=2))
        ARCH_CONFIG_REGISTRY["umix_switch_transformer_lm_tiny"](cfg)
        for key, value in overrides.items():
            setattr(cfg, key, value)
        plain = UMixLM.build_model(cfg, FakeTask(30))
    else:
        plain = build(arch, 30, **overrides)
    recomputed = copy.deepcopy(plain)
    for decoder in getattr(recomputed.decoder, "members", [recomputed.decoder]):
        decoder.checkpoint_activations = True
    tokens = torch.randint(4, 30, (3, 16))
    tokens[2, 12:] = 1  # padding
    grads, balances = [], []
    for model in (plain, recomputed):
        model.train()
        torch.manual_seed(5)
        logits, extra = model(tokens)
        balance = sum(aux.balance_loss for aux in extra["moe_aux"])
        balances.append((len(extra["moe_aux"]), balance.detach()))
        (logits.float().logsumexp(-1).mean() + 0.01 * balance).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    assert balances[0][0] == balances[1][0] and torch.equal(balances[0][1], balances[1][1])
    assert grads[0].keys() == grads[1].keys() and any("router" in name for name in grads[0])
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7), name


# ---- causal attention without masks (switch_decoder_layer.py) --------------------------------
def _masked(model, monkeypatch):
    """The same model forced onto fairseq's masked attention (the general path)."""
    monkeypatch.setattr(type(model.decoder), "attention_needs_no_mask", lambda self, mask: False)


@pytest.mark.parametrize("training", [True, False])
def test_causal_attention_without_masks_equals_fairseq_masked_attention(monkeypatch, training):
    """Right-padded batches: every real position's output, the loss over real positions and
    every gradient equal fairseq's attention with the causal and key-padding masks."""
    torch.manual_seed(0)
    model = build("switch_transformer_lm_tiny", 60, moe_experts=4, dropout=0.0).train(training)
    tokens = torch.randint(4, 60, (3, 16))
    tokens[1, 11:] = model.decoder.padding_idx
    tokens[2, 5:] = model.decoder.padding_idx
    real = tokens.ne(model.decoder.padding_idx)
    results = []
    for masked in (False, True):
        if masked:
            _masked(model, monkeypatch)
        model.zero_grad()
        with torch.set_grad_enabled(True):
            logits, extra = model(tokens)
            loss = logits[real].logsumexp(-1).sum() + sum(aux.balance_loss for aux in extra["moe_aux"])
            loss.backward()
        results.append((logits[real].detach(), loss.detach(),
                        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (fast_logits, fast_loss, fast_grads), (ref_logits, ref_loss, ref_grads) = results
    torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert fast_grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(fast_grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_padding_before_a_real_token_is_refused_in_training_and_masked_in_evaluation(monkeypatch):
    torch.manual_seed(1)
    model = build("switch_transformer_lm_tiny", 60, moe_experts=4, dropout=0.0)
    tokens = torch.randint(4, 60, (2, 10))
    tokens[1, :3] = model.decoder.padding_idx  # left padding
    with pytest.raises(RuntimeError, match="padded at the end of each row"):
        model.train()(tokens)
    model.eval()
    with torch.no_grad():
        fast = model(tokens)[0]
        _masked(model, monkeypatch)
        masked = model(tokens)[0]
    torch.testing.assert_close(fast, masked)  # evaluation fell back to the masked attention


def test_a_checkpoint_trained_with_gpu_only_flags_builds_on_cpu():
    """A checkpoint's saved config carries its training flags (--bf16, FSDP, the GPU kernel):
    building its model to score it on a CPU must not refuse them (they are checked when
    fairseq-train starts, train_flags.check_training_flags)."""
    from fairseq_alma.fairseq_glue.train_flags import check_training_flags

    model_cfg = OmegaConf.to_container(OmegaConf.structured(SwitchTransformerLMConfig(tokens_per_sample=64)))
    model_cfg.update(_name="switch_transformer_lm", moe_expert_kernel="segments")
    saved = OmegaConf.create({"model": model_cfg, "criterion": {"_name": "switch_cross_entropy"},
                              "common": {"bf16": True, "memory_efficient_bf16": False, "cpu": False, "tpu": False,
                                         "fp16": False, "memory_efficient_fp16": False, "fp16_no_flatten_grads": False},
                              "distributed_training": {"ddp_backend": "fully_sharded", "zero_sharding": "none"},
                              "task": {"grow_experts": ""}, "dataset": {"batch_size": 8}})
    validate_config(saved.model)
    with pytest.raises(UsageError, match="--bf16 trains on CUDA GPUs only"):
        check_training_flags(saved)  # but fairseq-train refuses them on this CPU


def test_fully_sharded_on_one_gpu_is_refused(monkeypatch):
    from fairseq_alma.fairseq_glue.train_flags import check_training_flags

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a node with two GPUs
    cfg = OmegaConf.create({"model": {"_name": "switch_transformer_lm"}, "task": {"_name": "language_modeling"},
                            "common": {"cpu": False, "tpu": False, "bf16": False, "fp16": True,
                                       "memory_efficient_fp16": False, "memory_efficient_bf16": False,
                                       "fp16_no_flatten_grads": False},
                            "distributed_training": {"ddp_backend": "fully_sharded", "zero_sharding": "none",
                                                     "distributed_world_size": 1},
                            "dataset": {"batch_size": 8}})
    with pytest.raises(UsageError, match="fully_sharded on one GPU: fairscale 0.4.13 cannot save"):
        check_training_flags(cfg)
    cfg.distributed_training.distributed_world_size = 2
    check_training_flags(cfg)  # several GPUs: fairseq's FSDP
    cfg.task._name = "alma_stream"
    with pytest.raises(UsageError, match="cannot train an alma_stream run"):
        check_training_flags(cfg)


def test_decoding_and_the_hub_route_without_the_evaluation_capacity(caplog):
    """--eval-capacity-factor limits an expert to cf * ceil(T / E) of a forward's T tokens; a
    decoding step routes one token per sequence, so T would be the number of prompts decoded
    together and a continuation would depend on its batch-mates.  Incremental decoding routes
    without the limit (one warning), restoring it after every step; the hub interface routes
    every forward without it (its ``score`` pads whatever sentences it is given together)."""
    import logging

    from fairseq import hub_utils

    from fairseq_alma.fairseq_glue.scoring_commands import install_hub_routing

    torch.manual_seed(0)
    model = build("switch_transformer_lm_tiny", 40, moe_experts=4, dropout=0.0, eval_capacity_factor=1.0).eval()
    unlimited = build("switch_transformer_lm_tiny", 40, moe_experts=4, dropout=0.0).eval()
    unlimited.load_state_dict(model.state_dict())
    tokens = torch.randint(4, 40, (3, 7))

    def decode(rows: torch.Tensor) -> torch.Tensor:
        state: dict = {}
        return torch.cat([model.decoder(rows[:, : i + 1], incremental_state=state)[0] for i in range(7)], 1)

    with caplog.at_level(logging.WARNING, logger="fairseq_alma.models.switch_transformer_lm"):
        together = decode(tokens)
        alone = torch.cat([decode(tokens[i : i + 1]) for i in range(3)])
    assert torch.allclose(together, alone, atol=1e-5)  # with the limit: up to 0.3 apart
    assert torch.allclose(together, unlimited(tokens)[0], atol=1e-5)
    warnings = [r.getMessage() for r in caplog.records if "--eval-capacity-factor" in r.getMessage()]
    assert len(warnings) == 1 and "incremental decoding" in warnings[0], warnings
    assert all(layer.cfg.eval_capacity_factor == 1.0 for layer in model.moe_layers())  # restored

    class HubTask(FakeTask):
        def max_positions(self):
            return 512

    install_hub_routing()  # installed with the plugin's patches; idempotent
    cfg = OmegaConf.create({"generation": {"replace_unk": None}, "tokenizer": None, "bpe": None})
    hub = hub_utils.GeneratorHubInterface(cfg, HubTask(40), [model])
    assert all(layer.cfg.eval_capacity_factor is None for layer in hub.models[0].moe_layers())
    assert torch.allclose(hub.models[0](tokens)[0], unlimited(tokens)[0], atol=1e-5)
