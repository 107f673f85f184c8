"""The element-wise kernels' HBM figures, `efficiency.memory`, `efficiency.memory_strided` and `memory_ramp_s`, fitted
to published timings of eager PyTorch modules, priced the way a projection prices a model's element-wise ops.

A model's element-wise kernels (fp32 norms, activations, residual adds, rotary embeddings, casts) each pay a fixed
time (a first wave's DRAM latency, a tail) besides their bytes, and one torch cannot vectorize (a strided view) runs
its index arithmetic per element: priced as bytes over the efficient HBM bandwidth plus `memory_ramp_s`, never under
a kernel's floor (`kernel_s`).

The data: Liger-Kernel's benchmark rows (github.com/linkedin/Liger-Kernel at ead96b61, benchmark/data/*.csv: the
one a row's `file` column names, else all_benchmark_data.csv), kept in results/published/elementwise with their line
numbers, time eager reference modules with triton's do_bench (CUDA events, the L2 cleared between runs). Each module
is rebuilt from its benchmark script as of the row, traced on fake tensors of the row's shape (trace.py) and priced
op by op, back to back (the benchmark times the GPU alone). The fit minimises the squared log error over the forward
rows (contiguous ones set `memory` and the ramp, strided ones `memory_strided`); the "full" rows are held out.

    python -m cpbench.harness.project.elementwise        # the H100 SXM's rows: every row, the fit and its error

H100 SXM (liger_h100_eager.csv): ReLU squared, Megatron's SwiGLU reference (a chunked input: strided) and the naive
add + RMSNorm in fp32. A100 SXM4 80GB (liger_a100_eager.csv, `--gpu a100-sxm`): transformers' LlamaRMSNorm and RoPE
(strided). B200 (liger_b200_eager.csv, `--gpu b200 --keep-ramp`): the torch Jensen-Shannon divergence (kernels of
0.5-12.6 GB, too large to set a ramp: the profile's is kept) and the Llama-3-8B's RoPE. Rows priced, never fitted:
Liger's fused (Triton) RMSNorm forward on the A100 (liger_a100_fused.csv), against cpbench's fused norm; transformers'
LlamaMLP (liger_{a100,b200}_mlp.csv), GEMMs and element-wise ops together; the 8B's residual add + RMSNorm on the B200
(liger_b200_add_rms_norm.csv), which the B200's figure, fitted to the JSD's gigabyte kernels, prices fast; torch's
cross-entropy on the A100 (liger_a100_cross_entropy.csv), whose softmax reads wide rows three times (work.py).

On another GPU, `python results/gpu/elementwise_bench.py OUT.csv` times the same modules at the same sizes there and
writes rows of the same form; `python -m cpbench.harness.project.elementwise --data OUT.csv --gpu h200` fits them.

Owns the benchmarks' eager modules, rebuilt (modules.py), and the rows, their traces, the fit and its report (fit.py;
__main__.py is its command). May import the project room's profiles, trace, timing and projection, and cpbench.cp's
fused norm (a row it prices).
"""