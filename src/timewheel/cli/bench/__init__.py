"""Every benchmark of ``timewheel bench``, in one place.

* ``<name>.py``: ``timewheel bench <name>``, a module per subcommand (``add_parser`` and
  ``main``), with its workload;
* ``baselines.py``: every baseline a benchmark measures against, but the pipeline's:
  ``baseline_engines.py`` (the ``threads`` and ``asyncio`` dispatch engines, which send
  with ``requests`` and aiohttp) and ``engines.py`` (every engine by name, for
  ``timewheel pipeline --engine`` and ``timewheel bench pipeline``).

The pytest-benchmark cases, parametrized over the same contenders so that a case's ratios
come from one run, are the checkout's top-level ``bench/test_bench_<name>.py``; they
import these workloads and baselines and measure the installed package
(``python -m pytest bench/test_bench_core.py --benchmark-disable-gc``).
"""
