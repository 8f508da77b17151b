"""specdec: speculative decoding served as a gRPC draft / target / gateway trio.

Layers, importing downward only (docs/architecture.md):
- the shared library: `model`, `kv_cache`, `sampling`, `wire`, `serving`, `cost_model`,
  `flags`, `stats`, `client`, `errors` and the generated stubs in `v1`;
- the services: `target_server`, `draft_server`, `gateway`;
- the command line: `cli`.
"""
