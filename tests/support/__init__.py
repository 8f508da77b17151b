"""What the tests share: fixtures (registered as plugins in tests/conftest.py) and helpers.

* `services`: real target / draft gRPC servers on one background event loop (`start_target`, `start_draft`);
* `stacks`: real target + draft + gateway trios on that loop (`start_stack`, `int8_stack`, `weak_stack`);
* `pki`: a throwaway CA with server and client certificates (`pki`);
* `tiny_models`: a seeded random Llama small enough to build in milliseconds;
* `chi_square`: Pearson's goodness-of-fit p-value in torch (the sampler's statistical tests, on any device);
* `prometheus_deploy`, `dashboard_queries`, `kustomize_lite`, `service_commands`: the deploy/ files read
  as a deployment would read them.
"""
