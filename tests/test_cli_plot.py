"""`runnel plot RUN_DIR`: a PNG learning curve from a hand-written progress.csv."""
import pytest

from pipeline.cli.main import main
from pipeline.cli.plot import DEFAULT_FILENAME, PlotError, plot_learning_curve, read_progress

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# As ResultLogger writes it: evaluation columns appear late (earlier rows empty), NaN where no episode ended.
PROGRESS = """\
training_iteration,num_env_steps_sampled_lifetime,env_runners/episode_return_mean,env_runners/episode_len_mean,learners/default_policy/vf_loss,evaluation/env_runners/episode_return_mean
1,4000,nan,,5.0,
2,8000,21.5,21.5,4.0,
3,12000,35.0,35.0,3.5,40.0
4,16000,60.25,60.25,3.0,
5,20000,120.0,120.0,2.5,150.0
"""


def _one_error_line(capsys):
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("runnel: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "PPO_CartPole-v1_2025-01-01_12-00-00"
    d.mkdir()
    (d / "progress.csv").write_text(PROGRESS)
    return d


def _is_png(path):
    return path.read_bytes()[:8] == PNG_SIGNATURE


def test_plot_writes_png_into_the_run_dir_and_prints_its_path(run_dir, capsys):
    assert main(["plot", str(run_dir)]) == 0
    png = run_dir / DEFAULT_FILENAME
    assert png.is_file() and _is_png(png)
    out = capsys.readouterr().out
    assert str(png) in out
    assert "env_runners/episode_return_mean, evaluation/env_runners/episode_return_mean" in out
    assert "env steps sampled" in out and "(5 results)" in out


def test_plot_chosen_metrics_to_output_file(run_dir, tmp_path, capsys):
    out_file = tmp_path / "curve.png"
    assert main(["plot", str(run_dir), "--metric", "env_runners/episode_len_mean",
                 "--metric", "learners/default_policy/vf_loss", "--output", str(out_file)]) == 0
    assert _is_png(out_file)
    assert not (run_dir / DEFAULT_FILENAME).exists()
    assert "env_runners/episode_len_mean, learners/default_policy/vf_loss" in capsys.readouterr().out


def test_plot_from_python_without_evaluation_column(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "progress.csv").write_text("training_iteration,num_env_steps_sampled_lifetime,env_runners/episode_return_mean\n"
                                    "1,100,9.0\n2,200,11.0\n")
    plot = plot_learning_curve(str(d))
    assert plot.metrics == ["env_runners/episode_return_mean"]
    assert plot.x_key == "num_env_steps_sampled_lifetime" and plot.num_rows == 2
    assert plot.path == str(d / DEFAULT_FILENAME) and _is_png(d / DEFAULT_FILENAME)


def test_read_progress_keeps_numeric_columns_with_gaps_as_nan(run_dir):
    path, columns, rows = read_progress(str(run_dir))
    assert rows == 5 and path == str(run_dir / "progress.csv")
    returns = columns["env_runners/episode_return_mean"]
    assert returns[0] != returns[0] and returns[1:] == [21.5, 35.0, 60.25, 120.0]  # nan first
    evaluation = columns["evaluation/env_runners/episode_return_mean"]
    assert [v for v in evaluation if v == v] == [40.0, 150.0]


def test_plot_accepts_the_csv_file_itself(run_dir, tmp_path):
    plot = plot_learning_curve(str(run_dir / "progress.csv"), output=str(tmp_path / "x.png"))
    assert _is_png(tmp_path / "x.png") and plot.num_rows == 5


# --- errors ------------------------------------------------------------------------------------
def test_missing_run_dir(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nope")]) == 2
    line = _one_error_line(capsys)
    assert f"no such run directory: '{tmp_path / 'nope'}'" in line and "runnel train" in line


def test_dir_without_csv(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "holds no progress.csv" in _one_error_line(capsys)


def test_checkpoint_dir_points_at_its_run_dir(run_dir, capsys):
    ckpt = run_dir / "checkpoint_000005"
    ckpt.mkdir()
    assert main(["plot", str(ckpt)]) == 2
    line = _one_error_line(capsys)
    assert "looks like a checkpoint" in line and f"'{run_dir}'" in line


def test_results_dir_lists_its_runs(run_dir, capsys):
    assert main(["plot", str(run_dir.parent)]) == 2
    assert f"plot one of them: {run_dir.name}" in _one_error_line(capsys)


def test_empty_csv(tmp_path, capsys):
    (tmp_path / "progress.csv").write_text("")
    assert main(["plot", str(tmp_path)]) == 2
    assert "holds no results yet" in _one_error_line(capsys)


def test_unknown_metric_names_close_matches_and_existing_metrics(run_dir, capsys):
    assert main(["plot", str(run_dir), "--metric", "env_runners/episode_reward_mean"]) == 2
    line = _one_error_line(capsys)
    assert "no metric 'env_runners/episode_reward_mean'" in line
    assert "did you mean 'env_runners/episode_return_mean'" in line
    assert ("Metrics with values in this run: env_runners/episode_return_mean, env_runners/episode_len_mean, "
            "learners/default_policy/vf_loss, evaluation/env_runners/episode_return_mean") in line
    assert not (run_dir / DEFAULT_FILENAME).exists()


def test_default_metric_without_values_asks_for_metric(tmp_path, capsys):
    (tmp_path / "progress.csv").write_text("training_iteration,env_runners/episode_return_mean,learners/default_policy/bc_loss\n"
                                           "1,nan,0.5\n2,,0.25\n")
    assert main(["plot", str(tmp_path)]) == 2
    line = _one_error_line(capsys)
    assert "no values of env_runners/episode_return_mean" in line and "--metric" in line
    assert "learners/default_policy/bc_loss" in line
    # with the metric named it plots against training iterations (no env steps column)
    assert main(["plot", str(tmp_path), "--metric", "learners/default_policy/bc_loss"]) == 0
    assert "against training iteration" in capsys.readouterr().out
    assert _is_png(tmp_path / DEFAULT_FILENAME)


def test_output_in_missing_directory_or_unknown_type(run_dir, tmp_path, capsys):
    assert main(["plot", str(run_dir), "--output", str(tmp_path / "no" / "x.png")]) == 2
    assert "does not exist" in _one_error_line(capsys)
    with pytest.raises(PlotError, match="unknown image type 'bmpx'; use .png"):
        plot_learning_curve(str(run_dir), output=str(tmp_path / "x.bmpx"))
