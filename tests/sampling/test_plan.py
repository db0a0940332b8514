"""Step plans: window placement schedules and their validation."""

import pytest

from flowrl.sampling import StepPlan, window_start


def test_full_sde_plan_covers_every_step():
    assert list(StepPlan(10).sde_steps) == list(range(10))
    assert StepPlan(10).leaves_per_root == 1


def test_window_and_tree_sizes():
    plan = StepPlan(10, sde_start=2, sde_size=4, branch_steps=(2, 4), branch_factor=3)
    assert list(plan.sde_steps) == [2, 3, 4, 5]
    assert plan.leaves_per_root == 9


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_steps=10, sde_start=8, sde_size=4), "does not fit"),
        (dict(num_steps=10, sde_start=0, sde_size=0), "does not fit"),
        (dict(num_steps=10, sde_start=2, sde_size=2, branch_steps=(5,), branch_factor=2), "inside the SDE window"),
        (dict(num_steps=10, branch_steps=(1,), branch_factor=1), "branch_factor"),
    ],
)
def test_impossible_plans_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StepPlan(**kwargs)


def test_sliding_window_moves_every_n_iterations_and_wraps():
    starts = [window_start(it, num_steps=10, size=4, mode="sliding", start_range=(0, 2), shift_every=2)
              for it in range(8)]
    assert starts == [0, 0, 1, 1, 2, 2, 0, 0]


def test_random_window_is_deterministic_and_stays_in_range():
    starts = [window_start(it, num_steps=10, size=3, mode="random", start_range=(1, 4), seed=7) for it in range(50)]
    again = [window_start(it, num_steps=10, size=3, mode="random", start_range=(1, 4), seed=7) for it in range(50)]
    assert starts == again
    assert set(starts) == {1, 2, 3, 4}


def test_fixed_window_and_bad_range():
    assert window_start(5, num_steps=10, size=2, mode="fixed", start_range=(3, 3)) == 3
    with pytest.raises(ValueError, match="invalid"):
        window_start(0, num_steps=10, size=4, start_range=(0, 7))
