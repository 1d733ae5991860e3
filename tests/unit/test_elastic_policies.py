"""The elastic job's failure and scaling policies: pure decisions, checked with a fake clock (no Ray)."""

from __future__ import annotations

from hvdray.driver.policies import (
    DEFAULT_COOLDOWN_RANGE,
    Blacklist,
    ElasticLimits,
    FailurePolicy,
    RunErrorDecision,
    ScalingPolicy,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _limits(min_workers=2, max_workers=4, reset_limit=None, cooldown_range=None, elastic_timeout=10.0):
    return ElasticLimits(min_workers, max_workers, reset_limit, cooldown_range, elastic_timeout)


def test_blacklist_backs_off_exponentially_up_to_the_range_end():
    clock = FakeClock()
    blacklist = Blacklist((1.0, 3.0), clock)
    assert [blacklist.add("n") for _ in range(4)] == [1.0, 2.0, 3.0, 3.0]
    assert blacklist.blocked("n")
    clock.now += 3.01
    assert not blacklist.blocked("n")


def test_failure_policy_marks_nodes_of_lost_workers_and_dead_starts_only_for_a_bounded_cooldown():
    clock = FakeClock()
    policy = FailurePolicy(reset_limit=None, cooldown_range=None, clock=clock)
    nodes = ["a", "b", "c"]
    assert policy.usable("a") and policy.usable("b")
    assert policy.start_failed("a", worker_died=False, known_nodes=nodes) is None  # a timeout: discovery decides
    assert policy.usable("a")
    low, high = DEFAULT_COOLDOWN_RANGE  # no cooldown range: the default one, never for good
    assert policy.start_failed("a", worker_died=True, known_nodes=nodes) == low
    assert policy.worker_lost("b", nodes) == low
    assert not policy.usable("a") and not policy.usable("b")
    clock.now += high + 1
    assert policy.usable("a") and policy.usable("b")


def test_the_last_usable_node_is_never_blacklisted():
    policy = FailurePolicy(reset_limit=None, cooldown_range=(5.0, 10.0), clock=FakeClock())
    assert policy.worker_lost("a", ["a"]) is None and policy.usable("a")  # the only node
    assert policy.worker_lost("a", ["a", "b"]) == 5.0 and not policy.usable("a")
    assert policy.worker_lost("b", ["a", "b"]) is None and policy.usable("b")  # "a" is cooling down
    assert policy.start_failed("b", worker_died=True, known_nodes=["a", "b"]) is None


def test_failure_policy_counts_resets_against_the_limit():
    assert FailurePolicy(None, None).reset_refusal(1000) is None
    policy = FailurePolicy(reset_limit=2, cooldown_range=None)
    assert policy.reset_refusal(0) is None and policy.reset_refusal(1) is None
    assert "reset number 3" in policy.reset_refusal(2) and "reset_limit=2" in policy.reset_refusal(2)


def test_failure_policy_ignores_only_errors_of_workers_outside_the_ring_while_finishing():
    decide = FailurePolicy.run_error
    assert decide(in_ring=True, finishing=False) is RunErrorDecision.RAISE
    assert decide(in_ring=True, finishing=True) is RunErrorDecision.RAISE
    assert decide(in_ring=False, finishing=False) is RunErrorDecision.RAISE
    assert decide(in_ring=False, finishing=True) is RunErrorDecision.IGNORE


def test_scaling_policy_fills_free_slots_within_max_workers_skipping_unusable_nodes():
    policy = ScalingPolicy(_limits(max_workers=4))
    slots = {"c": 3, "a": 2, "b": 5}
    # 1 worker already runs on a; b is blacklisted; nodes are filled in id order
    free = policy.free_slots(slots, held={"a": 1}, workers=1, usable=lambda n: n != "b")
    assert free == {"a": 1, "c": 2}
    assert policy.free_slots(slots, held={}, workers=4, usable=lambda n: True) == {}


def test_scaling_policy_gives_up_only_after_elastic_timeout_below_minimum():
    clock = FakeClock()
    policy = ScalingPolicy(_limits(min_workers=2, elastic_timeout=10.0), clock)
    assert policy.enough(2) and not policy.enough(1)
    assert policy.below_minimum(1) is None  # starts waiting
    clock.now += 10.0
    assert policy.below_minimum(1) is None  # exactly the timeout: still waiting
    assert policy.below_minimum(3) is None  # enough again: the wait is over
    clock.now += 5.0
    assert policy.below_minimum(1) is None  # a new wait starts here
    clock.now += 10.5
    reason = policy.below_minimum(0)
    assert reason is not None and "min_workers=2" in reason and "elastic_timeout=10.0" in reason
