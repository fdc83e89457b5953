"""Who may call what, decided in one place for every route: the Host header (DNS
rebinding, hosts.py), the Origin and the API key (middleware.py, ahead of any route), the
request body's size and type (body.py), and the cache namespace a caller reads, writes
and sees (namespaces.py)."""
