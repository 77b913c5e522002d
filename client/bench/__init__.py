"""card-bench, what a user runs to measure serving, apart from the product (``card.client.cli`` and
the services).

    cli      card-bench: the same prompts through every decoding mode, in one run
    modes    the decoding modes card-bench compares (``BenchMode``: the grammar, parsed once)
    load     closed-loop load through a card-target (``--concurrency``)
    report   exactness check against vanilla, summaries, table, JSON, chart
    data     benchmark prompts (GSM8K, HumanEval, MT-Bench): packaged samples or --data-dir
    derived  the input-grounded prompt sets packaged beside them
    peer     AIPerf against card-target and another OpenAI-compatible server, side by side
    gpu      ``make gpu-check``: forward and serving speed on an NVIDIA GPU
"""
