"""Issue 47's device benchmark (`python -m benchmarks.device`, bench.py): its models
(shapes), its measures, its table; run.sh runs it on the lent GPU machine, prepare.sh
readies the wheels."""
