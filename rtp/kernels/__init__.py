"""rtp's own compute kernels and what drives them on a CPU.

    csrc/            the C kernels (AVX-512 BF16, AMX, OpenMP): quantized and bf16 linears,
                     decode and prefill attention, norms, RoPE + KV write, SiLU / GELU-and-mul,
                     logit softcapping, argmax; every call also recordable as data
                     (kernel_calls.c)
    _cpu_kernels.pyx their Python binding (raw pointers in, nothing allocated)
    cpu_kernels.py   the glue the models call: checks, torch custom ops, the CPU-feature gates
    quant.py         GGUF Q4_1 / Q8_0 blocks kept as they are, regrouped for the kernels
    packed.py        oneDNN-prepacked bf16 weights for prompt-sized matmuls
    cpu_graph.py     CPU graphs: a step's kernel calls captured once, replayed from C
    hugepages.py     transparent huge pages for the KV cache and weight tiles

Nothing here knows about models, requests or scheduling: rtp/models/ and rtp/engine/ build on it.
"""
