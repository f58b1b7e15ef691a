import json

import pytest

from cppo_megatron.bench.report import Report, markdown_table, median, write_report


def test_median():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 2, 3]) == 2.5
    with pytest.raises(ValueError, match="median of no values"):
        median([])


def test_markdown_table_formats_values():
    text = markdown_table(["a", "b", "c"], [{"a": 1, "b": 0.123456, "c": None}, {"a": True, "b": 2e-5}])
    lines = text.splitlines()
    assert lines[0] == "| a | b | c |"
    assert lines[2] == "| 1 | 0.1235 | - |"
    assert lines[3] == "| yes | 2e-05 | - |"


def test_write_report_json_md_png(tmp_path):
    def plot(fig):
        fig.add_subplot(1, 1, 1).plot([0, 1], [1, 2])

    rep = Report("demo", "Demo", {"x": 1}, ["k", "v"], [{"k": 1, "v": float("nan")}, {"k": 2, "v": 0.5}],
                 notes=["a note"], extras={"extra": float("inf")}, plot=plot)
    paths = write_report(rep, tmp_path / "out")
    data = json.loads((tmp_path / "out" / "demo.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert data["rows"] == [{"k": 1, "v": None}, {"k": 2, "v": 0.5}]  # NaN written as null
    assert data["extra"] is None and data["params"] == {"x": 1}
    assert data["machine"]["cpu_count"] >= 1 and "torch" in data["machine"]
    md = (tmp_path / "out" / "demo.md").read_text()
    assert md.startswith("### Demo") and "- a note" in md and md.count("\n| ") == 3
    png = (tmp_path / "out" / "demo.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and set(paths) == {"json", "md", "png"}


def test_write_report_without_plot(tmp_path):
    paths = write_report(Report("x", "X", {}, ["a"], [{"a": 1}]), tmp_path, plot=True)
    assert set(paths) == {"json", "md"}


def test_markdown_table_column_formats():
    text = markdown_table(["x", "y"], [{"x": 1.0000123, "y": None}], {"x": ".6f", "y": ".2f"})
    assert text.splitlines()[2] == "| 1.000012 | - |"


def test_publish_without_matplotlib_still_writes_json_and_markdown(tmp_path, monkeypatch, capsys):
    import cppo_megatron._optional as optional
    from cppo_megatron.bench.report import publish

    def missing(module, purpose=""):
        raise optional.MissingDependency(f"{module} is needed for {purpose}. Install it: pip install ...")

    monkeypatch.setattr(optional, "require", missing)
    rep = Report("x", "X", {}, ["a"], [{"a": 1}], plot=lambda fig: None)
    paths = publish(rep, tmp_path)
    assert set(paths) == {"json", "md"} and (tmp_path / "x.json").exists() and (tmp_path / "x.md").exists()
    assert not (tmp_path / "x.png").exists()
    assert "no plot: matplotlib is needed" in capsys.readouterr().out


def test_plot_step_split_stacks_generation_under_the_rest_of_the_step():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from cppo_megatron.bench.report import plot_step_split

    table = [{"run": "grpo", "ms/prompt": 300.0, "ms/prompt gen": 120.0, "speedup": 1.0, "bound": 1.0},
             {"run": "cppo", "ms/prompt": 140.0, "ms/prompt gen": 110.0, "speedup": 2.14, "bound": 2.05}]
    fig = Figure()
    plot_step_split(fig, table, gen_label="timing_s/gen", title="veRL step time per prompt")
    (ax,) = fig.axes
    gen, rest = ax.containers
    assert [b.get_height() for b in gen] == [120.0, 110.0]
    assert [b.get_height() for b in rest] == [180.0, 30.0] and [b.get_y() for b in rest] == [120.0, 110.0]
    assert [t.get_text() for t in ax.texts] == ["1.00x (bound 1.00x)", "2.14x (bound 2.05x)"]
    assert ax.get_legend().get_texts()[0].get_text() == "generation (timing_s/gen)"
    assert ax.get_title() == "veRL step time per prompt"
