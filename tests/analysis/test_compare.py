"""Compare mode on synthetic run dirs whose losses differ by a known amount."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ling.analysis import compare
from tests.helpers import COMPARE_STEPS, baseline_loss, run_config, write_run


def test_known_offset_gives_known_summary_and_writes_report(tmp_path):
    base = baseline_loss()
    b = write_run(tmp_path, "bf16", base, run_config(), held_out=3.0)
    a = write_run(tmp_path, "fp8", base * 1.002, run_config(**{"precision.name": "fp8", "optim.name": "fp8_adamw"}),
                  health=True, held_out=3.003)
    out = tmp_path / "report"
    comp = compare.compare([(a, b)], out_dir=out)
    p = comp.pairs[0]
    assert p.steps == COMPARE_STEPS and p.window == (161, 200) and p.window_steps == 40
    # a constant relative offset: every relative difference is 0.002 up to float rounding
    assert p.mean_rel == pytest.approx(0.002, abs=1e-12)
    assert p.mean_abs_rel == pytest.approx(0.002, abs=1e-12)
    assert abs(p.slope.per_step) < 1e-12 and p.slope.ci_low <= 0 <= p.slope.ci_high + 1e-15
    assert p.held_out_rel == pytest.approx(0.001)
    assert comp.within_noise is None and not comp.within_target and comp.upward_trend == []
    # the expected differences (precision, optimizer) are listed but not flagged
    assert {k for k, *_ in p.config_differences} == {"precision.name", "optim.name", "run_name"}
    assert all(ok for *_, ok in p.config_differences)
    for name in ("loss_curves.png", "rel_diff.png", "fp8_health.png", "report.md", "summary.json"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "rel_diff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    assert "+0.200 %" in report and "![Relative difference](rel_diff.png)" in report
    assert "NOT within the 0.1 % target" in report
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pairs"][0]["mean_rel"] == pytest.approx(0.002)


def test_linear_trend_slope_and_ci():
    # rel(s) = 1e-3 + 2e-6·s exactly → slope 2e-6 per step, a zero-width interval
    x = np.arange(100, 200, dtype=np.float64)
    s = compare.slope_with_ci(x, 1e-3 + 2e-6 * x)
    assert s.per_step == pytest.approx(2e-6, rel=1e-9)
    assert s.ci_low == pytest.approx(2e-6, rel=1e-6) and s.ci_high == pytest.approx(2e-6, rel=1e-6)
    # with white noise the interval covers the true slope; compare with the textbook OLS interval (rho ~ 0)
    from scipy import stats

    rng = np.random.default_rng(3)
    y = 1e-3 + 2e-6 * x + 1e-4 * rng.standard_normal(len(x))
    s = compare.slope_with_ci(x, y)
    ref = stats.linregress(x, y)
    assert s.per_step == pytest.approx(ref.slope, rel=1e-9)
    if s.autocorr == 0.0:  # no positive autocorrelation: exactly the textbook interval
        half = stats.t.ppf(0.975, len(x) - 2) * ref.stderr
        assert s.ci_high - s.per_step == pytest.approx(half, rel=1e-9)
    assert s.ci_low < 2e-6 < s.ci_high


def test_autocorrelated_residuals_widen_the_interval():
    rng = np.random.default_rng(0)
    x = np.arange(400, dtype=np.float64)
    noise = np.cumsum(rng.standard_normal(400)) * 1e-5  # a random walk: strongly autocorrelated
    from scipy import stats

    s = compare.slope_with_ci(x, noise)
    ref = stats.linregress(x, noise)
    assert s.autocorr > 0.8
    assert (s.ci_high - s.ci_low) > 3 * 2 * stats.t.ppf(0.975, 398) * ref.stderr


def test_seeds_and_noise_floor(tmp_path):
    pairs, noise = [], []
    for seed, offset in ((1, 0.0004), (2, 0.0006), (3, 0.0008)):
        base = baseline_loss(seed)
        b = write_run(tmp_path, f"s{seed}_bf16", base, run_config(**{"train.seed": seed}))
        a = write_run(tmp_path, f"s{seed}_fp8", base * (1 + offset),
                      run_config(**{"train.seed": seed, "precision.name": "fp8"}))
        pairs.append((a, b))
    # noise pair: ±0.2 % alternating, so its mean |rel| is 0.2 %
    base = baseline_loss(1)
    sign = np.where(np.arange(COMPARE_STEPS) % 2 == 0, 1.0, -1.0)
    n = write_run(tmp_path, "s1_bf16_rerun", base * (1 + 0.002 * sign), run_config(**{"train.seed": 1}))
    noise.append((n, tmp_path / "s1_bf16"))
    comp = compare.compare(pairs, noise, tmp_path / "out")
    assert [p.mean_rel for p in comp.pairs] == pytest.approx([0.0004, 0.0006, 0.0008], abs=1e-12)
    assert comp.mean_rel["mean"] == pytest.approx(0.0006) and comp.mean_rel["std"] == pytest.approx(0.0002)
    assert comp.mean_rel["min"] == pytest.approx(0.0004) and comp.mean_rel["max"] == pytest.approx(0.0008)
    assert comp.noise_floor == pytest.approx(0.002)
    assert comp.within_noise and comp.within_target
    # 95 % t-interval of the mean of (0.04, 0.06, 0.08) %: t(0.975, 2) = 4.3027, std/sqrt(3) = 0.02/sqrt(3) %
    half = 4.302653 * 0.0002 / np.sqrt(3)
    assert (comp.mean_rel["ci_low"], comp.mean_rel["ci_high"]) == pytest.approx((0.0006 - half, 0.0006 + half))
    report = (tmp_path / "out" / "report.md").read_text()
    assert "mean over 3 pairs" in report and "noise: s1_bf16_rerun vs s1_bf16" in report
    assert f"95 % interval of the mean [{100 * (0.0006 - half):+.3f} %, {100 * (0.0006 + half):+.3f} %] excludes 0" \
        in report
    assert "within the BF16-vs-BF16 noise floor" in report
    assert not (tmp_path / "out" / "fp8_health.png").exists()  # no health in these logs


def test_noise_pairs_off_zero_are_called_systematic(tmp_path):
    """Kernel nondeterminism moves a rerun either way; noise pairs that all lie on one side, with an interval of
    their mean that excludes 0, are flagged (the parity runs' nondeterministic reruns all ended above their
    deterministic twins). Noise pairs of both signs are not."""
    pairs, noise = [], []
    for seed, offset in ((1, 0.008), (2, 0.010), (3, 0.012)):
        base = baseline_loss(seed)
        b = write_run(tmp_path, f"s{seed}_bf16", base, run_config(**{"train.seed": seed}))
        fp8 = run_config(**{"train.seed": seed, "precision.name": "fp8"})
        pairs.append((write_run(tmp_path, f"s{seed}_fp8", base, fp8), b))
        rerun = write_run(tmp_path, f"s{seed}_bf16_rerun", base * (1 + offset), run_config(**{"train.seed": seed}))
        noise.append((rerun, b))
    comp = compare.compare(pairs, noise, tmp_path / "out")
    half = 4.302653 * 0.002 / np.sqrt(3)  # t(0.975, 2) · std / sqrt(3)
    assert (comp.noise_rel["ci_low"], comp.noise_rel["ci_high"]) == pytest.approx((0.01 - half, 0.01 + half))
    flagged = (f"the noise pairs' mean +1.000 % is not 0 (95 % interval [{100 * (0.01 - half):+.3f} %, "
               f"{100 * (0.01 + half):+.3f} %]): their runs differ from their twins systematically")
    assert flagged in compare.verdict(comp)
    both = [(write_run(tmp_path, f"s{s}_bf16_rerun2", baseline_loss(s) * (1 + o), run_config(**{"train.seed": s})), b)
            for (s, o), (_, b) in zip(((1, 0.01), (2, -0.01), (3, 0.005)), pairs)]
    assert "noise pairs' mean" not in compare.verdict(compare.compare(pairs, both, tmp_path / "out2"))


def test_cli_globs_and_default_output(tmp_path, monkeypatch, capsys):
    for seed in (1, 2):
        base = baseline_loss(seed)
        write_run(tmp_path, f"s{seed}_bf16", base, run_config())
        write_run(tmp_path, f"s{seed}_fp8", base * 1.001, run_config(**{"precision.name": "fp8"}))
    monkeypatch.chdir(tmp_path)
    comp = compare.main(["--pairs", "s*_fp8:s*_bf16"])
    assert [(p.candidate, p.baseline) for p in comp.pairs] == [("s1_fp8", "s1_bf16"), ("s2_fp8", "s2_bf16")]
    assert (tmp_path / "runs/compare/s1_fp8_vs_s1_bf16/report.md").is_file()
    assert "mean rel. diff" in capsys.readouterr().out


def test_steps_compares_every_pair_on_its_first_n_common_steps(tmp_path):
    """--steps N: a pair cut short (a branch stopped at 150 of 200 steps) and a full one are both summarized on
    steps 1..N exactly as if both runs had stopped there; the end-of-run held-out result is left out."""
    base = baseline_loss()
    rel = np.where(np.arange(1, COMPARE_STEPS + 1) <= 120, 0.001, 0.01)  # the difference jumps after step 120
    b = write_run(tmp_path, "bf16", base, run_config(), held_out=3.0)
    a = write_run(tmp_path, "fp8", base * (1 + rel), run_config(**{"precision.name": "fp8"}), held_out=3.3)
    cut = write_run(tmp_path, "fp8_cut", (base * (1 + rel))[:150], run_config(**{"precision.name": "fp8"}))
    b_short = write_run(tmp_path, "bf16_short", base[:120], run_config())
    a_short = write_run(tmp_path, "fp8_short", (base * (1 + rel))[:120], run_config(**{"precision.name": "fp8"}))
    comp = compare.main(["--pairs", f"{a}:{b}", f"{cut}:{b}", "--steps", "120", "--window", "0.5",
                         "--out", str(tmp_path / "r")])
    want = compare.summarize_pair(compare.load_run(a_short), compare.load_run(b_short), window=0.5)
    for p in comp.pairs:
        assert p.steps == 120 and p.window == (61, 120) and p.window_steps == 60
        assert p.mean_rel == pytest.approx(want.mean_rel, abs=1e-15) == pytest.approx(0.001, abs=1e-12)
        assert p.held_out_rel is None  # 3.3 vs 3.0 is the runs' end, not step 120
    assert compare.compare([(a, b)], out_dir=tmp_path / "full").pairs[0].held_out_rel == pytest.approx(0.1)
    assert compare.summarize_pair(compare.load_run(a), compare.load_run(b), first_steps=200).held_out_rel \
        == pytest.approx(0.1)  # nothing cut: the held-out result stays
    with pytest.raises(ValueError, match="share 150 logged steps of 'loss', fewer than the 160"):
        compare.main(["--pairs", f"{cut}:{b}", "--steps", "160", "--out", str(tmp_path / "r2")])
    with pytest.raises(ValueError, match="steps=0: must be at least 1"):
        compare.main(["--pairs", f"{cut}:{b}", "--steps", "0", "--out", str(tmp_path / "r3")])


def test_run_dir_without_logs(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty: no metrics.jsonl"):
        compare.load_run(tmp_path / "empty")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "metrics.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no step record"):
        compare.load_run(tmp_path / "blank")


def test_configs_differing_beyond_precision_warn_with_the_list(tmp_path):
    base = baseline_loss()
    b = write_run(tmp_path, "bf16", base, run_config())
    a = write_run(tmp_path, "fp8", base, run_config(**{"precision.name": "fp8", "optim.lr": 1e-3,
                                                      "train.seq_len": 512}))
    listed = r"optim.lr: 0.001 vs 0.0003; train.seq_len: 512 vs 256"
    with pytest.warns(compare.ConfigMismatchWarning, match=listed) as w:
        comp = compare.compare([(a, b)], out_dir=tmp_path / "out")
    assert "precision.name" not in str(w[0].message)
    flagged = {k for k, *_, ok in comp.pairs[0].config_differences if not ok}
    assert flagged == {"optim.lr", "train.seq_len"}
    assert "`optim.lr` | `0.001` | `0.0003` | ⚠ unexpected" in (tmp_path / "out" / "report.md").read_text()


def test_resumed_run_keeps_the_last_record_of_a_step_and_skips_a_cut_line(tmp_path):
    run = write_run(tmp_path, "r", np.full(10, 5.0), run_config())
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 9, "loss": 4.0}) + "\n")
        f.write('{"step": 10, "loss": 3.')  # a crash mid-write
    with pytest.warns(UserWarning, match="skipped 1 unreadable"):
        r = compare.load_run(run)
    steps, loss = r.series("loss")
    assert list(steps) == list(range(1, 11)) and loss[8] == 4.0 and loss[9] == 5.0
    with pytest.raises(KeyError, match="no 'mtp_loss'"):
        r.series("mtp_loss")


def test_health_series_falls_back_to_the_layer_mean(tmp_path):
    run = compare.load_run(write_run(tmp_path, "h", baseline_loss(), run_config(), health=True))
    s, v = compare.health_series(run, "grad", "underflow")
    assert list(s[:3]) == [1, 11, 21]
    assert v[1] == pytest.approx(0.02 + 1e-5 * 10)
    assert compare.health_series(run, "act", "nope") is None
    assert np.isfinite(v).all()


def test_identical_check_passes_a_copy_and_names_the_first_differing_step(tmp_path, capsys):
    """`eval.py compare --identical`: exact equality of every non-timing metric and the held-out loss."""
    loss = baseline_loss(3)
    a = write_run(tmp_path, "a", loss, run_config(), held_out=3.25)
    b = write_run(tmp_path, "b", loss.copy(), run_config(), held_out=3.25)
    # timing differs between identical runs and must not count
    with open(b / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    for rec in recs:
        rec["step_time_s"], rec["tokens_per_s"] = 0.1 * rec["step"], 7.0
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(SystemExit) as done:
        compare.main(["--identical", str(a), str(b)])
    assert done.value.code == 0 and "bit-identical" in capsys.readouterr().out

    bumped = loss.copy()
    bumped[41] = np.nextafter(bumped[41], np.inf)  # one ULP at step 42
    c = write_run(tmp_path, "c", bumped, run_config(), held_out=3.25)
    problems = compare.identical_runs(compare.load_run(a), compare.load_run(c))
    assert problems == [f"loss: 1 of {COMPARE_STEPS} steps differ, first at step 42: {loss[41]!r} vs {bumped[41]!r}"]
    d = write_run(tmp_path, "d", loss, run_config(), held_out=3.2500001)
    assert compare.identical_runs(compare.load_run(a), compare.load_run(d)) == ["held-out loss: 3.25 vs 3.2500001"]
    with pytest.raises(SystemExit) as done:
        compare.main(["--identical", str(a), str(c)])
    assert done.value.code == 1 and "NOT bit-identical" in capsys.readouterr().out


def test_over_the_run_table_shows_where_the_gap_opens(tmp_path):
    """A gap of exactly +1 % from step 101 on: the training loss's 10 ranges of 20 steps read 0 then +1 %; a
    sparsely logged key (val_loss every 50 steps) gets one range per logged step."""
    base = baseline_loss()
    steps = np.arange(1, COMPARE_STEPS + 1)
    b = write_run(tmp_path, "bf16", base, run_config())
    a = write_run(tmp_path, "fp8", np.where(steps > 100, base * 1.01, base), run_config(**{"precision.name": "fp8"}))
    for run, factor in ((b, 1.0), (a, 1.02)):  # val_loss at steps 50, 100, 150, 200; fp8's +2 % from step 150
        lines = (run / "metrics.jsonl").read_text().splitlines()
        with open(run / "metrics.jsonl", "w") as f:
            for line in lines:
                rec = json.loads(line)
                if rec["step"] % 50 == 0:
                    rec["val_loss"] = 3.0 * (factor if rec["step"] >= 150 else 1.0)
                f.write(json.dumps(rec) + "\n")
    comp = compare.compare([(a, b)], out_dir=tmp_path / "report")
    assert comp.edges == list(range(0, COMPARE_STEPS + 1, 20))
    row = comp.over_the_run["fp8 vs bf16"]
    assert row[:5] == pytest.approx([0.0] * 5, abs=1e-12) and row[5:] == pytest.approx([0.01] * 5, rel=1e-9)
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## Over the run" in report and "| ≤ 20 |" in report and "+1.00 %" in report
    val = compare.compare([(a, b)], out_dir=tmp_path / "report_val", key="val_loss", window=0.5)
    assert val.edges == [0, 50, 100, 150, 200]
    assert val.over_the_run["fp8 vs bf16"] == pytest.approx([0.0, 0.0, 0.02, 0.02], abs=1e-12)


def test_a_short_window_gets_no_slope_and_a_slope_is_rounded_to_its_interval(tmp_path):
    """A 12-step window used to print '+49.4870 [-88.1279, +187.1019] %/1k steps': now it says it is too short; a
    slope that is shown carries the digits its interval supports (two of the half-width)."""
    rng = np.random.default_rng(5)
    base = baseline_loss()[:60]
    b = write_run(tmp_path, "bf16", base, run_config())
    a = write_run(tmp_path, "fp8", base * (1 + 1e-3 * rng.standard_normal(60)), run_config(**{"precision.name": "fp8"}))
    comp = compare.compare([(a, b)], out_dir=tmp_path / "short")
    assert comp.pairs[0].window_steps == 12 and comp.upward_trend == []
    report = (tmp_path / "short" / "report.md").read_text()
    assert "window too short (12 steps; a slope needs 30)" in report
    assert "no trend stated: a summary window is too short for a slope" in report
    assert compare.round_to_interval(49.487, -88.1279, 187.1019) == ("+50", "-90", "+190")
    assert compare.round_to_interval(0.0451, 0.0328, 0.0574) == ("+0.045", "+0.033", "+0.057")
    assert compare.round_to_interval(2.0, 2.0, 2.0) == ("+2", "+2", "+2")  # an exact fit keeps its digits
    long_a = write_run(tmp_path, "fp8_long", baseline_loss() * 1.001, run_config())
    long = compare.compare([(long_a, write_run(tmp_path, "bf16_long", baseline_loss(), run_config()))],
                           out_dir=tmp_path / "long")
    p = long.pairs[0]
    text = compare.slope_text(p)
    assert p.window_steps == 40 and text == "{} [{}, {}]".format(*compare.round_to_interval(
        p.slope.per_step * 1e5, p.slope.ci_low * 1e5, p.slope.ci_high * 1e5))


def test_the_health_plot_marks_each_sampled_step(tmp_path):
    run = compare.load_run(write_run(tmp_path, "h", baseline_loss()[:20], run_config(), health=True))  # 2 samples
    plt = compare._plt()
    fig = compare.fp8_health_figure(plt, [run])
    lines = [line for ax in fig.axes for line in ax.get_lines()]
    assert lines and all(line.get_marker() == "o" and len(line.get_xdata()) == 2 for line in lines)
    assert "(2 sampled steps)" in fig.axes[0].get_title()
    plt.close(fig)


def test_the_loss_plot_smooths_as_its_label_says(tmp_path):
    plt = compare._plt()
    long = compare.load_run(write_run(tmp_path, "long", baseline_loss(), run_config()))
    fig = compare.loss_figure(plt, [(long, long)], [], "loss")
    ax = fig.axes[0]
    assert ax.get_ylabel() == "loss (moving average over 11 steps; faint: per step)"
    raw, averaged = (line.get_ydata() for line in ax.get_lines())
    assert np.allclose(raw, long.series("loss")[1]) and np.allclose(averaged, compare.smooth(raw, 11))
    truth = 2.0 + 8.0 * np.exp(-np.arange(1, COMPARE_STEPS + 1) / 40)  # baseline_loss without its noise
    inner = slice(20, -20)  # past the steep start, where a moving average lags
    assert np.std((averaged - truth)[inner]) < 0.5 * np.std((raw - truth)[inner])  # visibly smoother
    plt.close(fig)
    short = compare.load_run(write_run(tmp_path, "short", baseline_loss()[:20], run_config()))
    fig = compare.loss_figure(plt, [(short, short)], [], "loss")
    assert fig.axes[0].get_ylabel() == "loss (per step)" and len(fig.axes[0].get_lines()) == 1
    plt.close(fig)


def test_unexpected_config_differences_come_first(tmp_path):
    base = baseline_loss()
    expected = {"precision.name": "fp8", "optim.name": "fp8_adamw", "train.seed": 2, "train.save_every": 10,
                "logging.level": "debug"}
    b = write_run(tmp_path, "bf16", base, run_config())
    a = write_run(tmp_path, "fp8", base, run_config(**expected, **{"optim.lr": 1e-3}))
    with pytest.warns(compare.ConfigMismatchWarning):
        compare.compare([(a, b)], out_dir=tmp_path / "out")
    report = (tmp_path / "out" / "report.md").read_text()
    assert "⚠ **fp8 vs bf16: 1 unexpected config difference**" in report.split("## Plots")[0]
    section = report.split("## Config differences")[1]
    assert section.index("`optim.lr`") < section.index("<details>") < section.index("`precision.name`")
    assert "⚠ 1 unexpected difference (beyond precision, optimizer, seed and bookkeeping):" in section
    assert "6 expected differences (precision, optimizer, seed, bookkeeping)</summary>" in section
