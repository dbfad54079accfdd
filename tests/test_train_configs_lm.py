"""Every LM experiment of the paper has a config that loads (flags checked by the real parser)."""

import glob
import os
import re
from pathlib import Path

import pytest

from fairseq_alma.sweeps import load_run_config

LM = Path(__file__).resolve().parent.parent / "train_configs" / "lm"
RUNS = sorted(p for p in glob.glob(str(LM / "*.yaml")) if not os.path.basename(p).startswith("_"))
PAPER_ROWS = {"SM_w1", "SM_w3", "SM_w4", "Ens_w1", "Ens_w3", "Ens_w4", "gEns_w1", "gMoE_w1", "seq_vs_iid"}


def test_every_table2_and_table1_setting_has_base_and_large_configs():
    names = {re.sub(r"_(base|large)\.yaml$", "", os.path.basename(p)) for p in RUNS}
    assert names == PAPER_ROWS
    assert len(RUNS) == 2 * len(PAPER_ROWS)


@pytest.mark.parametrize("path", RUNS, ids=os.path.basename)
def test_config_loads_and_cites_the_paper(path):
    config = load_run_config(path)
    assert config.args["task"] == "alma_stream"
    assert config.args["arch"] in ("switch_transformer_lm_base", "switch_transformer_lm_large")
    text = Path(path).read_text() + (LM / "_common.yaml").read_text()
    for key in ("updates-per-stage", "moe-balance-loss-weight", "capacity-factor", "adam-betas", "warmup-updates"):
        line = next(line for line in text.splitlines() if line.strip().startswith(f"{key}:"))
        assert re.search(r"#.*(§|App\.|Table)", line), f"{key} in {path} does not name its paper section"


def test_gmoe_grows_like_table2():
    config = load_run_config(str(LM / "gMoE_w1_base.yaml"))
    assert config.args["moe-experts"] == 4 and config.args["moe-max-experts"] == 12
    assert 4 + sum(int(k) for k in str(config.args["grow-experts"]).split(",")) == 12
