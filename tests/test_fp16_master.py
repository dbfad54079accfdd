"""--fp16/--bf16 (fairseq's FP16Optimizer) keep their fp32 master weights across a resume and a
growth step (fairseq_glue/fp16_master.py, lm/growth.py): on the CPU, with a half-precision model,
through fairseq's own optimizer classes (the GPU stream test is in test_cuda.py)."""

import inspect
import io
from unittest import mock

import pytest
import torch
from torch import nn

from fairseq_alma.errors import CheckpointError
from fairseq_alma.fairseq_glue.fp16_master import install_fp16_master_in_checkpoints, master_tensors
from fairseq_alma.lm import growth
from fairseq_alma.lm.stage_start import master_param_like
from fairseq_alma.modules import SwitchFFN, SwitchFFNConfig

LAYOUTS = {  # id: (model dtype, flat master copy)
    "fp16-flat": (torch.float16, True),
    "fp16-no-flatten": (torch.float16, False),
    "bf16": (torch.bfloat16, False),  # fairseq's own --bf16 layout
    "bf16-flat": (torch.bfloat16, True),  # patches.install_flat_bf16_master's layout on GPUs
}


def _cfg(bf16: bool, flatten: bool, memory_efficient: bool = False):
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "common": {"fp16_no_flatten_grads": not flatten, "bf16": bf16, "fp16_init_scale": 4,
                   "fp16_scale_window": 2, "fp16_scale_tolerance": 0.0, "min_loss_scale": 1e-4,
                   "threshold_loss_scale": None, "memory_efficient_bf16": False,
                   "memory_efficient_fp16": memory_efficient, "model_parallel_size": 1, "amp": False},
        "distributed_training": {"distributed_world_size": 1},
        "optimization": {"update_freq": [1]},
        "optimizer": {"_name": "adam", "lr": [3e-3], "adam_betas": "(0.9, 0.999)", "adam_eps": 1e-8,
                      "weight_decay": 0.0, "use_old_adam": False, "fp16_adam_stats": False, "tpu": False},
    })


def build_optimizer(model: nn.Module, layout: str, memory_efficient: bool = False):
    """What fairseq's Trainer builds for --fp16/--bf16 (--memory-efficient-fp16), on the CPU:
    ``torch.cuda.current_device()`` (the flat copy's device key) is the one call replaced."""
    from fairseq import optim
    from fairseq.optim.fp16_optimizer import FP16Optimizer, MemoryEfficientFP16Optimizer

    install_fp16_master_in_checkpoints()
    dtype, flatten = LAYOUTS[layout]
    cfg = _cfg(dtype == torch.bfloat16, flatten, memory_efficient)
    params = [p for p in model.parameters() if p.requires_grad]
    with mock.patch("torch.cuda.current_device", lambda: None):  # CPU tensors: device.index None
        if memory_efficient:
            return MemoryEfficientFP16Optimizer.build_optimizer(cfg, params)
        if dtype == torch.bfloat16 and flatten:  # fairseq itself gives bf16 per-parameter copies
            fp32 = FP16Optimizer.build_fp32_params(cfg.optimizer, params, flatten=True)
            return FP16Optimizer(cfg, params, optim.build_optimizer(cfg.optimizer, [fp32]), fp32)
        return FP16Optimizer.build_optimizer(cfg, params)


def train_steps(model: nn.Module, optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        optimizer.zero_grad()
        x = torch.randn(16, 8, generator=generator).to(dtype)
        out = model(x)
        out = out[0] if isinstance(out, tuple) else out
        optimizer.backward(out.float().pow(2).mean())
        optimizer.clip_grad_norm(0.0)
        optimizer.step()


def checkpointed(state: dict) -> dict:
    """The optimizer state as a checkpoint file holds it (torch.save and back)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def masters(optimizer) -> list[torch.Tensor]:
    return [t.detach().clone() for t in master_tensors(optimizer)]


def tiny_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).to(dtype)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_resumed_optimizer_has_the_fp32_master_weights_it_saved(layout):
    """Trainer.load_checkpoint rebuilds the optimizer from the loaded half-precision model and
    then loads its state: the master copy must be the saved one, not the model's rounding (which
    fairseq's own state_dict left it at), and training on from there equals training on."""
    model = tiny_model(LAYOUTS[layout][0])
    optimizer = build_optimizer(model, layout)
    train_steps(model, optimizer, steps=5, seed=1)
    saved, before = checkpointed(optimizer.state_dict()), masters(optimizer)
    rounded = [p.detach().float().reshape(-1) for p in model.parameters()]
    assert not torch.equal(torch.cat([m.reshape(-1) for m in before]), torch.cat(rounded))  # low bits exist

    resumed_model = tiny_model(LAYOUTS[layout][0])
    resumed_model.load_state_dict(model.state_dict())
    resumed = build_optimizer(resumed_model, layout)  # "rebuild optimizer after loading model"
    resumed.load_state_dict(saved, None)
    assert all(torch.equal(a, b) for a, b in zip(masters(resumed), before))
    if optimizer.scaler is not None:
        assert resumed.scaler.loss_scale == optimizer.scaler.loss_scale
        assert resumed.scaler._iter == optimizer.scaler._iter == 5

    train_steps(model, optimizer, steps=3, seed=2)
    train_steps(resumed_model, resumed, steps=3, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), resumed_model.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(masters(resumed), masters(optimizer)))


def test_a_checkpoint_without_the_master_copy_resumes_as_before():
    """A checkpoint written before the patch: the master copy is rebuilt from the model."""
    model = tiny_model(torch.float16)
    optimizer = build_optimizer(model, "fp16-flat")
    train_steps(model, optimizer, steps=3, seed=1)
    old = {key: value for key, value in checkpointed(optimizer.state_dict()).items()
           if key not in ("fp32_params", "loss_scaler")}
    resumed = build_optimizer(model, "fp16-flat")
    resumed.load_state_dict(old, None)
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    assert torch.equal(master_tensors(resumed)[0], flat)
    assert resumed.scaler.loss_scale == optimizer.scaler.loss_scale


def test_a_master_copy_of_another_layout_is_refused_before_anything_loads():
    model = tiny_model(torch.float16)
    optimizer = build_optimizer(model, "fp16-flat")
    train_steps(model, optimizer, steps=2, seed=1)
    saved = checkpointed(optimizer.state_dict())
    other = build_optimizer(model, "fp16-no-flatten")
    before = masters(other)
    with pytest.raises(CheckpointError, match="fp32 master weights .* do not fit"):
        other.load_state_dict(saved, None)
    assert all(torch.equal(a, b) for a, b in zip(masters(other), before))
    assert not other.fp32_optimizer.optimizer.state


def test_memory_efficient_fp16_resumes_its_loss_scaler_counters():
    """No master copy there, but the same loss scaler: its growth window continues where it was."""
    model = tiny_model(torch.float16)
    optimizer = build_optimizer(model, "fp16-flat", memory_efficient=True)
    train_steps(model, optimizer, steps=3, seed=1)
    saved = checkpointed(optimizer.state_dict())
    assert "fp32_params" not in saved
    resumed = build_optimizer(model, "fp16-flat", memory_efficient=True)
    resumed.load_state_dict(saved, None)
    assert resumed.scaler._iter == 3 and resumed.scaler.loss_scale == optimizer.scaler.loss_scale


def test_fairseq_loads_the_optimizer_state_after_rebuilding_the_optimizer():
    """The patch restores the master copy in load_state_dict: fairseq must call it after
    ``_build_optimizer`` (which makes the copy from the loaded model), as fairseq 0.12 does."""
    from fairseq.trainer import Trainer

    source = inspect.getsource(Trainer.load_checkpoint)
    rebuild = source.index("self._build_optimizer()")
    assert rebuild < source.index("self.optimizer.load_state_dict(last_optim_state, optimizer_overrides)")


class TinyMoE(nn.Module):
    """A Switch layer after a shared layer: growth must leave the shared weights' master alone."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.switch = SwitchFFN(SwitchFFNConfig(8, 16, 2, max_experts=4, capacity_factor=2.0))

    def moe_layers(self) -> list:
        return [self.switch]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.switch(self.shared(x))[0]


@pytest.mark.parametrize("layout", ["fp16-flat", "fp16-no-flatten", "bf16"])
def test_growth_copies_master_rows_and_keeps_every_other_master_weight(layout, monkeypatch):
    """grow_experts copies the chosen experts' fp32 master rows into the new slots (as it copies
    their Adam moments) and changes nothing else in the master copy; it used to overwrite all
    of it with the half-precision model, dropping every weight's low bits at each growth."""
    torch.manual_seed(0)
    model = TinyMoE().to(LAYOUTS[layout][0])
    optimizer = build_optimizer(model, layout)
    train_steps(model, optimizer, steps=4, seed=1)
    before = {name: master_param_like(optimizer, p).clone() for name, p in model.named_parameters()}
    losses = [torch.tensor([1.0, 3.0])]  # expert 1 has the larger loss: it is copied to slot 2
    monkeypatch.setattr(growth, "expert_validation_losses", lambda *args: (losses, 1.0))
    info = growth.grow_experts(model, None, None, k=1, batch_size=8, optimizer=optimizer)
    assert info["copied"] == {0: [1]} and model.switch.num_experts == 3

    for name, param in model.named_parameters():
        master = master_param_like(optimizer, param)
        assert torch.equal(master.to(param.dtype), param.detach()), name  # the model is its rounding
        if name.startswith("shared."):
            assert torch.equal(master, before[name]), name
        elif name.split(".")[-1] in growth.EXPERT_PARAMS:
            assert torch.equal(master[2], before[name][1]) and torch.equal(master[:2], before[name][:2]), name
        else:  # the router: rows 1 and 2 are the source row -/+ the tie-break
            assert torch.allclose(master[1] + master[2], 2 * before[name][1], atol=1e-6)
            assert torch.equal(master[0], before[name][0]) and not torch.equal(master[1], before[name][1])


def test_amp_resumes_its_grad_scaler():
    """fairseq's AMPOptimizer saved none of its GradScaler: a resumed --amp run started again at
    --amp-init-scale.  fairseq builds torch.cuda.amp's scaler (disabled without CUDA), so the
    test gives it torch's CPU scaler, enabled, and moves its scale as overflows would."""
    from fairseq import optim
    from fairseq.optim.amp_optimizer import AMPOptimizer

    install_fp16_master_in_checkpoints()

    def build() -> AMPOptimizer:
        model = tiny_model(torch.float32)
        optimizer = AMPOptimizer.__new__(AMPOptimizer)
        optimizer.fp32_optimizer = optim.build_optimizer(_cfg(False, True).optimizer, list(model.parameters()))
        optimizer._grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 7, growth_interval=3)
        return optimizer

    optimizer = build()
    optimizer._grad_scaler.scale(torch.tensor(1.0))  # the scaler's state starts at its first use
    optimizer._grad_scaler.update(new_scale=48.0)  # where overflows and growth left it
    optimizer._grad_scaler._growth_tracker.fill_(2)
    saved = checkpointed(optimizer.state_dict())
    resumed = build()
    resumed.load_state_dict(saved, None)
    assert resumed._grad_scaler.get_scale() == 48.0
    assert resumed._grad_scaler.state_dict()["_growth_tracker"] == 2
