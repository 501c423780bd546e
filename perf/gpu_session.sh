#!/usr/bin/env bash
# The GPU measurements as named steps, each writing a log + JSON under $OUT (default perf/out).
# Run from the repository root after the offline bundle is set up (scripts/gpu_setup.sh, and
# scripts/vllm_setup.sh for the vllm steps: .bundle/vllm_partN for vLLM 0.22, .bundle/vllm0250_partN for
# the vllm025_* steps):
#     bash perf/gpu_session.sh server vllm_server      # one or more steps; --help lists them
# perf/README.md says what each suite measures and holds the current tables.
# Each step fits one 10-minute GPU command; the exact command lines land in the logs and JSON.
set -uo pipefail

steps() {  # the step names: this file's case labels
  grep -oE '^    [a-z0-9_]+\)' "${BASH_SOURCE[0]}" | tr -d ' )' | tr '\n' ' '
}
if [[ $# -eq 0 || $1 == -h || $1 == --help ]]; then
  echo "usage: [OUT=DIR] bash perf/gpu_session.sh STEP...; steps: $(steps)"
  exit 0
fi

OUT=${OUT:-perf/out}
mkdir -p "$OUT"
# shellcheck disable=SC1091
source /tmp/pergola-gpu/env.sh
if [[ -n ${PERGOLA_GPU_BUNDLE_INCOMPLETE:-} ]]; then  # e.g. the tests' conftest fails to import without part 3
  echo "gpu_session: the offline bundle is incomplete ($PERGOLA_GPU_BUNDLE_INCOMPLETE): run" \
    "scripts/gpu_setup.sh for the other parts first; steps that need them will fail" | tee "$OUT/bundle_incomplete.txt" >&2
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
GPUS=$(nvidia-smi -L | wc -l)  # the scaling steps' largest N

run() {  # NAME COMMAND...: echo, run, keep the log, never stop the remaining steps
  local name=$1; shift
  echo "== $name: $*" | tee "$OUT/$name.log"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$OUT/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
}

lane_tests() {  # the query lane's GPU tests
  PERGOLA_TEST_DEVICE=gpu run pytest_gpu_query_lane python3 -m pytest -q -ra tests/test_query_lane.py -m gpu
}

connections_quiet() {  # 20,000 idle + 1,000 slowloris connections against `pergola serve --device cpu`,
  # the servers on CPUs 0-7 and the flood on 8-15. The host's hard open-files limit is 20,000: under it one
  # worker's cap is 17,500 and each new flood connection closes an idle one (docs/operations.md), so the
  # limit is raised first where the kernel lets root (fs.nr_open; a server's unit sets LimitNOFILE): then
  # the default single worker holds the flood whole; where it cannot be raised, two workers (a cap each)
  sysctl -qw fs.nr_open=1048576 2>/dev/null; ulimit -Hn 1048576 2>/dev/null
  ulimit -n "$(ulimit -Hn)"  # the flood processes too
  echo "open files: soft $(ulimit -Sn), hard $(ulimit -Hn), fs.nr_open $(cat /proc/sys/fs/nr_open)" \
    | tee "$OUT/open_files.txt"
  # one worker holds the flood when its cap (the limit less an eighth: 28,672 at 32,768) is over 21,000
  if (( $(ulimit -Hn) >= 32768 )); then
    run connections_quiet taskset -c 0-7 python3 perf/bench_connections.py --serve --flood-cpus 8-15 \
      --out "$OUT/connections_quiet.json"
  else
    run connections_quiet_w2 taskset -c 0-7 python3 perf/bench_connections.py --serve --flood-cpus 8-15 \
      --serve-arg=--gateway-workers=2 --out "$OUT/connections_quiet_w2.json"
  fi
}

archs_perf() {  # MODEL TAG: pergola's server suites, then vLLM 0.22's inproc + server suites, on one seeded
  # folder (perf/common.py's ARCH_MODELS, published shape, BF16) built once in a shared workdir
  local model=$1 tag=$2 workdir=/tmp/pergola-archs
  run "server_$tag" python3 perf/bench_server.py --model "$model" --latency-n 40 --workdir "$workdir" \
    --out "$OUT/server_$tag.json"
  # shellcheck disable=SC1091
  (source /tmp/vllm-site/env.sh && run "vllm_$tag" python3 perf/bench_vllm.py --models "$model" \
    --suites inproc server --workdir "$workdir" --out "$OUT/vllm_$tag.json")
}

vllm_server_suite() {  # SITE NAME IDS_API: vLLM's server suite from SITE on Qwen3's and both architectures' shapes
  # (VLLM_MODELS to choose), in the shared workdir pergola's archs steps use; writes NAME.json / NAME.log.
  # Token ids go to IDS_API, each version's faster route (VLLM_IDS_API overrides; bench_vllm.py's IDS_APIS
  # says why): 0.22's /v1/embeddings, 0.25's /pooling
  local site=$1 name=$2 ids_api=${VLLM_IDS_API:-$3} stamp
  stamp=$(mktemp)  # the server logs this step writes are newer than it
  # shellcheck disable=SC1090,SC1091
  # shellcheck disable=SC2086
  (source "$site/env.sh" && run "$name" python3 perf/bench_vllm.py --vllm-site "$site" \
    --models ${VLLM_MODELS:-qwen3-0.6b bge-m3 gte-modernbert} --suites server --ids-api "$ids_api" \
    --workdir /tmp/pergola-archs \
    --out "$OUT/$name.json")
  for log in /tmp/pergola-archs/vllm_*_embed.log; do  # vLLM's own server logs: its engine and kernel choices
    [[ $log -nt $stamp ]] && cp "$log" "$OUT/${name}_$(basename "$log")"
  done
  rm -f "$stamp"
}

for step in "$@"; do
  case $step in
    gemm)  # the matmul sweep: cuBLAS vs Triton tiles per projection and M; writes the tile table it measured
      run gemm python3 perf/bench_gemm.py --out "$OUT/gemm.json" --write-tiles "$OUT/tiles.json" ;;
    small_gemm)  # batch-1 sizes: cuBLAS vs pointer, split-K and dependent-launch tiles at M <= 256 (gate_up
      # with its folded norm, as the model runs it), then 16-, 64- and 128-token forwards' kernels on the
      # table it measured, the shipped one and cuBLAS alone (~4 min)
      run gemm_small python3 perf/bench_gemm.py --m 16 64 128 256 --pdl --out "$OUT/gemm_small.json" \
        --write-tiles "$OUT/tiles_small.json"
      for len in 16 64 128; do
        for mm in "$OUT/tiles_small.json" auto cublas; do
          run "profile_1x${len}_$(basename "$mm" .json)" python3 perf/profile_step.py --seqs 1 --length "$len" \
            --steps 3 --grid --matmul "$mm"
        done
      done ;;
    profile)  # top kernels of a batch-1 128-token step and a 32 x 512 step, Triton tiles vs cuBLAS only
      for shape in "1 128" "32 512"; do
        read -r seqs len <<< "$shape"
        for mm in auto cublas; do
          run "profile_${seqs}x${len}_$mm" python3 perf/profile_step.py --seqs "$seqs" --length "$len" --matmul "$mm"
        done
      done ;;
    encoder_kernels)  # the encoders' kernels: sliding-window kernels, full attention (the probe's kernels and
      # cuDNN's), then ModernBERT's and bge-m3's time by kernel
      run window python3 perf/bench_window.py --out "$OUT/window.json"
      run attention python3 perf/bench_attention.py --out "$OUT/attention.json"
      for model in gte-modernbert bge-m3; do
        run "anatomy_$model" python3 perf/anatomy.py --model "$model" --shapes 100x512 20x4096 \
          --workdir /tmp/pergola-archs --out "$OUT/anatomy_$model.json"
      done ;;
    anatomy)  # host vs GPU-busy time per call and kernel time by kind; start-up phases
      run anatomy python3 perf/anatomy.py --shapes 1x128 1x512 100x512 100x1024 100x4096 --out "$OUT/anatomy.json" ;;
    gputests)  # the GPU-marked engine tests only (kernels, probe, graphs, the pruned last layer, the query
      # lane), a few minutes
      PERGOLA_TEST_DEVICE=gpu run pytest_gpu_engine python3 -m pytest -q -ra tests/test_gpu.py tests/test_linear.py tests/test_attention_backends.py tests/test_packing.py \
        tests/test_attention_probe.py tests/test_rows_only.py
      lane_tests ;;
    gpumarked)  # every GPU-marked test in the suite, and nothing else (~5 minutes)
      PERGOLA_TEST_DEVICE=gpu run pytest_gpu_marked python3 -m pytest -q -ra -m gpu tests ;;
    prune_ab)  # the last layer on the pooled tokens (the default) against the whole layer (variant "whole"), in
      # process (bench_engine: the two engines take turns), on the encoders' and Qwen3's shapes (~5 minutes)
      for model in bge-m3 gte-modernbert qwen3-0.6b; do
        run "engine_prune_${model//[-.]/_}" python3 perf/bench_engine.py --models "$model" --latency-n 20 \
          --variant whole:prune_last_layer=False --backends flashinfer_fa3 --workdir /tmp/pergola-archs \
          --out "$OUT/engine_prune_${model//[-.]/_}.json"
      done ;;
    tests)  # the whole suite with the test server's encoders on the GPU, plus the gpu-marked tests
      # (the soak runs in the `hardening` step, on the Qwen3 shape, to fit the 10-minute command)
      PERGOLA_TEST_DEVICE=gpu run pytest_gpu python3 -m pytest -q -ra tests --deselect tests/test_soak.py ;;
    tests_slice)  # one slice of the whole suite on the GPU, SLICE=i/n (files dealt round-robin), for
      # the 10-minute command: SLICE=1/3, 2/3, 3/3 cover every test file once (the soak excluded as above)
      IFS=/ read -r i n <<< "${SLICE:?set SLICE=i/n, e.g. SLICE=1/3}"
      mapfile -t files < <(ls tests/test_*.py | grep -v test_soak.py | awk -v i="$i" -v n="$n" '(NR - i) % n == 0')
      PERGOLA_TEST_DEVICE=gpu run "pytest_gpu_slice_${i}of$n" python3 -m pytest -q -ra "${files[@]}" ;;
    hardening)  # overload flood, fuzz and soak against `pergola serve` with the Qwen3-0.6B shape on the GPU
      python3 scripts/make_test_models.py /tmp/q06 --shape qwen3-0.6b --dtype bfloat16 > /dev/null
      python3 -m pergola.cli serve --model q06=/tmp/q06 --repo /tmp/grepo --device gpu > "$OUT/serve_gpu.log" 2>&1 &
      local_pid=$!
      for _ in $(seq 180); do curl -sf localhost:8000/v2/health/ready > /dev/null && break; sleep 1; done
      run overload python3 perf/bench_overload.py --clients 64 --seconds 60 --timeout 10 --large-texts 100 \
        --words 400 --out "$OUT/overload_gpu.json"
      run fuzz python3 perf/fuzz_server.py --name q06 --cases "${FUZZ_CASES:-3000}"
      run soak python3 perf/soak.py --repo /tmp/grepo --minutes "${SOAK_MINUTES:-5}" --clients 8 --every 15 \
        --out "$OUT/soak_gpu.json"
      kill -TERM "$local_pid"; wait "$local_pid"; echo "pergola serve exit: $?" | tee -a "$OUT/soak.log" ;;
    mixed)  # queries under bulk load, fifth suite: the query lane, then one lane (query_tokens=0), then vLLM
      run mixed python3 perf/bench_mixed.py --out "$OUT/mixed.json"
      run mixed_one_lane python3 perf/bench_mixed.py --option query_tokens=0 --out "$OUT/mixed_one_lane.json" ;;
    mixed_gateway)  # queries under bulk sent through the same gateway (issue 38, item 9): an 8-word text query
      # and 128 ids over gRPC beside 4 processes sending 100 x 512 and 25 x 4,096 token ids to /v1/embeddings
      # (float answers), Qwen3-0.6B shape, ~4 min; goal: the text query's loaded p99 <= 3x its idle p99
      run mixed_gateway python3 perf/bench_mixed.py --bulk-door gateway --loads ids_100x512 ids_25x4096 \
        --queries gateway_text grpc_ids_128 -n 150 --out "$OUT/mixed_gateway.json" ;;
    chunking_tests)  # long documents (issue 42): tests/test_chunking.py with the test server's encoders on the
      # GPU, late chunking in BF16 through the GPU lanes among them (cosine >= 0.999 against transformers in FP32)
      PERGOLA_TEST_DEVICE=gpu run pytest_gpu_chunking python3 -m pytest -q -ra tests/test_chunking.py ;;
    chunking)  # long documents (issue 42): documents of 3,000 words embedded with `chunking` (each, mean, late)
      # against the same windows sent as plain inputs, chunks/s through the gateway, 4 clients of 4 documents
      # a request: 200 in the gte-modernbert shape (8,192 tokens, BF16, 256-token windows sharing 32; its
      # seeded folder's small BPE vocabulary makes ~18k tokens a document), then 500 with MiniLM (real
      # weights, 128-token windows sharing 16); ~8 minutes
      run chunking_modernbert python3 perf/bench_chunking.py --model gte-modernbert --docs 200 --words 3000 \
        --tokens 256 --overlap 32 --clients 4 --docs-per-request 4 --workdir /tmp/pergola-archs \
        --out "$OUT/chunking_modernbert.json"
      run chunking_minilm python3 perf/bench_chunking.py --model minilm --docs 500 --words 3000 --tokens 128 \
        --overlap 16 --clients 4 --docs-per-request 4 --out "$OUT/chunking_minilm.json" ;;
    front_door_quiet)  # the front door's CPU figures on this host's quiet cores (issue 38), the servers on
      # CPUs 0-7 and the clients on 8-15: the connection flood below, then 256 clients flooding for 120 s (the
      # 30 s floods of a3538ba answered 12-21 requests each: +-7% a request); ~6 min
      connections_quiet
      run overload_quiet taskset -c 8-15 python3 perf/bench_gateway_overload.py --out "$OUT/overload_quiet" \
        --cpus 0,1 --serve-args "--device cpu" --clients 256 --seconds 120 --solo-seconds 60 --phases solo,flood ;;
    front_door_connections)  # front_door_quiet's connection flood alone (~2.5 min)
      connections_quiet ;;
    mixed_rate)  # bulk kept against the query rate: the query client's pause swept, 100 x 512, ~1 min each
      for gap in 2 10 30; do
        run "mixed_gap${gap}ms" python3 perf/bench_mixed.py --no-gateway -n 100 --loads ids_100x512 \
          --query-gap-ms "$gap" --out "$OUT/mixed_gap${gap}ms.json"
      done ;;
    mixed_fill)  # bulk kept and query latency against the fill of a query's step (query_fill_tokens):
      # one bulk sequence of 512 or two ride along with the query, 100 x 512, ~1 min each
      for fill in 640 1152; do
        run "mixed_fill${fill}" python3 perf/bench_mixed.py --no-gateway -n 100 --loads ids_100x512 \
          --option "query_fill_tokens=$fill" --out "$OUT/mixed_fill${fill}.json"
      done ;;
    scaling)  # several GPUs (a multi-GPU kind): one server over N GPUs vs one per GPU behind the gateway,
      # 100 x 512 / 1,024 / 4,096 at N = 1, 2 and every GPU the host has (~2 min per layout and N)
      run scaling python3 perf/bench_scaling.py --gpus 1 2 "$GPUS" --out "$OUT/scaling.json" ;;
    scaling_mixed)  # the mixed-traffic suite over every GPU of the host (one encoder instance each, 4 bulk
      # processes per GPU), and vLLM 0.22's data-parallel server under the same load (scripts/vllm_setup.sh first)
      run mixed_all_gpus python3 perf/bench_mixed.py -n 100 --loads ids_100x512 ids_25x4096 --out "$OUT/mixed_all_gpus.json"
      # shellcheck disable=SC1091
      (source /tmp/vllm-site/env.sh && run vllm_mixed_dp python3 perf/bench_vllm.py --suites mixed \
        --data-parallel-size "$GPUS" --out "$OUT/vllm_mixed_dp.json") ;;
    vllm_scaling)  # vLLM 0.22's server suite with --data-parallel-size 2 and every GPU (scripts/vllm_setup.sh first)
      for n in 2 "$GPUS"; do
        # shellcheck disable=SC1091
        (source /tmp/vllm-site/env.sh && run "vllm_dp$n" python3 perf/bench_vllm.py --suites server \
          --data-parallel-size "$n" --out "$OUT/vllm_dp$n.json")
      done ;;
    vllm_mixed)  # vLLM 0.22's server under the same mixed traffic (scripts/vllm_setup.sh first)
      run vllm_mixed python3 perf/bench_vllm.py --suites mixed --out "$OUT/vllm_mixed.json" ;;
    gateway)  # the gateway's added latency and kept throughput vs Triton gRPC, Qwen3-0.6B shape
      run gateway python3 perf/bench_gateway.py --model qwen3-0.6b --out "$OUT/gateway.json" ;;
    batch)  # a Batch API job's throughput vs the same 20,000 texts of ~512 tokens as direct bulk requests
      # (100 a request, 4 clients), and a text query's p50/p99 idle / under each; goal: job >= 90% of
      # direct, query p99 while the job runs <= 3x idle (issue 43)
      run batch python3 perf/bench_batch.py --model qwen3-0.6b -n 20000 --length 512 --out "$OUT/batch.json" ;;
    gateway_grpc)  # the same with the gateway's inference over gRPC (--triton-http-port 0), the transport before 88093b5
      run gateway_grpc python3 perf/bench_gateway.py --model qwen3-0.6b --gateway-option triton_http_port=0 \
        --out "$OUT/gateway_grpc.json" ;;
    gateway_workers)  # the same with two gateway worker processes (16 in flight: one event loop's limit?)
      run gateway_workers python3 perf/bench_gateway.py --model qwen3-0.6b --gateway-option gateway_workers=2 \
        --out "$OUT/gateway_workers2.json" ;;
    gateway_tests)  # the gateway's tests with the test server's encoders on the GPU (a few minutes)
      PERGOLA_TEST_DEVICE=gpu run pytest_gpu_gateway python3 -m pytest -q -ra tests/test_gateway.py ;;
    engine)  # engine level: start-up probe's choice vs each kernel / cuBLAS forced (Qwen3), MiniLM as chosen
      # (MiniLM gets no kernel variants: FlashInfer has no head-dim-32 build and would JIT-fail for minutes)
      run engine python3 perf/bench_engine.py --models qwen3-0.6b --latency-n 40 \
        --variant tf:attention_backend=torch_flash fa3:attention_backend=flashinfer_fa3 cublas:matmul=cublas \
        --out "$OUT/engine_qwen3.json"
      run engine_minilm python3 perf/bench_engine.py --models minilm --latency-n 40 --backends torch_flash sdpa \
        --out "$OUT/engine_minilm.json" ;;
    server)  # the seed suites through tritonserver: latency, throughput, concurrency, perf_analyzer
      run server python3 perf/bench_server.py --model qwen3-0.6b --latency-n 60 --out "$OUT/server.json" ;;
    scoring)  # the scoring suite on the Qwen3-Reranker-0.6B shape
      run scoring python3 perf/bench_server.py --model qwen3-reranker-0.6b --suites scoring \
        --out "$OUT/scoring.json" ;;
    vllm)  # vLLM 0.22.0, the seeds' baseline: same models, same inputs, same GPU
      # shellcheck disable=SC1091
      (source /tmp/vllm-site/env.sh && run vllm python3 perf/bench_vllm.py --scoring-inputs windows \
        --out "$OUT/vllm.json") ;;
    vllm_inproc)  # vLLM 0.22.0 in-process only (LLM.embed): the engine-level baseline, a few minutes
      # shellcheck disable=SC1091
      (source /tmp/vllm-site/env.sh && run vllm_inproc python3 perf/bench_vllm.py --suites inproc \
        --out "$OUT/vllm_inproc.json") ;;
    minilm)  # all-MiniLM-L6-v2 (real weights) through pergola's server and vLLM's, same inputs
      run server_minilm python3 perf/bench_server.py --model minilm --latency-n 40 --out "$OUT/server_minilm.json"
      # shellcheck disable=SC1091
      (source /tmp/vllm-site/env.sh && run vllm_minilm python3 perf/bench_vllm.py --models minilm \
        --suites inproc server --out "$OUT/vllm_minilm.json") ;;
    fold_ab)  # the folded norms against the norms: batch-1 latency with the two engines taking turns, and
      # each one's kernels and GPU busy time for one 128-token forward (~3 minutes)
      run engine_fold python3 perf/bench_engine.py --models qwen3-0.6b --latency-n 200 \
        --variant nofold:fold_norms=False --backends flashinfer_fa3 --out "$OUT/engine_fold.json"
      run profile_fold python3 perf/profile_step.py --seqs 1 --length 128 --steps 3 --grid
      run profile_nofold python3 perf/profile_step.py --seqs 1 --length 128 --steps 3 --grid \
        --option fold_norms=False ;;
    kernels)  # the kernels and GPU busy time of one batch-1 128-token forward, as shipped (~20 s)
      run profile_1x128 python3 perf/profile_step.py --seqs 1 --length 128 --steps 3 --grid ;;
    fp8_server)  # FP8 through tritonserver: batch-1 latency and the throughput suite, beside `server`'s BF16
      run server_fp8 python3 perf/bench_server.py --model qwen3-0.6b --suites latency throughput perf_analyzer \
        --latency-n 60 --option quantization=fp8 --out "$OUT/server_fp8.json" ;;
    lane_ab)  # Qwen3's bulk throughput through the server with the query lane (the default: the host held
      # one layer ahead of the device in bulk steps) and without it (query_tokens=0), no HF baseline (~3 min)
      run server_lane_on python3 perf/bench_server.py --model qwen3-0.6b --suites throughput --no-baseline \
        --out "$OUT/server_lane_on.json"
      run server_lane_off python3 perf/bench_server.py --model qwen3-0.6b --suites throughput --no-baseline \
        --option query_tokens=0 --out "$OUT/server_lane_off.json" ;;
    bulk_1024)  # where a 1,024-token bulk call's time goes: kernel time by kind and host vs GPU busy for 100
      # texts (anatomy.json, as `anatomy` writes it for all its shapes: plot_results.py draws either), then
      # one 16 x 1,024 step's kernels with their grids (~1 min)
      run anatomy python3 perf/anatomy.py --shapes 100x1024 --out "$OUT/anatomy.json"
      run profile_16x1024 python3 perf/profile_step.py --seqs 16 --length 1024 --steps 3 --grid ;;
    batch1)  # batch-1 latency through Triton only (latency + perf_analyzer suites), ~1 minute
      run batch1 python3 perf/bench_server.py --model qwen3-0.6b --suites latency perf_analyzer --latency-n 100 \
        --out "$OUT/server_batch1.json" ;;
    adapter)  # where a batch-1 request's time goes between the gRPC client and the engine (Triton's trace)
      run adapter python3 perf/bench_adapter.py --model qwen3-0.6b --device gpu -n 500 --outputs EMBEDDING \
        --out "$OUT/adapter_gpu.json" ;;
    lanetests)  # the query lane's GPU tests alone (~2 minutes)
      lane_tests ;;
    fp8_profile)  # where an FP8 step's time goes against BF16's: one 32 x 512-token step, kernels by time (~1 min)
      run profile_32x512_bf16 python3 perf/profile_step.py --seqs 32 --length 512 --steps 3
      run profile_32x512_fp8 python3 perf/profile_step.py --seqs 32 --length 512 --steps 3 \
        --option quantization=fp8 ;;
    fp8tests)  # FP8's GPU tests alone (~1 minute)
      PERGOLA_TEST_DEVICE=gpu run pytest_fp8 python3 -m pytest -q -rs tests/test_fp8.py ;;
    fp8)  # FP8: its GPU tests, fidelity against BF16, engine throughput against BF16, a few minutes
      PERGOLA_TEST_DEVICE=gpu run pytest_fp8 python3 -m pytest -q -rs tests/test_fp8.py
      run fp8_fidelity python3 perf/fp8_fidelity.py --models minilm qwen3-0.6b --fp8-bf16-layers 0 1 2 3 \
        --out "$OUT/fp8_fidelity.json"
      run engine_fp8 python3 perf/bench_engine.py --models qwen3-0.6b --latency-n 40 --variant fp8:quantization=fp8 \
        fp8_all:quantization=fp8,fp8_bf16_layers=0 fp8_3bf16:quantization=fp8,fp8_bf16_layers=3 \
        --out "$OUT/engine_fp8.json" ;;
    archs)  # the architectures' GPU tests: published shapes, bge-m3's outputs, decoder rerankers
      PERGOLA_TEST_DEVICE=gpu run pytest_archs python3 -m pytest -q -ra tests/test_architectures_gpu.py \
        tests/test_bge_m3.py tests/test_decoder_rerankers.py -k "gpu or published" ;;
    archs_perf_bge_m3)  # bge-m3's shape through pergola's server and vLLM's (RobertaEmbeddingModel), ~7 min
      archs_perf bge-m3 bge_m3 ;;
    archs_perf_modernbert)  # gte-modernbert-base's shape, pergola vs vLLM's ModernBertModel, ~6 min
      archs_perf gte-modernbert modernbert ;;
    archs_server)  # bge-m3's and gte-modernbert-base's shapes through pergola's server: batch-1 latency and
      # throughput with HF transformers alongside, in the shared workdir vllm_server reuses (~3 min;
      # ARCHS="bge-m3": one of them)
      for model in ${ARCHS:-bge-m3 gte-modernbert}; do
        run "server_${model//-/_}" python3 perf/bench_server.py --model "$model" --suites latency throughput \
          --latency-n 40 --workdir /tmp/pergola-archs --out "$OUT/server_${model//-/_}.json"
      done ;;
    vllm_server)  # vLLM 0.22's server suite on Qwen3's and both architectures' shapes, the same folders (~8 min;
      # VLLM_MODELS="qwen3-0.6b": Qwen3's alone, ~2 min)
      vllm_server_suite /tmp/vllm-site vllm_server embeddings ;;
    vllm025_smoke)  # vLLM 0.25.0 (scripts/vllm_setup.sh .bundle/vllm0250_partN first): import, version and one
      # in-process embed of the Qwen3-0.6B shape within 60 s, before vllm025_server spends minutes
      # shellcheck disable=SC1091
      (source /tmp/vllm-site-0.25.0/env.sh && run vllm025_smoke python3 perf/vllm_smoke.py \
        --vllm-site /tmp/vllm-site-0.25.0 --workdir /tmp/pergola-archs --timeout 60) ;;
    vllm025_server)  # vllm_server with vLLM 0.25.0 (VLLM_MODELS as there), same folders, same suite
      vllm_server_suite /tmp/vllm-site-0.25.0 vllm025_server pooling ;;
    archs_perf)  # both of the above, ~13 min: over one 10-minute command, so run the two steps apart there
      archs_perf bge-m3 bge_m3
      archs_perf gte-modernbert modernbert ;;
    *) echo "unknown step $step; the steps: $(steps)" >&2
       exit 2 ;;
  esac
done
