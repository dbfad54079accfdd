"""The requeue contract between the trainers and slurm/sweep.sbatch.in: the status a preempted
trainer exits with is the one the sbatch script requeues on, and both are documented."""

from pathlib import Path

from fairseq_alma.errors import REQUEUE_EXIT_STATUS, Preempted

REPO = Path(__file__).resolve().parent.parent


def test_sbatch_script_requeues_on_the_trainers_status():
    script = (REPO / "slurm" / "sweep.sbatch.in").read_text()
    assert f"if ((rc == {REQUEUE_EXIT_STATUS})); then" in script
    assert "scontrol requeue" in script.split(f"if ((rc == {REQUEUE_EXIT_STATUS})); then")[1]
    assert Preempted.exit_status == REQUEUE_EXIT_STATUS == 75
    assert f"**{REQUEUE_EXIT_STATUS}**" in (REPO / "slurm" / "README.md").read_text()
