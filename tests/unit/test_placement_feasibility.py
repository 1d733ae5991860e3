"""Which placement groups the alive nodes can never hold (placement.infeasibility), without Ray."""

from __future__ import annotations

import pytest

from hvdray.driver.placement import NodeResources, describe_nodes, infeasibility

A = NodeResources("a" * 8, "10.0.0.1", {"CPU": 2.0}, {"CPU": 1.0})
B = NodeResources("b" * 8, "10.0.0.1", {"CPU": 2.0, "GPU": 1.0, "disk_io": 2.0}, {"CPU": 2.0})  # same host: 2 nodes


@pytest.mark.parametrize(
    "bundles, strategy, why",
    [
        ([{"CPU": 2}] * 2, "PACK", None),
        ([{"CPU": 2}] * 3, "PACK", "the nodes hold 2 bundle(s) of {'CPU': 2} at most, 3 are asked for"),
        ([{"CPU": 1}] * 4, "SPREAD", None),
        ([{"CPU": 3}], "PACK", "no node has {'CPU': 3} for one bundle"),
        ([{"CPU": 1, "GPU": 1}], "PACK", None),
        ([{"CPU": 1, "GPU": 1}] * 2, "PACK", "the nodes hold 1 bundle(s)"),
        ([{"CPU": 1, "disk_io": 1}] * 2, "PACK", None),  # a custom resource
        ([{"CPU": 1, "tpu": 1}], "PACK", "no node has {'CPU': 1, 'tpu': 1}"),
        ([{"CPU": 1}] * 2, "STRICT_SPREAD", None),
        ([{"CPU": 1}] * 3, "STRICT_SPREAD", "STRICT_SPREAD needs 3 distinct nodes that each fit a bundle, and 2 do"),
        ([{"CPU": 1, "GPU": 0.5}] * 2, "STRICT_SPREAD", "and 1 do"),
        ([{"CPU": 1}] * 2, "STRICT_PACK", None),
        ([{"CPU": 1}] * 3, "STRICT_PACK", "STRICT_PACK needs one node with {'CPU': 3}"),
        ([{"CPU": 1}, {"CPU": 2}, {"CPU": 1}], "PACK", None),
        ([{"CPU": 1}, {"CPU": 2}, {"CPU": 2}], "PACK", "the bundles need 5 CPU and the nodes hold 4"),
    ],
)
def test_infeasibility_per_strategy(bundles, strategy, why):
    found = infeasibility(bundles, strategy, [A, B])
    assert (found is None) if why is None else (why in found), found


def test_no_nodes_hold_nothing_and_nodes_are_listed_by_id():
    assert "no node has" in infeasibility([{"CPU": 1}], "PACK", [])
    text = describe_nodes([A, B], ["CPU", "GPU"])
    assert text.splitlines() == [
        f"  node {'a' * 8} (10.0.0.1): CPU 2 total / 1 free, GPU 0 total / 0 free",
        f"  node {'b' * 8} (10.0.0.1): CPU 2 total / 2 free, GPU 1 total / 0 free",
    ]
