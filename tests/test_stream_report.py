"""Table 2 / Figs. 2, 3, 5 rendering on hand-made series: exact text, CSV, JSON, PNGs."""

import csv
import json
import math
import os
import struct

import pytest

from fairseq_alma.report.figures import plot_cer_tradeoffs, plot_error_curves, plot_tradeoffs
from fairseq_alma.report.result_tables import (
    format_series_table,
    report_dict,
    write_csv,
    write_json,
)
from fairseq_alma.stream.records import ArrivalRecord
from fairseq_alma.stream.series import ReportSeries, series_from_records


def lm_series():
    sm_w1 = ReportSeries(
        setting="SM_w1",
        num_experts="4",
        metric_by_arrival=[None, 28.5, 27.5, 27.0, 26.0],
        train_flops_cum=[0.0, 1e15, 2e15, 3e15, 4e15],
        params_by_arrival=[65_000_000] * 5,
    )
    sm_w3 = ReportSeries(  # untrained arrivals were evaluated (huge ppl) but are shown as '*'
        setting="SM_w3",
        num_experts="8",
        metric_by_arrival=[900.0, 800.0, 700.0, 25.5, 25.0],
        train_flops_cum=[0.0, 0.0, 0.0, 3e15, 3e15],
        params_by_arrival=[91_000_000] * 5,
        trained=[False, False, False, True, False],
    )
    return [sm_w1, sm_w3]


def vision_series():
    common = {"num_experts": "h8", "params_by_arrival": [1000, 1000, 1000], "metric": "error"}
    greedy = ReportSeries(
        setting="SM_w1",
        metric_by_arrival=[0.875, 0.5, 0.25],
        train_flops_cum=[0.0, 1e12, 2e12],
        trained=[False, True, True],
        **common,
    )
    tardy = ReportSeries(
        setting="SM_w2",
        metric_by_arrival=[0.875, 0.875, 0.125],
        train_flops_cum=[0.0, 0.0, 2e12],
        trained=[False, False, True],
        **common,
    )
    return [greedy, tardy]


def test_lm_table_exact_layout():
    # paper's averages over trained arrivals: (28.5 + 27.5 + 27 + 26) / 4 = 27.25; SM_w3:
    # (25.5 + 25) / 2 = 25.25.  Anytime (every arrival 1..4, geometric): SM_w1 27.24; SM_w3
    # (800 x 700 x 25.5 x 25) ** 0.25 = 137.46, its two waiting arrivals charged.
    # cum params: 5 x 65M = 325M, 5 x 91M = 455M; TFLOPs: 4e15 / 1e12 = 4000, 3000
    assert format_series_table(lm_series()) == (
        "setting    #experts      params     t0     t1     t2     t3    avg ppl (trained)"
        "    anytime ppl    cum TFLOPs    cum params\n"
        "---------  ----------  --------  -----  -----  -----  -----  -------------------"
        "  -------------  ------------  ------------\n"
        "SM_w1      4                65M  28.50  27.50  27.00  26.00                27.25"
        "          27.24          4000          325M\n"
        "SM_w3      8                91M      *      *  25.50  25.00                25.25"
        "         137.46          3000          455M\n"
    )


def test_vision_table_exact_layout():
    # CER: 0.875 + 0.5 + 0.25 = 1.625 and 0.875 + 0.875 + 0.125 = 1.875 (Eq. 1)
    assert format_series_table(vision_series()) == (
        "setting    size      params    final error    CER    cum TFLOPs    cum params\n"
        "---------  ------  --------  -------------  -----  ------------  ------------\n"
        "SM_w1      h8        0.001M         0.2500  1.625          2.00        0.003M\n"
        "SM_w2      h8        0.001M         0.1250  1.875          2.00        0.003M\n"
    )


def test_lm_csv_and_json(tmp_path):
    write_csv(lm_series(), tmp_path / "t.csv")
    write_json(lm_series(), tmp_path / "t.json")
    rows = list(csv.reader((tmp_path / "t.csv").open()))
    assert rows == [
        [
            "setting",
            "num_experts",
            "params",
            "ppl_t0",
            "ppl_t1",
            "ppl_t2",
            "ppl_t3",
            "trained_avg_ppl",
            "anytime_nll",
            "anytime_ppl",
            "train_tflops_cum",
            "params_cum",
        ],
        [
            "SM_w1",
            "4",
            "65000000",
            "28.5",
            "27.5",
            "27.0",
            "26.0",
            "27.25",
            repr(sum(math.log2(p) for p in (28.5, 27.5, 27.0, 26.0)) / 4),
            repr(2 ** (sum(math.log2(p) for p in (28.5, 27.5, 27.0, 26.0)) / 4)),
            "4000.0",
            "325000000.0",
        ],
        ["SM_w3", "8", "91000000", "", "", "25.5", "25.0", "25.25", rows[2][8], rows[2][9],
         "3000.0", "455000000.0"],
    ]
    assert 2 ** float(rows[2][8]) == pytest.approx(float(rows[2][9])) == pytest.approx(137.457061)
    data = json.loads((tmp_path / "t.json").read_text())
    assert data == report_dict(lm_series())
    assert data["metric"] == "ppl" and data["num_megabatches"] == 4
    sm_w3 = data["series"][1]
    assert sm_w3["summary"] == {"trained_avg_ppl": 25.25, "anytime_nll": pytest.approx(7.1028372),
                                "anytime_ppl": pytest.approx(137.457061),
                                "train_tflops_cum": 3000.0, "params_cum": 455e6}
    assert [a["trained_so_far"] for a in sm_w3["arrivals"]] == [False, False, False, True, True]
    assert [a["trained_avg_ppl_so_far"] for a in sm_w3["arrivals"]] == [None, None, None, 25.5, 25.25]
    assert sm_w3["arrivals"][2]["anytime_nll_so_far"] == pytest.approx(math.log2(800 * 700) / 2)
    assert sm_w3["arrivals"][1]["ppl"] == 800.0  # the raw evaluation is kept
    assert sorted(os.listdir(tmp_path)) == ["t.csv", "t.json"]


def test_vision_csv_counts_arrivals_from_zero(tmp_path):
    write_csv(vision_series(), tmp_path / "v.csv")
    rows = list(csv.reader((tmp_path / "v.csv").open()))
    assert rows[0] == [
        "setting",
        "size",
        "params",
        "error_t0",
        "error_t1",
        "error_t2",
        "final_error",
        "cer",
        "train_tflops_cum",
        "params_cum",
    ]
    assert rows[2] == [
        "SM_w2",
        "h8",
        "1000",
        "0.875",
        "0.875",
        "0.125",
        "0.125",
        "1.875",
        "2.0",
        "3000.0",
    ]


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24]), len(data)


def _has_ink(path):
    import matplotlib.image

    pixels = matplotlib.image.imread(str(path))
    return float(pixels[..., :3].std()) > 0.05


def test_plots_are_written_and_non_trivial(tmp_path):
    plot_tradeoffs(lm_series(), tmp_path / "fig5.png")
    plot_error_curves(vision_series(), tmp_path / "fig3.png")
    plot_cer_tradeoffs(vision_series(), tmp_path / "fig2.png")
    for name, size in (
        ("fig5.png", (1980, 990)),  # 2 rows (paper, anytime) x 3 panels
        ("fig3.png", (660, 495)),
        ("fig2.png", (1320, 495)),
    ):
        (width_height, nbytes) = _png_size(tmp_path / name)
        assert width_height == size and nbytes > 20_000
        assert _has_ink(tmp_path / name)
    assert sorted(os.listdir(tmp_path)) == ["fig2.png", "fig3.png", "fig5.png"]


def test_a_series_drawn_over_another_says_so_in_the_legend(tmp_path, monkeypatch):
    """--wait auto that chose every arrival gives SM_w1's points exactly: drawn last, it hides
    SM_w1, so its legend entry names the series under it."""
    from dataclasses import replace

    from fairseq_alma.report import figures

    drawn = []
    monkeypatch.setattr(figures, "_save", lambda figure, path: drawn.append(figure))
    sm_w1, sm_w3 = lm_series()
    plot_tradeoffs([sm_w1, sm_w3, replace(sm_w1, setting="SM_wauto")], tmp_path / "fig5.png")
    plot_error_curves([sm_w1, sm_w3, replace(sm_w1, setting="SM_wauto")], tmp_path / "fig3.png")
    legends = [[text.get_text() for text in axis.get_legend().get_texts()]
               for figure in drawn for axis in figure.axes if axis.get_legend() is not None]
    assert legends == [["SM_w1 (4)", "SM_w3 (8)", "SM_wauto (4) = SM_w1 (4)"],
                       ["SM_w1", "SM_w3", "SM_wauto = SM_w1"]] * 2 + \
        [["SM_w1 (4)", "SM_w3 (8)", "SM_wauto (4) = SM_w1 (4)"]]


def test_series_from_records():
    def record(arrival, ppl, trained):
        return ArrivalRecord(
            arrival=arrival,
            stage=int(arrival >= 2),
            trained=trained,
            megabatches_seen=arrival,
            params_active=10 + arrival,
            train_flops_cum=5.0 * (arrival >= 2),
            infer_flops_per_token=1.0,
            wall_time=0.0,
            eval_ppl=ppl,
        )

    series = series_from_records(
        "SM_w2", "2", [record(0, 90.0, False), record(1, 90.0, False), record(2, 30.0, True)]
    )
    assert series.metric == "ppl" and series.params == 12
    assert series.params_cum == [10.0, 21.0, 33.0]
    anytime = (math.log2(90.0) + math.log2(30.0)) / 2  # arrival 1 charged with the initial model
    assert series.summary() == {"trained_avg_ppl": 30.0, "anytime_nll": pytest.approx(anytime),
                                "anytime_ppl": pytest.approx(2 ** anytime),
                                "train_tflops_cum": 5e-12, "params_cum": 33.0}
    with pytest.raises(ValueError, match=r"arrivals 0..B in order, found \[1, 2\]"):
        series_from_records("x", "1", [record(1, 90.0, False), record(2, 30.0, True)])


def test_bad_series():
    with pytest.raises(ValueError, match=r"\(perplexity, B = \d+\) and .* \(test error, B = \d+\) are not one stream.s results"):
        format_series_table(lm_series() + vision_series())
    with pytest.raises(ValueError, match="use plot_cer_tradeoffs for these series"):
        plot_tradeoffs(vision_series(), "unused.png")
    with pytest.raises(ValueError, match="train_flops_cum has 2 entries, metric_by_arrival has 3"):
        ReportSeries("x", "1", [0.5, 0.4, 0.3], [0.0, 1.0], [1, 1, 1], metric="error")
    with pytest.raises(ValueError, match="no test error at arrival 0; CER"):
        ReportSeries("x", "1", [None, 0.4], [0.0, 1.0], [1, 1], metric="error")
    with pytest.raises(ValueError, match="train_flops_cum decreases"):
        ReportSeries("x", "1", [None, 20.0, 19.0], [0.0, 2.0, 1.0], [1, 1, 1])
    with pytest.raises(ValueError, match="no series to report"):
        format_series_table([])
    kaplan = ReportSeries("SM_k", "4", [None, 20.0], [0.0, 1.0], [1, 1], flops_convention="kaplan")
    full = ReportSeries("SM_f", "4", [None, 20.0], [0.0, 1.0], [1, 1], flops_convention="full")
    with pytest.raises(ValueError, match="different --flops-convention"):
        format_series_table([kaplan, full])


def test_numpy_scalars_are_stored_as_plain_numbers(tmp_path):
    import numpy as np

    series = ReportSeries(
        "SM_w1",
        "4",
        [None, np.float32(20.5), np.float64(19.5)],
        [0.0, np.float64(1e12), 2e12],
        [np.int64(7), np.int64(7), 7],
    )
    write_csv([series], tmp_path / "n.csv")
    write_json([series], tmp_path / "n.json")
    anytime = (math.log2(20.5) + math.log2(19.5)) / 2
    assert (tmp_path / "n.csv").read_text().splitlines()[1] == (
        f"SM_w1,4,7,20.5,19.5,20.0,{anytime!r},{2 ** anytime!r},2.0,21.0")
    assert json.loads((tmp_path / "n.json").read_text())["series"][0]["summary"]["trained_avg_ppl"] == 20.0
