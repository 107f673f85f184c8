"""Host memory in reports: where an offload lever put anything on the host, the points table gains the host memory
of a node and the bytes moved per step, the largest-fit table the host memory at the fit, and the breakdown plot a
hatched host bar beside each device bar; a run without host memory shows none of them."""

from __future__ import annotations

import pandas as pd

from cpbench.report import plots, tables
from tests.report_fixtures import make_run, projected

GIB = 1 << 30


def _with_host(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame.copy()
    ok = frame["status"] == "ok"
    frame.loc[ok, "host_peak_bytes"] = 3 * GIB
    frame.loc[ok, "host_node_peak_bytes"] = 24 * GIB
    for column, gib in (("host_params_bytes", 1), ("host_grads_bytes", 0.5), ("host_optimizer_bytes", 1),
                        ("host_activations_bytes", 0.5)):
        frame.loc[ok, column] = gib * GIB
    frame.loc[ok, "d2h_bytes"] = 2 * GIB
    frame.loc[ok, "h2d_bytes"] = 2 * GIB
    return frame


def test_tables_show_the_host_only_where_something_lives_there():
    plain = projected(make_run())
    assert "host per node" not in tables.points(plain) and "host per node at the fit" not in tables.fits(plain)
    host = _with_host(plain)
    points = tables.points(host)
    ok = points[points["status"].str.startswith("ok")]
    assert set(ok["host per node"]) == {"24.0 GiB"} and set(ok["host<->device per step"]) == {"4.00 GiB"}
    fits = tables.fits(host)
    assert "24.0 GiB" in set(fits["host per node at the fit"]) <= {"24.0 GiB", "–"}
    assert fits["peak at the fit"].str.endswith(" MiB").all()  # one unit for the column, picked from its values


def test_the_breakdown_plot_draws_a_host_bar_beside_the_device_bar():
    fig = plots.breakdown_figure(_with_host(projected(make_run())))
    labels = {t.get_text() for ax in fig.axes for legend in [ax.get_legend()] if legend for t in legend.get_texts()}
    assert {"host: parameters", "host: checkpoints", "device: activations"} <= labels
    hatched = [p for p in fig.axes[0].patches if p.get_hatch() == "//"]
    device = [p for p in fig.axes[0].patches if not p.get_hatch()]
    assert hatched and hatched[0].get_x() >= device[0].get_x() + device[0].get_width() - 1e-9  # beside, not on top
    plain = plots.breakdown_figure(projected(make_run()))
    assert not [p for p in plain.axes[0].patches if p.get_hatch()]
