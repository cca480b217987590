"""`run-recipe gpu-spec --measure`: the device that is present, measured into a GPU spec of the
performance model (core/dryrun/gpuspec.py, docs/gpu-spec.md).

- device.py: which device is measured (CUDA GPU or this CPU), its versions, which GEMM kernel
  families it runs and why not;
- benchmarks.py: GEMMs at the model's shapes, SDPA forward / backward, streaming copy and the
  eager pointwise kernels, one kernel's fixed cost;
- collectives.py: all-gather, reduce-scatter, all-reduce across local ranks (NCCL or gloo);
- assemble.py: the measurements as a spec file (measured numbers marked, the rest from a base spec);
- command.py: the click command.
"""
