"""The GPU paths (issue: the paper's cluster path): fp16 streams, fairscale's FSDP, AMP routing.

These need a CUDA GPU and skip with the reason elsewhere (CI and the development machines have
none); run them with ``pytest -m cuda tests/test_cuda.py`` on a GPU node.
"""

from __future__ import annotations

import json

import pytest
import torch
from lm_fixtures import run, stream_cmd

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible to torch here"),
]


def gpu_cmd(stream_dir, save, *extra):
    cmd = stream_cmd(stream_dir, save, *extra)
    cmd.remove("--cpu")
    return cmd


def _records(save):
    return [json.loads(line) for line in (save / "stream.jsonl").read_text().splitlines()]


def test_fp16_stream_with_growth_on_one_gpu(stream_dir, tmp_path):
    save = tmp_path / "fp16"
    run(gpu_cmd(stream_dir, save, "--fp16", "--moe-max-experts", "4", "--grow-experts", "2"))
    records = _records(save)
    assert [r["trained"] for r in records] == [False, True, True]
    assert all("skipped_updates" in r for r in records)
    assert records[2]["eval_ppl"] < records[0]["eval_ppl"]


def test_memory_efficient_fp16_and_amp_streams(stream_dir, tmp_path):
    for flag in ("--memory-efficient-fp16", "--amp"):
        save = tmp_path / flag.strip("-")
        run(gpu_cmd(stream_dir, save, flag))
        assert len(_records(save)) == 3


def test_fully_sharded_wraps_each_block(stream_dir, tmp_path):
    """--ddp-backend fully_sharded: each decoder block is its own FSDP unit, and the stream
    trains to the end."""
    from fairseq.distributed import fsdp_enable_wrap
    from omegaconf import OmegaConf

    from fairseq_alma.models.switch_transformer_lm import SwitchTransformerDecoder, SwitchTransformerLMConfig

    save = tmp_path / "fsdp"
    run(gpu_cmd(stream_dir, save, "--ddp-backend", "fully_sharded", "--fp16"))
    assert len(_records(save)) == 3
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
    from fairseq_alma.modules import SwitchFFN, SwitchFFNConfig

    layer = SwitchFFN(SwitchFFNConfig(16, 32, 4)).cuda().eval()
    x = torch.randn(64, 16, device="cuda")
    reference = layer.router_logits(x)
    for dtype in (torch.float16, torch.bfloat16):
        with torch.autocast("cuda", dtype=dtype):
            logits = layer.router_logits(x)
        assert logits.dtype == torch.float32 and torch.equal(logits, reference)
