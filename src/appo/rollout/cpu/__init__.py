"""The hf engine's decode path for CPUs.

- `lean`: a lean forward for Llama-family decoders (packed projections, grouped-query and
  shared-prefix decode attention); the engine uses it on any device.
- `matmuls`: which matmuls a CPU decode step runs, by a fixed rule on the row count and the
  CPU (`APPO_DECODE_MATMUL` overrides it).
- `kernels`: the numba matmul kernels (a row-at-a-time, an AVX-512 wide and a register-tiled
  kernel for many rows), from the optional extra `appo[cpu-kernels]`; without numba decode
  steps use torch, only slower.
- `split`: runs a kernel over every thread the run is given (output columns in chunks),
  bit-identical to one thread.
- `fused`: a decode step with the work between the matmuls in numba kernels (`attention`:
  rotary + cache write, one GQA / shared-prefix attention kernel per layer, fused norms);
  without numba the lean decoder's torch code runs instead.
- `sampling`: a decode step's sampling (penalty, temperature, top-k / top-p, log-softmax,
  inverse-CDF draw, entropies) of CPU float32 logits in one numba kernel call; without
  numba (or with `APPO_CPU_SAMPLING=0`) the engine samples with `appo.rollout.sampling`.
"""
