"""Builds fastkern._C with setuptools alone: gcc for csrc/**/*.c, nvcc for csrc/cuda/**/*.cu.

Environment:
  FASTKERN_CUDA=auto|0|1    build the CUDA kernels when nvcc is found (auto), never, or always
  FASTKERN_CUDA_ARCHS=...   targets, comma separated: sm_XY -> SASS, compute_XY -> PTX
                            (default sm_80,sm_90a,compute_90)
  FASTKERN_JOBS=N           parallel compile jobs (default: the CPU count)
  FASTKERN_NVCC_FLAGS=...   extra nvcc flags (e.g. -Xptxas -v, or -D switches for experiments)
  CUDA_HOME                 where to find nvcc and libcudart_static.a (else nvcc on PATH)

The CUDA runtime is linked statically, so the module imports on machines with no driver, and the
module is abi3 (Py_LIMITED_API), so one build serves every CPython >= 3.9.
"""
import glob
import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
LIMITED_API = "0x03090000"
DEFAULT_ARCHS = "sm_80,sm_90a,compute_90"
C_FLAGS = ["-std=c11", "-O3", "-Wall", "-Wextra", "-fPIC"]


CUDA_LIB_DIRS = ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib")


def cuda_lib_dir(home):
    for d in CUDA_LIB_DIRS:
        if os.path.exists(os.path.join(home, d, "libcudart_static.a")):
            return os.path.join(home, d)
    return None


def find_cuda_home():
    """A CUDA toolkit with bin/nvcc and libcudart_static.a, or None (FASTKERN_CUDA decides)."""
    setting = os.environ.get("FASTKERN_CUDA", "auto").strip().lower()
    if setting in ("0", "no", "off", "false"):
        return None
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for home in filter(None, candidates):
        if os.path.exists(os.path.join(home, "bin", "nvcc")) and cuda_lib_dir(home):
            return home
    if setting in ("1", "yes", "on", "true"):
        raise RuntimeError("FASTKERN_CUDA=1 but no CUDA toolkit (bin/nvcc and libcudart_static.a) "
                           "was found: set CUDA_HOME")
    return None


def gencode_flags(archs):
    flags = []
    for arch in (a.strip() for a in archs.split(",") if a.strip()):
        kind, _, number = arch.partition("_")
        if kind == "sm":
            flags.append(f"-gencode=arch=compute_{number},code=sm_{number}")
        elif kind == "compute":
            flags.append(f"-gencode=arch=compute_{number},code=compute_{number}")
        else:
            raise ValueError(f"FASTKERN_CUDA_ARCHS: {arch!r} is neither sm_XY nor compute_XY")
    return flags


class BuildFastkern(build_ext):
    """Compiles every source in parallel (C through the setuptools compiler, CUDA through nvcc)
    and links them into one shared object."""

    def build_extension(self, ext):
        cuda_home = find_cuda_home()
        sources = [s for s in ext.sources if s.endswith(".c")]
        cuda_sources = sorted(glob.glob("csrc/cuda/**/*.cu", recursive=True)) if cuda_home else []
        macros = list(ext.define_macros) + ([("FASTKERN_WITH_CUDA", "1")] if cuda_home else [])
        include_dirs = [sysconfig.get_paths()["include"]]
        archs = os.environ.get("FASTKERN_CUDA_ARCHS", DEFAULT_ARCHS)
        jobs = int(os.environ.get("FASTKERN_JOBS", os.cpu_count() or 2))

        def compile_c(src):
            return self.compiler.compile([src], output_dir=self.build_temp, macros=macros,
                                         include_dirs=include_dirs, extra_postargs=C_FLAGS)[0]

        def compile_cuda(src):
            obj = os.path.join(self.build_temp, src[: -len(".cu")] + ".cu.o")
            os.makedirs(os.path.dirname(obj), exist_ok=True)
            cmd = [os.path.join(cuda_home, "bin", "nvcc"), "-std=c++17", "-O3", "-c", src, "-o", obj,
                   "-Xcompiler", "-fPIC", "-Xcompiler", "-Wall", f'-DFK_CUDA_ARCHS="{archs}"',
                   *gencode_flags(archs), *os.environ.get("FASTKERN_NVCC_FLAGS", "").split()]
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            return obj

        os.makedirs(self.build_temp, exist_ok=True)
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = [pool.submit(compile_cuda, s) for s in cuda_sources]
            futures += [pool.submit(compile_c, s) for s in sources]
            objects = [f.result() for f in futures]

        libraries, library_dirs = ["pthread"], []  # the CPU kernels' threads (csrc/cpu/parallel.c)
        if cuda_home:
            library_dirs = [cuda_lib_dir(cuda_home)]
            libraries = [":libcudart_static.a", "rt", "pthread", "dl", "stdc++"]
        self.compiler.link_shared_object(
            objects, self.get_ext_fullpath(ext.name), libraries=libraries, library_dirs=library_dirs,
            extra_postargs=["-Wl,--exclude-libs,ALL"], target_lang="c")


c_sources = sorted(glob.glob("csrc/*.c") + glob.glob("csrc/cpu/*.c"))
setup(
    ext_modules=[Extension("fastkern._C", sources=c_sources, py_limited_api=True,
                           define_macros=[("Py_LIMITED_API", LIMITED_API)])],
    cmdclass={"build_ext": BuildFastkern},
    package_dir={"": "python"},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
