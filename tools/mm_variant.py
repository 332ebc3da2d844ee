"""Links a variant of a built fastkern._C whose Hopper GEMM unit is recompiled with extra nvcc flags.

    FASTKERN_NVCC_FLAGS="-DFK_MM_TIMESTAMPS=1" python tools/mm_variant.py BUILT_TREE OUT.so [UNIT]

BUILT_TREE is a tree where `setup.py build_ext --inplace` ran with default flags (its build/temp.*
holds the objects and the commands that made them). Only csrc/cuda/matmul/wgmma_sm90.cu, taken from
this checkout, is recompiled: with the nvcc command BUILT_TREE recorded for it plus
FASTKERN_NVCC_FLAGS, into OUT.so's directory; then OUT.so is linked from that object and
BUILT_TREE's others, as setup.py links. The result is what a full build with FASTKERN_NVCC_FLAGS
makes for the persistent instances, since the FK_MM_* switches (csrc/cuda/matmul/stamps.cuh, D-133)
are read by the Hopper GEMM's units alone, in ~2 minutes instead of a full rebuild (~7 on the 2-core
machine). BUILT_TREE's targets (e.g. sm_90a alone) are the variant's. UNIT names another unit to
recompile the same way (e.g. csrc/cuda/matmul/wgmma_sm90_small.cu, the small problems' instances: with
-DFK_MM_TIMESTAMPS=1 -DFK_MM_STAMP_SMALL=1 for their stamps; csrc/cuda/attention/fwd_wgmma_sm90.cu and its
FK_ATTN_* switches); its flags must be ones no other unit reads.
"""
import glob
import os
import shlex
import subprocess
import sys
import sysconfig

UNIT = "csrc/cuda/matmul/wgmma_sm90.cu"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv):
    if len(argv) not in (2, 3):
        sys.exit(__doc__)
    tree, out = os.path.abspath(argv[0]), os.path.abspath(argv[1])
    unit = argv[2] if len(argv) == 3 else UNIT
    temps = glob.glob(os.path.join(tree, "build", "temp.*"))
    if len(temps) != 1:
        sys.exit(f"mm_variant: expected one build/temp.* under {tree}, found {temps}")
    temp = temps[0]
    with open(os.path.join(temp, unit[: -len(".cu")] + ".cu.o.cmd")) as f:
        cmd = [t for t in shlex.split(f.read()) if not t.startswith("# nvcc mtime")]
    obj = os.path.splitext(out)[0] + "." + os.path.basename(unit) + ".o"
    # the recorded command names the unit and its object relative to BUILT_TREE: point them here
    at = {"-c": os.path.join(ROOT, unit), "-o": obj, "-MF": obj + ".d"}
    cmd = [at[cmd[i - 1]] if i and cmd[i - 1] in at else t for i, t in enumerate(cmd)]
    cmd += os.environ.get("FASTKERN_NVCC_FLAGS", "").split()
    os.makedirs(os.path.dirname(out), exist_ok=True)
    print(shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)

    with open(os.path.join(temp, "link.cmd")) as f:
        tokens = shlex.split(f.read())[1:]  # setup.py: target, objects, libraries, library dirs, flags
    objects = [t for t in tokens if t.endswith(".o")]
    rest = tokens[len(objects):]
    dirs = [t for t in rest if os.path.isdir(t)]
    libs = [t for t in rest if t not in dirs and not t.startswith("-")]
    flags = [t for t in rest if t.startswith("-")]
    unit_obj = os.path.join(os.path.relpath(temp, tree), unit[: -len(".cu")] + ".cu.o")
    if unit_obj not in objects:
        sys.exit(f"mm_variant: {unit_obj} is not among the linked objects of {tree}")
    objects = [obj if o == unit_obj else os.path.join(tree, o) for o in objects]
    link = (shlex.split(sysconfig.get_config_var("LDSHARED")) + objects + [f"-L{d}" for d in dirs]
            + [f"-l{lib}" for lib in libs] + flags + ["-o", out])
    subprocess.run(link, check=True)
    print(f"mm_variant: linked {out}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
