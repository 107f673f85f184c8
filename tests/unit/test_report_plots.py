"""The report's figures and page: files exist, are PNGs, are not empty; the page embeds them."""

import pytest

from cpbench.report import page, plots, units
from cpbench.report.units import GIB, parse_bytes
from tests.report_fixtures import make_run

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return page.write_report(make_run(), tmp_path_factory.mktemp("report"), capacity=0.25 * 1024**3)


def test_every_figure_is_a_non_empty_png(report):
    assert set(report.plots) == set(plots.FIGURES)
    for path in report.plots.values():
        data = path.read_bytes()
        assert data.startswith(PNG) and len(data) > 5_000, path


def test_html_page_is_self_contained_with_table_and_images(report):
    text = report.html.read_text()
    assert text.count("data:image/png;base64,") == len(plots.FIGURES)
    assert "out of memory" in text and "cp 2 · cp_ring" in text
    assert 'src="plots/' not in text


def test_markdown_page_links_the_images_beside_it(report):
    text = report.markdown.read_text()
    for path in report.plots.values():
        assert f"]({path.relative_to(report.markdown.parent).as_posix()})" in text
    assert report.table.read_text().startswith("| seq len |")


def test_a_run_where_nothing_finished_still_draws_its_failures_and_writes_no_empty_figure(tmp_path):
    frame = make_run(seq_lens=(256,), cp_sizes=(1,), oom_cp1_at=256)
    paths, omitted = page.save_figures(frame, tmp_path)
    assert "memory" in paths and "time" not in paths and "parity" not in paths  # the oom point, at its peak
    assert set(omitted) == set(page.FIGURES) - set(paths) and "no point finished ok" in omitted["time"]
    assert all(p.read_bytes().startswith(PNG) for p in paths.values())


def _lines(fig):
    return {line.get_label(): line.get_ydata()[0] for line in fig.axes[0].get_lines() if len(set(line.get_ydata())) == 1}


def _unit(fig) -> float:
    """Bytes per unit of a memory figure's axis, read from its label."""
    label = fig.axes[0].get_ylabel()
    return {"(GiB)": GIB, "(MiB)": 1024**2, "(KiB)": 1024}[label[label.rindex("("):]]


def test_the_capacity_line_is_drawn_where_parse_bytes_puts_it():
    frame = make_run(oom_cp1_at=None)
    fig = plots.memory_figure(frame, capacity=parse_bytes("1.5GB", field_name="--device-memory"))
    label = "device capacity (report --device-memory)"  # the line is named for where it came from
    assert _lines(fig)[label] * _unit(fig) == pytest.approx(1.5e9)  # GB is 10^9 bytes
    fig = plots.memory_figure(frame, capacity=parse_bytes("2GiB"))
    assert _lines(fig)[label] * _unit(fig) == pytest.approx(2 * GIB)


def test_without_a_capacity_the_runs_own_is_drawn():
    frame = make_run()  # cp=1 ran out of a 256 MiB budget
    fig = plots.memory_figure(frame)
    label = "capacity per rank the run was checked against"  # a sweep's budget, or an estimate's --device-memory
    assert {k: v * _unit(fig) for k, v in _lines(fig).items()} == {label: pytest.approx(0.25 * GIB)}
    assert label not in _lines(plots.memory_figure(frame, capacity=GIB))


def test_every_figure_draws_a_projected_run_and_says_so():
    from tests.report_fixtures import make_run, projected

    frame = projected(make_run())
    for name, draw in plots.FIGURES.items():
        fig = draw(frame)
        assert plots.png_bytes(fig), name
    assert "(projected)" in plots.memory_figure(frame).axes[0].get_title()


def _colors(fig) -> dict:
    """label -> colour of every line of a figure's axes."""
    return {line.get_label(): line.get_color() for ax in fig.axes for line in ax.get_lines()}


def test_a_configuration_has_one_colour_in_every_figure():
    frame = make_run(oom_cp1_at=None)
    colors = plots.config_colors(frame)
    memory, time = _colors(plots.memory_figure(frame)), _colors(plots.time_figure(frame))
    scaling = _colors(plots.scaling_figure(frame))
    for config, color in colors.items():
        for seen in (memory, time):
            if config in seen:
                assert seen[config] == color, (config, seen[config], color)
        if f"{config}: peak" in scaling:
            assert scaling[f"{config}: peak"] == color
    assert len(set(map(tuple, colors.values()))) == len(colors)  # and no two configurations share one


def test_lengths_read_16k_and_1M_and_legends_stand_outside():
    assert [units.seq_label(n) for n in (512, 1536, 16384, 1 << 20, 3 << 20)] == ["512", "1.5k", "16k", "1M", "3M"]
    fig = plots.memory_figure(make_run())
    ax = fig.axes[0]
    assert ax.xaxis.get_major_formatter()(16384, 0) == "16k"
    anchor = ax.get_legend().get_bbox_to_anchor().transformed(ax.transAxes.inverted())
    assert anchor.x0 >= 1.0  # right of the axes, never over the data


def test_an_out_of_memory_point_is_drawn_at_its_projected_peak():
    from tests.report_fixtures import projected

    frame = projected(make_run())
    frame.loc[frame["status"] == "oom", "peak_bytes"] = 300 * 1024**2  # a projection records the peak it found
    oom = frame[frame["status"] == "oom"].iloc[0]
    fig = plots.memory_figure(frame, capacity=0.25 * GIB)
    marks = [c for c in fig.axes[0].collections if "out of memory (at its peak)" in c.get_label()]
    assert marks and any(pytest.approx(oom["peak_bytes"]) == y * _unit(fig) for c in marks for _, y in c.get_offsets())


def test_a_projected_report_writes_no_empty_time_or_parity_figure(tmp_path):
    from tests.report_fixtures import projected

    paths, omitted = page.save_figures(projected(make_run()), tmp_path)
    assert "memory" in paths and "time" not in paths and "parity" not in paths
    assert "estimate --gpu" in omitted["time"] and "parity verdict" in omitted["parity"]  # each says why


def _timed(frame):
    """A projection priced on a GPU profile, as `estimate --gpu h100-sxm` writes it."""
    ran = frame["status"] == "ok"
    return frame.assign(projected_step_s=ran.map({True: 0.25, False: float("nan")}).astype(float),
                        projected_tokens_per_s=ran.map({True: 4096.0, False: float("nan")}).astype(float),
                        gpu_profile=ran.map({True: "h100-sxm", False: None}))


def test_a_projected_report_names_its_gpu_profile_at_the_top_and_fills_every_time_cell(tmp_path):
    from cpbench.report import tables
    from tests.report_fixtures import projected

    frame = _timed(projected(make_run()))
    files = page.write_report(frame, tmp_path)
    lines = files.markdown.read_text().splitlines()
    assert lines[2].startswith("Projected times are priced on the GPU profile `h100-sxm`, shipped with cpbench")
    assert "priced on the GPU profile `h100-sxm`" in files.html.read_text()
    ok = tables.points(frame)[frame["status"].eq("ok").to_numpy()]
    assert set(ok["step median"]) == {"250 ms projected"} and set(ok["tokens/s per GPU"]) == {
        f"{4096 / w:g} projected" for w in frame.loc[frame["status"] == "ok", "world_size"]}
    from cpbench.report.derive import profile_note

    assert profile_note(make_run()) is None  # a measured run's times are its own: the page opens on its title


def test_series_with_equal_values_stay_visible_side_by_side_with_their_own_markers():
    frame = make_run(backends=("eager", "sdpa"), oom_cp1_at=None)
    frame["peak_bytes"] = 40 * 1024**2  # every configuration at one value: drawn on top of each other before
    lines = [line for line in plots.memory_figure(frame).axes[0].get_lines() if line.get_label() in
             set(plots.config_colors(frame))]
    assert len(lines) == len(plots.config_colors(frame)) == 6
    assert len({tuple(line.get_xdata()) for line in lines}) == 6  # each configuration a little aside
    assert len({line.get_marker() for line in lines}) == 6
    for line in lines:  # aside by under 10 % of the length: still read at it
        assert all(abs(x / s - 1) < 0.1 for x, s in zip(line.get_xdata(), sorted(frame["seq_len"].unique())))


def test_memory_is_drawn_in_the_unit_its_values_read_in():
    small = make_run(oom_cp1_at=None)  # peaks of MiB: a GiB axis drew them flat at 0.00
    fig = plots.memory_figure(small)
    assert fig.axes[0].get_ylabel() == "peak memory per rank (MiB)"
    assert max(max(line.get_ydata()) for line in fig.axes[0].get_lines()) > 1
    assert plots.breakdown_figure(small).axes[0].get_ylabel() == "MiB (rank with the highest peak)"
    large = small.assign(peak_bytes=small["peak_bytes"] * 4096)
    assert plots.memory_figure(large).axes[0].get_ylabel() == "peak memory per rank (GiB)"


def test_throughput_is_per_gpu_from_zero_and_every_panel_is_titled():
    frame = make_run(oom_cp1_at=None)
    step_ax, tps_ax = plots.time_figure(frame).axes
    assert "per GPU" in tps_ax.get_title() and "per GPU" in tps_ax.get_ylabel()
    ok = frame[(frame["status"] == "ok") & (frame["cp_size"] == 2)]
    per_gpu = sorted(ok["tokens_per_s"] / ok["world_size"])
    drawn = sorted(y for line in tps_ax.get_lines() for y in line.get_ydata())
    assert any(pytest.approx(per_gpu[0]) == y for y in drawn) and max(drawn) < frame["tokens_per_s"].max()
    assert step_ax.get_ylim()[0] == tps_ax.get_ylim()[0] == 0  # a 7 % difference reads as 7 %
    for fig in (plots.time_figure(frame), plots.scaling_figure(frame)):
        assert all(ax.get_title() for ax in fig.axes if ax.axison)


def test_a_projected_time_says_its_gpu_and_draws_no_bars_it_does_not_have():
    from tests.report_fixtures import projected

    frame = _timed(projected(make_run()))
    step_ax, tps_ax = plots.time_figure(frame).axes
    assert "bars" not in step_ax.get_ylabel() and step_ax.get_title().endswith("(projected) on h100-sxm")
    speed_ax = plots.scaling_figure(frame).axes[0]
    assert speed_ax.get_title().endswith("on h100-sxm")


def test_one_length_is_drawn_as_points_and_a_fit_that_nothing_limited_is_not_drawn(tmp_path):
    frame = make_run(seq_lens=(512,), oom_cp1_at=None)
    lines = plots.memory_figure(frame).axes[0].get_lines()
    assert lines and all(line.get_linestyle() == "None" for line in lines if len(line.get_xdata()) == 1)
    paths, omitted = page.save_figures(frame, tmp_path)
    assert "largest_fit" not in paths and "nothing failed to set a limit" in omitted["largest_fit"]
    _, omitted = page.save_figures(make_run(), tmp_path / "limited")  # cp 1 out of memory at 1024: drawn
    assert "largest_fit" not in omitted


def test_a_capacity_that_dwarfs_the_peaks_is_written_not_drawn():
    frame = make_run(oom_cp1_at=None)  # peaks of MiB
    fig = plots.memory_figure(frame, capacity=80 * GIB)
    label = "device capacity (report --device-memory)"
    assert label not in _lines(fig)  # drawn, it would flatten the MiB points against the axis
    said = [t.get_text().replace("\n", " ") for t in fig.axes[0].get_legend().get_texts()]
    assert any(t.startswith(label) and "80" in t and "off the scale" in t for t in said), said
    assert fig.axes[0].get_ylim()[1] * _unit(fig) < GIB
