"""What the server serves: a request's model name -> a served model (names.py), the pool of
resident engines loaded on demand (pool.py) on the loader thread (loading.py,
mlx_threads.py), kept while in use (lease.py) and listed as cards (cards.py), and the
--embedding-model beside them (embeddings.py)."""
