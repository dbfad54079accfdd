"""alma_stream task, first slice of issue #3: stages, fixed budget, LR restarts, per-arrival records,
stage checkpoints loadable by fairseq-eval-lm, one-line errors for bad stream flags."""

import json
import re
import shutil
from pathlib import Path

import pytest
from lm_fixtures import RESUMABLE, assert_same_stream, run, stream_cmd, tool, wait_for

from fairseq_alma.optim.alma_stage_linear import stage_budget, stage_lr
from fairseq_alma.stream.transformer_flops import SwitchLMShape

REPO = Path(__file__).resolve().parent.parent
USER_DIR = str(REPO / "fairseq_alma")


def test_stage_lr_restarts_every_stage():
    budget, warmup, peak = 10, 2, 1.0
    lrs = [stage_lr(u % budget, budget, warmup, peak) for u in range(2 * budget)]
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0)
    assert lrs[9] == pytest.approx(1 / 8)  # last update of the stage, one step above 0
    assert lrs[10:] == lrs[:10]  # the next stage restarts with warmup
    assert stage_budget(100, 3, True) == 300 and stage_budget(100, 3, False) == 100


@pytest.mark.slow
def test_stream_records_and_stage_checkpoints(stream_dir, reference_run):
    save, out = reference_run
    records = [json.loads(line) for line in (save / "stream.jsonl").read_text().splitlines()]
    assert [r["arrival"] for r in records] == [0, 1, 2]
    assert [r["trained"] for r in records] == [False, True, True]
    assert [r["stage"] for r in records] == [0, 1, 2]
    assert records[0]["train_flops_cum"] == 0 < records[1]["train_flops_cum"] < records[2]["train_flops_cum"]
    assert records[2]["eval_ppl"] < records[0]["eval_ppl"]
    # wall_time: seconds this run has trained so far (fairseq's wall meter), not a clock reading
    assert 0 <= records[0]["wall_time"] <= records[1]["wall_time"] <= records[2]["wall_time"] < 3600
    # exactly the budget per stage: 2 stages x 6 updates
    assert re.search(r"num_updates 12\b", out)
    for stage in (1, 2):
        ckpt = save / f"checkpoint_stage{stage}.pt"
        assert ckpt.exists()
    ev = run([tool("fairseq-eval-lm"), str(stream_dir), "--user-dir", USER_DIR, "--path", str(save / "checkpoint_stage2.pt"),
              "--gen-subset", "eval", "--tokens-per-sample", "32", "--batch-size", "8", "--cpu", "--num-workers", "0"])
    ppl = float(re.search(r"Perplexity: ([0-9.]+)", ev.stdout + ev.stderr).group(1))
    assert ppl == pytest.approx(records[2]["eval_ppl"], rel=0.005)


@pytest.mark.parametrize("flags, needle", [(["--wait", "3"], "--wait must be in [1, 2]"),
                                           (["--updates-per-stage", "0"], "--updates-per-stage must be >= 1")])
def test_bad_stream_flags(stream_dir, tmp_path, flags, needle):
    proc = run(stream_cmd(stream_dir, tmp_path / "bad", *flags), check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fairseq-alma: error:")]
    assert proc.returncode != 0 and len(errors) == 1 and needle in errors[0], proc.stderr[-1500:]


def test_missing_shard_is_named(stream_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(stream_dir, broken)
    (broken / "megabatch1.bin").unlink()
    proc = run(stream_cmd(broken, tmp_path / "bad"), check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fairseq-alma: error:")]
    assert proc.returncode != 0 and len(errors) == 1 and "megabatch1.bin" in errors[0], proc.stderr[-1500:]


# kill -9 and SIGTERM at six points: tests/test_resume_points.py


@pytest.mark.slow
def test_sigusr1_saves_then_resumes(stream_dir, reference_run, tmp_path):
    """The Slurm requeue contract: SIGUSR1 -> save checkpoint_last.pt only, no validation, exit
    with the requeue status and one line saying so; the same command continues."""
    import os
    import signal
    import subprocess

    import torch

    save = tmp_path / "run"
    cmd = stream_cmd(stream_dir, save, "--save-interval-updates", "100")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    wait_for(save / "checkpoint_stage1.pt", proc)
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=600)
    from fairseq_alma.errors import REQUEUE_EXIT_STATUS

    assert proc.returncode == REQUEUE_EXIT_STATUS, out[-2000:]
    after = out[out.index("received SIGUSR1"):]
    assert re.search(r"fairseq-alma: preempted at update \d+, checkpoint saved", after), after
    assert "begin validation" not in after and "checkpoint_best" not in after, after
    state = torch.load(save / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    assert 6 < state["optimizer_history"][-1]["num_updates"] < 12  # saved inside stage 2
    run(cmd)
    assert_same_stream(save, reference_run[0])


def test_ctrl_c_is_one_line_then_the_same_command_resumes(stream_dir, reference_run, tmp_path):
    """Ctrl-C (SIGINT) inside stage 2: one line saying how to continue, the shell's status 130,
    no traceback; the same command then gives the uninterrupted stream."""
    import os
    import signal
    import subprocess

    from fairseq_alma.console import INTERRUPTED_EXIT_STATUS

    save = tmp_path / "run"
    cmd = stream_cmd(stream_dir, save, "--save-interval-updates", "100")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    log = tmp_path / "log.txt"
    with open(log, "w") as out:  # SIGINT's default action even if this process ignores it
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        wait_for(save / "checkpoint_stage1.pt", proc)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=600)
    text = log.read_text()
    assert proc.returncode == INTERRUPTED_EXIT_STATUS, text[-2000:]
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("fairseq-alma: ")]
    assert lines == ["fairseq-alma: interrupted; run the same command again to continue"], text[-2000:]
    run(cmd)
    assert_same_stream(save, reference_run[0])


@pytest.mark.slow
def test_restart_stream_moves_a_finished_run_aside_once_then_its_requeue_continues(
        stream_dir, reference_run, tmp_path):
    """--restart-stream trains a finished run again; the same command after a stop (a requeue,
    or "run the same command to continue") continues that new run. It moved the new run's own
    progress aside too, and started it from update 0 at every preemption."""
    import os

    save = tmp_path / "run"
    shutil.copytree(reference_run[0], save)
    cmd = stream_cmd(stream_dir, save, *RESUMABLE, "--restart-stream")
    os.environ["ALMA_STOP_AFTER_STAGE"] = "1"
    try:
        run(cmd)
    finally:
        del os.environ["ALMA_STOP_AFTER_STAGE"]
    assert len(list(save.glob("replaced-*"))) == 1 and not (save / "checkpoint_stage2.pt").exists()
    proc = run(cmd)
    assert "holds this run, unfinished: continuing it" in proc.stdout + proc.stderr
    assert len(list(save.glob("replaced-*"))) == 1
    assert_same_stream(save, reference_run[0])


@pytest.mark.slow
def test_stop_after_stage_env_then_continue_under_another_expert_kernel(stream_dir, reference_run, tmp_path):
    """ALMA_STOP_AFTER_STAGE=1, then the command again with ``--moe-expert-kernel segments``.
    The expert kernel says how a run computes, not what (run_dir.EXECUTION_SETTINGS), so the run
    continues (as after moving to a GPU, or off the compiled kernel): run.json and every
    checkpoint's run hash stay the run's (alma-score checks them).  segments is what auto runs
    on CPU, so the stream is the uninterrupted one bit for bit."""
    import os

    import torch

    from fairseq_alma.stream.run_view import RunView

    save = tmp_path / "run"
    cmd = stream_cmd(stream_dir, save, *RESUMABLE)
    os.environ["ALMA_STOP_AFTER_STAGE"] = "1"
    try:
        run(cmd)
    finally:
        del os.environ["ALMA_STOP_AFTER_STAGE"]
    assert (save / "checkpoint_stage1.pt").exists() and not (save / "checkpoint_stage2.pt").exists()
    before = (save / "run.json").read_bytes()
    proc = run(cmd + ["--moe-expert-kernel", "segments"])
    assert "with other execution settings (config.model.moe_expert_kernel: 'auto' -> 'segments')" in \
        proc.stdout + proc.stderr
    assert (save / "run.json").read_bytes() == before
    assert_same_stream(save, reference_run[0])
    for stage in (1, 2):
        state = torch.load(save / f"checkpoint_stage{stage}.pt", map_location="cpu", weights_only=False)
        assert state["alma"]["run"] == RunView(save).run_hash()


@pytest.mark.slow
def test_growth_stream_copies_experts_and_reports_loss(stream_dir, tmp_path):
    save = tmp_path / "grow"
    proc = run(stream_cmd(stream_dir, save, "--moe-max-experts", "4", "--grow-experts", "2"))
    # by default a stream keeps its stage checkpoints and checkpoint_last.pt, nothing else
    assert sorted(p.name for p in save.glob("*.pt")) == [
        "checkpoint_last.pt", "checkpoint_stage1.pt", "checkpoint_stage2.pt"]
    growth = [json.loads(line) for line in (save / "growth.jsonl").read_text().splitlines()]
    assert [g["stage"] for g in growth] == [2] and growth[0]["experts"] == 4
    assert all(len(v) == 2 for v in growth[0]["copied"].values())
    assert growth[0]["valid_nll_before"] > 0 and growth[0]["valid_nll_after"] > 0
    records = [json.loads(line) for line in (save / "stream.jsonl").read_text().splitlines()]
    per_expert = (records[2]["params_active"] - records[1]["params_active"]) // 2
    assert per_expert > 0 and records[2]["params_active"] == growth[0]["params_active"]
    # Comp counts each stage at the model that trained it (it charged stage 1 at the grown size)
    stage_tokens = [records[1]["train_tokens_cum"], records[2]["train_tokens_cum"] - records[1]["train_tokens_cum"]]
    assert records[2]["infer_flops_per_token"] > records[1]["infer_flops_per_token"]
    assert records[2]["train_flops_cum"] == 3 * (stage_tokens[0] * records[1]["infer_flops_per_token"]
                                                 + stage_tokens[1] * records[2]["infer_flops_per_token"])
    # fairseq's own log says "num. expert model params: 0": ours says where the experts are
    ffn = 2 * (per_expert - 64)  # two experts' FFNs: each grown expert brings a d-64 router row too
    assert f"Switch experts: {ffn:,} parameters in 1 MoE block; {ffn:,} more in slots kept for " \
        "--grow-experts" in proc.stdout + proc.stderr
    bad = run(stream_cmd(stream_dir, tmp_path / "bad", "--grow-experts", "2"), check=False)
    assert "--moe-max-experts must be >= 4" in bad.stderr


@pytest.mark.slow
def test_fairseq_transformer_lm_trains_a_stream(stream_dir, tmp_path):
    """--task alma_stream also trains fairseq's own dense LMs (the baselines users have)."""
    save = tmp_path / "dense"
    cmd = stream_cmd(stream_dir, save)
    cmd[cmd.index("switch_transformer_lm_tiny")] = "transformer_lm"
    del cmd[cmd.index("--moe-experts"):cmd.index("--moe-experts") + 2]
    cmd[cmd.index("switch_cross_entropy")] = "cross_entropy"
    cmd += ["--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
            "--decoder-attention-heads", "2"]
    # fairseq keeps --decoder-input-dim/--decoder-output-dim at 512: 512-wide embeddings projected
    # to 32-wide blocks, which the FLOPs count would take as 512-wide blocks
    refused = run(cmd, check=False)
    assert refused.returncode == 2 and "--decoder-embed-dim 32 with --decoder-input-dim 512" in refused.stderr
    assert not save.exists()
    run(cmd + ["--decoder-input-dim", "32", "--decoder-output-dim", "32"])
    records = [json.loads(line) for line in (save / "stream.jsonl").read_text().splitlines()]
    assert [r["trained"] for r in records] == [False, True, True]
    assert records[2]["eval_ppl"] < records[0]["eval_ppl"] and records[2]["params_active"] > 0
    vocab = len((stream_dir / "dict.txt").read_text().splitlines()) + 4  # with fairseq's 4 symbols
    shape = SwitchLMShape(n_layers=2, d_model=32, ffn_dim=64, vocab_size=vocab, context=32, moe_layers=0,
                          num_experts=1)
    assert records[1]["infer_flops_per_token"] == shape.forward_flops_per_token()
    assert records[1]["infer_flops_per_sequence"] == records[1]["infer_flops_per_token"] * 32
    # runs trained before each refusal (their run.json says so) are refused by alma-score and
    # alma-report rather than tabulated: FLOPs counted at the embeddings' 512; perplexities that
    # counted a free <s> target in every block (--add-bos-token)
    old = tmp_path / "old"
    shutil.copytree(save, old)
    for section, key, value, needle in (
            ("model", "decoder_input_dim", 512,
             "its stream.jsonl counts FLOPs wrongly: --decoder-embed-dim 32 with --decoder-input-dim 512"),
            ("task", "add_bos_token", True, "trained with --add-bos-token, so every block's first target is a free <s>")):
        run_file = json.loads((save / "run.json").read_text())
        run_file["fingerprint"]["config"][section][key] = value
        (old / "run.json").write_text(json.dumps(run_file))
        for cmd in ([tool("alma-score"), str(old)], [tool("alma-report"), str(old), "--out", str(tmp_path / "rep")]):
            refused = run(cmd, check=False)
            assert refused.returncode == 2 and needle in refused.stderr, refused.stderr
        assert not (tmp_path / "rep").exists()


def test_the_same_command_on_a_finished_run_changes_no_byte(stream_dir, reference_run, tmp_path):
    """Every arrival recorded and every stage checkpoint kept: the training command again
    exits 0 and leaves every file as it was (it rewrote the last record's wall_time before)."""
    import hashlib
    import shutil

    save = tmp_path / "run"
    shutil.copytree(reference_run[0], save)

    def digest() -> dict:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(save.iterdir())}

    before = digest()
    proc = run(stream_cmd(stream_dir, save, *RESUMABLE))
    assert "nothing to train" in proc.stdout + proc.stderr
    assert digest() == before


@pytest.mark.slow
def test_pre_dataclass_optimizer_trains_resumes_and_scores(stream_dir, tmp_path):
    """fairseq 0.12 configures some optimizers the old way (``--optimizer sgd``, adagrad,
    adafactor, ...): their config is the command line's ``argparse.Namespace``, in the
    checkpoints too.  Such a run fingerprints only the optimizer's own flags, resumes to
    exactly the uninterrupted run, keeps its initialised model (``--wait 2``) and scores with
    alma-score and fairseq-eval-lm (the run.json write, the weights-only loads and the
    checkpoint config each ended in a traceback before)."""
    sgd = ("--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.3")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run(stream_cmd(stream_dir, whole, *sgd))
    run(stream_cmd(stream_dir, parts, *sgd, "--max-epoch", "1"))
    legacy = tmp_path / "legacy"  # as fairseq-alma 0.1 left it: no run.json (the Namespace
    shutil.copytree(parts, legacy)  # in its checkpoint's config was an omegaconf traceback)
    (legacy / "run.json").unlink()
    run(stream_cmd(stream_dir, parts, *sgd))
    assert_same_stream(whole, parts)
    run(stream_cmd(stream_dir, legacy, *sgd))
    assert_same_stream(whole, legacy)
    fingerprint = json.loads((whole / "run.json").read_text())["fingerprint"]["config"]
    assert fingerprint["optimizer"] == {"_name": "sgd", "momentum": 0.9, "weight_decay": 0.0}
    scored = run([tool("alma-score"), str(whole), "--json", str(tmp_path / "s.json")])
    logged = [r["eval_ppl"] for r in map(json.loads, (whole / "stream.jsonl").read_text().splitlines())]
    arrivals = json.loads((tmp_path / "s.json").read_text())["series"][0]["arrivals"]
    assert [a["ppl"] for a in arrivals[1:]] == pytest.approx(logged[1:], rel=1e-6), scored.stdout
    waited = tmp_path / "waited"
    run(stream_cmd(stream_dir, waited, *sgd, "--wait", "2"))
    assert (waited / "checkpoint_stage0.pt").exists()
    run([tool("alma-score"), str(waited)])
    evaluated = run([tool("fairseq-eval-lm"), str(stream_dir), "--path", str(waited / "checkpoint_stage0.pt"),
                     "--user-dir", USER_DIR, "--gen-subset", "eval", "--cpu", "--tokens-per-sample", "32",
                     "--batch-size", "8"])
    assert "Perplexity" in evaluated.stdout + evaluated.stderr


@pytest.mark.slow
def test_per_stage_update_freq_records_the_tokens_fairseq_trains(stream_dir, tmp_path):
    """``--update-freq 1,2``: fairseq's per-epoch list, one entry per stage here.  Each stage's
    recorded tokens (and so its FLOPs) are its counted updates times the words per update that
    fairseq itself logs for that epoch; stage 1 was recorded at the last entry's rate before."""
    save = tmp_path / "run"
    proc = run(stream_cmd(stream_dir, save, "--update-freq", "1,2", "--log-format", "simple"))
    records = [json.loads(line) for line in (save / "stream.jsonl").read_text().splitlines()]
    tokens = [b["train_tokens_cum"] - a["train_tokens_cum"] for a, b in zip(records, records[1:])]
    logged = [float(m) for m in re.findall(r"\| epoch 00\d \|.*?\| wpb ([0-9.]+) \|", proc.stdout + proc.stderr)]
    assert len(logged) == 2 and logged[1] > 1.5 * logged[0], logged
    assert tokens == [pytest.approx(6 * wpb, rel=0.01) for wpb in logged]


@pytest.mark.slow
def test_max_update_at_the_streams_last_update_records_every_arrival(stream_dir, reference_run, tmp_path):
    """--max-update equal to the stream's updates (2 stages x 6, what fairseq's whole-run LR
    schedules read): fairseq stopped before the epoch whose start records the last arrival, and
    exited 0 with the stream unfinished. Now the run equals the one without it."""
    reference, _ = reference_run
    save = tmp_path / "run"
    run(stream_cmd(stream_dir, save, *RESUMABLE, "--max-update", "12"))
    assert_same_stream(reference, save)


def test_every_arrival_is_one_log_line_and_the_log_file_has_each_line_once(stream_dir, tmp_path):
    """After every arrival the log gets fairseq's kind of stats line (tag ``stream``: eval and
    valid perplexity, compute, parameters), under ``--log-format json`` one JSON object, and
    ``--log-file`` gets every progress-bar line once: fairseq added a file handler per epoch,
    so stage N's lines reached the file N times.  Run in two processes, as under Slurm.  Each
    stage says what it trains on and that fairseq's progress counts its spare batches too."""
    save, log_file = tmp_path / "run", tmp_path / "train.log"
    logging = ("--log-format", "json", "--log-file", str(log_file))
    first = run(stream_cmd(stream_dir, save, *logging, "--max-epoch", "1"))
    second = run(stream_cmd(stream_dir, save, *logging))
    records = [json.loads(line) for line in (save / "stream.jsonl").read_text().splitlines()]
    lines = [json.loads(line) for line in log_file.read_text().splitlines() if line.startswith("{\"")]
    logged = [(int(line["stream_arrival"]), float(line["stream_eval_ppl"]), float(line["stream_valid_ppl"]))
              for line in lines if "stream_arrival" in line]
    # the first process ended with stage 1's checkpoint, before arrival 1 was recorded: the
    # second measures arrival 1 again (the same numbers) and says so
    expected = [(r["arrival"], round(r["eval_ppl"], 2), round(r["valid_ppl"], 2)) for r in records]
    assert logged == [expected[0], expected[1], expected[1], expected[2]]
    assert [line["epoch"] for line in lines if "train_loss" in line] == [1, 2]
    assert "\"stream_arrival\": \"1\"" in first.stdout and "\"stream_arrival\": \"2\"" not in first.stdout
    assert '"stream_arrival": "2"' in second.stdout and '"stream_arrival": "0"' not in second.stdout
    simple = run(stream_cmd(stream_dir, tmp_path / "simple"))
    assert re.findall(r"alma_stream: stage (\d) of 2 \(arrival \d\) trains on mega-batch (\d): 6 updates; "
                      r"fairseq's progress counts to 26 \(20 spares", simple.stdout) == [("1", "0"), ("2", "1")]
    assert re.findall(r"\| stream \| arrival (\d+) \| stage (\d) \|.* eval_ppl ([0-9.]+) \|", simple.stdout) == [
        (f"{r['arrival']:03d}", str(r["stage"]), f"{round(r['eval_ppl'], 2):g}") for r in records]


def test_a_checkpoint_without_run_json_is_compared_as_run_json_is():
    """A run directory without run.json (fairseq-alma 0.1) is compared by its checkpoint's
    config the way run.json fingerprints are: one growth plan spelled two ways is one run (it
    was refused), another seed is not."""
    from fairseq_alma.fairseq_glue.train_flags import _settings_changed

    def config(grow: str, seed: int) -> dict:
        return {"common": {"seed": seed}, "task": {"_name": "alma_stream", "grow_experts": grow,
                                                   "grow_at_stages": "", "wait": 1}}

    assert _settings_changed(config("1", 1), config("1,1", 1), 3) == []
    assert _settings_changed(config("1", 1), config("1,1", 2), 3) == ["common.seed: 1 -> 2"]


def test_a_vision_checkpoint_without_run_json_is_refused_before_anything_is_written(tmp_path):
    """An LM command into a vision run's directory without run.json wrote its run.json before
    the loader refused the checkpoint: the vision run could not be continued any more."""
    import torch

    from fairseq_alma.errors import CheckpointError
    from fairseq_alma.fairseq_glue.train_flags import check_leftover_checkpoint

    torch.save({"format": "alma-vision-stream/1", "learner": {}}, tmp_path / "checkpoint_last.pt")
    (tmp_path / "stream.jsonl").write_text("")
    with pytest.raises(CheckpointError, match="holds no fairseq config: not a language-model"):
        check_leftover_checkpoint(str(tmp_path), None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_last.pt", "stream.jsonl"]
