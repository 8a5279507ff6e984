"""distcomm-bench: benchmarks of distcomm against torch.distributed on the same machine, same run.

Each benchmark is a subcommand module with a ``main(argv)``; ``python -m distcomm.bench <name>``.
"""
