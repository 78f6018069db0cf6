"""Plan before you pay: predicted step time, memory and MFU of every layout, from the compiled step.

    python -m jaxdist.plan --config llama3-8b --gpus 8 --hardware h100 [--gpus-per-node 8]
                           [--global-batch B] [--time-budget S] [--json]

``hardware`` (profiles), ``measure`` (the cpu-local profile), ``hlo_cost`` (per-op-class
costs of a compiled program), ``cost`` (step time on a profile), ``search`` (layouts,
screening, the compile cache) and ``__main__`` (the CLI).
"""
