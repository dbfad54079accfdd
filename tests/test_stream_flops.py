"""Analytic Switch-LM FLOPs (formula in fairseq_alma/stream/transformer_flops.py) on hand-computed configs."""

import pytest
import torch

from fairseq_alma.stream.transformer_flops import (
    SwitchLMShape,
    lm_forward_flops_per_token,
    lm_train_flops,
)

# 2 layers, d 4, f 8, V 10, context 3, 1 of the 2 FFNs is a Switch layer with 4 experts:
#   attention   2 x (4*4*4 + 2*3*4) = 2 x (64 + 24) = 176 MACs
#   FFN         2 x 2*4*8 = 128, + router 1 x 4*4 = 16       = 144 MACs
#   output      4*10                                           =  40 MACs
#   total 360 MACs -> 720 forward FLOPs per token
TINY = {
    "n_layers": 2,
    "d_model": 4,
    "ffn_dim": 8,
    "vocab_size": 10,
    "context": 3,
    "moe_layers": 1,
    "num_experts": 4,
}


def test_tiny_config_by_hand():
    assert SwitchLMShape(**TINY).forward_macs_per_token() == 360
    assert lm_forward_flops_per_token(**TINY) == 720
    assert SwitchLMShape(**TINY).forward_flops_per_sequence() == 3 * 720
    assert lm_train_flops(5, **TINY) == 3 * 5 * 720  # forward + backward = 3 x forward
    assert lm_train_flops(0, **TINY) == 0
    assert lm_train_flops(5, 2, 4, 8, 10, 3, 1, 4) == 3 * 5 * 720  # positional, as the brief's API
    with pytest.raises(ValueError, match="tokens must be an integer >= 0"):
        lm_train_flops(-1, **TINY)


def test_only_the_router_depends_on_the_number_of_experts():
    # §6.2: one expert per token, so 4 -> 8 experts adds only 1 layer x d x 4 router MACs
    more = dict(TINY, num_experts=8)
    assert lm_forward_flops_per_token(**more) - lm_forward_flops_per_token(**TINY) == 2 * 1 * 4 * 4


def test_dense_model_has_no_router():
    dense = dict(TINY, moe_layers=0, num_experts=0)
    assert SwitchLMShape(**dense).forward_macs_per_token() == 360 - 16


def test_paper_base_and_large_inference_cost_vs_section_6_2():
    # §6.2 states 42 and 126 GFLOPs per input; read as one 512-token sequence with Switch
    # layers every other layer (what §5's parameter counts imply), our count is 16% / 8% higher.
    # Hand count, base: 6 x (4*512^2 + 2*512*512) + 6 x 2*512*2048 + 3*512*4 + 512*50000
    #                  = 9,437,184 + 12,582,912 + 6,144 + 25,600,000 = 47,626,240 MACs per token
    base = SwitchLMShape(6, 512, 2048, 50000, 512, moe_layers=3, num_experts=4)
    base = base.forward_flops_per_sequence()
    assert base == 2 * 47_626_240 * 512 == 48_769_269_760
    assert base / 42e9 == pytest.approx(1.1612, abs=1e-4)
    large = SwitchLMShape(12, 768, 3072, 50000, 512, moe_layers=6, num_experts=4)
    large = large.forward_flops_per_sequence()
    assert large == 135_977_238_528
    assert large / 126e9 == pytest.approx(1.0792, abs=1e-4)


@pytest.mark.parametrize("convention, base, large", [
    ("full", 48.76926976e9, 135.977238528e9),
    ("kaplan", 47.158657024e9, 131.14540032e9),  # QK^T only: n_ctx*d MACs per layer
    ("params", 45.548044288e9, 126.313562112e9),  # 2N: reproduces the paper's large 126
])
def test_flops_conventions_table_of_the_module_doc(convention, base, large):
    shapes = {"base": (6, 512, 2048, 50000, 512, 3, 4), "large": (12, 768, 3072, 50000, 512, 6, 4)}
    got = {name: SwitchLMShape(*shape, convention=convention).forward_flops_per_sequence()
           for name, shape in shapes.items()}
    assert got == {"base": base, "large": large}
    # only the attention-score term differs: per layer 2, 1 or 0 x n_ctx*d MACs
    tiny = SwitchLMShape(**TINY, convention=convention).forward_macs_per_token()
    assert tiny == 360 - {"full": 0, "kaplan": 1, "params": 2}[convention] * 2 * 3 * 4


def test_base_without_experts_is_still_not_the_papers_42():
    # the module doc's claim: leaving the three Switch FFNs (and routers) out gives 39.1, not 42
    no_experts = SwitchLMShape(6, 512, 2048, 50000, 512, 3, 4, convention="params")
    switch_ffn = 3 * (2 * 512 * 2048 + 512 * 4) * 2 * 512
    assert (no_experts.forward_flops_per_sequence() - switch_ffn) / 1e9 == pytest.approx(39.09, abs=0.01)
    with pytest.raises(ValueError, match="convention 'paper' must be one of"):
        SwitchLMShape(**TINY, convention="paper")


@pytest.mark.parametrize(
    "change, pattern",
    [
        ({"moe_layers": 3}, r"moe_layers \(3\) cannot exceed n_layers \(2\)"),
        ({"d_model": 0}, "d_model must be an integer >= 1"),
        ({"num_experts": 0}, "num_experts must be an integer >= 1"),
        ({"context": 2.5}, "context must be an integer"),
    ],
)
def test_bad_shapes(change, pattern):
    with pytest.raises(ValueError, match=pattern):
        lm_forward_flops_per_token(**dict(TINY, **change))


def test_a_dense_lm_is_counted_at_its_blocks_width_or_refused():
    """fairseq's transformer_lm keeps --decoder-input-dim at 512 whatever --decoder-embed-dim says:
    the count takes the blocks' width, and a model with projections it has no term for is refused."""
    from fairseq.data import Dictionary
    from fairseq.models.transformer_lm import (
        TransformerLanguageModel,
        TransformerLanguageModelConfig,
    )
    from omegaconf import OmegaConf

    from fairseq_alma.errors import UsageError
    from fairseq_alma.lm.model_flops import model_shape

    class Task:
        source_dictionary = target_dictionary = Dictionary()

    def build(**dims: int):
        cfg = OmegaConf.structured(TransformerLanguageModelConfig(
            decoder_layers=2, decoder_embed_dim=32, decoder_ffn_embed_dim=64, decoder_attention_heads=2,
            tokens_per_sample=16, max_target_positions=16, share_decoder_input_output_embed=True, **dims))
        return TransformerLanguageModel.build_model(cfg, Task())

    with pytest.raises(UsageError, match="a projection from --decoder-input-dim, a projection to --decoder-output-dim"):
        model_shape(build(), context=16)
    shape = model_shape(build(decoder_input_dim=32, decoder_output_dim=32), context=16)
    assert (shape.d_model, shape.ffn_dim, shape.n_layers, shape.vocab_size) == (32, 64, 2, len(Task.target_dictionary))


def _torch_counted_flops(model, tokens, train: bool) -> int:
    """FLOPs of the model's matmuls as torch's own ``FlopCounterMode`` counts them, attention
    through the math kernel (CPU's fused attention kernel is not in the counter's table)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model.train(train)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH), \
            torch.set_grad_enabled(train):
        logits, _ = model(tokens)
        if train:
            logits.float().sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("arch, sizes", [
    ("switch_transformer_lm_tiny", dict(moe_experts=4)),
    ("switch_transformer_lm_tiny", dict(moe_experts=4, moe_freq=1, decoder_layers=3)),
    ("switch_transformer_lm_tiny", dict(moe_experts=2, moe_max_experts=8)),  # growth's empty slots
    ("umix_switch_transformer_lm_tiny", dict(moe_experts=2, umix_members=2, decoder_embed_dim=32,
                                             decoder_ffn_embed_dim=64, decoder_attention_heads=2)),
    ("transformer_lm", dict(decoder_layers=2, decoder_embed_dim=32, decoder_input_dim=32,
                            decoder_output_dim=32, decoder_ffn_embed_dim=64, decoder_attention_heads=4)),
])
def test_the_recorded_flops_are_torchs_own_count_of_the_built_model(arch, sizes):
    """Comp and §6.2's cost, as every run records them (``lm/model_flops.model_flops`` on the
    model it trains), equal torch's count of that model's matmuls: forward, and forward +
    backward = 3 x forward.  An independent check of the module doc's table and of how a built
    model's sizes are read (FFN width, Switch layers, experts, members, vocabulary).  Capacity
    is ample so no token is dropped (a dropped token skips its expert on CPU; the count, which
    gives every token one expert, includes it)."""
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY
    from omegaconf import OmegaConf
    from test_switch_lm import FakeTask

    from fairseq_alma.lm.model_flops import model_flops

    context, batch = 16, 3
    model_class = ARCH_MODEL_REGISTRY[arch]
    cfg = OmegaConf.structured(model_class.__dataclass(tokens_per_sample=context, max_target_positions=context))
    for key, value in dict(sizes, dropout=0.0, **({} if arch == "transformer_lm" else {"capacity_factor": 8.0})).items():
        setattr(cfg, key, value)
    ARCH_CONFIG_REGISTRY[arch](cfg)
    torch.manual_seed(0)
    model = model_class.build_model(cfg, FakeTask(40))
    tokens = torch.randint(4, 40, (batch, context))
    forward, train = model_flops(model, context, batch * context)
    assert forward * batch * context == _torch_counted_flops(model, tokens, train=False)
    assert train == _torch_counted_flops(model, tokens, train=True)
