"""The command line: `specdec serve | generate | bench`, the process launcher and `make demo`.

The top layer: it may import the services and the shared library, and nothing imports it
(except the benchmark harness, which drives the same launcher).
"""
