"""The report's figures and page: files exist, are PNGs, are not empty; the page embeds them."""

import pytest

from cpbench.report import page, plots
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


def test_a_run_where_nothing_finished_still_draws(tmp_path):
    frame = make_run(seq_lens=(256,), cp_sizes=(1,), oom_cp1_at=256)
    paths = plots.save_all(frame, tmp_path)
    assert all(p.read_bytes().startswith(PNG) for p in paths.values())


def _lines(fig):
    return {line.get_label(): line.get_ydata()[0] for line in fig.axes[0].get_lines() if len(set(line.get_ydata())) == 1}


def test_the_capacity_line_is_drawn_where_parse_bytes_puts_it():
    frame = make_run(oom_cp1_at=None)
    lines = _lines(plots.memory_figure(frame, capacity=parse_bytes("1.5GB", field_name="--device-memory")))
    assert lines["device capacity"] == pytest.approx(1.5e9 / GIB)  # GB is 10^9 bytes, drawn in GiB
    assert _lines(plots.memory_figure(frame, capacity=parse_bytes("2GiB")))["device capacity"] == pytest.approx(2.0)


def test_without_a_capacity_the_sweeps_memory_budget_is_drawn():
    frame = make_run()  # cp=1 ran out of a 256 MiB budget
    assert _lines(plots.memory_figure(frame)) == {"memory budget": pytest.approx(0.25)}
    assert "memory budget" not in _lines(plots.memory_figure(frame, capacity=GIB))


def test_every_figure_draws_a_projected_run_and_says_so():
    from tests.report_fixtures import make_run, projected

    frame = projected(make_run())
    for name, draw in plots.FIGURES.items():
        fig = draw(frame)
        assert plots.png_bytes(fig), name
    assert "(projected)" in plots.memory_figure(frame).axes[0].get_title()
