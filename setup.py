"""Build the Cython extensions: the timing wheel and the timer tasks / purgatory core.

All Cython directives live here. ``TIMEWHEEL_DEBUG_BUILD=1`` turns bounds checks and
C assertions back on; ``TIMEWHEEL_CYTHON_TRACING=1`` builds with line tracing for
coverage and profilers.
"""

import os
import sys

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

#: Cores to build with: the three extensions are translated and compiled side by side
#: (about 0.7x the wall time of one after another on 2 cores: 38-41 s against 54-59 s for
#: the wheel, 2026-11-30). cythonize's processes only where they fork (Linux): elsewhere a
#: spawned process would run this file again.
JOBS = os.cpu_count() or 1


class ParallelBuildExt(build_ext):
    """build_ext compiling the extensions' C in parallel unless ``--parallel`` says."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = JOBS


DEBUG = os.environ.get("TIMEWHEEL_DEBUG_BUILD") == "1"
TRACING = os.environ.get("TIMEWHEEL_CYTHON_TRACING") == "1"

directives = {
    "language_level": "3",
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "cdivision": not DEBUG,
    "initializedcheck": DEBUG,
    "embedsignature": True,
    "linetrace": TRACING,
    "profile": TRACING,
}
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
if TRACING:
    macros += [("CYTHON_TRACE", "1"), ("CYTHON_TRACE_NOGIL", "1")]
if not DEBUG:
    macros.append(("NDEBUG", "1"))

extensions = [
    Extension(
        "timewheel._core",
        ["src/timewheel/_core.pyx"],
        include_dirs=[numpy.get_include()],
        define_macros=macros,
        extra_compile_args=["-O0", "-g"] if DEBUG else ["-O2"],
    ),
    Extension(
        "timewheel._impl._tasks_c",
        ["src/timewheel/_impl/_tasks_c.pyx"],
        define_macros=macros,
        extra_compile_args=["-O0", "-g"] if DEBUG else ["-O2"],
    ),
    Extension(
        "timewheel._impl._aio_c",
        ["src/timewheel/_impl/_aio_c.pyx"],
        define_macros=macros,
        extra_compile_args=["-O0", "-g"] if DEBUG else ["-O2"],
    ),
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives=directives,
        nthreads=JOBS if sys.platform.startswith("linux") else 0,
    ),
    cmdclass={"build_ext": ParallelBuildExt},
)
