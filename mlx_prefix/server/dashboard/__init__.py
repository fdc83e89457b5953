"""The dashboard's data (snapshot.py: the cache tree, memory, disk, activity, all through
the caller's `visible` filter), the last requests it charts (recent.py), and its page
(static/: HTML, CSS, JS, no build step; uPlot 1.6.32, MIT). Its routes: routes/dashboard.py."""
