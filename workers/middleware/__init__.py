"""Handler middleware: the API users subclass (base.py, re-exported by `workers`), how a worker
runs a job through it (chain.py), and the built-ins (builtin.py decides which a worker gets):
the [idempotency] guard (guard.py). This file imports nothing: `import workers` loads base.py
through it."""
