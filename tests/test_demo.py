"""The demo's before -> after table (the run itself is tests/integration and `make demo`)."""

from horizonrl.demo import before_after_table


def result(rate, episodes, categories=None):
    return {"success_rate": rate, "episodes_valid": episodes,
            "categories": {c: {"success_rate": r, "episodes_valid": n} for c, (r, n) in (categories or {}).items()}}


def test_one_row_per_environment_and_per_category_when_there_are_several():
    before = {"babyai": result(0.3, 200, {"GoToDoor": (0.4, 67), "GoToRedBall": (0.2, 133)}),
              "signpost": result(0.11, 100, {"length 2": (0.11, 100)})}
    after = {"babyai": result(0.9, 198, {"GoToDoor": (0.95, 66), "GoToRedBall": (0.87, 132)}),
             "signpost": result(0.97, 100, {"length 2": (0.97, 100)})}
    lines = before_after_table(before, after).splitlines()
    assert len(lines) == 5  # header, babyai, its two levels, signpost (one category: no sub-rows)
    assert lines[1].split() == ["babyai", "0.30", "->", "0.90", "(198)"]
    assert lines[2].split() == ["GoToDoor", "0.40", "->", "0.95", "(66)"]
    assert lines[3].split() == ["GoToRedBall", "0.20", "->", "0.87", "(132)"]
    assert lines[4].split() == ["signpost", "0.11", "->", "0.97", "(100)"]
