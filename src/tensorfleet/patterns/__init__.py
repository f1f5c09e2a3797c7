"""Cluster patterns beyond data parallelism: one module per pattern.

* :mod:`~tensorfleet.patterns.sweep`: hyperparameter sweeps (grid, random, Optuna samplers
  and pruners), as many trials at once as there are slots, resumable
  (``tensorfleet sweep CONFIG``);
* :mod:`~tensorfleet.patterns.ensemble`: K models trained in parallel, the averaged
  prediction evaluated next to each member;
* :mod:`~tensorfleet.patterns.cross_validation`: k folds over the workers, one fold each;
* :mod:`~tensorfleet.patterns.broadcast`: a trainer publishes versioned weight snapshots,
  any number of subscribers always get the newest one;
* :mod:`~tensorfleet.patterns.actor_learner`: actors produce samples into a learner's
  bounded queue and follow its weights;
* :mod:`~tensorfleet.patterns.pbt`: population-based training, the members in their own
  namespaces on one ps task, the worst copying the best on the ps (``tensorfleet pbt CONFIG``);
* :mod:`~tensorfleet.patterns.preloaded_interpreter`: ``preload()``, one interpreter that
  imported torch once and forks the executor of every later sweep of the program.

The layer sits above ``session`` (it composes training sessions and the wire) and below
``launch`` (whose CLI registers ``tensorfleet sweep``); see docs/patterns.md.
"""
