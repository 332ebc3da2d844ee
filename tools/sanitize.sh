#!/usr/bin/env bash
# `make sanitize` (tools/sanitize.sh [all|cpu|gpu|memcheck|racecheck|synccheck [REGEX]], default all;
# PY=the python to use; gpu = memcheck, racecheck, synccheck in turn; REGEX keeps the selected tests
# whose ids match it, e.g. "attention|cross_entropy").
#
# cpu: the C code (csrc/*.c, csrc/cpu/*.c) built with AddressSanitizer and UBSan, without CUDA,
#      into build/sanitize/ (the normal build is untouched), then the CPU tests run on it. Python
#      itself is not instrumented, so libasan is preloaded (with libstdc++, whose __cxa_throw ASan
#      must find at start: torch throws C++ exceptions at import); leak checking is off (CPython and torch
#      keep memory until exit by design); any ASan or UBSan report stops the run and fails it.
# gpu: only where nvidia-smi sees a GPU and compute-sanitizer exists (else it says so and skips):
#      the normal build's CUDA kernels under compute-sanitizer, torch's caching allocator off so each
#      tensor is its own allocation: memcheck on a subset of tests/test_softmax.py and
#      tests/test_gelu.py that reaches every kernel (both directions, 32- and 16-bit, every row
#      length of test_rows, the column, causal and misaligned paths), and of the matmul, attention
#      (each dispatch row, both paths, head dims, decoding, windows) and cross_entropy tests;
#      racecheck and synccheck on a smaller subset (the kernels with shared memory, clusters or
#      barriers). Any error fails. The whole memcheck subset takes ~14 min on an H100
#      (estimated from two partial runs): more than one 10-minute device call.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
what=${1:-all}
root=$PWD

cpu() {
  local out=build/sanitize
  local flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g"
  echo "sanitize cpu: building the C code with $flags into $out"
  FASTKERN_CUDA=0 FASTKERN_CFLAGS="$flags" FASTKERN_LDFLAGS="-fsanitize=address,undefined" \
    "$PY" setup.py -q build_ext --build-temp "$out/temp" --build-lib "$out/lib"
  # a copy of the package with the sanitized module in it, first on the path
  rm -rf "$out/site" && mkdir -p "$out/site"
  cp -r python/fastkern "$out/site/" && rm -f "$out"/site/fastkern/_C*.so
  cp "$out"/lib/fastkern/_C*.so "$out/site/fastkern/"
  echo "sanitize cpu: the CPU tests under ASan + UBSan"
  CUDA_VISIBLE_DEVICES= PYTHONPATH="$root/$out/site" \
    LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)" \
    ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:abort_on_error=0:protect_shadow_gap=0 \
    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    "$PY" -m pytest -q -p no:cacheprovider tests -k "not cuda"
}

# pytest node ids of the CUDA tests in $1 whose id matches the extended regex $2
select_tests() {
  PYTHONPATH="$root/python" "$PY" -m pytest -q --collect-only -p no:cacheprovider "$1" 2>/dev/null | grep -E '::' | grep 'cuda' \
    | grep -E "$2" || true
}

# gpu_tests TOOL: the pytest node ids (one a line) that compute-sanitizer's TOOL runs
gpu_tests() {
  # memcheck: fp32 and bf16 (fp16 runs the 16-bit code bf16 runs), every length of test_rows with 3
  # rows (softmax and log) and 1000 rows (softmax), every column shape and dim, the causal masks,
  # special values, misaligned views, the looped columns and the chained (PDL) calls; GELU's shapes
  # with and without bias, views and special values
  local dt='cuda-(float32|bfloat16)'
  case $1 in
    memcheck) select_tests tests/test_softmax.py \
        "test_rows\[(3-[0-9]+-(softmax|log)|1000-[0-9]+-softmax)-$dt\]|test_dims\[.*-softmax-$dt\]|test_scale_and_causal\[0\.125-.*-softmax-$dt\]|test_special_values\[.*-softmax-$dt\]|test_views\[$dt\]|looped_columns|fp32_rows_over_one_wave|chained_calls|column_calls_repeat"
      select_tests tests/test_gelu.py \
        "test_matches_float64_reference\[.*-$dt\]|test_views\[.*-$dt\]|chained_calls|special_values"
      select_tests tests/test_matmul.py \
        "test_dispatch_table|test_operand_layouts\[.*-$dt\]|test_k_zero|test_cuda_hopper_consumer_arrangements\[.*-bf16\]|test_fp32_exact_wide_tiles|test_cuda_hopper_small_problem_edges\[.*-row-col\]|test_cuda_hopper_split_k"
      select_tests tests/test_attention.py \
        "test_dispatch_table|test_cuda_decode_rows|test_cuda_forward_walks_many_tiles|test_cuda_first_cuda_work|test_cuda_values_and_gradients\[(default|force_general)-(1-4097|113-203|128-217|512-256)-(full|causal)-torch.bfloat16\]|test_cuda_head_dims|test_cuda_decoding\[.*-8192\]|test_cuda_windows|test_cuda_sdpa|test_cuda_deterministic|test_cuda_backward_tile_edges"
      select_tests tests/test_attention_bwd.py \
        "test_cuda_atomic_backward_tile_edges\[[0-9]+-[0-9]+-(64|96)\]|test_cuda_atomic_backward_(varlen|misaligned)|test_cuda_deterministic"
      select_tests tests/test_cross_entropy.py \
        "(test_values_and_grads|test_ignore_index|test_special_values|test_views_and_misaligned)\[.*-cuda-(float32|bfloat16)\]|test_padded_rows_in_and_out\[cuda\]" ;;
    # racecheck / synccheck: a row length for each register, CTA, shared-memory and cluster strategy
    # (forward and backward), the column tile, its clusters and chunks, the looped columns, and the
    # row-tiled GELU bias gradient; attention's split (decoding) forward through test_cuda_head_dims'
    # (1, 1, 300) case (test_cuda_decoding's 8192 keys x 32 heads with gradients did not finish in
    # 200 s under racecheck, H100)
    *) select_tests tests/test_softmax.py \
        "test_rows\[3-(1000|4097|8192|12001|16384|65543|300000|1000003)-softmax-$dt\]|test_dims\[\((3, 1000, 4|2000, 5, 8|6000, 2, 8|20000, 2, 4)\)-(0|1)-softmax-$dt\]|test_looped_columns_cuda\[softmax-torch.float32\]"
      select_tests tests/test_gelu.py "test_matches_float64_reference\[bias-\(33, 1000\)-tanh-$dt\]"
      select_tests tests/test_matmul.py \
        "test_dispatch_table|test_cuda_hopper_small_problem_edges\[((37x185x300|251x184x257)x1-col-row|[0-9]+x488x257x1-row-row)\]|test_cuda_hopper_consumer_arrangements\[[0-9]+x[0-9]+x(40|72)-[a-z-]+-bf16\]|test_cuda_fp32_exact_wide_tiles_at_ragged_edges\[row-col\]|test_cuda_general_kernel_large_tile_edges\[k200-row-col\]"
      select_tests tests/test_attention.py \
        "test_cuda_decode_rows\[default|test_cuda_forward_walks_many_tiles|test_cuda_head_dims\[(default-(64|128)|force_general-(64|96|256))\]|test_cuda_values_and_gradients\[(default|force_general)-113-203-causal-torch.bfloat16\]|test_cuda_windows_and_varlen\[default-\(100, 30\)\]|test_cuda_backward_tile_edges\[129-300-64\]"
      select_tests tests/test_attention_bwd.py \
        "test_cuda_atomic_backward_tile_edges\[(129-300-64|127-129-128)\]|test_cuda_atomic_backward_varlen\[96\]"
      select_tests tests/test_cross_entropy.py "test_values_and_grads\[(33-1000|7-4097|4-50257)-mean-cuda-bfloat16\]" ;;
  esac
}

# gpu TOOL: the selected CUDA tests under compute-sanitizer --tool TOOL
gpu() {
  local cs c
  cs=$(command -v compute-sanitizer || true)
  for c in "${CUDA_HOME:-/usr/local/cuda}"/bin/compute-sanitizer /usr/local/cuda/bin/compute-sanitizer \
           "${CUDA_HOME:-/usr/local/cuda}"/compute-sanitizer/compute-sanitizer; do
    [ -n "$cs" ] || [ ! -x "$c" ] || cs=$c
  done
  export PYTHONPATH="$root/python"
  if [ -z "$cs" ] || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "sanitize gpu: skipped (no GPU or no compute-sanitizer here)"
    return 0
  fi
  "$PY" -c "import fastkern, sys; sys.exit(not fastkern.cuda_available())" \
    || { echo "sanitize gpu: this build of fastkern has no CUDA kernels (FASTKERN_CUDA)"; return 1; }
  local tests
  mapfile -t tests < <(gpu_tests "$1" | grep -E "${2:-.}")
  echo "sanitize gpu: $cs --tool $1 on ${#tests[@]} tests"
  [ ${#tests[@]} -gt 0 ] || { echo "sanitize gpu: no tests selected"; return 1; }
  # memcheck without the caching allocator, so a read past a tensor's end is not inside a cached
  # block (graph capture needs the allocator: conftest's chained-call check then runs eagerly only)
  # (torch reads any value of PYTORCH_NO_CUDA_MEMORY_CACHING as "off", so it is set for memcheck only)
  local env=()
  [ "$1" = memcheck ] && env=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
  if [ "$1" != racecheck ]; then
    env "${env[@]}" "$cs" --tool "$1" --error-exitcode 1 --print-limit 20 \
      "$PY" -m pytest -q -p no:cacheprovider "${tests[@]}"
    return
  fi
  # racecheck also reports hazards in cuBLAS's Hopper kernels (nvjet_*: torch.matmul, the matmul
  # tests' references), whose shared-memory protocol it does not follow and which are not ours to
  # check; a hazard fails the run only in another kernel. (--kernel-name-exclude kns=nvjet instead
  # made the sanitizer fail on a hardware exception, with or without fastkern's D-119, H200.)
  local log rc
  log=$(mktemp)
  set +e
  "$cs" --tool racecheck --print-limit 200 "$PY" -m pytest -q -p no:cacheprovider "${tests[@]}" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  if grep -E "Race reported" "$log" | grep -vq "nvjet_"; then
    echo "sanitize gpu: racecheck found hazards in fastkern's kernels"; rm -f "$log"; return 1
  fi
  rm -f "$log"
  return "$rc"
}

case $what in
  cpu) cpu ;;
  memcheck|racecheck|synccheck) gpu "$what" "${2:-}" ;;  # [REGEX]: only the selected tests it matches
  list) gpu_tests "${2:-memcheck}" ;;  # list [TOOL]: the tests TOOL would run
  gpu) gpu memcheck && gpu racecheck && gpu synccheck ;;
  all) cpu && gpu memcheck && gpu racecheck && gpu synccheck ;;
  *) echo "usage: tools/sanitize.sh [all|cpu|gpu|memcheck|racecheck|synccheck]" >&2; exit 2 ;;
esac
