"""wanexp.generation.expert_routing: which expert (and adapter) serves each sampling step, as training routed."""
from __future__ import annotations

import pytest

from wanexp.generation import expert_routing

A14B = ["high", "low"]
STUDENT = [1000.0, 937.5, 833.3, 625.0]  # timesteps of four sampling steps, two on each side of t = 875


@pytest.mark.parametrize("trained, distilled, expected", [
    # flow matching: routed by the boundary; the untrained side on the other expert's base weights
    (["low"], False, [("high", False), ("high", False), ("low", True), ("low", True)]),
    (["high"], False, [("high", True), ("high", True), ("low", False), ("low", False)]),
    (["high", "low"], False, [("high", True), ("high", True), ("low", True), ("low", True)]),
    # distilled one-expert: every student step on the trained expert, as the rollout ran them
    (["low"], True, [("low", True)] * 4),
    (["high"], True, [("high", True)] * 4),
    # distilled on both experts: the rollout routed each student step by its sigma
    (["high", "low"], True, [("high", True), ("high", True), ("low", True), ("low", True)]),
    # the base model (a teacher): both experts, no adapter
    ([], False, [("high", False), ("high", False), ("low", False), ("low", False)]),
])
def test_a14b_steps_go_where_training_sent_them(trained, distilled, expected):
    routing = expert_routing(A14B, 0.875, trained, distilled)
    assert routing.plan(STUDENT) == expected
    assert set(routing.experts) == {e for e, _ in expected}  # the experts a sample needs loaded, no more


def test_a_dense_model_serves_every_step():
    routing = expert_routing(["dense"], None, ["dense"], True)
    assert routing.plan(STUDENT) == [("dense", True)] * 4 and routing.experts == ["dense"]


def test_the_routing_takes_a_familys_own_expert_names_in_its_order():
    """No expert name is wanexp's: a family's two experts, listed high-noise first (model.experts), route by the
    boundary; its one expert serves every step."""
    routing = expert_routing(["coarse", "fine"], 0.875, ["fine"], False)
    assert routing.plan(STUDENT) == [("coarse", False)] * 2 + [("fine", True)] * 2
    assert expert_routing(["only"], None, [], False).plan(STUDENT) == [("only", False)] * 4
