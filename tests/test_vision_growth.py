"""gMoE splits keep the function exactly and are chosen on the right data; grown learners
resume (Firefly: ``test_vision_firefly``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_vision_data import _one_thread  # noqa: F401  (autouse: one torch thread)

from fairseq_alma.stream.partition import Megabatch
from fairseq_alma.stream.schedule import build_schedule
from fairseq_alma.vision.dataset import VisionData
from fairseq_alma.vision.learner_builder import build_learner
from fairseq_alma.vision.learners import LearnerSpec
from fairseq_alma.vision.mac_count import count_parameters
from fairseq_alma.vision.models_moe import MoEBackbone
from fairseq_alma.vision.moe_tree import TreeGating
from fairseq_alma.vision.stage_trainer import OptimizerSpec, StageTrainConfig
from fairseq_alma.vision.stream_stage import arrived_statistics, train_one_stage

SHAPES = {"mlp": (1, 8, 8), "vgg": (3, 32, 32)}


@pytest.mark.parametrize("arch", ["mlp", "vgg"])
@pytest.mark.parametrize("gating,mode", [("soft", "train"), ("soft", "eval"), ("hard", "eval")])
def test_gmoe_split_leaves_outputs_and_loss_exactly_unchanged(arch, gating, mode):
    generator = torch.Generator().manual_seed(3)
    model = MoEBackbone(arch, SHAPES[arch], 4, 10, gating, (0, 1), generator)
    model.train(mode == "train")
    x = torch.randn(40, *SHAPES[arch], generator=generator)
    y = torch.randint(0, 10, (40,), generator=generator)
    for step in range(3):  # 1 -> 2 -> 3 -> 4 experts, splitting a different leaf each time
        before = model(x)
        loss_before = F.cross_entropy(before[0], y)
        params = count_parameters(model)
        for block in model.growing_blocks():
            block.split_expert(step % block.num_experts, generator)
        after = model(x)
        assert torch.equal(before, after)
        assert torch.equal(loss_before, F.cross_entropy(after[0], y))
        assert [b.num_experts for b in model.growing_blocks()] == [step + 2] * 2
        assert count_parameters(model) > params


def test_tree_gating_probabilities_and_greedy_path():
    tree = TreeGating(3)
    g = torch.Generator().manual_seed(0)
    tree.split(0, 1, g)  # root: (0, 1)
    tree.split(1, 2, g)  # node 1 under the root's right branch: (1, 2)
    z = torch.randn(7, 3)
    a = tree.left_probs(z)
    probs = tree.leaf_probs(a)
    torch.testing.assert_close(probs.sum(1), torch.ones(7))
    torch.testing.assert_close(probs[:, 0], a[:, 0])
    torch.testing.assert_close(probs[:, 2], (1 - a[:, 0]) * (1 - a[:, 1]))
    greedy = tree.choose_leaf(a, None, sample=False)
    expected = torch.where(a[:, 0] >= 0.5, 0, torch.where(a[:, 1] >= 0.5, 1, 2))
    assert torch.equal(greedy, expected)
    # combine is the probability-weighted sum of the experts' outputs
    outs = torch.randn(3, 7, 5)
    torch.testing.assert_close(
        tree.combine(a, lambda e: outs[e]), (probs.t()[:, :, None] * outs).sum(0)
    )


def test_gmoe_splits_the_expert_with_largest_routed_validation_loss():
    learner = build_learner(LearnerSpec("gmoe", "mlp", 4, gating="soft", seed=0), (1, 8, 8), 10)
    blocks = learner.model.growing_blocks()
    for block in blocks:
        block.split_expert(0, learner.generator)
    with (
        torch.no_grad()
    ):  # layer 0 routes everything right (expert 1), layer 1 by the sign of a gate
        blocks[0].gate.weight.zero_()
        blocks[0].gate.bias.fill_(-50.0)
    x, y = torch.randn(30, 1, 8, 8), torch.randint(0, 10, (30,))
    totals = learner.expert_losses(x, y)
    learner.eval()
    with torch.no_grad():
        losses = F.cross_entropy(learner.model(x)[0], y, reduction="none").double()
        hidden = F.relu(blocks[0](x.flatten(1)))
        routing = blocks[1].gate.leaf_probs(blocks[1].gate.left_probs(hidden)).double()
    torch.testing.assert_close(
        totals[0],
        torch.stack([torch.tensor(0.0, dtype=torch.float64), losses.sum()]),
        atol=1e-12,
        rtol=1e-9,
    )
    torch.testing.assert_close(totals[1], routing.t() @ losses)
    plan = learner.plan_growth(1, x, y)
    assert plan["losers"] == [1, int(totals[1].argmax())] and plan["flops"] > 0
    assert [block.num_experts for block in blocks] == [2, 2]  # planned, not split yet
    report = learner.before_stage(2, x, y, x, y)
    assert report["split"] == plan["losers"] and report["experts"] == [3, 3]


def test_gmoe_splits_what_the_previous_stage_validation_data_chose():
    """Algorithm 2: the split is decided on the validation data of the stage just trained.
    The next stage's validation data (here routed to the other expert) must not decide it,
    and a stage without a plan refuses to guess."""
    learner = build_learner(LearnerSpec("gmoe", "mlp", 4, seed=0), (2,), 2)
    block = learner.model.growing_blocks()[0]
    block.split_expert(0, learner.generator)
    with torch.no_grad():  # left (expert 0) when x[0] > 0, right (expert 1) when x[0] < 0
        block.gate.weight.zero_()
        block.gate.weight[0, 0] = 50.0
        block.gate.bias.zero_()
    ones = torch.ones(20, 2)
    y = torch.zeros(20, dtype=torch.long)
    with pytest.raises(RuntimeError, match="gMoE stage 2: no split was planned"):
        learner.before_stage(2, -ones, y, -ones, y)
    assert learner.plan_growth(1, ones, y)["losers"][0] == 0  # stage 1 saw x[0] > 0 only
    report = learner.before_stage(2, -ones, y, -ones, y)  # stage 2's data: x[0] < 0
    assert report["split"][0] == 0 and learner.split_plan.numel() == 0


def test_grown_gmoe_checkpoint_loads_into_a_fresh_learner():
    spec = LearnerSpec("gmoe", "mlp", 4, gating="hard", seed=2)
    grown = build_learner(spec, (1, 8, 8), 10)
    x, y = torch.randn(20, 1, 8, 8), torch.randint(0, 10, (20,))
    for stage in (2, 3):
        grown.plan_growth(stage - 1, x, y)
        grown.before_stage(stage, x, y, x, y)
    fresh = build_learner(spec, (1, 8, 8), 10)
    fresh.load_state_dict(grown.state_dict())
    grown.eval(), fresh.eval()
    assert torch.equal(grown.predict_log_probs(x), fresh.predict_log_probs(x))


@pytest.mark.parametrize("method", ["ff", "gens", "gmoe"])
def test_grown_learner_checkpoint_resumes(method):
    spec = LearnerSpec(method, "mlp", 4, seed=5)
    grown = build_learner(spec, (1, 8, 8), 10)
    x, y = torch.randn(30, 1, 8, 8), torch.randint(0, 10, (30,))
    for stage in (1, 2, 3):
        grown.before_stage(stage, x, y, x, y)
        grown.plan_growth(stage, x[:10], y[:10])  # the plan for stage 4 is in the checkpoint
    fresh = build_learner(spec, (1, 8, 8), 10)
    fresh.load_checkpoint_state(grown.checkpoint_state())
    grown.eval(), fresh.eval()
    assert torch.equal(grown.predict_log_probs(x), fresh.predict_log_probs(x))
    assert fresh.params_active() == grown.params_active()
    assert fresh.describe() == grown.describe()  # FF: its inserted layers rebuilt
    assert [p.requires_grad for p in fresh.parameters()] == [
        p.requires_grad for p in grown.parameters()
    ]
    grown.before_stage(4, x, y, x, y), fresh.before_stage(4, x, y, x, y)  # same RNG: same growth
    grown.eval(), fresh.eval()
    assert torch.equal(grown.predict_log_probs(x), fresh.predict_log_probs(x))


def test_stream_stage_plans_gmoe_growth_on_its_own_validation_data():
    """Through the runner's stage function: mega-batch 1's examples go to expert 0, mega-batch
    2's to expert 1.  The split at stage 2 is stage 1's choice (expert 0); the old order, which
    scored the experts on stage 2's validation data, split expert 1."""
    x = torch.zeros(40, 4)
    x[:20, 0], x[20:, 0] = 5.0, -5.0  # stays > 0 / < 0 under the arrived statistics
    x[:, 1:] = torch.randn(40, 3, generator=torch.Generator().manual_seed(0))
    y = torch.arange(40) % 2
    data = VisionData("signs", x, y, x[:4], y[:4], num_classes=2)
    partition = [Megabatch(i, np.arange(20 * i, 20 * i + 15), np.arange(20 * i + 15, 20 * i + 20))
                 for i in range(2)]
    learner = build_learner(LearnerSpec("gmoe", "mlp", 4, seed=0), (4,), 2)
    block = learner.model.growing_blocks()[0]
    block.split_expert(0, learner.generator)
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[0, 0] = 50.0
        block.gate.bias.zero_()
    config = StageTrainConfig(epochs=1, optimizer=OptimizerSpec("sgd", 1e-12))  # gates stay
    statistics = arrived_statistics(data, partition)
    first, second = (
        train_one_stage(learner, stage, data, partition, statistics, config, seed=0,
                        plans_growth=True)
        for stage in build_schedule(2, 1, replay=False)
    )
    assert first.plan["losers"][0] == 0 and first.flops > first.result.flops
    assert second.growth["split"][0] == 0
    assert learner.describe()["experts"] == [3, 2]
