from pathlib import Path

from milestone_cli.progress_view import format_eval
from milestone_cli.report import moving_average, render_report
from workflows.run_state import RunProgress
from workflows.contracts.step import StepSummary


def test_moving_average_window() -> None:
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([], 3) == []


def test_report_plots_eval_accuracy_when_present(tmp_path: Path) -> None:
    steps = [
        StepSummary(step=n, policy_version=n, data_cursor=4 * n, reward_mean=n / 10, reward_std=0.1, accuracy=n / 10,
                    loss=1.0 / n, step_seconds=1.0, phase_seconds={"rollout": 0.5, **({"eval": 0.2} if n % 2 == 0 else {})},
                    **({"eval_greedy": n / 20, "eval_pass_at_k": n / 10, "eval_k": 4, "eval_n": 8} if n % 2 == 0 else {}))
        for n in range(1, 5)
    ]
    p = RunProgress(run_id="r", state="completed", step=4, total_steps=4, policy_version=4, data_cursor=16, steps=steps)
    with_eval = render_report(p, tmp_path / "eval.png")
    without = render_report(p.model_copy(update={"steps": [s.model_copy(update={"eval_greedy": None}) for s in steps]}),
                            tmp_path / "plain.png")
    for png in (with_eval, without):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    widths = [matplotlib.image.imread(str(png)).shape[1] for png in (with_eval, without)]
    assert widths[0] > widths[1]  # the eval column
    assert format_eval(p) == "  eval after step 4 (v4, 8 held-out prompts): greedy 0.200, pass@4 0.400"
    assert format_eval(p.model_copy(update={"steps": steps[:1]})) is None


def test_report_of_a_fully_async_run_plots_staleness_and_buffer_depth(tmp_path: Path) -> None:
    from unittest import mock

    import matplotlib.axes

    steps = [
        StepSummary(step=n, policy_version=n, data_cursor=4 * n, reward_mean=0.1, reward_std=0.1, accuracy=0.1,
                    loss=0.5, step_seconds=1.0, phase_seconds={"rollout": 0.5, "train": 0.4},
                    rollout_version=max(0, n - 3) if n > 1 else 0, buffer_depth=min(2, 4 - n),
                    overlap_seconds=0.3 if n < 3 else 0.0)
        for n in range(1, 5)
    ]
    p = RunProgress(run_id="r", state="completed", step=4, total_steps=4, policy_version=4, data_cursor=16, steps=steps)
    with mock.patch.object(matplotlib.axes.Axes, "step", autospec=True,
                           side_effect=matplotlib.axes.Axes.step) as drawn:
        render_report(p, tmp_path / "async.png")
    labels = [call.kwargs.get("label") for call in drawn.call_args_list]
    assert labels == ["staleness (versions)", "buffer depth (batches)"]
    assert [list(call.args[2]) for call in drawn.call_args_list] == [[0, 1, 2, 2], [2, 2, 1, 0]]


def test_status_and_report_show_the_train_inference_gap(tmp_path: Path) -> None:
    """``milestone status``'s gap line (the last step's mean and max) and the report's gap
    curves (log scale, drawn only when a step has engine logprobs)."""
    from unittest import mock

    import matplotlib.axes

    from milestone_cli.progress_view import format_gap

    steps = [StepSummary(step=n, policy_version=n, data_cursor=4 * n, reward_mean=0.1, reward_std=0.1, accuracy=0.1,
                         loss=0.5, step_seconds=1.0, rollout_logprob_abs_diff=n * 1e-7,
                         rollout_logprob_abs_diff_max=n * 4e-7) for n in range(1, 4)]
    p = RunProgress(run_id="r", state="running", step=3, total_steps=4, policy_version=3, data_cursor=12, steps=steps)
    assert format_gap(p) == "  logprob gap engine vs trainer (step 3): mean 3.00e-07, max 1.20e-06"
    assert format_gap(p.model_copy(update={"mode": "sft"})) is None
    assert format_gap(p.model_copy(update={"steps": []})) is None
    for gap, drawn_labels in ((1e-7, ["logprob gap mean", "logprob gap max"]), (0.0, [])):
        run = p.model_copy(update={"steps": [s.model_copy(update={"rollout_logprob_abs_diff_max": gap})
                                             for s in steps]})
        with mock.patch.object(matplotlib.axes.Axes, "semilogy", autospec=True,
                               side_effect=matplotlib.axes.Axes.semilogy) as drawn:
            render_report(run, tmp_path / f"gap-{gap}.png")
        assert [call.kwargs.get("label") for call in drawn.call_args_list] == drawn_labels
