#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan) in a separate build directory and runs each one
# for DXS_FUZZ_SECONDS seconds on a scratch copy of its seed corpus, so the committed corpus
# under tests/fuzz/corpus is never modified. Exits non-zero if a fuzzer finds a crash, a leak
# or a broken invariant; the reproducer is kept under $BUILD_DIR/fuzz-findings/.
#
# usage: [DXS_FUZZ_SECONDS=60] [DXS_FUZZ_BUILD_DIR=build-fuzz] scripts/fuzz.sh [fuzzer...]
#        fuzzers: safetensors config (default: both)
# Reproduce a finding: build-fuzz/bin/<name>_fuzz <reproducer file>
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${DXS_FUZZ_SECONDS:-60}"
build_dir="${DXS_FUZZ_BUILD_DIR:-build-fuzz}"
case "${build_dir}" in /*) ;; *) build_dir="${root}/${build_dir}" ;; esac
lock="${DXS_BUILD_LOCK:-/tmp/dxs-build.lock}"
fuzzers=("$@")
if [[ ${#fuzzers[@]} -eq 0 ]]; then fuzzers=(safetensors config); fi

# Configure and build through the shared lock: the machine is small and shared.
CC=clang CXX=clang++ flock "${lock}" \
  cmake -S "${root}" -B "${build_dir}" -G Ninja -DDXS_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  >/dev/null
targets=()
for f in "${fuzzers[@]}"; do targets+=("${f}_fuzz"); done
flock "${lock}" cmake --build "${build_dir}" --target "${targets[@]}"

work="$(mktemp -d /tmp/dxs-fuzz.XXXXXX)"
trap 'rm -rf "${work}"' EXIT

# Tokens that help libFuzzer build JSON headers and configs.
cat >"${work}/json.dict" <<'EOF'
"{"
"}"
"["
"]"
":"
","
"\""
"null"
"true"
"false"
"-1"
"0"
"18446744073709551615"
"9223372036854775807"
"1e308"
"__metadata__"
"dtype"
"shape"
"data_offsets"
"F32"
"F16"
"BF16"
"I64"
"format"
"pt"
"model_type"
"qwen3_moe"
"vocab_size"
"hidden_size"
"intermediate_size"
"moe_intermediate_size"
"num_hidden_layers"
"num_attention_heads"
"num_key_value_heads"
"head_dim"
"num_experts"
"num_experts_per_tok"
"decoder_sparse_step"
"mlp_only_layers"
"norm_topk_prob"
"tie_word_embeddings"
"rms_norm_eps"
"rope_theta"
"rope_scaling"
"rope_parameters"
"rope_type"
"default"
"yarn"
"max_position_embeddings"
"hidden_act"
"silu"
"torch_dtype"
"bfloat16"
"eos_token_id"
"bos_token_id"
EOF

failed=()
for f in "${fuzzers[@]}"; do
  binary="${build_dir}/bin/${f}_fuzz"
  corpus="${work}/corpus-${f}"
  artifacts="${work}/artifacts-${f}"
  mkdir -p "${artifacts}"
  cp -r "${root}/tests/fuzz/corpus/${f}" "${corpus}"
  echo "== ${f}_fuzz: ${seconds}s on a copy of tests/fuzz/corpus/${f}"
  status=0
  ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}" \
    "${binary}" "${corpus}" \
    -dict="${work}/json.dict" \
    -max_total_time="${seconds}" \
    -max_len=16384 \
    -timeout=10 \
    -rss_limit_mb=2048 \
    -artifact_prefix="${artifacts}/" \
    -print_final_stats=1 \
    >"${work}/${f}.log" 2>&1 || status=$?
  tail -n 25 "${work}/${f}.log"
  if [[ ${status} -ne 0 ]] || compgen -G "${artifacts}/*" >/dev/null; then
    keep="${build_dir}/fuzz-findings/${f}"
    mkdir -p "${keep}"
    cp "${artifacts}"/* "${work}/${f}.log" "${keep}/" 2>/dev/null || true
    echo "!! ${f}_fuzz failed (exit ${status}); reproducer and log in ${keep}" >&2
    failed+=("${f}")
  else
    echo "== ${f}_fuzz: no findings"
  fi
done

if [[ ${#failed[@]} -ne 0 ]]; then
  echo "fuzz.sh: findings in: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz.sh: all fuzzers ran ${seconds}s without findings"
