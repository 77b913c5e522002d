"""The lab: benchmarks and measurements, apart from the product (``card.client.cli`` and the services).

    cli            card-bench: the same prompts through every decoding mode, in one run
    modes          the decoding modes card-bench compares, behind one interface
    report         exactness check against vanilla, summaries, table, JSON, chart
    data           benchmark prompts (GSM8K, HumanEval, MT-Bench): packaged samples or --data-dir
    costs          forward costs that decide the tree shape: ``python -m card.client.bench.costs``
    default_draft  training-free draft candidates for the default target:
                   ``python -m card.client.bench.default_draft``
    step_latency   the cache service's Step latency: ``python -m card.client.bench.step_latency``
"""
