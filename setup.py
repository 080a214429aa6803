"""Builds the compiled runtime, rtp._runtime, from rtp/_runtime.pyx.

Everything else about the package lives in pyproject.toml. Set RTP_ANNOTATE=1 to
write Cython's annotated HTML (rtp/_runtime.html) and check that the hot paths
stay free of Python interaction (no yellow lines).
"""
import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

extension = Extension(
    "rtp._runtime",
    sources=["rtp/_runtime.pyx"],
    include_dirs=[np.get_include()],
    extra_compile_args=["-O3"],
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
)

setup(
    ext_modules=cythonize(
        [extension],
        language_level=3,
        annotate=os.environ.get("RTP_ANNOTATE") == "1",
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
            "embedsignature": True,
        },
    ),
)
