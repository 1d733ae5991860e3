"""Ray actors and placement: the coordinator, the workers, and the placement group they live in."""
