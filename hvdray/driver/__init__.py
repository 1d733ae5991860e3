"""The Ray side of hvdray, run in the user's process: the executor facade and what it drives.

``executor`` (RayExecutor, its arguments checked in ``arguments``) -> ``worker_group`` (the actors of
one run: start, run, drain, stop; ``records`` hands on what the workers log and report, ``failures``
names a failed rank) and, for elastic jobs, ``controller`` (the state machine) with its
``policies``; ``placement`` (all resource arithmetic), ``coordinator`` (the table that assigns ranks
and holds the rendezvous) and ``coordinator_host`` (where it lives: a job's first worker, or one actor
per driver), ``discovery``, ``callbacks``, ``cluster`` (connecting to Ray).
Nothing here imports torch: a driver can run where only Ray is installed.
"""
