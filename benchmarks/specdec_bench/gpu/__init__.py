"""`make gpu-check`: one prepared command that proves the CUDA path on a lent GPU machine
(docs/gpu.md), and `make gpu-carry`, which packs what that machine lacks."""
