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


def test_the_capacity_line_is_drawn_where_parse_bytes_puts_it():
    frame = make_run(oom_cp1_at=None)
    lines = _lines(plots.memory_figure(frame, capacity=parse_bytes("1.5GB", field_name="--device-memory")))
    label = "device capacity (--device-memory)"  # the line is named for where it came from
    assert lines[label] == pytest.approx(1.5e9 / GIB)  # GB is 10^9 bytes, drawn in GiB
    assert _lines(plots.memory_figure(frame, capacity=parse_bytes("2GiB")))[label] == pytest.approx(2.0)


def test_without_a_capacity_the_sweeps_memory_budget_is_drawn():
    frame = make_run()  # cp=1 ran out of a 256 MiB budget
    assert _lines(plots.memory_figure(frame)) == {"the suite's memory budget": pytest.approx(0.25)}
    assert "the suite's memory budget" not in _lines(plots.memory_figure(frame, capacity=GIB))


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
    ax = plots.memory_figure(frame, capacity=0.25 * GIB).axes[0]
    marks = [c for c in ax.collections if "out of memory (at its peak)" in c.get_label()]
    assert marks and any(pytest.approx(oom["peak_bytes"] / GIB) == y for c in marks for _, y in c.get_offsets())


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
    assert set(ok["step median"]) == {"250 ms projected"} and set(ok["tokens/s"]) == {"4096 projected"}
    from cpbench.report.derive import profile_note

    assert profile_note(make_run()) is None  # a measured run's times are its own: the page opens on its title
