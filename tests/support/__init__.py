"""What the tests share: the test models and cache settings, engine and server helpers,
fakes, the agents' and clients' drivers. On the path through pyproject's `pythonpath`,
so a test in any folder imports `support.<module>`; fixtures stay in tests/conftest.py."""
