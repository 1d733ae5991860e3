"""The Ray side of hvdray, run in the user's process: the executor facade and what it drives.

``executor`` (RayExecutor) -> ``worker_group`` (the actors of one run) and, for elastic jobs,
``controller`` (the state machine) with its ``policies``; ``placement`` (all resource arithmetic),
``coordinator`` (the actor that assigns ranks and holds the rendezvous), ``discovery``, ``callbacks``.
Nothing here imports torch: a driver can run where only Ray is installed.
"""
