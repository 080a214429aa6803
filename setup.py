"""Builds the compiled parts: the runtime (rtp/runtime/*.pyx) and the CPU decode
kernels (rtp/kernels/_cpu_kernels.pyx over the C files in rtp/kernels/csrc/).

Everything else about the package lives in pyproject.toml. Set RTP_ANNOTATE=1 to
write Cython's annotated HTML (rtp/runtime/*.html) and check that the hot paths
stay free of Python interaction (no yellow lines).

RTP_SANITIZE=address,undefined (any -fsanitize= list) builds every extension with
the sanitizers, frame pointers, debug info and -O1. Python is not sanitized, so such a
build runs only with the runtime preloaded: tools/sanitize.sh builds one in a copy of
the tree (never over the checkout's own extensions) and runs the kernel tests under it.
"""
import glob
import os
import platform
import sys

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

SANITIZE = os.environ.get("RTP_SANITIZE", "")
# -O1: reports with readable stacks, tests at a bearable speed. The kernels' target attributes
# and OpenMP still apply, so the same code paths run as in the -O3 build.
SANITIZE_COMPILE = [f"-fsanitize={SANITIZE}", "-fno-omit-frame-pointer", "-g", "-O1"] if SANITIZE else []
SANITIZE_LINK = [f"-fsanitize={SANITIZE}"] if SANITIZE else []

# The runtime: one extension per structure, cimporting each other through their .pxd files
# (rtp/runtime/*.pxd), so every cross-module call on the hot path is a C call.
RUNTIME_MODULES = ("common", "block_allocator", "radix_cache", "step_plan", "scheduler")
runtime = [
    Extension(
        f"rtp.runtime.{name}",
        sources=[f"rtp/runtime/{name}.pyx"],
        include_dirs=[np.get_include()],
        extra_compile_args=["-O3"] + SANITIZE_COMPILE,
        extra_link_args=SANITIZE_LINK,
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    for name in RUNTIME_MODULES
]

# The kernel ops' enum, call structs, replay table and Python entry points are generated from the op
# table (rtp/kernels/ops.py) before anything is compiled: a plain-Python step, so a build needs nothing
# beyond Cython. rtp/__init__.py and rtp/kernels/__init__.py import nothing, so this loads no torch.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rtp.kernels import ops_codegen  # noqa: E402

ops_codegen.write()

# The kernels carry their own target attributes (AVX-512 BF16) and are only called
# when the CPU reports the feature, so the module builds and imports anywhere x86. On AArch64
# the x86-64 files compile to nothing and csrc/arm/ holds the neon and dotprod paths (built for
# baseline ARMv8-A, which every AArch64 CPU runs; the dotprod path's file targets ARMv8.2-A + dot
# product itself and runs where the CPU's HWCAP reports it).
# -fopenmp links libgomp.so.1, which resolves to the copy torch has already loaded.
ARM = platform.machine() in ("aarch64", "arm64")
cpu_kernels = Extension(
    "rtp.kernels._cpu_kernels",
    # every C file under csrc/ (by concept: linear/, attention/, norm.c, ...): a new kernel file needs no edit here
    sources=["rtp/kernels/_cpu_kernels.pyx"] + sorted(glob.glob("rtp/kernels/csrc/**/*.c", recursive=True)),
    include_dirs=["rtp/kernels/csrc"],
    depends=sorted(glob.glob("rtp/kernels/csrc/**/*.h", recursive=True)),
    extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off"] + SANITIZE_COMPILE,
    extra_link_args=["-fopenmp"] + SANITIZE_LINK,
)
extensions = runtime + ([cpu_kernels] if platform.machine() in ("x86_64", "AMD64") or ARM else [])

ext_modules = cythonize(
    extensions,
    language_level=3,
    annotate=os.environ.get("RTP_ANNOTATE") == "1",
    compiler_directives={
        "boundscheck": False,
        "wraparound": False,
        "cdivision": True,
        "initializedcheck": False,
        "embedsignature": True,
    },
)
for ext in ext_modules:
    # on AArch64 (not yet built on an Arm machine here: its C is cross-compiled and run under qemu by
    # tests/kernels/test_arm_kernels.py) a failed kernel build leaves rtp on its torch paths, installable
    # (set after cythonize, which does not carry the flag over)
    ext.optional = ARM and ext.name == "rtp.kernels._cpu_kernels"

setup(ext_modules=ext_modules)
