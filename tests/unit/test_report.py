from milestone_cli.report import moving_average


def test_moving_average_window() -> None:
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([], 3) == []
