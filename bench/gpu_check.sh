#!/usr/bin/env bash
# One run on a GPU machine: the GPU tests, then the benchmarks the GPU targets are read from.
#   bash bench/gpu_check.sh [OUT_DIR] [PARTS]   (default bench/out; logs, tables and JSON land there)
# PARTS: "all" (default: tests, then bench), "tests", "bench", "tune" (bench.moe_tune,
# bench.gdn_tune, bench.attention_tune), "gemv" (bench.gemv_tune at two shapes, plain and with
# the norm in front) or "pdl" (the 35B-A3B batch-1 step with programmatic dependent launch off,
# then in its two forms) or "ab" (decode steps with and without an open launch choice, through
# bench.decode --set: the 35B-A3B router read after the PDL wait, its inputs sent by the host
# rather than advanced in the graph, its greedy argmax taken after the graph rather than in it;
# the 27B without its own attention choices; the 9B's prompts of 2-16 tokens beside 8 decoding
# requests with the GDN rows in the chunked and in the recurrent form) or "serve" (bench.serve through HTTP: the 9B shape
# at 16 and 64 streams, the 0.8B at 1, 4, 16 and 64; 200-token prompts, 256 out, all at once) or
# "cache" (bench.serve --cache-ab, the prefix cache on and off: the 9B and 0.8B at 16 and 64
# streams, three rounds each; the 9B's 30K-token conversation, two requests sharing a 30K-token
# system prompt, and the document chat preset) or "cache16" (the 0.8B at 16 streams with the cache
# on and off: engine-direct at 32K and 8K of context, through HTTP at 8K) or
# "steps" (issue 35's steps at GPU speed: the GPU tests of the pieces and verify graphs, bench.decode of
# the 9B's decode, verify rows and 512-token prompt alone and beside 8 decoders, bench.profile of a
# 2,033-token step with prompt rows at the 0.8B and of the 9B's prompt beside 8 decoders) or
# "vision" (bench.vision: images of 1 and 4 megapixels through the 27B-shape tower and model,
# beside transformers') or "int4" (the 4-bit kernels' GPU tests, bench.gemv_tune --int4 at the
# 27B's projections, and bench.decode of the 27B and the 35B-A3B with --weights int4, the 27B
# in bf16 beside it: issue 21's decode and 16K-prompt figures, and bench.profile of the 27B's
# 4-bit decode step and 16K prompt) or "presets" (measure_presets under a 16 GiB cap from 4-bit
# random checkpoints: the 27B at 128K with 4-bit KV and at 64K with fp8, the 9B at 262,144) or
# "memory" (the same plans' commands through bench.memory: their bytes by stage, and by source
# where they run out), so a machine that limits one command's time can take the run in several
# calls; "all" runs neither tuning part nor "pdl" nor "ab" nor "serve" nor "vision".
# Needs a CUDA build of torch with Triton, fla-core and the test extras. On an H200 with a cold
# Triton cache the tests alone take more than 5 minutes (a 290 s limit cut them short twice), the
# three benchmarks about 4; on a machine that limits one command to 10 minutes, run them apart.
set -u
cd "$(dirname "$0")/.."
out=${1:-bench/out}
parts=${2:-all}
case "$parts" in all | tests | bench | tune | gemv | pdl | ab | serve | cache | cache16 | steps | vision | int4 | presets | memory) ;;
    *) echo "unknown PARTS: $parts (all, tests, bench, tune, gemv, pdl, ab, serve, cache, cache16, steps, vision, int4, presets, memory)" >&2
        exit 2 ;;
esac
mkdir -p "$out"
py=${PYTHON:-python}
status=0
run() {  # run NAME COMMAND...: log to $out/NAME.txt, keep going, remember a failure
    local name=$1
    shift
    echo "== $name: $*"
    "$@" >"$out/$name.txt" 2>&1 || { echo "$name failed (rc $?)"; status=1; }
    tail -n 12 "$out/$name.txt"
}
if [ "$parts" = all ] || [ "$parts" = tests ]; then
    # the server end to end first: it is the one a cut-short run would otherwise lose
    run gpu-server "$py" -m pytest -q tests/gpu/test_server_gpu.py -p no:cacheprovider
    run gpu-tests "$py" -m pytest -q tests/gpu -p no:cacheprovider --ignore tests/gpu/test_server_gpu.py
fi
if [ "$parts" = all ] || [ "$parts" = bench ]; then
    run qwen3.5-27b "$py" -m bench.decode --shape qwen3.5-27b --batches 1,8 --prefill 16384 --steps 16 \
        --hf-batches 1 --hf-prefill 16384 --json "$out/qwen3.5-27b.json"
    run qwen3.5-35b-a3b "$py" -m bench.decode --shape qwen3.5-35b-a3b --batches 1,8 --prefill 512,16384 \
        --steps 16 --no-hf --json "$out/qwen3.5-35b-a3b.json"
    run qwen3.5-0.8b "$py" -m bench.decode --shape qwen3.5-0.8b --batches 1 --prefill 512 --steps 32 --no-hf \
        --json "$out/qwen3.5-0.8b.json"
fi
if [ "$parts" = tune ]; then
    run moe-tune "$py" -m bench.moe_tune --shape qwen3.5-35b-a3b --tokens 1,8
    run gdn-tune "$py" -m bench.gdn_tune --shape qwen3.5-35b-a3b --batches 1,8
    run gdn-tune-27b "$py" -m bench.gdn_tune --shape qwen3.5-27b --batches 1
    run attention-tune "$py" -m bench.attention_tune --shape qwen3.5-35b-a3b --batches 1,8
fi
if [ "$parts" = gemv ]; then
    run gemv-tune "$py" -m bench.gemv_tune --shape qwen3.5-27b --rows 1,8
    run gemv-tune-35b "$py" -m bench.gemv_tune --shape qwen3.5-35b-a3b --rows 1,8
    run gemv-norm "$py" -m bench.gemv_tune --shape qwen3.5-27b --rows 1 --norm
    run gemv-norm-35b "$py" -m bench.gemv_tune --shape qwen3.5-35b-a3b --rows 1 --norm
fi
if [ "$parts" = int4 ]; then
    run int4-tests "$py" -m pytest -q tests/gpu/test_kernels.py -k "int4 or quant" -p no:cacheprovider
    run gemv-int4 "$py" -m bench.gemv_tune --int4 --shape qwen3.5-27b --rows 1,8,20
    run 27b-int4 "$py" -m bench.decode --shape qwen3.5-27b --weights int4 --batches 1,8 --prefill 16384 --steps 16 \
        --no-hf --json "$out/27b-int4.json"
    # one decode row prepared once before each 4-bit product (launch setting int4_x_pack; the
    # default beside it, above): the whole step with the extra launch
    run 27b-int4-xpack "$py" -m bench.decode --shape qwen3.5-27b --weights int4 --batches 1 --prefill "" --steps 16 \
        --no-hf --set int4_x_pack=True --json "$out/27b-int4-xpack.json"
    run 27b-bf16 "$py" -m bench.decode --shape qwen3.5-27b --batches 1 --prefill 16384 --steps 16 --no-hf \
        --json "$out/27b-bf16.json"
    run 35b-a3b-int4 "$py" -m bench.decode --shape qwen3.5-35b-a3b --weights int4 --batches 1,8 --prefill 16384 \
        --steps 16 --no-hf --json "$out/35b-a3b-int4.json"
    run 27b-int4-profile "$py" -m bench.profile --shape qwen3.5-27b --weights int4 --batch 1 --context 512 \
        --prefill 16384 --steps 4
fi
if [ "$parts" = memory ]; then  # the 16 GiB plans' commands through bench.memory: their bytes by stage and source
    run memory-9b "$py" -m ninfer.bench.measure_presets --shape Qwen3.5-9B --checkpoint-format gptq \
        --lanes 1 --cap-gib 16 --prompt-tokens 16384 --memory --out "$out/memory-9b.json"
    run memory-27b "$py" -m ninfer.bench.measure_presets --shape Qwen3.5-27B --checkpoint-format gptq \
        --lanes 1 --cap-gib 16 --prompt-tokens 16384 --memory --out "$out/memory-27b.json"
fi
if [ "$parts" = presets ]; then  # issue 21's 16 GiB rows, from 4-bit random checkpoints (15 GB of disk for the 27B)
    run presets-27b-4bit "$py" -m ninfer.bench.measure_presets --shape Qwen3.5-27B --checkpoint-format gptq \
        --lanes 1 --cap-gib 16 --prompt-tokens 131072 --serve-args "--kv-dtype 4bit" --out "$out/presets-27b-4bit.json"
    run presets-27b-fp8 "$py" -m ninfer.bench.measure_presets --shape Qwen3.5-27B --checkpoint-format gptq \
        --lanes 1 --cap-gib 16 --prompt-tokens 65536 --serve-args "--kv-dtype fp8" --out "$out/presets-27b-fp8.json"
    run presets-9b "$py" -m ninfer.bench.measure_presets --shape Qwen3.5-9B --checkpoint-format gptq \
        --lanes 1 --cap-gib 16 --prompt-tokens 262144 --out "$out/presets-9b.json"
fi
if [ "$parts" = pdl ]; then
    for mode in off first late; do
        run "pdl-$mode" "$py" -m bench.decode --shape qwen3.5-35b-a3b --batches 1 --prefill 512 --steps 16 --no-hf \
            --json "$out/qwen3.5-35b-a3b-pdl-$mode.json" --set "pdl='$mode'"
    done
fi
if [ "$parts" = ab ]; then
    moe="--shape qwen3.5-35b-a3b --batches 1 --prefill 512 --steps 16 --no-hf"
    run ab-35b "$py" -m bench.decode $moe --json "$out/ab-35b.json"
    run ab-35b-router-after-wait "$py" -m bench.decode $moe --json "$out/ab-35b-router-after-wait.json" \
        --set moe_router_before_wait=False
    run ab-35b-inputs-from-host "$py" -m bench.decode $moe --json "$out/ab-35b-inputs-from-host.json" \
        --set advance_in_graph=False
    run ab-35b-argmax-after-graph "$py" -m bench.decode $moe --json "$out/ab-35b-argmax-after-graph.json" \
        --set greedy_in_graph=False
    dense="--shape qwen3.5-27b --batches 1,8 --prefill 512 --steps 16 --no-hf"
    run ab-27b "$py" -m bench.decode $dense --json "$out/ab-27b.json"
    run ab-27b-attention-defaults "$py" -m bench.decode $dense --json "$out/ab-27b-attention-defaults.json" \
        --set "attention_shape_tiles={}"
    short="--shape qwen3.5-9b --batches 1 --prefill 2,4,8,16 --beside 8 --steps 16 --no-hf"
    run ab-9b-short-prompts "$py" -m bench.decode $short --json "$out/ab-9b-short-prompts.json"
    run ab-9b-short-prompts-recurrent "$py" -m bench.decode $short --json "$out/ab-9b-short-prompts-recurrent.json" \
        --set gdn_recurrent_prompt_tokens=16
fi
if [ "$parts" = vision ]; then
    run vision-27b "$py" -m bench.vision --shape qwen3.5-27b --megapixels 1,4 --json "$out/vision-27b.json"
fi
if [ "$parts" = cache ]; then
    ab="--cache-ab --repeat 3 --streams 16,64 --prompt-tokens 200 --output-tokens 256"
    run cache-9b "$py" -m bench.serve --shape qwen3.5-9b $ab --json "$out/cache-9b.json"
    run cache-0.8b "$py" -m bench.serve --shape qwen3.5-0.8b $ab --json "$out/cache-0.8b.json"
    run cache-conversation "$py" -m bench.serve --shape qwen3.5-9b --streams 1 --turns 3 --prompt-tokens 30000 \
        --turn-tokens 256 --output-tokens 32 --cache-ab --json "$out/cache-conversation.json" -- --max-context 36000
    run cache-shared "$py" -m bench.serve --shape qwen3.5-9b --streams 2 --shared-tokens 30000 --prompt-tokens 100 \
        --output-tokens 32 --cache-ab --json "$out/cache-shared.json" -- --max-context 36000
    run cache-documents "$py" -m bench.serve --shape qwen3.5-9b --preset documents --cache-ab \
        --json "$out/cache-documents.json" -- --max-context 36000
fi
if [ "$parts" = cache16 ]; then
    # the 0.8B's first tokens at 16 streams with the cache on: the engine alone, at the server's
    # context (a KV pool sized to the free memory with the cache on) and at 8K; then through HTTP at 8K
    run cost16-32k "$py" -m bench.cache_cost --shape qwen3.5-0.8b --streams 16 --modes on,off --rounds 4 \
        --max-context 32768 --json "$out/cost16-32k.json"
    run cost16-8k "$py" -m bench.cache_cost --shape qwen3.5-0.8b --streams 16 --modes on,off --rounds 4 \
        --max-context 8192 --json "$out/cost16-8k.json"
    run cache16-8k "$py" -m bench.serve --shape qwen3.5-0.8b --cache-ab --repeat 3 --streams 16 --prompt-tokens 200 \
        --output-tokens 256 --json "$out/cache16-8k.json" -- --max-context 8192
fi
if [ "$parts" = steps ]; then
    run steps-tests "$py" -m pytest -q tests/gpu/test_mixed_graph_gpu.py tests/gpu/test_verify_graph_gpu.py -p no:cacheprovider
    run steps-9b "$py" -m bench.decode --shape qwen3.5-9b --batches 1,8 --context 512 --prefill 512 --beside 8 --verify 4 \
        --steps 16 --no-hf --json "$out/steps-9b.json"
    # 16 prompts of 127 tokens and one decoding row: 2,033 tokens, inside the largest bucket (2,048)
    run profile-0.8b "$py" -m bench.profile --shape qwen3.5-0.8b --batch 1 --mixed 16 --mixed-tokens 127
    run profile-9b "$py" -m bench.profile --shape qwen3.5-9b --batch 8 --context 512 --mixed 1 --mixed-tokens 512
fi
if [ "$parts" = serve ]; then
    load="--prompt-tokens 200 --output-tokens 256"
    run serve-9b "$py" -m bench.serve --shape qwen3.5-9b --streams 16,64 $load --json "$out/serve-9b.json"
    run serve-0.8b "$py" -m bench.serve --shape qwen3.5-0.8b --streams 1,4,16,64 $load --json "$out/serve-0.8b.json"
fi
exit "$status"
