"""What the server shows about itself: Prometheus metrics (requests and tokens lost per
reason among them), each request's one log line, which hands the request's CacheTrace to
the request explainer (explain/), and the response counts (metrics.py); the last
requests' token counts and timings (recent.py); the dashboard's data (dashboard.py: the
cache tree, memory, disk, activity, recent misses and why, all through the caller's
`visible` filter) and its page (static/: HTML, CSS, JS, no build step; uPlot 1.6.32,
MIT). Their routes: routes/status.py (/metrics) and routes/dashboard.py."""
