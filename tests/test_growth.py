"""Expert growth (issue #3 item 3): copies weights, router rows and optimizer moments."""

import torch

from fairseq_alma.errors import UsageError
from fairseq_alma.lm.growth import check_growth_schedule, copy_experts
from fairseq_alma.modules import SwitchFFN, SwitchFFNConfig


def test_copy_experts_copies_weights_router_rows_and_adam_moments():
    torch.manual_seed(0)
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 2, max_experts=5, capacity_factor=2.0))
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    y, aux = layer(torch.randn(32, 8))
    (y.pow(2).sum() + aux.balance_loss).backward()
    opt.step()
    before_rows = layer.router.weight.detach().clone()
    new = copy_experts(layer, [1, 0], optimizer=opt)
    assert new == [2, 3] and layer.num_experts == 4 and int(layer.num_active) == 4
    for name in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"):
        p = getattr(layer, name)
        assert torch.equal(p[2], p[1]) and torch.equal(p[3], p[0])
        for moment in ("exp_avg", "exp_avg_sq"):
            m = opt.state[p][moment]
            assert torch.equal(m[2], m[1]) and torch.equal(m[3], m[0])
    # router rows: copy and source differ by a small symmetric tie-break, not exactly equal
    assert not torch.equal(layer.router.weight[2], layer.router.weight[1])
    assert torch.allclose(layer.router.weight[2] + layer.router.weight[1], 2 * before_rows[1], atol=1e-6)
    assert (layer.router.weight[2] - layer.router.weight[1]).norm() < 0.05 * before_rows[1].norm()
    # the optimizer's parameter list is unchanged and now updates the new experts too
    opt.zero_grad()
    layer.train()
    with torch.no_grad():
        layer.router.weight[2:4] += 1.0  # send tokens to the new experts
    y, aux = layer(torch.randn(64, 8))
    y.pow(2).sum().backward()
    before = layer.fc1_weight[2].clone()
    opt.step()
    assert not torch.equal(before, layer.fc1_weight[2])


def test_copy_beyond_allocated_slots_is_refused():
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 2, max_experts=3))
    try:
        copy_experts(layer, [0, 1])
    except ValueError as exc:
        assert "--moe-max-experts" in str(exc)
    else:
        raise AssertionError("expected ValueError")


def test_growth_schedule_is_checked_step_by_step():
    """Each step may copy at most the experts there are at that point (top-k of them): Table 2's
    4 -> 6 -> 8 -> 12 passes; 2 -> 4 then 5 copies at stage 3 (4 experts then) is refused, as are
    a repeated stage and a growth on a one-stage stream (which would train, and report, no gMoE)."""
    check_growth_schedule("2,2,4", "", 4, 4)
    check_growth_schedule("2,4", "2,4", 4, 2)
    for flags, stages, experts, needle in ((("2,5", "2,3"), 3, 2, "stage 3 would copy 5 experts but the model has 4"),
                                           (("1,1", "3,2"), 3, 2, "--grow-at-stages 3,2 must list each stage once"),
                                           (("2", ""), 1, 2, "--grow-experts 2 has no stage to grow at"),
                                           (("", "2"), 3, 2, "--grow-at-stages 2 without --grow-experts grows nothing")):
        try:
            check_growth_schedule(*flags, stages, experts)
        except UsageError as exc:
            assert needle in str(exc), exc
        else:
            raise AssertionError(f"expected UsageError for {flags}")


def _fp16_optimizer(params, flatten: bool, memory_efficient: bool):
    """fairseq's FP16Optimizer / MemoryEfficientFP16Optimizer around Adam, on CPU: fairseq
    hard-wires ``torch.cuda.current_device()`` into building the flat master copy, the only
    call the test replaces."""
    from unittest import mock

    from fairseq.optim.fp16_optimizer import FP16Optimizer, MemoryEfficientFP16Optimizer
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({
        "common": {"fp16_no_flatten_grads": not flatten, "bf16": False, "fp16_init_scale": 1,
                   "fp16_scale_window": None, "fp16_scale_tolerance": 0.0, "min_loss_scale": 1e-4,
                   "threshold_loss_scale": None, "memory_efficient_bf16": False,
                   "model_parallel_size": 1, "amp": False},
        "distributed_training": {"distributed_world_size": 1},
        "optimization": {"update_freq": [1]},
        "optimizer": {"_name": "adam", "lr": [1e-2], "adam_betas": "(0.9, 0.999)", "adam_eps": 1e-8,
                      "weight_decay": 0.0, "use_old_adam": False, "fp16_adam_stats": False,
                      "tpu": False},
    })
    builder = MemoryEfficientFP16Optimizer if memory_efficient else FP16Optimizer
    with mock.patch("torch.cuda.current_device", lambda: None):  # CPU tensors: device.index None
        return builder.build_optimizer(cfg, params)


import pytest  # noqa: E402


@pytest.mark.parametrize("flatten, memory_efficient", [(True, False), (False, False), (False, True)],
                         ids=["fp16-flat", "fp16-no-flatten", "memory-efficient-fp16"])
def test_growth_copies_adam_moments_under_fp16_optimizers(flatten, memory_efficient):
    """--fp16 keeps Adam's moments in FP16Optimizer's fp32 master copy (one flat tensor, or one
    per parameter); --memory-efficient-fp16 keeps them per parameter.  Growth copies them in
    each layout (it used to skip the flat one)."""
    from fairseq_alma.lm.stage_start import optimizer_state_like

    torch.manual_seed(0)
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 2, max_experts=4, capacity_factor=2.0))
    params = [p for p in layer.parameters() if p.requires_grad]
    opt = _fp16_optimizer(params, flatten, memory_efficient)
    y, aux = layer(torch.randn(32, 8))
    opt.backward(y.pow(2).sum() + aux.balance_loss)
    opt.step()
    copy_experts(layer, [1], optimizer=opt)
    for name in ("fc1_weight", "fc2_bias"):
        p = getattr(layer, name)
        views = optimizer_state_like(opt, p)
        assert len(views) == 2  # exp_avg and exp_avg_sq, shaped like the parameter
        for m in views:
            assert m.abs().sum() > 0 and torch.equal(m[2], m[1])
    if flatten:  # the views write through to the one flat master state
        flat = next(iter(opt.fp32_params.values()))
        state = opt.fp32_optimizer.optimizer.state[flat]
        offset = sum(q.numel() for q in params[: params.index(layer.fc1_weight)])
        rows = state["exp_avg"][offset: offset + layer.fc1_weight.numel()].view(layer.fc1_weight.shape)
        assert torch.equal(rows[2], rows[1])


def test_one_growth_plan_spelled_two_ways_compares_as_one():
    """``--grow-experts 2`` on a 3-stage stream is ``2,2`` at stages ``2,3`` (the default):
    fingerprints compare the parsed plan (``stream/growth_plan``), so a requeue that spells the
    plan the other way continues its run and two seeds of it are one setting; run.json files
    that hold the flags as typed (every release so far) compare the same way."""
    from fairseq_alma.stream.growth_plan import with_parsed_growth_plan

    def fingerprint(wait: int = 1, megabatches: int | None = 3, **growth: str) -> dict:
        data = {"num_megabatches": megabatches} if megabatches else None
        return {"config": {"task": {"wait": wait, "replay": False, **growth}}, "data": data}

    spellings = [fingerprint(grow_experts="2,2"), fingerprint(grow_experts="2"),
                 fingerprint(grow_experts="2", grow_at_stages="2,3"),
                 fingerprint(grow_experts="2,2", grow_at_stages="2,3")]
    parsed = [with_parsed_growth_plan(f) for f in spellings]
    assert all(p == parsed[0] for p in parsed)
    assert parsed[0]["config"]["task"] == {"wait": 1, "replay": False, "grow_experts": "2,2",
                                           "grow_at_stages": "2,3"}
    assert spellings[1]["config"]["task"]["grow_experts"] == "2"  # the input is left as it is
    assert with_parsed_growth_plan(fingerprint(grow_experts="2,1")) != parsed[0]
    assert with_parsed_growth_plan(fingerprint(grow_experts="2", grow_at_stages="3")) != parsed[0]
    # --wait 2 on 4 mega-batches trains 2 stages: one growth, at stage 2
    two_stages = with_parsed_growth_plan(fingerprint(wait=2, megabatches=4, grow_experts="3"))
    assert two_stages["config"]["task"]["grow_at_stages"] == "2"
    # B from the caller (a 0.1 run: no data identity); without it, compared as written
    no_data = fingerprint(megabatches=None, grow_experts="2")
    assert with_parsed_growth_plan(no_data) is no_data
    assert with_parsed_growth_plan(no_data, 3)["config"]["task"]["grow_experts"] == "2,2"
    plain = fingerprint()
    assert with_parsed_growth_plan(plain) is plain  # no growth: nothing to rewrite


def test_resume_ens_and_report_read_the_parsed_growth_plan(tmp_path):
    """The comparisons of run fingerprints (resume: ``run_dir.same_run`` and the refusal's list
    of differences; alma-report's seed groups: ``report/seeds.comparable_fingerprint``) read the
    parsed plan, so a run.json holding ``--grow-experts 2,2`` as typed (any release) is continued
    by a command that spells it ``2``, and groups with it; another plan is still refused."""
    import json

    import pytest

    from fairseq_alma.errors import RunDirError
    from fairseq_alma.report.seeds import SEED_KEYS, comparable_fingerprint
    from fairseq_alma.stream.run_dir import RunDirectory, same_run

    def fingerprint(seed: int = 1, **growth: str) -> dict:
        return {"config": {"common": {"seed": seed}, "task": {"wait": 1, "replay": False, **growth}},
                "data": {"num_megabatches": 3}}

    old = fingerprint(grow_experts="2,2")
    assert same_run(old, fingerprint(grow_experts="2"))
    assert same_run(old, fingerprint(grow_experts="2", grow_at_stages="2,3"))
    assert not same_run(old, fingerprint(grow_experts="1"))
    assert comparable_fingerprint(fingerprint(2, grow_experts="2"), SEED_KEYS) == \
        comparable_fingerprint(old, SEED_KEYS)
    (tmp_path / "run.json").write_text(json.dumps({"fingerprint": old, "hash": "x"}))
    (tmp_path / "stream.jsonl").write_text("")  # a run that trained: not free for another
    run_dir = RunDirectory.for_reading(tmp_path)
    run_dir.check_fingerprint(fingerprint(grow_experts="2"))  # accepted
    with pytest.raises(RunDirError, match=r"\(config.task.grow_experts: '2,2' -> '1,1'\)"):
        run_dir.check_fingerprint(fingerprint(grow_experts="1"))
