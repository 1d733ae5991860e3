"""Framework-neutral collectives over a private Gloo group: topology, engine, ops."""
