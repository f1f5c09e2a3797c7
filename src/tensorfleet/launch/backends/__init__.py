"""Where the launcher's tasks run: each backend starts a task's process, relays its output
lines, reports its exit and signals it; the supervisor (:mod:`tensorfleet.launch.supervisor`)
decides what to do about it, the same way for every backend.

- :mod:`~tensorfleet.launch.backends.local`: processes on this machine (the default), forked
  from the run's task fork server (:mod:`~tensorfleet.launch.backends.task_forks`) or fresh;
- :mod:`~tensorfleet.launch.backends.ray`: processes started by Ray actors on the nodes of an
  existing Ray cluster (``tensorfleet launch --backend ray``).

The interface they implement is in :mod:`~tensorfleet.launch.backends.base`.
"""
