"""The GPU paths (issue: the paper's cluster path): SwitchFFN in fp32/fp16/AMP against a float64
reference, fp16 streams, fairscale's FSDP, AMP routing, expert parallelism over NCCL.

These need a CUDA GPU (NCCL: two) and skip with the reason elsewhere (CI and the development
machines have none); ``make gpu-check`` runs them with the other ``cuda`` tests on a GPU node.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch
from lm_fixtures import USER_DIR, assert_same_stream, run, stream_cmd, tool
from test_expert_parallel_train import train_cmd, train_losses, train_two_ranks

from fairseq_alma.modules import SwitchFFN, SwitchFFNConfig

pytestmark = pytest.mark.cuda  # conftest skips these, saying why, when torch sees no GPU
GPUS = torch.cuda.device_count()
two_gpus = pytest.mark.skipif(
    GPUS < 2, reason=f"needs 2 CUDA GPUs for expert parallelism over NCCL; {GPUS} visible"
)


def on_gpu(cmd: list[str]) -> list[str]:
    cmd.remove("--cpu")
    return cmd


def gpu_cmd(stream_dir, save, *extra):
    return on_gpu(stream_cmd(stream_dir, save, *extra))


def _records(save):
    return [json.loads(line) for line in (save / "stream.jsonl").read_text().splitlines()]


def test_fp16_stream_with_growth_on_one_gpu(stream_dir, tmp_path):
    save = tmp_path / "fp16"
    run(gpu_cmd(stream_dir, save, "--fp16", "--moe-max-experts", "4", "--grow-experts", "2"))
    records = _records(save)
    assert [r["trained"] for r in records] == [False, True, True]
    assert all("skipped_updates" in r for r in records)
    assert records[2]["eval_ppl"] < records[0]["eval_ppl"]


def _stage_checkpoint(save, stage):
    return torch.load(save / f"checkpoint_stage{stage}.pt", map_location="cpu", weights_only=False)


@pytest.mark.parametrize("flag", ["--bf16", "--memory-efficient-bf16"])
def test_bf16_stream_with_growth_scores_in_fp32(stream_dir, tmp_path, flag):
    """--bf16 trains on the GPU (bf16 model, fp32 master weights, no loss scaler; growth copies
    the Adam moments in that layout); its stage checkpoints (fairseq saves bf16 weights as
    float32) score in fp32 with alma-score and with fairseq-eval-lm, and the two agree."""
    save = tmp_path / flag.strip("-")
    log = run(gpu_cmd(stream_dir, save, flag, "--moe-max-experts", "4", "--grow-experts", "2"))
    records = _records(save)
    assert [r["trained"] for r in records] == [False, True, True]
    assert records[2]["eval_ppl"] < records[0]["eval_ppl"]
    assert "loss_scale=" not in log.stdout + log.stderr  # bf16: no loss scaler
    state = _stage_checkpoint(save, 2)
    assert state["cfg"]["common"]["bf16"] and not state["cfg"]["common"]["tpu"]
    assert int(state["model"]["decoder.layers.1.ffn.num_active"]) == 4  # grown 2 -> 4
    run([tool("alma-score"), str(save), "--json", str(tmp_path / "score.json")])
    scored = json.loads((tmp_path / "score.json").read_text())["series"][0]["arrivals"][-1]["ppl"]
    evaluated = run([tool("fairseq-eval-lm"), str(stream_dir), "--user-dir", USER_DIR, "--path",
                     str(save / "checkpoint_stage2.pt"), "--gen-subset", "eval", "--tokens-per-sample", "32",
                     "--batch-size", "8"])
    stock = float(re.search(r"Perplexity: ([0-9.]+)", evaluated.stdout + evaluated.stderr).group(1))
    assert scored == pytest.approx(stock, rel=0.005)
    assert scored == pytest.approx(records[2]["eval_ppl"], rel=0.02)  # fp32 scoring of bf16 weights


@pytest.mark.parametrize("flag", ["--fp16", "--bf16"])
def test_fp16_and_bf16_streams_stopped_after_a_stage_resume_to_the_uninterrupted_run(
        stream_dir, tmp_path, monkeypatch, flag):
    """FP16Optimizer's fp32 master weights (and loss scaler) are checkpointed and restored
    (fairseq_glue/fp16_master.py): a stream stopped with ALMA_STOP_AFTER_STAGE=1 and run again
    equals the uninterrupted one bit for bit, records and stage checkpoints, growth included
    (it copies master rows: lm/growth.py)."""
    cmd = ("--moe-max-experts", "4", "--grow-experts", "2", flag)
    run(gpu_cmd(stream_dir, tmp_path / "whole", *cmd))
    monkeypatch.setenv("ALMA_STOP_AFTER_STAGE", "1")
    run(gpu_cmd(stream_dir, tmp_path / "resumed", *cmd))
    assert not (tmp_path / "resumed" / "checkpoint_stage2.pt").exists()
    monkeypatch.delenv("ALMA_STOP_AFTER_STAGE")
    run(gpu_cmd(stream_dir, tmp_path / "resumed", *cmd))
    assert_same_stream(tmp_path / "resumed", tmp_path / "whole")


def test_bf16_and_fsdp_is_refused(stream_dir, tmp_path):
    proc = run(gpu_cmd(stream_dir, tmp_path / "r", "--bf16", "--ddp-backend", "fully_sharded"), check=False)
    assert proc.returncode == 2 and "--bf16 with --ddp-backend fully_sharded" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_memory_efficient_fp16_and_amp_streams(stream_dir, tmp_path):
    for flag in ("--memory-efficient-fp16", "--amp"):
        save = tmp_path / flag.strip("-")
        run(gpu_cmd(stream_dir, save, flag))
        assert len(_records(save)) == 3


def test_fully_sharded_is_refused_for_a_stream_and_on_one_gpu(stream_dir, tiny_lm_bin, tmp_path):
    """--ddp-backend fully_sharded: an alma_stream run is refused in one line (its evaluation,
    counts and growth read the model outside FSDP's flattened shards), and so is any run on one
    GPU (fairscale 0.4.13 cannot save a one-process FSDP run's optimizer state: seen on an H100,
    AttributeError in gather_full_optim_state_dict); each decoder block is its own FSDP unit
    for the multi-GPU runs FSDP is for."""
    from fairseq.distributed import fsdp_enable_wrap
    from omegaconf import OmegaConf

    from fairseq_alma.models.switch_transformer_lm import (
        SwitchTransformerDecoder,
        SwitchTransformerLMConfig,
    )

    refused = run(gpu_cmd(stream_dir, tmp_path / "stream", "--ddp-backend", "fully_sharded", "--fp16"), check=False)
    assert refused.returncode == 2 and "cannot train an alma_stream run" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "stream").exists()
    if GPUS == 1:
        one = run(on_gpu(train_cmd(tiny_lm_bin, tmp_path / "lm", 4, "--ddp-backend", "fully_sharded", "--fp16")),
                  check=False)
        assert one.returncode == 2 and "--ddp-backend fully_sharded on one GPU" in one.stderr
        assert "Traceback" not in one.stderr and not (tmp_path / "lm").exists()
    import torch.distributed as dist
    from fairscale.nn.data_parallel import FullyShardedDataParallel
    from fairseq.data import Dictionary

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", world_size=1, rank=0)
    cfg = OmegaConf.structured(SwitchTransformerLMConfig(tokens_per_sample=32, decoder_layers=2,
                                                         decoder_embed_dim=64, decoder_ffn_embed_dim=128,
                                                         decoder_attention_heads=4, moe_experts=2))
    dictionary = Dictionary()
    distributed = OmegaConf.create({"cpu_offload": False, "no_reshard_after_forward": False,
                                    "fp32_reduce_scatter": False, "memory_efficient_fp16": False,
                                    "fp16": True, "not_fsdp_flatten_parameters": False,
                                    "distributed_world_size": 1})
    with fsdp_enable_wrap(distributed):
        decoder = SwitchTransformerDecoder(cfg, dictionary)
    assert all(isinstance(layer, FullyShardedDataParallel) for layer in decoder.layers)


def test_router_logits_float32_under_cuda_autocast():
    layer = SwitchFFN(SwitchFFNConfig(16, 32, 4)).cuda().eval()
    x = torch.randn(64, 16, device="cuda")
    reference = layer.router_logits(x)
    for dtype in (torch.float16, torch.bfloat16):
        with torch.autocast("cuda", dtype=dtype):
            logits = layer.router_logits(x)
        assert logits.dtype == torch.float32 and torch.equal(logits, reference)


# ---- SwitchFFN on the GPU against a float64 CPU reference ------------------------------------
# name: (dtype of the layer and its input, autocast dtype or None, bound on the relative error)
PRECISIONS = {
    "fp32": (torch.float32, None, 1e-5),
    "fp16": (torch.float16, None, 1e-2),  # --fp16: model.half()
    "amp": (torch.float32, torch.float16, 1e-2),  # --amp: torch.autocast
    "bf16": (torch.bfloat16, None, 4e-2),  # --bf16: model.bfloat16() (8 mantissa bits)
}


def _forward_backward(layer: SwitchFFN, x: torch.Tensor, padding: torch.Tensor,
                      weight: torch.Tensor, autocast: torch.dtype | None) -> tuple[dict, dict]:
    x = x.clone().requires_grad_()
    enabled = autocast is not None
    with torch.autocast(x.device.type, dtype=autocast or torch.float16, enabled=enabled):
        y, aux = layer(x, padding)
    loss = (y.to(weight.dtype) * weight).sum() + aux.balance_loss + 0.1 * aux.z_loss
    loss.backward()
    results = {"y": y.detach(), "balance": aux.balance_loss.detach(), "z": aux.z_loss.detach(),
               "dx": x.grad}
    results.update({name: p.grad for name, p in layer.named_parameters()})
    routing = {"counts": aux.counts.cpu(), "dropped": aux.diagnostics["dropped"].cpu()}
    if aux.expert_ids is not None:
        routing["expert_ids"] = aux.expert_ids.cpu()
    return results, routing


def relative_errors_against_float64(precision: str, device: str, kernel: str = "auto") -> dict[str, float]:
    """Training mode, capacity factor 1.0 (tokens dropped) and padding. The reference gets the
    very values the tested layer holds (fp16-rounded under --fp16) and its experts run in float64
    (its router, like every SwitchFFN router, in float32), so both route every token to the same
    expert and only the experts' arithmetic precision differs.  The compiled kernel does not
    record expert ids (that is growth's eager path): its routing is compared by counts and drops."""
    dtype, autocast, _ = PRECISIONS[precision]
    torch.manual_seed(0)
    cfg = SwitchFFNConfig(32, 64, 4, capacity_factor=1.0, z_loss=True)
    layer = SwitchFFN(dataclasses.replace(cfg, expert_kernel=kernel)).to(device, dtype).train()
    x = torch.randn(4, 16, 32).to(dtype)
    padding = torch.zeros(4, 16, dtype=torch.bool)
    padding[1, 10:] = True
    weight = torch.randn(4, 16, 32, dtype=torch.float64)
    reference = SwitchFFN(cfg).double().train()
    reference.load_state_dict({k: v.cpu().double() if v.is_floating_point() else v.cpu()
                               for k, v in layer.state_dict().items()})
    layer.record_expert_ids = reference.record_expert_ids = kernel != "compiled"

    got, got_routing = _forward_backward(layer, x.to(device), padding.to(device),
                                         weight.to(device).float(), autocast)
    want, want_routing = _forward_backward(reference, x.double(), padding, weight, None)
    assert got_routing.keys() == want_routing.keys()
    assert all(torch.equal(got_routing[key], want_routing[key]) for key in want_routing)
    assert torch.equal(got_routing["dropped"], want_routing["dropped"])
    assert want_routing["dropped"] > 0
    assert not got["dx"][1, 10:].any() and not want["dx"][1, 10:].any()  # padding: no gradient
    assert all(p.grad.dtype == dtype for p in layer.parameters())
    return {name: ((got[name].cpu().double() - want[name]).norm() / want[name].norm()).item()
            for name in want}


@pytest.mark.parametrize("kernel", ["auto", "compiled"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_switch_ffn_forward_and_backward_match_a_float64_cpu_reference(precision, kernel):
    errors = relative_errors_against_float64(precision, "cuda", kernel)
    bound = PRECISIONS[precision][2]
    assert all(math.isfinite(e) and e < bound for e in errors.values()), errors


# ---- expert parallelism over NCCL: one process per GPU ---------------------------------------
@two_gpus
def test_expert_parallel_over_nccl_trains_like_one_gpu_holding_all_experts(tiny_lm_bin, tmp_path):
    """The CPU test's comparison (test_expert_parallel_train.py) with NCCL all_to_all on two
    GPUs: one GPU with --update-freq 2 sees the same two batches per update as the two ranks."""
    reference = run(on_gpu(train_cmd(tiny_lm_bin, tmp_path / "one", 4, "--update-freq", "2")))
    sharded = train_two_ranks(tiny_lm_bin, tmp_path / "two", 4, gpus=True)
    expected = train_losses(reference.stdout + reference.stderr)
    assert len(expected) == 4 and train_losses(sharded[0]) == pytest.approx(expected, abs=1e-3)


@two_gpus
def test_expert_parallel_over_nccl_with_fp16_and_torch_ddp(tiny_lm_bin, tmp_path):
    """The cluster setting: --memory-efficient-fp16 (plain --fp16 is refused with expert
    parallelism) and torch DDP, which skips the expert shards."""
    logs = train_two_ranks(tiny_lm_bin, tmp_path / "fp16", 4, "--memory-efficient-fp16",
                           "--ddp-backend", "pytorch_ddp", gpus=True)
    losses = train_losses(logs[0])
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses), logs[0][-2000:]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_causal_attention_without_masks_on_the_gpu(monkeypatch, dtype):
    """The decoder's mask-free causal attention (FlashAttention on the GPU) against fairseq's
    masked attention: the same outputs at every real position of a right-padded batch."""
    from test_switch_lm import build

    torch.manual_seed(0)
    model = build("switch_transformer_lm_tiny", 60, moe_experts=4, dropout=0.0).cuda().to(dtype).eval()
    tokens = torch.randint(4, 60, (3, 16), device="cuda")
    tokens[1, 11:] = model.decoder.padding_idx
    real = tokens.ne(model.decoder.padding_idx)
    with torch.no_grad():
        model.train()  # the training path: checked on the device, no host read
        fast = model(tokens)[0][real].float()
        monkeypatch.setattr(type(model.decoder), "attention_needs_no_mask", lambda self, mask: False)
        masked = model(tokens)[0][real].float()
    assert ((fast - masked).norm() / masked.norm()).item() < 2e-2
