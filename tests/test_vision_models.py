"""Stacked members equal separately computed models; UMix/Ens combination rules; FLOP counts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_vision_data import _one_thread  # noqa: F401  (autouse: one torch thread)
from torch import nn

from fairseq_alma.vision.learner_builder import build_learner
from fairseq_alma.vision.learners import LearnerSpec
from fairseq_alma.vision.mac_count import count_forward_macs, count_parameters
from fairseq_alma.vision.models import StackedMLP, StackedVGG, build_backbone

SHAPES = {"mlp": (1, 8, 8), "vgg": (3, 32, 32)}


def member_copy(stacked: nn.Module, member: int, arch: str) -> nn.Module:
    """A separate N = 1 model holding member ``member``'s tensors."""
    single = build_backbone(arch, SHAPES[arch], 4, 10, 1, None)
    single.load_state_dict(
        {k: v[member : member + 1].clone() for k, v in stacked.state_dict().items()}
    )
    return single


@pytest.mark.parametrize("arch", ["mlp", "vgg"])
@pytest.mark.parametrize("per_member", [False, True])
def test_stacked_members_equal_separate_models(arch, per_member):
    torch.manual_seed(0)
    members = 3
    # float64: a 16-layer batch-normed net on 6 examples amplifies float32 rounding to ~1e-5
    stacked = build_backbone(
        arch, SHAPES[arch], 4, 10, members, torch.Generator().manual_seed(1)
    ).double()
    singles = [member_copy(stacked, n, arch).double() for n in range(members)]
    shape = (members, 6, *SHAPES[arch]) if per_member else (6, *SHAPES[arch])
    x = torch.randn(shape, dtype=torch.float64)
    y = torch.randint(0, 10, (6,))
    out = stacked(x, per_member=per_member)  # (N, B, C)
    (F.cross_entropy(out.flatten(0, 1), y.repeat(members)) * members).backward()
    for n, single in enumerate(singles):
        alone = single(x[n] if per_member else x)[0]
        torch.testing.assert_close(out[n], alone, rtol=1e-10, atol=1e-10)
        F.cross_entropy(alone, y).backward()
        for (name, p_stacked), p_single in zip(stacked.named_parameters(), single.parameters()):
            torch.testing.assert_close(
                p_stacked.grad[n], p_single.grad[0], rtol=1e-9, atol=1e-10, msg=name
            )
        if arch == "vgg":  # batch-norm running statistics are per member too
            torch.testing.assert_close(
                stacked.norms[0].running_mean[n], single.norms[0].running_mean[0]
            )


def test_umix_averages_logits_and_ens_averages_probabilities():
    x = torch.randn(5, 1, 8, 8)
    umix = build_learner(LearnerSpec("umix", "mlp", 4, members=3), (1, 8, 8), 10)
    logits = umix.model(x)  # (3, 5, 10)
    torch.testing.assert_close(umix.train_logits(x)[0], logits.mean(0))
    torch.testing.assert_close(umix.predict_log_probs(x), F.log_softmax(logits.mean(0), -1))
    ens = build_learner(LearnerSpec("ens", "mlp", 4, members=3), (1, 8, 8), 10)
    logits = ens.model(x)
    assert ens.train_logits(x).shape == (3, 5, 10) and ens.selection_groups == 3
    expected = F.softmax(logits, -1).mean(0).log()
    torch.testing.assert_close(ens.predict_log_probs(x), expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(
        ens.model.layers[0].weight[0], ens.model.layers[0].weight[1]
    )  # own inits


def test_mlp_macs_and_params_by_hand():
    # 64 -> 16 -> 16 -> 10: MACs 64*16 + 16*16 + 16*10 = 1440; params 1040 + 272 + 170 = 1482
    model = StackedMLP(64, [16, 16], 10, members=1)
    assert count_forward_macs(model, lambda: model(torch.zeros(3, 64)), 3) == 1440
    assert count_parameters(model) == 1482
    ens = StackedMLP(64, [16, 16], 10, members=5)
    assert count_forward_macs(ens, lambda: ens(torch.zeros(3, 64)), 3) == 5 * 1440
    plain = nn.Sequential(
        nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 10)
    )
    assert count_forward_macs(plain, lambda: plain(torch.zeros(2, 64)), 2) == 1440
    learner = build_learner(LearnerSpec("sm", "mlp", 16), (1, 8, 8), 10)
    assert learner.infer_flops_per_image() == 2 * 1440 and learner.params_active() == 1482


def test_vgg_macs_by_hand():
    model = StackedVGG(3, (32, 32), [4] * 16, 10, members=1)
    sides = [32, 32, 16, 16, 8, 8, 8, 8, 4, 4, 4, 4, 2, 2, 2, 2]
    convs = sum(cin * 4 * 9 * s * s for cin, s in zip([3] + [4] * 15, sides))
    norms = sum(4 * s * s for s in sides)
    expected = convs + norms + 4 * 10
    model.eval()
    assert count_forward_macs(model, lambda: model(torch.zeros(2, 3, 32, 32)), 2) == expected


def test_gens_counts_every_member_and_trains_only_the_newest():
    learner = build_learner(LearnerSpec("gens", "mlp", 4), (1, 8, 8), 10)
    single = learner.params_active()
    empty = torch.zeros(0, 1, 8, 8)
    learner.before_stage(
        2, empty, torch.zeros(0, dtype=torch.long), empty, torch.zeros(0, dtype=torch.long)
    )
    assert learner.params_active() == 2 * single and len(learner.members) == 2
    assert all(not p.requires_grad for p in learner.members[0].parameters())
    assert learner.trainable() is learner.members[1]
    x = torch.randn(3, 1, 8, 8)
    expected = torch.stack([F.softmax(m(x)[0], -1) for m in learner.members]).mean(0).log()
    torch.testing.assert_close(learner.predict_log_probs(x), expected, rtol=1e-5, atol=1e-6)
    assert math.isclose(learner.infer_macs_per_image(), 2 * (64 * 4 + 16 + 40))


@pytest.mark.parametrize("arch", ["mlp", "vgg"])
@pytest.mark.parametrize("method, gating", [("sm", "soft"), ("ens", "soft"), ("umix", "soft"),
                                            ("gens", "soft"), ("gmoe", "soft"), ("gmoe", "hard"),
                                            ("ff", "soft")])
def test_inference_flops_are_torchs_own_count_before_and_after_growth(arch, method, gating):
    """Comp's and the inference cost's MACs (forward hooks, ``mac_count``) equal torch's own
    ``FlopCounterMode`` count of every matmul and convolution that ran, plus what torch does not
    count and the module doc says we do: one multiply-add per batch-norm output element, and a
    soft mixture's combination of its E expert outputs (E - 1 per output element).  Checked at
    stage 1 and after a growth step (gEns members, gMoE splits, Firefly's new units and layers)."""
    from torch.utils.flop_counter import FlopCounterMode

    from fairseq_alma.vision.models_moe import MixtureBlock

    torch.manual_seed(0)
    spec = LearnerSpec(method, arch, 4, members=3, gating=gating, ff_score_examples=32,
                       ff_new_candidates=4)
    learner = build_learner(spec, SHAPES[arch], 10)
    x = torch.randn(2, *SHAPES[arch])

    def torch_count() -> int:
        uncounted = [0]

        def norm(module, inputs, output):
            uncounted[0] += output.numel()

        def mixture(module, inputs, output):
            if module.gating == "soft":
                uncounted[0] += (module.num_experts - 1) * output.numel()
            elif module.kind == "conv":  # hard routing folds its expert's batch norm in by hand
                uncounted[0] += output.numel()

        hooks = [m.register_forward_hook(mixture if isinstance(m, MixtureBlock) else norm)
                 for m in learner.modules()
                 if isinstance(m, MixtureBlock) or "BatchNorm" in type(m).__name__]
        learner.eval()
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            learner.predict_log_probs(x)
        for hook in hooks:
            hook.remove()
        return counter.get_total_flops() + 2 * uncounted[0]

    assert learner.infer_flops_per_image() * 2 == torch_count()
    if method in ("gens", "gmoe", "ff"):
        train_x, train_y = torch.randn(32, *SHAPES[arch]), torch.randint(0, 10, (32,))
        learner.plan_growth(1, train_x, train_y)
        learner.before_stage(2, train_x, train_y, train_x, train_y)
        assert learner.infer_flops_per_image() * 2 == torch_count()
