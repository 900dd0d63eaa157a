"""``saltserve bench``: validate, profiles, tenants and sweep (docs/benchmarks.md)."""

# The names the CLI offers as choices; the modules that run them import these.
PROFILES = ("shared_system", "rag_document", "few_shot", "unique")
SWEEP_AXES = ("prefix_length", "match_rate", "concurrency", "output_length", "pool_size")
# The "url" of our engine in the bench's own process (``--in-process``) in reports.
IN_PROCESS_URL = "in-process"
