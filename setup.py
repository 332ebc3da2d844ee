"""Builds fastkern._C with setuptools alone: gcc for csrc/**/*.c, nvcc for csrc/cuda/**/*.cu.

    python setup.py build_ext --inplace    incremental development build (what `make build` runs)
    pip install .                          a user's install (same compile steps)

Environment:
  FASTKERN_CUDA=auto|0|1    build the CUDA kernels when nvcc is found (auto), never, or always
  FASTKERN_CUDA_ARCHS=...   targets, comma separated: sm_XY -> SASS, compute_XY -> PTX
                            (default sm_80,sm_90a,compute_90); `native`: only the GPUs of this
                            machine (nvidia-smi's compute capability, 9.0 -> sm_90a), else the default
  FASTKERN_JOBS=N           translation units compiled at once (default: the CPU count)
  FASTKERN_NVCC_THREADS=N   nvcc --threads: targets of one unit compiled at once (default: all of
                            them, so the last long unit of a build still fills the cores)
  FASTKERN_NVCC_FLAGS=...   extra nvcc flags (e.g. -Xptxas -v, or -D switches for experiments)
  FASTKERN_CFLAGS=...       extra gcc flags, FASTKERN_LDFLAGS=... extra link flags (tools/sanitize.sh
                            sets both to -fsanitize=address,undefined ...)
  CUDA_HOME                 where to find nvcc and libcudart_static.a (else nvcc on PATH)

Incremental: every object lives in build_temp (build/temp.<platform>-<python>/) beside a `.d`
depfile (gcc -MMD, nvcc -MMD: the headers it included) and a `.cmd` file (the command that made it).
A unit recompiles only when its object is missing, older than the source or one of those headers,
or was made by a different command (flags, archs, compiler); the module relinks only when an object
is newer than it. After each CUDA unit it compiles, the build prints that unit's kernel count (its
__global__ template instances, STYLE.md section 5), read from the object's host stubs with `nm`.

The CUDA runtime is linked statically, so the module imports on machines with no driver, and the
module is abi3 (Py_LIMITED_API), so one build serves every CPython >= 3.10 (3.10: METH_FASTCALL in the stable ABI, D-104).
"""
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
LIMITED_API = "0x030A0000"
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


def native_archs():
    """The targets of this machine's GPUs from nvidia-smi ("9.0" -> sm_90a: the Hopper kernels need
    the arch-specific target), or None when there is no nvidia-smi or no GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    archs = []
    for cap in out.split():
        major, _, minor = cap.strip().partition(".")
        if major.isdigit() and minor.isdigit():
            arch = f"sm_{major}{minor}" + ("a" if (major, minor) == ("9", "0") else "")
            if arch not in archs:
                archs.append(arch)
    return ",".join(archs) or None


def cuda_archs():
    archs = os.environ.get("FASTKERN_CUDA_ARCHS", "").strip() or DEFAULT_ARCHS
    if archs.lower() == "native":
        archs = native_archs()
        if archs is None:
            print(f"fastkern: FASTKERN_CUDA_ARCHS=native found no GPU (nvidia-smi); building "
                  f"{DEFAULT_ARCHS}", flush=True)
            archs = DEFAULT_ARCHS
    return archs


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


# ---- incremental compilation ----------------------------------------------------------------------

def depfile_inputs(path):
    """The files listed in a make-style depfile (`obj: src hdr \\ ...`), or None if it is missing."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    _, _, deps = text.replace("\\\n", " ").partition(": ")
    return deps.split()


def up_to_date(obj, command):
    """True when `obj` was made by `command` and is newer than every input its depfile lists."""
    try:
        with open(obj + ".cmd") as f:
            if f.read() != command:
                return False
        built = os.stat(obj).st_mtime_ns
        inputs = depfile_inputs(obj + ".d")
        return inputs is not None and all(os.stat(p).st_mtime_ns <= built for p in inputs)
    except OSError:  # a missing object, command file or input
        return False


def compile_unit(obj, cmd, run):
    """Runs `run()` (which makes obj and obj.d) unless obj is up to date; returns True if it ran.
    The .cmd file is written only after success, so an interrupted compile is redone."""
    command = shlex.join(cmd) + "\n"
    if up_to_date(obj, command):
        return False
    os.makedirs(os.path.dirname(obj), exist_ok=True)
    if os.path.exists(obj + ".cmd"):
        os.remove(obj + ".cmd")
    run()
    with open(obj + ".cmd", "w") as f:
        f.write(command)
    return True


def kernel_count(obj):
    """The number of __global__ instances in a CUDA object: the distinct host launch stubs
    (`__device_stub__<kernel>`, one per template instance, whatever the targets), from nm."""
    try:
        symbols = subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    stubs = set()
    for m in re.finditer(r"(\d+)(__device_stub__)", symbols):  # <length><identifier> (Itanium)
        stubs.add(symbols[m.start(2): m.start(2) + int(m.group(1))])
    return len(stubs)


class BuildFastkern(build_ext):
    """Compiles the sources that changed in parallel (C through the setuptools compiler, CUDA
    through nvcc, one process per translation unit, largest first) and links them into one shared
    object."""

    def build_extension(self, ext):
        cuda_home = find_cuda_home()
        sources = [s for s in ext.sources if s.endswith(".c")]
        cuda_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "**", "*.cu"), recursive=True)
                              ) if cuda_home else []
        macros = list(ext.define_macros) + ([("FASTKERN_WITH_CUDA", "1")] if cuda_home else [])
        include_dirs = [sysconfig.get_paths()["include"]]
        archs = cuda_archs() if cuda_home else ""
        cpus = os.cpu_count() or 2
        jobs = max(1, int(os.environ.get("FASTKERN_JOBS", cpus)))
        gencode = gencode_flags(archs)
        threads = int(os.environ.get("FASTKERN_NVCC_THREADS", len(gencode) or 1))
        c_flags = C_FLAGS + os.environ.get("FASTKERN_CFLAGS", "").split()
        started = time.time()

        def compile_c(src):
            obj = os.path.join(self.build_temp, src[: -len(".c")] + ".o")
            flags = c_flags + ["-MMD", "-MF", obj + ".d"]
            cmd = [*self.compiler.compiler_so, *flags, *[f"-D{k}={v}" for k, v in macros],
                   *[f"-I{d}" for d in include_dirs], "-c", src]
            ran = compile_unit(obj, cmd, lambda: self.compiler.compile(
                [src], output_dir=self.build_temp, macros=macros, include_dirs=include_dirs,
                extra_postargs=flags))
            if ran:
                print(f"fastkern: compiled {src}", flush=True)
            return obj

        def run_nvcc(cmd, src):
            # ptxas says so when it serializes a kernel's wgmmas (a divergent branch, or accumulators
            # read while a wgmma group is open): a silent loss of most of the tensor cores' rate
            done = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
            sys.stderr.write(done.stderr)
            if "wgmma.mma_async instructions are serialized" in done.stderr:
                print(f"fastkern: WARNING: ptxas serialized wgmma instructions in {src} (see its C75xx "
                      f"lines above): that kernel runs far below the tensor cores' rate", flush=True)
            done.check_returncode()

        def compile_cuda(src):
            obj = os.path.join(self.build_temp, src[: -len(".cu")] + ".cu.o")
            nvcc = os.path.join(cuda_home, "bin", "nvcc")
            cmd = [nvcc, "-std=c++17", "-O3", "-c", src, "-o", obj, "-MMD", "-MF", obj + ".d",
                   "-Xcompiler", "-fPIC", "-Xcompiler", "-Wall", f'-DFK_CUDA_ARCHS="{archs}"',
                   *gencode, *os.environ.get("FASTKERN_NVCC_FLAGS", "").split()]
            signature = cmd + [f"# nvcc mtime {os.stat(nvcc).st_mtime_ns}"]  # a new toolkit rebuilds
            if threads > 1:  # not in the signature: it changes how long, not what
                cmd[1:1] = ["--threads", str(threads)]
            t0 = time.time()
            if compile_unit(obj, signature, lambda: run_nvcc(cmd, src)):
                count = kernel_count(obj)
                print(f"fastkern: compiled {src} in {time.time() - t0:.0f} s: "
                      f"{count if count is not None else '?'} kernel instances", flush=True)
            return obj

        os.makedirs(self.build_temp, exist_ok=True)
        if cuda_home:
            print(f"fastkern: CUDA targets {archs}; {jobs} jobs, nvcc --threads {threads}", flush=True)
        units = [(compile_cuda, s) for s in cuda_sources] + [(compile_c, s) for s in sources]
        units.sort(key=lambda u: -os.path.getsize(u[1]))  # the long poles start first
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(fn, src) for fn, src in units]
            objects = [f.result() for f in futures]

        libraries, library_dirs = ["pthread", "dl"], []  # the CPU kernels' threads (csrc/cpu/parallel.c)
        if cuda_home:
            library_dirs = [cuda_lib_dir(cuda_home)]
            libraries = [":libcudart_static.a", "rt", "pthread", "dl", "stdc++"]
        link_flags = ["-Wl,--exclude-libs,ALL"] + os.environ.get("FASTKERN_LDFLAGS", "").split()
        target = self.get_ext_fullpath(ext.name)
        link_cmd = shlex.join([target, *objects, *libraries, *library_dirs, *link_flags]) + "\n"
        link_record = os.path.join(self.build_temp, "link.cmd")
        try:
            with open(link_record) as f:
                relink = f.read() != link_cmd or any(
                    os.stat(o).st_mtime_ns > os.stat(target).st_mtime_ns for o in objects)
        except OSError:
            relink = True
        if relink:
            if os.path.exists(link_record):
                os.remove(link_record)
            self.compiler.link_shared_object(
                objects, target, libraries=libraries, library_dirs=library_dirs,
                extra_postargs=link_flags, target_lang="c")
            with open(link_record, "w") as f:
                f.write(link_cmd)
            print(f"fastkern: linked {target} ({time.time() - started:.0f} s)", flush=True)
        else:
            print(f"fastkern: {ext.name} is up to date", flush=True)


c_sources = sorted(glob.glob("csrc/*.c") + glob.glob("csrc/cpu/*.c"))
setup(
    ext_modules=[Extension("fastkern._C", sources=c_sources, py_limited_api=True,
                           define_macros=[("Py_LIMITED_API", LIMITED_API)])],
    cmdclass={"build_ext": BuildFastkern},
    package_dir={"": "python"},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
