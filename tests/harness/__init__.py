"""The suite's ways of starting ranks (the public part, for users' own tests,
is ``nccl_pg.testing``: ``run_threads``/``run_ranks`` with a default group
initialized for them). Pick by what the test needs:

- ``harness.forked.run_world``: a scenario function on a world of processes
  forked from a preloaded forkserver (tens of milliseconds per world), which
  rendezvous themselves over a FileStore; ``backend="simnccl"`` runs the
  NCCL backend on the simulated bindings (tests/simnccl). Most group-level
  tests.
- ``harness.procs.World``: fresh interpreters around a TCPStore served by the
  test, for faults (kill, SIGSTOP, exit codes, hangs), the exit path
  (atexit), fork safety; scenarios are functions of a ``Ctx``
  (``harness.pg_scenarios``: error handling and shrink on groups;
  ``harness.fault_scenarios``: the fault matrix's rank;
  ``harness.fork_scenarios``, ``harness.diagnosis_scenarios``;
  ``harness.comm_scenarios``: on communicators). ``harness.procs.run_scripts``
  runs a script as ranks.
- ``harness.threads``: host communicators of one group as threads of the
  test (no process group), with ``harness.cases``, the collective matrix
  checked against numpy; ``harness.sim_threads``: the same for NCCL
  communicators on the simulated bindings.
- ``harness.torch_ranks``: helpers for ``run_world`` scenarios that drive
  torch.distributed with backend "nccl_pg"; ``harness.pg_seed``: what the
  test_pg_*.py files share; ``harness.store_wire``: the store protocol by
  hand.

Every wait is bounded and every rank still running at the end is killed.
"""
