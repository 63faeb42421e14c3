"""Every benchmark, in one place.

* ``<name>.py``: ``timewheel bench <name>``, a module per subcommand (``add_parser`` and
  ``main``), with its workload;
* ``baselines.py``: every baseline a benchmark measures against;
* ``test_bench_<name>.py``: pytest-benchmark cases, parametrized over the contenders, so a
  case's ratios come from one run. They reuse the workloads and baselines above and are
  not part of the test suite (``testpaths`` is ``tests``); run them against the installed
  package by module name, e.g.
  ``python -m pytest --pyargs timewheel.cli.bench.test_bench_core --benchmark-disable-gc``.
"""
