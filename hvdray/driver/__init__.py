"""The Ray side of hvdray, run in the user's process: the executor facade and what it drives.

``executor`` (RayExecutor, its arguments checked in ``arguments``) -> ``worker_group`` (the actors of
one run: start, run, drain, stop) and, for elastic jobs, ``controller`` (the state machine) with its
``policies``; ``placement`` (all resource arithmetic), ``coordinator`` (the actor that assigns ranks
and holds the rendezvous), ``discovery``, ``callbacks``, ``cluster`` (connecting to Ray).
Nothing here imports torch: a driver can run where only Ray is installed.
"""
