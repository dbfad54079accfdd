"""Speed of the vision stream's training loop (issue 4, "Speed"), measured in one run.

1. Examples/s of ``stage_trainer.train_stage`` (the loop every ALMA stage runs: shuffling,
   mini-batches, best-validation selection, FLOP accounting) against a bare PyTorch loop training
   the same model on the same tensors with the same optimizer.  Target: >= 0.8x.
2. Wall time of Ens (N = 5 members trained together as one stacked module) and UMix over SM for
   the MLP of width 32 (MNIST shape, AdaDelta) and the VGG with c = 8 (CIFAR shape, SGD, crop +
   flip augmentation).  Target: <= 2.0x.

Inputs are random tensors with MNIST/CIFAR shapes: speed does not depend on pixel values, and
nothing is downloaded.  Each timing is the best of ``--repeats`` runs, interleaved, after a
warm-up; ``--threads 1`` (default) keeps numbers stable on machines shared with other jobs.
``--device cuda`` runs both loops on the GPU with the data already there (as the runner does),
``--amp`` under autocast; the defaults (cpu, off) give the numbers in the README.

    python benchmarks/vision_stream.py [--threads 1] [--repeats 3] [--device cpu] [--amp off]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fairseq_alma.text_table import format_table
from fairseq_alma.vision.augment import random_crop_flip
from fairseq_alma.vision.devices import AMP_MODES, autocast, optimizer_step
from fairseq_alma.vision.learner_builder import build_learner
from fairseq_alma.vision.learners import LearnerSpec
from fairseq_alma.vision.stage_trainer import OptimizerSpec, StageTrainConfig, train_stage

MNIST_SHAPE = (1, 28, 28)
CIFAR_SHAPE = (3, 32, 32)


def best_of(
    repeats: int, runs: dict[str, Callable[[], None]], device: torch.device
) -> dict[str, float]:
    """Best wall time of each run, interleaving them so load changes hit all alike."""
    for run in runs.values():  # warm-up (first-call allocations, oneDNN primitive caches)
        run()
    best = {name: float("inf") for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            if device.type == "cuda":  # the GPU's queue is part of the run
                torch.cuda.synchronize()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def tensors(
    shape: tuple[int, ...], n: int, seed: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    valid = max(1, n // 9)  # a mega-batch keeps 10%: 9 training examples per validation one
    data = (
        torch.randn(n, *shape, generator=g),
        torch.randint(0, 10, (n,), generator=g),
        torch.randn(valid, *shape, generator=g),
        torch.randint(0, 10, (valid,), generator=g),
    )
    return tuple(t.to(device) for t in data)


def stream_run(
    spec: LearnerSpec, shape, data, config: StageTrainConfig, device: torch.device
) -> Callable[[], None]:
    def run() -> None:
        learner = build_learner(spec, shape, 10).to(device)
        train_stage(learner, *data, config, seed=0)

    return run


def bare_run(
    spec: LearnerSpec, shape, data, config: StageTrainConfig, device: torch.device
) -> Callable[[], None]:
    """The same model, optimizer, augmentation and precision in the plainest loop: shuffle,
    slice, step."""
    x, y = data[0], data[1]

    def run() -> None:
        model = build_learner(spec, shape, 10).to(device).trainable()
        optimizer = config.optimizer.build(list(model.parameters()))
        scaler = torch.amp.GradScaler(device.type) if config.amp == "fp16" else None
        cast = autocast(config.amp, device)  # a no-op context for off
        generator = torch.Generator().manual_seed(0)
        for _ in range(config.epochs):
            order = torch.randperm(x.shape[0], generator=generator).to(device)
            for start in range(0, x.shape[0], config.batch_size):
                index = order[start : start + config.batch_size]
                xb = random_crop_flip(x[index], generator) if config.augment else x[index]
                with cast:
                    logits = model(xb)[0]
                loss = F.cross_entropy(logits.float(), y[index])
                optimizer_step(loss, optimizer, scaler)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per setting; the best counts"
    )
    parser.add_argument(
        "--mlp-examples", type=int, default=12800, help="training examples, MLP runs"
    )
    parser.add_argument(
        "--vgg-examples", type=int, default=1280, help="training examples, VGG runs"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="default cpu")
    parser.add_argument("--amp", choices=AMP_MODES, default="off", help="autocast (default off)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch here; use --device cpu")
    if args.amp == "fp16" and device.type != "cuda":
        parser.error("--amp fp16 needs --device cuda; use bf16 or off on CPU")
    if args.threads < 1 or args.repeats < 1 or args.mlp_examples < 128 or args.vgg_examples < 128:
        parser.error("--threads and --repeats must be >= 1, example counts >= 128")
    torch.set_num_threads(args.threads)

    settings = [
        (
            "mlp",
            32,
            MNIST_SHAPE,
            args.mlp_examples,
            StageTrainConfig(epochs=2, optimizer=OptimizerSpec.paper_mnist()),
        ),
        (
            "vgg",
            8,
            CIFAR_SHAPE,
            args.vgg_examples,
            StageTrainConfig(epochs=1, optimizer=OptimizerSpec.paper_cifar(), augment=True),
        ),
    ]
    rows = []
    for arch, width, shape, n, config in settings:
        config = dataclasses.replace(config, amp=args.amp)
        data = tensors(shape, n, seed=0, device=device)
        sm = LearnerSpec("sm", arch, width)
        print(
            f"timing {arch} width {width} on {n} examples x {config.epochs} epoch(s) ...",
            flush=True,
        )
        ens = LearnerSpec("ens", arch, width, members=5)
        umix = LearnerSpec("umix", arch, width, members=5)
        times = best_of(
            args.repeats,
            {
                "bare": bare_run(sm, shape, data, config, device),
                "stream": stream_run(sm, shape, data, config, device),
                "ens": stream_run(ens, shape, data, config, device),
                "umix": stream_run(umix, shape, data, config, device),
            },
            device,
        )
        examples = n * config.epochs
        rows.append((arch, width, examples / times["bare"], examples / times["stream"], times))

    print(
        f"\nthreads={args.threads}, device={args.device}, amp={args.amp}, "
        f"best of {args.repeats}\n"
    )
    header = ["model", "bare ex/s", "stream ex/s", "stream/bare", "SM s", "Ens s", "Ens/SM",
              "UMix s", "UMix/SM"]
    table = [[arch + str(width), f"{bare:.0f}", f"{stream:.0f}", f"{stream / bare:.2f}x",
              f"{times['stream']:.2f}", f"{times['ens']:.2f}", f"{times['ens'] / times['stream']:.2f}x",
              f"{times['umix']:.2f}", f"{times['umix'] / times['stream']:.2f}x"]
             for arch, width, bare, stream, times in rows]
    print(format_table(header, table), end="")
    print("\ntargets: stream/bare >= 0.80x; Ens/SM <= 2.00x (MLP h=32 and VGG c=8)")


if __name__ == "__main__":
    main()
