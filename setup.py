"""Build the Cython extensions: the timing wheel and the timer tasks / purgatory core.

All Cython directives live here. ``TIMEWHEEL_DEBUG_BUILD=1`` turns bounds checks and
C assertions back on; ``TIMEWHEEL_CYTHON_TRACING=1`` builds with line tracing for
coverage and profilers.
"""

import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

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

setup(ext_modules=cythonize(extensions, compiler_directives=directives))
