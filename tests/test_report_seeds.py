"""Grouping runs that differ only by seed (report/seeds.py), and the tables of such groups:
mean ± sample standard deviation, never a spread for one seed, never a group on a guess."""

import csv
import json
import statistics

import pytest

from fairseq_alma.report.result_tables import format_series_table, report_dict, write_csv
from fairseq_alma.report.seeds import (
    ReportedRun,
    SeedGroup,
    find_key,
    group_by_seed,
    replay_pairs,
    stat,
    without_keys,
)
from fairseq_alma.stream.series import ReportSeries


def _lm_fingerprint(seed: int, wait: int | None = 1, replay: bool = False) -> dict:
    return {"config": {"common": {"seed": seed, "fp16": False},
                       "task": {"wait": wait, "replay": replay}},  # None: --wait auto
            "data": {"manifest_sha256": "abc"}}


def _run(seed: int, ppl: list[float | None], wait: int | None = 1, replay: bool = False,
         fingerprint: bool = True, trained: list[bool] | None = None) -> ReportedRun:
    if trained is None:
        trained = [False] + [t % wait == 0 for t in range(1, len(ppl))]  # a stage every w arrivals
    series = ReportSeries(f"SM_w{wait or 'auto'}" + (" replay" if replay else ""), "4", ppl,
                          [float(t) * 1e12 for t in range(len(ppl))], [100] * len(ppl), trained)
    return ReportedRun(series, f"run{seed}", _lm_fingerprint(seed, wait, replay) if fingerprint
                       else None, (seed,))


def test_fingerprint_minus_seed():
    fingerprint = {"settings": {"--seed": 3, "--wait": 2, "learner": {"seed": 3, "width": 8}}}
    assert without_keys(fingerprint, frozenset({"seed", "--seed"})) == {
        "settings": {"--wait": 2, "learner": {"width": 8}}}
    assert find_key(fingerprint, {"seed", "--seed"}) == 3
    assert find_key({"a": [{"b": {"replay": True}}]}, {"replay"}) is True


def test_runs_differing_only_by_seed_are_grouped():
    runs = [_run(2, [900.0, 30.0, 20.0]), _run(1, [900.0, 32.0, 22.0]),
            _run(1, [900.0, 900.0, 25.0], wait=2)]
    groups = group_by_seed(runs)
    assert [g.n for g in groups] == [2, 1]
    sm_w1 = groups[0]
    assert sm_w1.seeds == [(1,), (2,)]  # ordered by seed
    summary = sm_w1.summary()
    assert summary["trained_avg_ppl"].mean == pytest.approx(26.0)
    assert summary["trained_avg_ppl"].std == pytest.approx(statistics.stdev([27.0, 25.0]))
    assert groups[1].summary()["trained_avg_ppl"].std is None  # one seed: no spread claimed
    table = format_series_table(groups)
    assert "seeds" in table.splitlines()[0]
    row = next(line for line in table.splitlines() if line.startswith("SM_w1"))
    assert "26.00 ± 1.41" in row and row.split()[2] == "2"


def test_no_fingerprint_never_grouped_and_copies_refused():
    alone = group_by_seed([_run(1, [900.0, 30.0, 20.0], fingerprint=False),
                           _run(2, [900.0, 31.0, 21.0], fingerprint=False)])
    assert [g.n for g in alone] == [1, 1]
    with pytest.raises(ValueError, match="same fingerprint and seed"):
        group_by_seed([_run(1, [900.0, 30.0, 20.0]), _run(1, [900.0, 30.0, 20.0])])


def test_stat_is_undefined_when_a_seed_lacks_the_number():
    assert stat([1.0, None]) is None and stat([]) is None
    assert stat([2.0]).std is None and stat([1.0, 3.0]).std == pytest.approx(2 ** 0.5)


def test_group_json_and_csv_keep_every_seed(tmp_path):
    groups = group_by_seed([_run(1, [900.0, 30.0, 20.0]), _run(2, [900.0, 34.0, 22.0])])
    entry = report_dict(groups)["series"][0]
    assert entry["seeds"] == [[1], [2]] and entry["runs"] == ["run1", "run2"]
    assert entry["summary"]["trained_avg_ppl"] == pytest.approx(26.5)
    assert entry["summary_std"]["trained_avg_ppl"] == pytest.approx(statistics.stdev([25.0, 28.0]))
    assert [a["ppl"] for a in entry["arrivals"]] == [900.0, 32.0, 21.0]
    assert entry["arrivals"][1]["ppl_std"] == pytest.approx(statistics.stdev([30.0, 34.0]))
    assert len(entry["members"]) == 2 and entry["members"][1]["arrivals"][1]["ppl"] == 34.0
    json.dumps(report_dict(groups), allow_nan=False)
    write_csv(groups, tmp_path / "g.csv")
    header, row = list(csv.reader((tmp_path / "g.csv").open()))
    assert header[:4] == ["setting", "num_experts", "seeds", "params"]
    assert row[header.index("trained_avg_ppl")] == repr(26.5)
    assert float(row[header.index("trained_avg_ppl_std")]) == pytest.approx(2.1213203)


def test_replay_pairs_match_everything_but_replay_and_seed():
    plain = SeedGroup([_run(1, [900.0, 30.0, 20.0])])
    replay = SeedGroup([_run(2, [900.0, 29.0, 18.0], replay=True)])
    other = SeedGroup([_run(1, [900.0, 900.0, 25.0], wait=2, replay=True)])
    assert replay_pairs([plain, other, replay]) == [(plain, replay)]
    assert replay_pairs([plain, other]) == []


def test_a_group_must_share_its_stream():
    with pytest.raises(ValueError, match="share a fingerprint but not their stream"):
        SeedGroup([_run(1, [900.0, 30.0, 20.0]), _run(2, [900.0, 30.0, 20.0, 10.0])])


def test_numbers_measured_on_different_streams_never_share_a_table():
    """A perplexity depends on the dictionary and the evaluation split: runs scored on streams
    of different identity are refused; an unverifiable one (its stream gone: a path) is not."""
    def scored(seed: int, data: object) -> ReportedRun:
        run = _run(seed, [900.0, 30.0, 20.0])
        run.scoring = {"split": "eval", "data": data}
        return run

    here, other = {"dictionary": {"sha256": "a"}}, {"dictionary": {"sha256": "b"}}
    assert format_series_table(group_by_seed([scored(1, here), scored(2, here), scored(3, "/gone")]))
    with pytest.raises(ValueError, match="run1 and run2 were evaluated on different streams"):
        format_series_table(group_by_seed([scored(1, here), scored(2, other)]))


def test_copies_are_refused_and_seeds_named_without_seed_groups():
    """--no-seed-groups (a group per run) still refuses two copies of one run, and names the
    rows of one setting by their seeds rather than printing the same name twice."""
    with pytest.raises(ValueError, match="same fingerprint and seed"):
        group_by_seed([_run(1, [900.0, 30.0, 20.0]), _run(1, [900.0, 30.0, 20.0])], by_seed=False)
    rows = group_by_seed([_run(1, [900.0, 30.0, 20.0]), _run(2, [900.0, 34.0, 22.0])], by_seed=False)
    assert [g.n for g in rows] == [1, 1]
    assert [g.first.setting.split(" ", 1)[1] for g in rows] == ["[seed=1]", "[seed=2]"]


def test_seeds_of_wait_auto_group_though_they_trained_at_other_arrivals():
    """--wait auto decides per seed, so its seeds train at different arrivals and are still one
    setting (alma-report refused every multi-seed auto sweep); a fixed wait never does that."""
    early = _run(1, [900.0, 30.0, 20.0, 15.0], wait=None, trained=[False, True, False, True])
    late = _run(2, [900.0, 900.0, 22.0, 16.0], wait=None, trained=[False, False, True, True])
    (group,) = group_by_seed([early, late])
    assert group.n == 2 and group.seen == [False, True, True, True]
    row = next(line for line in format_series_table([group]).splitlines() if "wauto" in line)
    assert "465.00 ± 615.18" in row  # arrival 1: one seed trained, one waited (anytime's charge)
    assert report_dict([group])["series"][0]["arrivals"][1]["trained"] is True
    fixed = _run(3, [900.0, 30.0, 20.0, 15.0], trained=[False, True, False, True])
    with pytest.raises(ValueError, match="fixed --wait but trained at different arrivals"):
        SeedGroup([_run(4, [900.0, 30.0, 20.0, 15.0]), fixed])


def test_rows_measured_on_different_splits_name_theirs_whatever_their_names():
    """SM_w1 scored on valid beside SM_w1 replay on eval read as replay gaining 8 points where it
    gained 0.4: every row names its split, and Fig. 4 never joins numbers measured apart."""
    def scored(run: ReportedRun, split: str) -> ReportedRun:
        run.scoring = {"split": split, "tokens": "all", "data": {"dictionary": "a"}}
        return run

    plain = scored(_run(1, [900.0, 30.0, 20.0]), "valid")
    replayed = scored(_run(1, [900.0, 29.0, 19.0], replay=True), "eval")
    groups = group_by_seed([plain, replayed])
    assert [g.first.setting for g in groups] == ["SM_w1 [split=valid]", "SM_w1 replay [split=eval]"]
    assert replay_pairs(groups) == []
    alike = group_by_seed([scored(_run(1, [900.0, 30.0, 20.0]), "eval"),
                           scored(_run(1, [900.0, 29.0, 19.0], replay=True), "eval")])
    assert [g.first.setting for g in alike] == ["SM_w1", "SM_w1 replay"]  # no needless tags
    assert len(replay_pairs(alike)) == 1


def test_fig4_pairs_each_run_with_its_own_seed_without_seed_groups():
    """--no-seed-groups: the last seed's run was paired with the last replay run, another
    seed's, and the other seeds got no arrow."""
    runs = [_run(seed, [900.0, 30.0 + seed, 20.0], replay=replay)
            for seed in (1, 2, 3) for replay in (False, True) if (seed, replay) != (3, True)]
    pairs = replay_pairs(group_by_seed(runs, by_seed=False))
    assert [(a.seeds, b.seeds) for a, b in pairs] == [([(1,)], [(1,)]), ([(2,)], [(2,)])]


def test_fig4_names_an_arrow_drawn_exactly_under_another(tmp_path, monkeypatch):
    """--wait auto choosing every arrival draws SM_w1's arrow exactly: its legend entry says so,
    as Figs. 2, 3 and 5 do (the legend listed an arrow the plot did not show)."""
    from fairseq_alma.report import figures

    drawn = []
    monkeypatch.setattr(figures, "_save", lambda figure, path: drawn.append(figure))
    runs = [_run(1, [900.0, 30.0, 20.0], wait=wait, replay=replay, trained=[False, True, True])
            for wait in (1, None) for replay in (False, True)]
    runs[1].series.metric_by_arrival = [900.0, 29.0, 18.0]  # replay gains, alike for both waits
    runs[3].series.metric_by_arrival = [900.0, 29.0, 18.0]
    pairs = replay_pairs(group_by_seed(runs))
    assert len(pairs) == 2
    figures.plot_replay(pairs, tmp_path / "fig4.png")
    (axis,) = drawn[0].axes
    assert [text.get_text() for text in axis.get_legend().get_texts()] == [
        "SM_w1 (4)", "SM_wauto (4) = SM_w1 (4)"]


def test_eval_matrix_summary_has_the_forgetting_of_each_group(tmp_path):
    """README: forgetting is reported beside the three summaries; a group's is the mean over
    seeds of each seed's (its perplexity ratio and bits), as the other summaries are."""
    import math

    from fairseq_alma.report import matrix_table
    from fairseq_alma.stream.period_matrix import PeriodMatrix

    seeds = [PeriodMatrix([1, 2], [1, 2], [[5.0, 7.0], [5.5, 6.0]]),   # period 1: +0.5 bits
             PeriodMatrix([1, 2], [1, 2], [[5.0, 7.0], [4.75, 6.0]])]  # period 1: -0.25 bits
    runs = [_run(seed, [900.0, 30.0, 20.0]) for seed in (1, 2)]
    for run, matrix in zip(runs, seeds):
        run.eval_matrix = matrix.as_json()
    (group,) = matrix_table.matrix_groups(group_by_seed(runs))
    ratios = [2 ** 0.5, 2 ** -0.25]
    forgetting = group.forgetting()
    assert forgetting["ppl_ratio"].mean == pytest.approx(statistics.fmean(ratios))
    assert forgetting["ppl_ratio"].std == pytest.approx(statistics.stdev(ratios))
    assert forgetting["nll_bits"].mean == pytest.approx(0.125)
    table = matrix_table.format_summary([group])
    assert table.splitlines()[0].rstrip().endswith("forward ppl    forgetting (ppl ×)")
    assert f"{statistics.fmean(ratios):.3f} ± {statistics.stdev(ratios):.3f}" in table.splitlines()[2]
    matrix_table.write_csv([group], tmp_path / "m.csv")
    (row,) = csv.DictReader((tmp_path / "m.csv").open())
    assert float(row["forgetting_ppl_ratio"]) == pytest.approx(statistics.fmean(ratios), rel=1e-12)
    assert float(row["forgetting_nll_bits_std"]) == pytest.approx(0.75 / math.sqrt(2), rel=1e-12)
    matrix_table.write_json([group], tmp_path / "m.json")
    (entry,) = json.loads((tmp_path / "m.json").read_text())["groups"]
    assert entry["forgetting"]["ppl_ratio"]["values"] == pytest.approx(ratios)
    assert entry["forgetting"]["periods"] == [1]
    one_stage = _run(3, [900.0, 30.0, 20.0])
    one_stage.eval_matrix = PeriodMatrix([1], [2], [[5.0, 6.0]]).as_json()
    (alone,) = matrix_table.matrix_groups(group_by_seed([one_stage]))
    assert alone.forgetting()["ppl_ratio"] is None and "n/a" in matrix_table.format_summary([alone])


def test_eval_matrix_panels_share_one_colour_scale(tmp_path, monkeypatch):
    """Side-by-side heatmaps with a range each gave one colour to 74.7 in one panel and 77.3 in
    the next; every panel now spans the range of all of them."""
    from fairseq_alma.report import figures, matrix_table
    from fairseq_alma.stream.period_matrix import PeriodMatrix

    drawn = []
    monkeypatch.setattr(figures, "_save", lambda figure, path: drawn.append(figure))
    runs = [_run(1, [900.0, 30.0, 20.0]), _run(1, [900.0, 30.0, 20.0], replay=True)]
    for run, shift in zip(runs, (0.0, 1.0)):
        run.eval_matrix = PeriodMatrix([1, 2], [1, 2], [[5.0 + shift, 7.0], [5.5, 6.0 + shift]]).as_json()
    groups = matrix_table.matrix_groups(group_by_seed(runs))
    assert len(groups) == 2
    figures.plot_eval_matrix(groups, tmp_path / "m.png")
    limits = {image.get_clim() for axis in drawn[0].axes for image in axis.get_images()}
    assert limits == {(2 ** 5.0, 2 ** 7.0)}
