"""rtp's own compute kernels and what drives them on a CPU.

    csrc/            the C kernels (AVX-512 BF16, AMX, OpenMP), a file per concept: linear/ (one per
                     weight format, and the tile-order kernels), attention/, norm.c, activation.c,
                     rope_kv.c, embedding.c, sampling.c; every call also recordable as data
                     (kernel_calls.c)
    ops.py           the op table: each kernel op defined once (name, typed fields, rows, addresses)
    ops_codegen.py   what setup.py writes from it: the enum, call structs and replay table
                     (csrc/kernel_ops.h, .c) and the Python entry points (_kernel_ops.pxi)
    _cpu_kernels.pyx their Python binding (raw pointers in, nothing allocated)
    cpu_kernels.py   the glue the models call: checks, torch custom ops, the CPU-feature gates
    quant.py         GGUF Q4_1 / Q8_0 blocks kept as they are, regrouped for the kernels
    packed.py        oneDNN-prepacked bf16 weights for prompt-sized matmuls
    cpu_graph.py     CPU graphs: a step's kernel calls captured once, replayed from C
    hugepages.py     transparent huge pages for the KV cache and weight tiles

Nothing here knows about models, requests or scheduling: rtp/models/ and rtp/engine/ build on it.
"""
