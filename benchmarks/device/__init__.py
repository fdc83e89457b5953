"""Issue 47's device benchmark (benchmarks/bench_device.py): its models (shapes), its
measures, its table; run.sh runs it on the lent GPU machine, prepare.sh readies the wheels."""
