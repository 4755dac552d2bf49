"""Every benchmark of the project, a module per scenario.

Behind `minisgl bench` (command.py; the CLI parses the flags and hands them over):
- offline.py: the default run, the engine vs Hugging Face `generate` on one workload;
- configs.py: `--scenario overlap-table|prefix` and `--sweep FIELD=...`, one workload under several configs;
- peers.py: `--scenario peers`, the peer harness's workloads;
- measure.py: what they measure (TTFT, TPOT, throughput) and the table they print.

Behind `minisgl bench-serve`: serve.py, concurrent streaming HTTP clients against a server.

Run as `python -m minisgl_backend.bench.<name> --help` (each its own flags; the lm-eval and serve
ones start fresh processes from a source checkout):
- linear, attention, rowwise: the native kernels' micro-benchmarks (bf16 linear, paged attention,
  RMSNorm / RoPE / SiLU x up), each against torch's own op;
- decode_profile: decode steps of the model alone, with torch.profiler's op split;
- callbacks: the completion path, the Python tracker vs the native one;
- lm_eval: the same lm_eval run with `--model hf` and `--model minisgl` (time, parity);
- lm_eval_dp: lm-eval at data_parallel_size=1 vs N (Ray replicas);
- serve_replicas: `minisgl serve` at 1 vs N replicas, measured with `minisgl bench-serve`.
- hostile: what one hostile client costs the others (latency beside it, RSS after it);
- schema: schemathesis-generated requests against the server's /openapi.json (needs schemathesis).
"""
