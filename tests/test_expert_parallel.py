"""Expert-parallel SwitchFFN on 2 (and 4) gloo processes against one process holding all experts.

Every rank builds the single-process reference itself (same seed, all ranks' tokens) next to its
expert-parallel layer, so each worker writes both results and the assertions here compare them.
Gradients go through fairseq's real LegacyDistributedDataParallel and are multiplied by the world
size as fairseq's trainer does (sample size 1), so "same gradients" means what the optimizer sees.
"""

from __future__ import annotations

import copy
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

D, F_DIM = 8, 16
SHAPE = (3, 5)  # (B, T) tokens per rank
CASES = {
    # name: world, group size, active experts, slots, capacity factor, padding
    "drops_and_padding": dict(world=2, size=2, experts=4, slots=4, cf=1.0, padding="some"),
    "grown_slots_idle_rank": dict(world=2, size=2, experts=2, slots=4, cf=1.5, padding="rank1_all"),
    "two_groups_of_two": dict(world=4, size=2, experts=4, slots=4, cf=1.25, padding="none"),
    # the GPU kernels (batched in SwitchFFN, plain autograd for the local experts), run on CPU
    "gpu_kernels": dict(world=2, size=2, experts=4, slots=4, cf=1.0, padding="some", kernel="batched"),
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _padding(kind: str, rank: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    mask = torch.zeros(SHAPE, dtype=torch.bool)
    if kind == "some":
        mask[0, 3:] = True
        mask[2, 1:] = rank == 1
    elif kind == "rank1_all" and rank == 1:
        mask[:] = True  # a rank with nothing to send (like fairseq's dummy batch) still takes part
    return mask


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(*SHAPE, D, generator=g), torch.randn(*SHAPE, D, generator=g)


def _copy(state: dict) -> dict:
    """state_dict() values share storage with the parameters: keep a snapshot."""
    return {key: value.clone() for key, value in state.items()}


def _loss(layer, x, weight, padding):  # noqa: ANN001
    y, aux = layer(x, padding)
    return (y * weight).sum() + 0.5 * aux.balance_loss + 0.1 * aux.z_loss, y, aux


def _worker(rank: int, world: int, port: int, names: list[str], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for name in names:  # one process start for all cases of this world size (imports are slow)
        out = _run_case(rank, world, CASES[name])
        torch.save(out, os.path.join(out_dir, f"{name}-rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _run_case(rank: int, world: int, case: dict) -> dict:
    from fairseq.distributed import LegacyDistributedDataParallel

    from fairseq_alma.errors import UsageError
    from fairseq_alma.fairseq_glue.expert_parallel import (
        prepare_expert_parallel,
        register_optimizer_hooks,
    )
    from fairseq_alma.modules.expert_parallel import ExpertParallelSwitchFFN, build_switch_ffn
    from fairseq_alma.modules.switch_ffn import SwitchFFN
    from fairseq_alma.modules.switch_ffn_config import SwitchFFNConfig

    size, experts, slots = case["size"], case["experts"], case["slots"]
    kwargs = dict(capacity_factor=case["cf"], max_experts=slots, z_loss=True, expert_kernel=case.get("kernel", "auto"))
    torch.manual_seed(0)
    ref = SwitchFFN(SwitchFFNConfig(D, F_DIM, experts, **kwargs))
    torch.manual_seed(0)
    layer = build_switch_ffn(SwitchFFNConfig(D, F_DIM, experts, **kwargs), size)
    assert isinstance(layer, ExpertParallelSwitchFFN)
    out: dict = {"init_state": _copy(layer.state_dict()), "ref_init_state": _copy(ref.state_dict())}

    # single process: every rank's tokens through the reference, one summed loss
    total = 0.0
    ref_inputs = []
    for r in range(world):
        x, w = _inputs(r)
        x.requires_grad_()
        loss, y, aux = _loss(ref, x, w, _padding(case["padding"], r))
        total = total + loss
        ref_inputs.append(x)
        if r == rank:
            out["ref_y"], out["ref_balance"] = y.detach(), aux.balance_loss.detach()
            out["ref_diag"] = {k: v.clone() for k, v in aux.diagnostics.items()}
    total.backward()
    out["ref_dx"] = ref_inputs[rank].grad
    out["ref_grads"] = {n: p.grad.clone() for n, p in ref.named_parameters()}

    # expert parallel: this rank's tokens, fairseq's legacy DDP average, times world (trainer)
    ddp = LegacyDistributedDataParallel(layer, process_group=dist.group.WORLD)
    x, w = _inputs(rank)
    x.requires_grad_()
    loss, y, aux = _loss(ddp, x, w, _padding(case["padding"], rank))
    loss.backward()
    ddp.all_reduce_grads()
    for p in layer.parameters():
        p.grad.mul_(world)
    out["y"], out["balance"], out["dx"] = y.detach(), aux.balance_loss.detach(), x.grad
    out["diag"] = {k: v.clone() for k, v in aux.diagnostics.items()}
    out["grads"] = {n: p.grad.clone() for n, p in layer.named_parameters()}
    out["rank_in_group"] = layer.groups.rank

    # evaluation (no capacity limit) also matches
    layer.eval(), ref.eval()
    with torch.no_grad():
        out["eval_y"] = layer(x, None)[0]
        out["ref_eval_y"] = ref(x, None)[0]
    layer.train(), ref.train()

    # Adam on the shards: gathered moments equal the single-process optimizer's; reload slices
    opt = torch.optim.Adam(layer.parameters(), lr=0.01)
    register_optimizer_hooks(opt, [layer])
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    opt.step(), ref_opt.step()
    out["opt_state"], out["ref_opt_state"] = copy.deepcopy(opt.state_dict()), copy.deepcopy(ref_opt.state_dict())
    fresh = torch.optim.Adam(layer.parameters(), lr=0.01)
    register_optimizer_hooks(fresh, [layer])
    fresh.load_state_dict(out["opt_state"])
    out["reloaded_moments_equal"] = all(
        torch.equal(fresh.state[p]["exp_avg"], opt.state[p]["exp_avg"]) for p in layer.parameters()
    )
    out["stepped_state"], out["ref_stepped_state"] = _copy(layer.state_dict()), _copy(ref.state_dict())

    # checkpoint round trip: load another full state, save it again unchanged
    torch.manual_seed(1)
    other = SwitchFFN(SwitchFFNConfig(D, F_DIM, experts, **kwargs)).state_dict()
    layer.load_state_dict(other)
    out["other_state"], out["resaved_state"] = other, _copy(layer.state_dict())
    out["shard_after_load"] = layer.fc1_weight.detach().clone()
    torch.manual_seed(7)
    layer.reset_parameters()
    torch.manual_seed(7)
    ref.reset_parameters()
    out["reset_state"], out["ref_reset_state"] = _copy(layer.state_dict()), _copy(ref.state_dict())

    # torch DDP skips the shards through the ignore list prepare_expert_parallel writes
    model = _Chain(torch.nn.Linear(D, D), layer)
    prepare_expert_parallel(model)
    out["ignored"] = sorted(model._ddp_params_and_buffers_to_ignore)
    model.zero_grad()
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    x2 = torch.randn(*SHAPE, D, generator=torch.Generator().manual_seed(5 + rank))
    wrapped(x2).sum().backward()
    out["ddp_grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}

    try:  # a group size that does not divide the number of processes
        build_switch_ffn(SwitchFFNConfig(D, F_DIM, 2 * world), 2 * world)
        out["bad_size_error"] = None
    except UsageError as err:
        out["bad_size_error"] = err.message
    return out


class _Chain(torch.nn.Module):
    """proj -> moe, returning a plain tensor (what torch DDP wants from forward)."""

    def __init__(self, proj: torch.nn.Module, moe: torch.nn.Module) -> None:
        super().__init__()
        self.proj, self.moe = proj, moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, aux = self.moe(self.proj(x))
        return y + aux.balance_loss


def run_ranks(world: int, names: list[str], out_dir: Path, timeout: float = 240.0) -> dict[str, list[dict]]:
    """Spawn ``world`` gloo workers; fail (instead of hanging) if they do not finish in time."""
    context = mp.spawn(_worker, args=(world, _free_port(), names, str(out_dir)), nprocs=world, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"expert-parallel workers did not finish within {timeout:.0f}s (deadlock?)")
    return {n: [torch.load(out_dir / f"{n}-rank{r}.pt", weights_only=False) for r in range(world)] for n in names}


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):  # noqa: ANN001
    """world size -> {case: per-rank results}; each world's processes start once, when needed."""
    cache: dict[int, dict[str, list[dict]]] = {}

    def results(world: int) -> dict[str, list[dict]]:
        if world not in cache:
            names = [name for name, case in CASES.items() if case["world"] == world]
            cache[world] = run_ranks(world, names, tmp_path_factory.mktemp(f"world{world}"))
        return cache[world]

    return results


@pytest.fixture(
    params=[pytest.param(n, marks=[pytest.mark.slow] if CASES[n]["world"] > 2 else []) for n in sorted(CASES)]
)
def ranks(request, spawned) -> tuple[dict, list[dict]]:  # noqa: ANN001
    case = CASES[request.param]
    return case, spawned(case["world"])[request.param]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _states_close(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].shape == b[key].shape, key
        _close(a[key].float(), b[key].float())


def test_outputs_and_aux_equal_single_process(ranks):
    _, results = ranks
    for out in results:
        _close(out["y"], out["ref_y"])
        _close(out["eval_y"], out["ref_eval_y"])
        _close(out["balance"], out["ref_balance"])
        for key in ("tokens", "dropped", "unused"):
            assert out["diag"][key] == out["ref_diag"][key], key


def test_gradients_equal_single_process(ranks):
    case, results = ranks
    for out in results:
        _close(out["dx"], out["ref_dx"])  # input gradients: not scaled by the group size
        _close(out["grads"]["router.weight"], out["ref_grads"]["router.weight"])
        for name in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"):
            # the local shard's rows of the full gradient (global expert e = slot e // G of e % G)
            _close(out["grads"][name], out["ref_grads"][name][out["rank_in_group"] :: case["size"]])


def test_shared_gradients_identical_across_ranks_expert_shards_differ(ranks):
    case, results = ranks
    first, second = results[0], results[1]
    assert torch.equal(first["grads"]["router.weight"], second["grads"]["router.weight"])
    assert not torch.equal(first["grads"]["fc1_weight"], second["grads"]["fc1_weight"])
    if case["world"] > case["size"]:  # replicas of one shard end with the same gradient
        for name, grad in results[0]["grads"].items():
            assert torch.equal(grad, results[case["size"]]["grads"][name]), name


def test_initial_state_is_single_process_init(ranks):
    _, results = ranks
    for out in results:
        for key, value in out["ref_init_state"].items():
            assert torch.equal(out["init_state"][key], value), key


def test_checkpoint_round_trip_is_exact(ranks):
    case, results = ranks
    for out in results:
        for key, value in out["other_state"].items():
            assert torch.equal(out["resaved_state"][key], value), key
        assert torch.equal(out["shard_after_load"], out["other_state"]["fc1_weight"][out["rank_in_group"] :: case["size"]])
        for key, value in out["ref_reset_state"].items():  # --stage-init scratch re-init
            assert torch.equal(out["reset_state"][key], value), key


def test_optimizer_state_gathers_to_single_process_layout(ranks):
    _, results = ranks
    for out in results:
        _states_close(out["stepped_state"], out["ref_stepped_state"])
        state, ref_state = out["opt_state"]["state"], out["ref_opt_state"]["state"]
        for index, entry in ref_state.items():
            _close(state[index]["exp_avg"], entry["exp_avg"])
            _close(state[index]["exp_avg_sq"], entry["exp_avg_sq"])
        assert out["reloaded_moments_equal"]


def test_torch_ddp_ignores_expert_shards(ranks):
    case, results = ranks
    assert results[0]["ignored"] == [f"moe.{n}" for n in ("fc1_bias", "fc1_weight", "fc2_bias", "fc2_weight")]
    first, second = results[0]["ddp_grads"], results[1]["ddp_grads"]
    assert torch.equal(first["proj.weight"], second["proj.weight"])  # averaged by DDP
    assert torch.equal(first["moe.router.weight"], second["moe.router.weight"])
    assert not torch.equal(first["moe.fc1_weight"], second["moe.fc1_weight"])


def test_group_size_must_divide_process_count(ranks):
    case, results = ranks
    message = results[0]["bad_size_error"]
    assert message is not None and "--moe-expert-parallel-size" in message
    assert f"--distributed-world-size {case['world']}" in message


def test_experts_must_divide_evenly():
    from fairseq_alma.errors import UsageError
    from fairseq_alma.modules.expert_parallel import build_switch_ffn
    from fairseq_alma.modules.switch_ffn_config import SwitchFFNConfig

    with pytest.raises(UsageError, match=r"--moe-experts \(3\) must be divisible by --moe-expert-parallel-size \(2\)"):
        build_switch_ffn(SwitchFFNConfig(D, F_DIM, 3), 2)
    with pytest.raises(UsageError, match=r"--moe-expert-parallel-size must be an integer >= 1"):
        build_switch_ffn(SwitchFFNConfig(D, F_DIM, 4), 0)
    # one process holds all experts (e.g. fairseq-eval-lm on an expert-parallel checkpoint)
    layer = build_switch_ffn(SwitchFFNConfig(D, F_DIM, 4), 2)
    assert type(layer).__name__ == "SwitchFFN" and layer.fc1_weight.shape[0] == 4


def _fairseq_cfg(common: dict, distributed: dict, checkpoint: dict) -> SimpleNamespace:
    """Fresh fairseq config nodes (FairseqConfig() shares one default instance of each)."""
    from fairseq.dataclass.configs import CheckpointConfig, CommonConfig, DistributedTrainingConfig

    return SimpleNamespace(
        common=CommonConfig(**common),
        distributed_training=DistributedTrainingConfig(**distributed),
        checkpoint=CheckpointConfig(**checkpoint),
    )


@pytest.mark.parametrize(
    "common, distributed, checkpoint, needle",
    [
        ({"fp16": True}, {}, {}, "needs --memory-efficient-fp16 (or --amp) instead of plain --fp16"),
        ({"bf16": True}, {}, {}, "needs --memory-efficient-bf16 instead of plain --bf16"),
        ({}, {"ddp_backend": "fully_sharded"}, {}, "works with --ddp-backend legacy_ddp or"),
        ({}, {}, {"no_last_checkpoints": True}, "cannot be used with --no-last-checkpoints"),
    ],
)
def test_unsupported_fairseq_setups_are_one_line_errors(common, distributed, checkpoint, needle):
    from fairseq_alma.errors import UsageError
    from fairseq_alma.fairseq_glue.expert_parallel import check_training_setup

    with pytest.raises(UsageError) as error:
        check_training_setup(_fairseq_cfg(common, distributed, checkpoint))
    assert needle in error.value.message and "\n" not in error.value.message


def test_supported_fairseq_setups_pass():
    from fairseq_alma.fairseq_glue.expert_parallel import check_training_setup

    for backend in ("legacy_ddp", "pytorch_ddp"):
        check_training_setup(_fairseq_cfg({"fp16": True, "memory_efficient_fp16": True}, {"ddp_backend": backend}, {}))
        check_training_setup(_fairseq_cfg({"bf16": True, "memory_efficient_bf16": True}, {"ddp_backend": backend}, {}))


def test_scoring_commands_build_every_expert_on_every_rank(monkeypatch):
    """fairseq-eval-lm / fairseq-validate on several processes rebuilt an expert-parallel
    checkpoint sharded: a rank with one batch more waited in all_to_all forever."""
    from fairseq_alma.modules import expert_parallel
    from fairseq_alma.modules.switch_ffn import SwitchFFN
    from fairseq_alma.modules.switch_ffn_config import SwitchFFNConfig

    monkeypatch.setattr(expert_parallel, "distributed_world_size", lambda: 2)
    monkeypatch.setattr(expert_parallel, "_EXPERTS_WHOLE", [False])
    cfg = SwitchFFNConfig(embed_dim=8, ffn_dim=16, num_experts=4)
    monkeypatch.setattr(expert_parallel, "ExpertParallelSwitchFFN", lambda *a: "sharded")
    assert expert_parallel.build_switch_ffn(cfg, 2) == "sharded"  # training: shards
    expert_parallel.build_experts_whole()
    whole = expert_parallel.build_switch_ffn(cfg, 2)
    assert type(whole) is SwitchFFN and whole.num_experts == 4
