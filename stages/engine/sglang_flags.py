"""SGLang's launch flags on ``inflight engine``: every flag SGLang 0.5.23's server parses is
either served, taken, or refused saying why, so that a command line written for SGLang (an RL
framework's, a launch script's) starts the built-in engine or says exactly which flag it
cannot honour, never argparse's bare "unrecognized arguments".

``_TABLE`` is SGLang 0.5.23's command line, read from its source (the fields of
``srt/arg_groups/fields/*.py`` that have a command-line name, their aliases, and the flags
``srt/server_args.py`` registers itself): a flag a line, with how many values it takes (``0``
a switch, ``no`` a ``--no-`` switch, ``1`` one value, ``?``, ``*``, ``+`` as argparse's
``nargs``) and SGLang's default (JSON). ``tests/stages/test_engine_sglang_flags.py`` holds it
to SGLang's own parser where SGLang imports.

The engine's parser (``stages.engine.server``) defines the flags it serves; ``add_to`` adds
every other flag of the table, hidden from ``--help``, and ``read(args)`` sorts those given:

- at SGLang's default (``--dp-size 1``, ``--kv-cache-dtype auto``): nothing changes;
- ``TAKEN`` (what tunes SGLang's GPU runtime and scheduler and changes no answer: kernels and
  their backends, CUDA graphs, chunked prefill, memory pools and their host tiers, overlap,
  compilation, log and metric intervals, worker counts, LoRA's memory pool): taken, and logged
  once at start (``engine_flags_not_applicable``);
- any other value: refused at start, ``REASONS``' words where they say more.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["TAKEN", "add_to", "read"]

_DEST = "sglang_flag__"

# SGLang 0.5.23's flags: name, values taken, SGLang's default (see the module's docstring)
_TABLE = """
--abort-on-priority-when-disabled 0 false
--admin-api-key 1 null
--allow-auto-truncate 0 false
--allowed-media-domains + []
--api-key 1 null
--asr-max-buffer-seconds 1 60
--asr-max-concurrent-sessions 1 32
--attention-backend 1 null
--attention-context-parallel-size 1 1
--attention-data-parallel-size 1 1
--attn-cp-size 1 1
--attn-dp-size 1 1
--base-gpu-id 1 0
--batch-notify-size 1 16
--bf16-gemm-backend 1 "auto"
--boundary-reduction 1 "auto"
--bucket-e2e-request-latency + null
--bucket-inter-token-latency + null
--bucket-time-to-first-token + null
--c128-page-size 1 16
--chat-template 1 null
--checkpoint-engine-wait-weights-before-ready 0 false
--chunked-prefill-size 1 null
--completion-template 1 null
--config 1 null
--constrained-json-disable-any-whitespace 0 false
--constrained-json-max-whitespace-cnt 1 null
--constrained-json-whitespace-pattern 1 null
--context-bucket 1 null
--context-length 1 null
--cp-strategy 1 null
--cpu-offload-gb 1 0
--crash-dump-folder 1 null
--cuda-graph-backend-decode 1 null
--cuda-graph-backend-prefill 1 null
--cuda-graph-bs-decode + null
--cuda-graph-bs-prefill + null
--cuda-graph-config 1 null
--cuda-graph-max-bs-decode 1 null
--cuda-graph-max-bs-prefill 1 null
--cuda-graph-max-seq-len-prefill 1 null
--cuda-graph-prefill-max-context 1 null
--custom-weight-loader * null
--data-parallel-size 1 1
--dcp-comm-backend 1 null
--dcp-replicate-q-proj 0 null
--dcp-size 1 1
--debug-cuda-graph 0 false
--debug-tensor-dump-input-file 1 null
--debug-tensor-dump-layers + null
--debug-tensor-dump-output-folder 1 null
--decode-attention-backend 1 null
--decode-context-parallel-size 1 1
--decode-log-interval 1 40
--decoupled-spec-bind-endpoint 1 null
--decoupled-spec-connect-endpoints 1 null
--decoupled-spec-rank 1 null
--decoupled-spec-role 1 "null"
--decrypted-config-file 1 null
--decrypted-draft-config-file 1 null
--deepep-config 1 null
--deepep-dispatcher-output-dtype 1 "auto"
--deepep-mode 1 "auto"
--deepep-v2-mode 1 "direct"
--default-chat-template-kwargs 1 null
--default-priority-value 1 null
--delete-ckpt-after-loading 0 false
--detokenizer-worker-num 1 1
--device 1 null
--disable-aiter-allreduce-fusion-in-decode 0 false
--disable-aiter-allreduce-fusion-in-prefill 0 false
--disable-attn-tp-gather 0 false
--disable-chunked-prefix-cache 0 false
--disable-cuda-graph 0 false
--disable-cuda-graph-padding 0 false
--disable-custom-all-reduce 0 false
--disable-decode-cuda-graph 0 false
--disable-fast-image-processor 0 false
--disable-flashinfer-autotune 0 false
--disable-flashinfer-cutlass-moe-fp4-allgather 0 false
--disable-hybrid-swa-memory 0 false
--disable-outlines-disk-cache 0 false
--disable-overlap-schedule 0 false
--disable-prefill-cuda-graph 0 false
--disable-priority-preemption 0 false
--disable-radix-cache 0 false
--disable-shared-experts-fusion 0 false
--disable-tokenizer-batch-decode 0 false
--disaggregation-bootstrap-port 1 8998
--disaggregation-decode-allocation-policy 1 "early"
--disaggregation-decode-enable-offload-kvcache 0 false
--disaggregation-decode-enable-radix-cache 0 false
--disaggregation-decode-extra-slots 1 null
--disaggregation-decode-host-receive-threshold 1 1.0
--disaggregation-decode-polling-interval 1 1
--disaggregation-decode-retraction-backup 1 null
--disaggregation-enable-kv-checksum 0 false
--disaggregation-ib-device 1 null
--disaggregation-mode 1 "null"
--disaggregation-transfer-backend 1 "mooncake"
--dist-init-addr 1 null
--dist-timeout 1 null
--dllm-algorithm 1 null
--dllm-algorithm-config 1 null
--dllm-fdfo 0 true
--download-dir 1 null
--dp-size 1 1
--dsa-decode-backend 1 null
--dsa-paged-mqa-logits-backend 1 "auto"
--dsa-prefill-backend 1 null
--dsa-topk-backend 1 "sgl-kernel"
--dsa-triton-union 1 0
--dsv4-attn-backend 1 "auto"
--dsv4-prefill-backend 1 "auto"
--dtype 1 "auto"
--dwdp-size 1 1
--dynamic-batch-tokenizer-batch-size 1 32
--dynamic-batch-tokenizer-batch-timeout 1 0.002
--elastic-ep-backend 1 null
--elastic-ep-initial-size 1 null
--elastic-ep-join-mode 1 null
--elastic-ep-join-rank-offset 1 0
--elastic-ep-scale-timeout 1 600
--enable-adaptive-dispatch-to-encoder 0 false
--enable-aiter-allreduce-fusion 0 false
--enable-amd-monokernel 0 false
--enable-attn-tp-input-scattered 0 false
--enable-broadcast-mm-inputs-process 0 false
--enable-cache-report 0 false
--enable-cp-decode-attn-tp 0 false
--enable-cudagraph-gc 0 false
--enable-custom-logit-processor 0 false
--enable-decoder-swa-bounded-replay 0 null
--enable-deepseek-v4-fp4-indexer 0 false
--enable-dense-mlp-attn-tp 0 false
--enable-deterministic-inference 0 false
--enable-dp-attention 0 false
--enable-dp-attention-local-control-broadcast 0 false
--enable-dp-lm-head 0 false
--enable-draft-weights-cpu-backup 0 false
--enable-dsa-cache-layer-split 0 false
--enable-dsa-fused-indexer 0 null
--enable-dynamic-batch-tokenizer 0 false
--enable-dynamic-chunking 0 false
--enable-elastic-expert-backup 0 false
--enable-encoder-swa-bounded-replay 0 false
--enable-eplb 0 false
--enable-flashinfer-allreduce-fusion 0 false
--enable-flexkv 0 false
--enable-forward-pass-metrics 0 false
--enable-fp32-lm-head 0 false
--enable-fused-moe-sum-all-reduce 0 false
--enable-fused-qk-norm-rope 0 null
--enable-hicache 0 false
--enable-hierarchical-cache 0 false
--enable-hisparse 0 false
--enable-http-worker-reuseport 0 false
--enable-http2 0 false
--enable-int8-mamba-checkpoint 0 false
--enable-kv-cache-sharding 0 false
--enable-layernorm-sp 0 false
--enable-layerwise-nvtx-marker 0 false
--enable-lean-attention 0 null
--enable-linear-replayssm 0 false
--enable-linear-replayssm-spec 0 false
--enable-linker-mla-dedup 0 false
--enable-lmcache 0 false
--enable-lora 0 null
--enable-lora-overlap-loading 0 null
--enable-mamba-cache-stochastic-rounding 0 false
--enable-megamoe-for-layernorm-sp 0 false
--enable-memory-saver 0 false
--enable-metrics 0 false
--enable-metrics-for-all-schedulers 0 false
--enable-mfu-metrics 0 false
--enable-mis 0 false
--enable-mixed-chunk 0 false
--enable-mm-global-cache 0 false
--enable-mscclpp 0 false
--enable-multi-layer-eagle 0 false
--enable-multimodal 0 null
--enable-nccl-nvls 0 false
--enable-nvidia-megakernel 0 false
--enable-p2p-check 0 false
--enable-page-major-kv-layout 0 false
--enable-paged-experts 0 false
--enable-pd-role-switch 0 false
--enable-pdmux 0 false
--enable-precise-embedding-interpolation 0 false
--enable-prefill-cp 0 false
--enable-prefill-delayer 0 false
--enable-prefix-mm-cache 0 false
--enable-priority-scheduling 0 false
--enable-profile-cuda-graph 0 false
--enable-quant-communications 0 false
--enable-request-time-stats-logging 0 false
--enable-response-store 0 false
--enable-return-aux-hidden-states 0 false
--enable-return-hidden-states 0 false
--enable-return-indexer-topk 0 false
--enable-return-routed-experts 0 false
--enable-scattered-sconv 0 false
--enable-session-radix-cache 0 false
--enable-shared-experts-attn-tp 0 false
--enable-single-batch-overlap 0 false
--enable-ssl-refresh 0 false
--enable-streaming-session 0 false
--enable-strict-thinking 0 false
--enable-symm-mem 0 false
--enable-tf32-matmul 0 null
--enable-tokenizer-batch-encode 0 false
--enable-torch-compile 0 false
--enable-torch-compile-debug-mode 0 false
--enable-torch-symm-mem 0 false
--enable-tp-lm-head-all-to-all 0 null
--enable-trace 0 false
--enable-two-batch-overlap 0 false
--enable-unified-cache-external-linker 0 false
--enable-unified-memory 0 false
--enable-w4a4-mxfp4-megamoe 0 false
--enable-waterfill 0 false
--enable-watermark 0 false
--enable-weights-cpu-backup 0 false
--encoder-bootstrap-port 1 8997
--encoder-only 0 false
--encoder-register-urls + []
--encoder-transfer-backend 1 "auto"
--encoder-urls + []
--enforce-disable-flashinfer-allreduce-fusion 0 false
--enforce-shared-experts-fusion 0 false
--engine-info-bootstrap-port 1 6789
--ep 1 1
--ep-dispatch-algorithm 1 null
--ep-num-redundant-experts 1 0
--ep-size 1 1
--eplb-algorithm 1 "auto"
--eplb-min-rebalancing-utilization-threshold 1 1.0
--eplb-rebalance-layers-per-chunk 1 null
--eplb-rebalance-num-iterations 1 1000
--expert-balancedness-report-mode 1 "off"
--expert-distribution-recorder-buffer-size 1 null
--expert-distribution-recorder-mode 1 null
--expert-parallel-size 1 1
--experts-shared-outer-loras 0 null
--export-metrics-to-file 0 false
--export-metrics-to-file-dir 1 null
--extra-metric-labels 1 null
--fastapi-root-path 1 ""
--file-storage-path 1 null
--flashinfer-a2a-dispatch-type 1 null
--flashinfer-allreduce-fusion-backend 1 null
--flashinfer-autotune-skip-ops + null
--flashinfer-mla-disable-ragged 0 false
--flashinfer-mxfp4-moe-precision 1 "default"
--flexkv-config-file 1 null
--forward-hooks 1 null
--forward-pass-metrics-ipc-name 1 null
--forward-pass-metrics-worker-id 1 ""
--fp4-gemm-backend 1 "auto"
--fp8-gemm-backend 1 "auto"
--fuseep-mode 1 2
--gated-launch-port 1 null
--gc-threshold + null
--gc-warning-threshold-secs 1 0.0
--generation-tokens-buckets + null
--gpu-id-step 1 1
--grammar-backend 1 null
--grpc-http-sidecar-port 1 null
--grpc-mode 0 false
--grpc-port 1 null
--grpc-response-timeout-secs 1 300
--hf-chat-template-name 1 null
--hicache-host-memory-fraction 1 0.8
--hicache-host-memory-mode 1 "cache"
--hicache-io-backend 1 "kernel"
--hicache-mem-layout 1 "page_first"
--hicache-ratio 1 null
--hicache-size 1 0
--hicache-storage-backend 1 null
--hicache-storage-backend-extra-config 1 null
--hicache-storage-prefetch-policy 1 "timeout"
--hicache-storage-prefetch-retry-max-attempts 1 8
--hicache-storage-prefetch-retry-poll-interval 1 8
--hicache-write-policy 1 "write_through"
--hierarchical-sparse-attention-extra-config 1 null
--hisparse-config 1 null
--host 1 "127.0.0.1"
--http2-initial-connection-window-size 1 1048576
--http2-max-concurrent-streams 1 200
--image-processor-backend 1 "auto"
--incremental-streaming-output 0 false
--init-expert-location 1 "trivial"
--int8-mamba-ckpt-size 1 null
--is-embedding 0 false
--json-model-override-args 1 "{}"
--kt-cpuinfer 1 null
--kt-max-deferred-experts-per-token 1 null
--kt-method 1 "AMXINT4"
--kt-num-gpu-experts 1 null
--kt-threadpool-count 1 2
--kt-weight-path 1 null
--kv-cache-dtype 1 "auto"
--kv-canary 1 "none"
--kv-canary-real-data 1 "none"
--kv-canary-sweep-interval 1 0
--kv-events-config 1 null
--language-model-only 0 false
--language-only 0 false
--limit-mm-data-per-request 1 null
--linear-attn-backend 1 "triton"
--linear-attn-decode-backend 1 null
--linear-attn-prefill-backend 1 null
--linear-attn-verify-backend 1 null
--linear-replayssm-cache-len 1 16
--lmcache-config-file 1 null
--load-balance-method 1 "auto"
--load-format 1 "auto"
--load-publish-endpoint 1 null
--load-snapshot-publish-interval 1 15
--log-level 1 "info"
--log-level-http 1 null
--log-requests 0 false
--log-requests-format 1 "text"
--log-requests-level 1 2
--log-requests-target + null
--lora-backend 1 "csgmv"
--lora-drain-wait-threshold 1 0.0
--lora-eviction-policy 1 "lru"
--lora-paths * null
--lora-strict-loading 0 false
--lora-target-modules * null
--lora-use-virtual-experts 0 false
--mamba-backend 1 "triton"
--mamba-cache-philox-rounds 1 0
--mamba-full-memory-ratio 1 null
--mamba-max-states-per-path 1 -1
--mamba-radix-cache-strategy 1 "auto"
--mamba-ssm-dtype 1 null
--mamba-track-interval 1 256
--max-ep-size 1 null
--max-loaded-loras 1 null
--max-lora-chunk-size 1 16
--max-lora-rank 1 null
--max-loras-per-batch 1 8
--max-mamba-cache-size 1 null
--max-prefill-tokens 1 16384
--max-queued-requests 1 null
--max-running-requests 1 null
--max-total-tokens 1 null
--media-url-max-file-size-mb 1 64
--mem-fraction-static 1 null
--min-free-slots-delay 1 null
--mlx-enable-sampling 0 false
--mm-attention-backend 1 null
--mm-enable-dp-encoder 0 null
--mm-feature-transport 1 null
--mm-global-cache-backend 1 "mooncake"
--mm-io-worker-num 1 0
--mm-preprocess-cache-size-mb 1 null
--mm-process-config 1 null
--mm-processor-worker-num 1 0
--model 1 null
--model-checksum ? null
--model-config-parser 1 "auto"
--model-impl 1 "auto"
--model-loader-extra-config 1 "{}"
--model-path 1 null
--modelexpress-config 1 null
--modelopt-checkpoint-restore-path 1 null
--modelopt-checkpoint-save-path 1 null
--modelopt-export-path 1 null
--modelopt-quant 1 null
--moe-a2a-backend 1 "none"
--moe-data-parallel-size 1 1
--moe-dense-tp-size 1 null
--moe-dp-size 1 1
--moe-runner-backend 1 "auto"
--monokernel-backend 1 null
--mooncake-ib-device 1 null
--msprobe-dump-config 1 null
--nccl-init-addr 1 null
--nccl-port 1 null
--nnodes 1 1
--no-dcp-replicate-q-proj no null
--no-dllm-fdfo no true
--no-enable-decoder-swa-bounded-replay no null
--no-enable-dsa-fused-indexer no null
--no-enable-fused-qk-norm-rope no null
--no-enable-tf32-matmul no null
--no-enable-tp-lm-head-all-to-all no null
--no-experts-shared-outer-loras no null
--no-lora-strict-loading no false
--no-mm-enable-dp-encoder no null
--no-ple-offload-embedding no null
--no-speculative-enable-w4a4-mxfp4-megamoe no null
--node-rank 1 0
--num-continuous-decode-steps 1 1
--num-reserved-decode-tokens 1 512
--numa-node + null
--offload-group-size 1 -1
--offload-mode 1 "cpu"
--offload-num-in-group 1 1
--offload-prefetch-step 1 1
--optimistic-prefill-attempts 1 0
--otlp-service-name 1 null
--otlp-traces-endpoint 1 "localhost:4317"
--page-size 1 null
--paged-experts-num-resident 1 null
--pdmux-config-path 1 null
--pipeline-parallel-size 1 1
--ple-offload-backend 1 "pinned"
--ple-offload-dir 1 null
--ple-offload-embedding 0 null
--port 1 30000
--pp-async-batch-depth 1 0
--pp-max-micro-batch-size 1 null
--pp-size 1 1
--pre-warm-nccl 0 false
--preferred-sampling-params 1 null
--prefill-attention-backend 1 null
--prefill-decode-interval 1 null
--prefill-decode-interval-min-bs 1 0
--prefill-delayer-forward-passes-buckets + null
--prefill-delayer-max-delay-ms 1 null
--prefill-delayer-max-delay-passes 1 30
--prefill-delayer-queue-min-ratio 1 null
--prefill-delayer-token-usage-low-watermark 1 null
--prefill-delayer-wait-seconds-buckets + null
--prefill-kv-cache-dequant-dtype 1 "auto"
--prefill-max-requests 1 null
--prefill-only-disable-kv-cache 0 false
--priority-scheduling-preemption-threshold 1 10
--prompt-tokens-buckets + null
--qsa-indexer-dtype 1 "auto"
--quantization 1 null
--quantization-param-path 1 null
--quantize-and-serve 0 false
--radix-cache-backend 1 null
--radix-eviction-policy 1 "lru"
--radix-eviction-policy-config 1 null
--random-seed 1 null
--remote-instance-weight-loader-backend 1 "nccl"
--remote-instance-weight-loader-seed-instance-ip 1 null
--remote-instance-weight-loader-seed-instance-service-port 1 null
--remote-instance-weight-loader-send-weights-group-ports 1 null
--remote-instance-weight-loader-start-seed-via-transfer-engine 0 false
--retraction-policy 1 "length"
--return-aux-hidden-state-layer-ids + null
--return-hidden-states-mode 1 null
--return-input-ids 0 false
--return-output-ids 0 false
--revision 1 null
--rl-on-policy-target 1 null
--rl-quant-profile 1 null
--sampling-backend 1 null
--sampling-defaults 1 "model"
--sampling-mask-max-tokens 1 4096
--schedule-conservativeness 1 1.0
--schedule-low-priority-values-first 0 false
--schedule-policy 1 "fcfs"
--scheduler-recv-interval 1 1
--served-model-name 1 null
--shared-experts-tp-size 1 null
--show-time-cost 0 false
--sidecar 1 null
--sidecar-args 1 null
--skip-server-warmup 0 false
--skip-tokenizer-init 0 false
--sleep-on-idle 0 false
--sm-group-num 1 8
--smg-grpc-mode 0 false
--smg-http-sidecar-port 1 null
--soft-watchdog-timeout 1 null
--spec-trace-dir 1 null
--speculative-accept-threshold-acc 1 1.0
--speculative-accept-threshold-single 1 1.0
--speculative-adaptive 0 false
--speculative-adaptive-config 1 null
--speculative-algorithm 1 null
--speculative-attention-mode 1 "prefill"
--speculative-dflash-block-size 1 null
--speculative-domino-candidate-pool-size 1 2048
--speculative-draft-attention-backend 1 null
--speculative-draft-kv-cache-dtype 1 null
--speculative-draft-load-format 1 null
--speculative-draft-model 1 null
--speculative-draft-model-path 1 null
--speculative-draft-model-quantization 1 null
--speculative-draft-model-revision 1 null
--speculative-draft-sink-size 1 null
--speculative-draft-window-size 1 null
--speculative-dsa-topk-backend 1 "sgl-kernel"
--speculative-dspark-align-verify-tokens-to-graph-tier 0 false
--speculative-dspark-block-size 1 null
--speculative-dspark-confidence-sts-path 1 null
--speculative-dspark-sps-table-path 1 null
--speculative-eagle-topk 1 null
--speculative-enable-w4a4-mxfp4-megamoe 0 null
--speculative-moe-a2a-backend 1 null
--speculative-moe-runner-backend 1 null
--speculative-ngram-capacity 1 10000000
--speculative-ngram-external-corpus-max-tokens 1 10000000
--speculative-ngram-external-corpus-path 1 null
--speculative-ngram-external-sam-budget 1 0
--speculative-ngram-match-type 1 "BFS"
--speculative-ngram-max-bfs-breadth 1 10
--speculative-ngram-max-trie-depth 1 18
--speculative-ngram-min-bfs-breadth 1 1
--speculative-num-draft-tokens 1 null
--speculative-num-steps 1 null
--speculative-token-map 1 null
--speculative-use-block-verification 0 false
--speculative-use-rejection-sampling 0 false
--ssl-ca-certs 1 null
--ssl-certfile 1 null
--ssl-keyfile 1 null
--ssl-keyfile-password 1 null
--startup-weight-load-mode 1 "serial"
--stream-interval 1 1
--stream-response-default-include-usage 0 false
--strip-thinking-cache 0 false
--swa-full-tokens-ratio 1 null
--swa-prefix-tails 1 null
--tbo-token-distribution-threshold 1 0.48
--tensor-parallel-size 1 1
--tokenizer-backend 1 "huggingface"
--tokenizer-metrics-allowed-custom-labels + null
--tokenizer-metrics-custom-labels-header 1 "x-custom-labels"
--tokenizer-mode 1 "auto"
--tokenizer-path 1 null
--tokenizer-worker-num 1 1
--tool-server 1 null
--torch-compile-max-bs 1 32
--tp-size 1 1
--trace-modules 1 "request"
--triton-attention-num-kv-splits 1 8
--triton-attention-reduce-in-fp32 0 false
--triton-attention-split-tile-size 1 null
--trust-mm-content-hashes 0 false
--trust-remote-code 0 false
--trust-request-chat-template 0 false
--unified-cache-external-linker-backend 1 "mooncake"
--unified-cache-external-linker-config 1 null
--uno-lora-path 1 null
--use-ray 0 false
--uvicorn-access-log-exclude-prefixes * []
--warmups 1 null
--watchdog-timeout 1 300
--watermark-config 1 null
--weight-cache-mode 1 "off"
--weight-cache-socket 1 null
--weight-cache-timeout 1 1800
--weight-loader-disable-mmap 0 false
--weight-loader-drop-cache-after-load 0 false
--weight-loader-prefetch-checkpoints 0 false
--weight-loader-prefetch-num-threads 1 4
--weight-version 1 "default"
"""

_FLAGS: dict[str, tuple[str, Any]] = {
    name: (nargs, json.loads(default))
    for name, nargs, default in (line.split(" ", 2) for line in _TABLE.strip().splitlines())
}

# Flags that tune SGLang's GPU runtime or its scheduler and change no answer: taken here.
TAKEN = frozenset(
    """
--attention-backend --prefill-attention-backend --decode-attention-backend
--mm-attention-backend --sampling-backend --mamba-backend --moe-runner-backend
--fp8-gemm-backend --fp4-gemm-backend --bf16-gemm-backend --linear-attn-backend
--linear-attn-decode-backend --linear-attn-prefill-backend --image-processor-backend
--monokernel-backend --enable-amd-monokernel
--disable-cuda-graph --disable-cuda-graph-padding --disable-decode-cuda-graph
--disable-prefill-cuda-graph --debug-cuda-graph --enable-profile-cuda-graph --enable-cudagraph-gc
--cuda-graph-backend-decode --cuda-graph-backend-prefill --cuda-graph-bs-decode
--cuda-graph-bs-prefill --cuda-graph-config --cuda-graph-max-bs-decode
--cuda-graph-max-bs-prefill --cuda-graph-max-seq-len-prefill --cuda-graph-prefill-max-context
--enable-torch-compile --torch-compile-max-bs --enable-torch-compile-debug-mode
--triton-attention-num-kv-splits --triton-attention-split-tile-size
--flashinfer-allreduce-fusion-backend --flashinfer-autotune-skip-ops --disable-flashinfer-autotune
--enable-flashinfer-allreduce-fusion --enforce-disable-flashinfer-allreduce-fusion
--enable-aiter-allreduce-fusion --disable-aiter-allreduce-fusion-in-decode
--disable-aiter-allreduce-fusion-in-prefill --disable-custom-all-reduce --enable-mscclpp
--enable-nccl-nvls --enable-symm-mem --enable-torch-symm-mem --pre-warm-nccl
--enable-multimodal
--enable-fused-qk-norm-rope --enable-fused-moe-sum-all-reduce --disable-shared-experts-fusion
--enforce-shared-experts-fusion --enable-tf32-matmul
--chunked-prefill-size --max-prefill-tokens --enable-mixed-chunk --enable-dynamic-chunking
--schedule-policy --schedule-conservativeness --disable-overlap-schedule
--num-continuous-decode-steps --scheduler-recv-interval --min-free-slots-delay
--optimistic-prefill-attempts --enable-two-batch-overlap --enable-single-batch-overlap
--tbo-token-distribution-threshold --prefill-decode-interval --prefill-decode-interval-min-bs
--num-reserved-decode-tokens --retraction-policy --sleep-on-idle --max-total-tokens
--enable-prefill-delayer --prefill-delayer-max-delay-passes --prefill-delayer-max-delay-ms
--prefill-delayer-queue-min-ratio --prefill-delayer-token-usage-low-watermark
--prefill-delayer-forward-passes-buckets --prefill-delayer-wait-seconds-buckets
--page-size --c128-page-size --enable-page-major-kv-layout --disable-hybrid-swa-memory
--swa-full-tokens-ratio --enable-unified-memory --radix-eviction-policy
--radix-eviction-policy-config --disable-chunked-prefix-cache --enable-hierarchical-cache
--enable-hicache --hicache-ratio --hicache-size --hicache-write-policy --hicache-io-backend
--hicache-mem-layout --hicache-host-memory-fraction --hicache-host-memory-mode
--hicache-storage-backend --hicache-storage-backend-extra-config
--hicache-storage-prefetch-policy --hicache-storage-prefetch-retry-max-attempts
--hicache-storage-prefetch-retry-poll-interval --cpu-offload-gb --offload-group-size
--offload-mode --offload-num-in-group --offload-prefetch-step --enable-weights-cpu-backup
--enable-draft-weights-cpu-backup --mamba-max-states-per-path --mamba-radix-cache-strategy
--mamba-track-interval --mamba-cache-philox-rounds
--weight-loader-disable-mmap --weight-loader-drop-cache-after-load
--weight-loader-prefetch-checkpoints --weight-loader-prefetch-num-threads
--startup-weight-load-mode --download-dir
--decode-log-interval --show-time-cost --enable-trace --otlp-traces-endpoint --otlp-service-name
--trace-modules --enable-layerwise-nvtx-marker --bucket-time-to-first-token
--bucket-inter-token-latency --bucket-e2e-request-latency --prompt-tokens-buckets
--generation-tokens-buckets --enable-request-time-stats-logging --enable-mfu-metrics
--enable-metrics-for-all-schedulers --log-level-http --gc-warning-threshold-secs --kv-canary
--kv-canary-sweep-interval --kv-canary-real-data --enable-forward-pass-metrics
--forward-pass-metrics-ipc-name --forward-pass-metrics-worker-id
--tokenizer-worker-num --detokenizer-worker-num --enable-tokenizer-batch-encode
--disable-tokenizer-batch-decode --enable-dynamic-batch-tokenizer
--dynamic-batch-tokenizer-batch-size --dynamic-batch-tokenizer-batch-timeout
--mm-processor-worker-num --mm-io-worker-num --mm-preprocess-cache-size-mb
--disable-fast-image-processor --disable-outlines-disk-cache --enable-http2
--http2-initial-connection-window-size --http2-max-concurrent-streams
--enable-http-worker-reuseport --watchdog-timeout --soft-watchdog-timeout --dist-timeout
--numa-node --gc-threshold --enable-p2p-check --gpu-id-step --dist-init-addr --nccl-init-addr
--nccl-port
--max-lora-rank --lora-target-modules --max-loras-per-batch --max-loaded-loras
--lora-eviction-policy --lora-backend --max-lora-chunk-size --enable-lora-overlap-loading
--lora-drain-wait-threshold
""".split()
)

# What a refusal says beyond "not served", for the flags command lines use most.
REASONS = {
    "--quantization": "the built-in engine runs the checkpoint's own weights in --dtype",
    "--kv-cache-dtype": "the built-in engine keeps keys and values in the model's dtype",
    "--speculative-algorithm": "the built-in engine decodes without a draft model",
    "--dp-size": "one engine serves one replica; run more engines (a generator's engines)",
    "--data-parallel-size": "one engine serves one replica; run more engines",
    "--ep-size": "the built-in engine runs a model on one device (--tp-size 1)",
    "--ep": "the built-in engine runs a model on one device (--tp-size 1)",
    "--expert-parallel-size": "the built-in engine runs a model on one device (--tp-size 1)",
    "--pp-size": "the built-in engine runs a model on one device (--tp-size 1)",
    "--pipeline-parallel-size": "the built-in engine runs a model on one device (--tp-size 1)",
    "--nnodes": "the built-in engine runs a model on one device (--tp-size 1)",
    "--enable-dp-attention": "the built-in engine runs a model on one device (--tp-size 1)",
    "--config": "give the flags on the command line",
    "--base-gpu-id": "pick the device with --device cuda:N",
}


def add_to(parser: argparse.ArgumentParser) -> None:
    """Add every SGLang flag ``parser`` does not define itself (hidden from ``--help``)."""
    own = parser._option_string_actions
    for name, (nargs, _) in _FLAGS.items():
        if name in own:
            continue
        dest = _DEST + name[2:].replace("-", "_")
        if nargs in ("0", "no"):
            parser.add_argument(
                name, dest=dest, action="store_true", default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )  # fmt: skip
        else:
            parser.add_argument(
                name, dest=dest, nargs=None if nargs == "1" else nargs,
                default=argparse.SUPPRESS, help=argparse.SUPPRESS,
            )  # fmt: skip


def read(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The SGLang flags given in ``args`` (taken out of it): those taken, flag -> value, and
    the refusals, one a flag, sorted."""
    taken: dict[str, Any] = {}
    refused: list[str] = []
    for dest in [d for d in vars(args) if d.startswith(_DEST)]:
        value = vars(args).pop(dest)
        name = "--" + dest[len(_DEST) :].replace("_", "-")
        nargs, default = _FLAGS[name]
        if _unchanged(nargs, value, default):
            continue
        if name in TAKEN:
            taken[name[2:].replace("-", "_")] = value
            continue
        shown = name if nargs in ("0", "no") else f"{name} {_shown(value)}"
        why = REASONS.get(name, "the built-in engine does not serve it")
        refused.append(f"{shown}: SGLang's flag, not taken: {why}")
    return taken, sorted(refused)


def _unchanged(nargs: str, value: Any, default: Any) -> bool:
    """Whether ``value`` (as argparse read it) is SGLang's ``default``: nothing changes."""
    if nargs == "0":
        return default is True
    if nargs == "no":
        return default is False
    if isinstance(value, list):
        return isinstance(default, list) and [str(v) for v in default] == value
    return value is not None and (value == str(default) or _number(value) == default)


def _number(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


def _shown(value: Any) -> str:
    return " ".join(value) if isinstance(value, list) else str(value)
